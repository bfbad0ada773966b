"""The ctypes binding against the real library on the CPU reference backend (run by CTest)."""
import contextlib
import ctypes
import gc
import math
import os
import re
import struct
import sys
import threading
import unittest
import weakref

import fp8


HEADER = os.environ.get("FP8_HEADER", os.path.join(os.path.dirname(__file__), "..", "..", "include", "fp8.h"))


class BindingTest(unittest.TestCase):
    def test_every_constant_equals_its_definition_in_fp8_h(self):
        with open(HEADER) as f:
            defines = dict(re.findall(r"^#define FP8_([A-Z0-9_]+) \(?(-?\d+)\)?", f.read(), re.M))
        constants = {k: v for k, v in vars(fp8).items() if k.isupper() and isinstance(v, int)}
        self.assertGreater(len(constants), 25)
        for name, value in constants.items():
            self.assertIn(name, defines, f"fp8.{name} has no FP8_{name} in fp8.h")
            self.assertEqual(value, int(defines[name]), f"fp8.{name}")

    def test_every_declared_function_matches_its_prototype_in_fp8_h(self):
        with open(HEADER) as f:
            text = f.read()
        protos = {name: (ret, args) for ret, name, args in
                  re.findall(r"FP8_API\s+([^;(]*?)\b(fp8_\w+)\s*\(([^)]*)\)\s*;", text)}
        int32_typedefs = set(re.findall(r"^typedef int32_t (\w+);", text, re.M))
        scalars = {"int32_t": fp8._i32, "int64_t": fp8._i64, "uint32_t": ctypes.c_uint32, "uint8_t": fp8._u8,
                   "size_t": fp8._size, "float": fp8._f32, "double": ctypes.c_double}

        def check(c_type, py_type, what):
            c_type = re.sub(r"\s+", " ", c_type.replace("const", "")).strip()
            base, stars = c_type.replace("*", "").strip(), c_type.count("*")
            base = "int32_t" if base in int32_typedefs else base
            if stars == 1 and base in scalars:
                # An out-parameter (or a buffer) of a scalar: a pointer to exactly that scalar (an
                # int64_t * declared as a pointer to int32 would have libfp8 write past it), or a
                # void pointer for device memory (fp8_tensor_wrap_scaled's scale_inv).
                self.assertTrue(py_type is ctypes.c_void_p or getattr(py_type, "_type_", None) is scalars[base],
                                f"{what}: {c_type} declared as {py_type}")
            elif c_type == "char *":
                self.assertIn(py_type, (ctypes.c_char_p, ctypes.c_void_p), f"{what}: {c_type}")
            elif c_type == "char **":
                self.assertIs(getattr(py_type, "_type_", None), ctypes.c_char_p, f"{what}: {c_type}")
            elif stars == 2:  # an object handle out-parameter (T **), or an array of handles
                self.assertIs(getattr(py_type, "_type_", None), ctypes.c_void_p, f"{what}: {c_type} declared as {py_type}")
            elif "*" in c_type or c_type.endswith("_fn"):  # handles, buffers (function pointers are typedefs)
                self.assertTrue(py_type in (ctypes.c_void_p, ctypes.c_char_p) or issubclass(py_type, ctypes._Pointer),
                                f"{what}: {c_type} declared as {py_type}")
            elif c_type == "void":
                self.assertIsNone(py_type, what)
            else:
                self.assertIs(py_type, scalars["int32_t" if c_type in int32_typedefs else c_type], f"{what}: {c_type}")

        self.assertGreater(len(fp8._declared), 60)
        for name, (restype, argtypes) in fp8._declared.items():
            self.assertIn(name, protos, f"{name} is declared in fp8.py but not in fp8.h")
            ret, args = protos[name]
            params = [] if args.strip() == "void" else [a.strip() for a in args.split(",")]
            self.assertEqual(len(argtypes), len(params), f"{name}: argument count")
            check(ret, restype, f"{name} result")
            for i, (param, py_type) in enumerate(zip(params, argtypes)):
                check(re.sub(r"\w+$", "", param), py_type, f"{name} argument {i} ({param})")  # the type
        # What this binding wraps of the newer API, so that a rename in fp8.h fails here.
        for name in ["fp8_layer_forward_saved", "fp8_layer_backward_saved", "fp8_saved_destroy", "fp8_saved_needs_input",
                     "fp8_model_write_parameter", "fp8_model_storage_level", "fp8_model_flat_storage",
                     "fp8_tensor_from_dlpack_versioned", "fp8_tensor_to_dlpack_versioned"]:
            self.assertIn(name, fp8._declared)
        for name in ["fp8_context_set_allocator", "fp8_context_set_stream", "fp8_tensor_wrap",
                     "fp8_tensor_from_dlpack", "fp8_tensor_to_dlpack", "fp8_layer_get_report"]:
            self.assertIn(name, fp8._declared)  # what libfp8.torch needs

    def test_gemm_and_activation(self):
        ctx = fp8.Context()
        a, b, d = fp8.Tensor(ctx, fp8.DTYPE_F32, (2, 16)), fp8.Tensor(ctx, fp8.DTYPE_F32, (16, 16)), fp8.Tensor(ctx, fp8.DTYPE_F32, (2, 16))
        with self.assertRaises(fp8.Fp8Error) as err:  # operands of two dtypes
            fp8.gemm(ctx, a, fp8.Tensor(ctx, fp8.DTYPE_BF16, (16, 16)), d)
        self.assertEqual(err.exception.status_name, "FP8_ERR_DTYPE")
        a_values = [float(i % 5) - 2 for i in range(32)]
        a.write_floats(a_values)
        b.write_floats([1.0 if i % 17 == 0 else 0.0 for i in range(256)])  # identity: a b^T = a
        fp8.gemm(ctx, a, b, d)
        self.assertEqual(d.read_floats(), a_values)
        y = fp8.Tensor(ctx, fp8.DTYPE_F32, (2, 8))
        fp8.activation_forward(ctx, fp8.ACTIVATION_SWIGLU, a, y)
        self.assertEqual(len(y.read_floats()), 16)

    def test_recipe_text_round_trips_and_refusals_raise_with_the_message(self):
        r = fp8.Recipe("fp8_format=E4M3, margin=1, power_2_scales=on, scaling=current")
        self.assertEqual(r[fp8.RECIPE_SCALING], fp8.SCALING_CURRENT)
        self.assertEqual(r[fp8.RECIPE_MARGIN], 1)
        self.assertEqual(r[fp8.RECIPE_POWER_2_SCALES], 1)
        self.assertIn("power_2_scales=on", str(r))
        self.assertIn("fp8_format=E4M3", str(r))
        self.assertEqual(str(fp8.Recipe(str(r))), str(r))
        with self.assertRaises(fp8.Fp8Error) as err:
            r.parse("fp8_format=E5M2")
        self.assertEqual(err.exception.status_name, "FP8_ERR_INVALID_ARGUMENT")
        self.assertIn("E4M3, HYBRID", str(err.exception))

    def test_quantize_transpose_and_dequantize(self):
        ctx, recipe = fp8.Context(), fp8.Recipe()
        values = [0.5, -1.25, 3.0, 100.0, -7.5, 0.001]
        x = fp8.Tensor(ctx, fp8.DTYPE_F32, (2, 3))
        q, qt, back = fp8.Tensor(ctx, fp8.DTYPE_E4M3, (2, 3)), fp8.Tensor(ctx, fp8.DTYPE_E4M3, (3, 2)), fp8.Tensor(ctx, fp8.DTYPE_F32, (2, 3))
        s = fp8.Scaling(ctx, recipe)
        s.set_scale(4.0)
        x.write_floats(values)
        fp8.quantize(ctx, x, q, s, out_transposed=qt)
        codes = q.read()
        self.assertEqual(list(codes), [fp8.encode(v * 4.0) for v in values])
        self.assertEqual(qt.read(), bytes([codes[0], codes[3], codes[1], codes[4], codes[2], codes[5]]))
        self.assertEqual(q.scale_inv, 0.25)
        fp8.dequantize(ctx, q, back)
        self.assertEqual(back.read_floats(), [fp8.decode(c) * 0.25 for c in codes])
        fp8.scaling_update(ctx, [s], recipe)

    def test_block_scaled_quantize_and_gemm(self):
        # x [4, 256] in 1x128 blocks (each row's two blocks), w [16, 256] in one 128x128 block row:
        # every cell's scale is the current-scaling rule's, rounded down to a power of two (block
        # scaling's default), recomputed here; the GEMM is checked against the float64 product of
        # the dequantised operands.
        ctx, recipe = fp8.Context(), fp8.Recipe()
        f32 = lambda v: struct.unpack("f", struct.pack("f", v))[0]
        rows, n, k = 4, 16, 256
        xv = [f32(((r * 7 + i * 3) % 23 - 11) * 2.0 ** (r - 3 * (i // 128)) * 0.01) for r in range(rows) for i in range(k)]
        wv = [f32(((j * 5 + i) % 19 - 9) * 0.003 * (1 + (i // 128))) for j in range(n) for i in range(k)]

        def scale_of(amax):  # fp8_max / amax in FP32, rounded down to a power of two
            mant, exp = math.frexp(f32(448.0 / amax))
            return 2.0 ** (exp - 1)

        self.assertEqual(fp8.scale_grid_shape(fp8.SCALE_MODE_BLOCK_1X128, rows, k), (2, rows))
        self.assertEqual(fp8.scale_grid_shape(fp8.SCALE_MODE_BLOCK_128X128, n, k), (1, 4))
        self.assertEqual(fp8.scale_grid_shape(fp8.SCALE_MODE_ROW, rows, k), (rows, 1))
        x, w = fp8.Tensor(ctx, fp8.DTYPE_F32, (rows, k)), fp8.Tensor(ctx, fp8.DTYPE_F32, (n, k))
        x.write_floats(xv)
        w.write_floats(wv)
        xq, xs = fp8.Tensor(ctx, fp8.DTYPE_E4M3, (rows, k)), fp8.Tensor(ctx, fp8.DTYPE_F32, (2, rows))
        wq, ws = fp8.Tensor(ctx, fp8.DTYPE_E4M3, (n, k)), fp8.Tensor(ctx, fp8.DTYPE_F32, (1, 4))
        fp8.quantize_scaled(ctx, x, fp8.SCALE_MODE_BLOCK_1X128, recipe, xq, xs)
        fp8.quantize_scaled(ctx, w, fp8.SCALE_MODE_BLOCK_128X128, recipe, wq, ws)
        x_scale = {(r, j): scale_of(max(abs(v) for v in xv[r * k + 128 * j:r * k + 128 * (j + 1)]))
                   for r in range(rows) for j in range(2)}
        w_scale = {j: scale_of(max(abs(wv[a * k + i]) for a in range(n) for i in range(128 * j, 128 * (j + 1))))
                   for j in range(2)}
        self.assertEqual(xs.read_floats(), [1.0 / x_scale[(r, j)] for j in range(2) for r in range(rows)])
        self.assertEqual(ws.read_floats()[:2], [1.0 / w_scale[0], 1.0 / w_scale[1]])
        x_codes, w_codes = xq.read(), wq.read()
        self.assertEqual(list(x_codes), [fp8.encode(xv[r * k + i] * x_scale[(r, i // 128)])
                                         for r in range(rows) for i in range(k)])
        self.assertEqual(list(w_codes), [fp8.encode(wv[j * k + i] * w_scale[i // 128]) for j in range(n) for i in range(k)])
        d = fp8.Tensor(ctx, fp8.DTYPE_F32, (rows, n))
        fp8.gemm_scaled(ctx, xq, fp8.SCALE_MODE_BLOCK_1X128, xs, wq, fp8.SCALE_MODE_BLOCK_128X128, ws, d)
        want = [sum(fp8.decode(x_codes[r * k + i]) / x_scale[(r, i // 128)] *
                    fp8.decode(w_codes[j * k + i]) / w_scale[i // 128] for i in range(k))
                for r in range(rows) for j in range(n)]
        got = d.read_floats()
        norm = math.sqrt(sum(v * v for v in want))
        self.assertGreater(norm, 0.0)
        self.assertLess(math.sqrt(sum((g - v) ** 2 for g, v in zip(got, want))) / norm, 1e-6)
        # The refusals: the transposed copy without its grid, and a pair cuBLASLt has no GEMM for.
        with self.assertRaises(ValueError):
            fp8.quantize_scaled(ctx, x, fp8.SCALE_MODE_BLOCK_1X128, recipe, xq, xs,
                                out_transposed=fp8.Tensor(ctx, fp8.DTYPE_E4M3, (k, rows)))
        with self.assertRaises(fp8.Fp8Error) as err:
            fp8.gemm_scaled(ctx, wq, fp8.SCALE_MODE_BLOCK_128X128, ws, wq, fp8.SCALE_MODE_BLOCK_128X128, ws,
                            fp8.Tensor(ctx, fp8.DTYPE_F32, (n, n)))
        self.assertEqual(err.exception.status_name, "FP8_ERR_UNSUPPORTED")
        self.assertIn("a_mode = FP8_SCALE_MODE_BLOCK_128X128 (128x128-block) with b_mode = "
                      "FP8_SCALE_MODE_BLOCK_128X128", str(err.exception))

    def test_wrong_shape_is_refused_naming_the_argument(self):
        ctx = fp8.Context()
        s = fp8.Scaling(ctx, fp8.Recipe())
        with self.assertRaises(fp8.Fp8Error) as err:
            fp8.quantize(ctx, fp8.Tensor(ctx, fp8.DTYPE_F32, (2, 3)), fp8.Tensor(ctx, fp8.DTYPE_E4M3, (3, 2)), s)
        self.assertEqual(err.exception.status_name, "FP8_ERR_SHAPE")
        self.assertIn("out has shape [3, 2]", str(err.exception))


    def test_fp8_linear_step_through_the_model(self):
        ctx = fp8.Context()
        model = fp8.Model(ctx)
        fc = model.add_linear("fc", 16, 16)
        weight, weight_grad = model.parameter("fc.weight")
        weight.write_floats([1.0 if i % 17 == 0 else 0.0 for i in range(256)])  # identity
        self.assertFalse(model.has_fp8_layers)
        # backend=te keeps FP32 storage (the default, auto, stores an F16 weight and an FP8 gradient
        # from the conversion on: see test_write_parameter_round_trips_at_fp32_and_rounds_at_o2).
        model.convert(fp8.Recipe("backend=te, small_layer_fallback=off"))
        self.assertTrue(model.has_fp8_layers)
        self.assertEqual((model.storage_level(), weight.dtype, weight_grad.dtype), (0, fp8.DTYPE_F32, fp8.DTYPE_F32))
        x, y = fp8.Tensor(ctx, fp8.DTYPE_F32, (16, 16)), fp8.Tensor(ctx, fp8.DTYPE_F32, (16, 16))
        dy, dx = fp8.Tensor(ctx, fp8.DTYPE_F32, (16, 16)), fp8.Tensor(ctx, fp8.DTYPE_F32, (16, 16))
        values = [float(i % 7) - 3 for i in range(256)]  # exact in E4M3 and E5M2 at scale 1
        x.write_floats(values)
        dy.write_floats(values[::-1])
        with model.autocast():
            model.forward(fc, x, y)
        model.backward(fc, dy, dx)
        self.assertEqual(y.read_floats(), values)          # x I^T, through E4M3
        self.assertEqual(dx.read_floats(), values[::-1])   # dy I, through E5M2
        self.assertNotEqual(weight_grad.read_floats(), [0.0] * 256)
        self.assertIn("fc", model.report())
        with self.assertRaises(fp8.Fp8Error) as err:
            model.forward(fc, fp8.Tensor(ctx, fp8.DTYPE_F32, (4, 8)), y)
        self.assertEqual(err.exception.status_name, "FP8_ERR_SHAPE")
        self.assertIn("layer 'fc'", str(err.exception))
        model.convert(None)
        self.assertFalse(model.has_fp8_layers)
        self.assertEqual(weight.read_floats()[:18], [1.0] + [0.0] * 16 + [1.0])  # kept

    def test_no_python_object_outlives_the_c_tensor_it_uses(self):
        ctx = fp8.Context()
        model = fp8.Model(ctx)
        model.add_linear("fc", 16, 16)
        weight, grad = model.parameter("fc.weight")
        values = [0.25 * ((i % 9) - 4) for i in range(256)]  # exact in F16
        weight.write_floats(values)
        # An MS-AMP conversion stores the weight at its level (F16 value, FP8 gradient): the Parameter
        # objects follow, and an optimizer adopts the storage as it is.
        model.convert(fp8.Recipe("backend=msamp, opt_level=O2"))
        self.assertEqual(weight.dtype, fp8.DTYPE_F16)
        opt = fp8.Optimizer(model, fp8.OPTIMIZER_ADAM)
        self.assertEqual(weight.dtype, fp8.DTYPE_F16)
        self.assertEqual(grad.dtype, fp8.DTYPE_E5M2)
        self.assertEqual(weight.shape, (16, 16))
        self.assertEqual(list(struct.unpack("256e", weight.read())), values)
        # The model, its context and its optimizer dropped: the parameter tensors keep the model alive.
        model_ref = weakref.ref(model)
        del model, ctx, opt
        gc.collect()
        self.assertIsNotNone(model_ref())
        self.assertEqual(list(struct.unpack("256e", weight.read())), values)
        self.assertEqual(len(grad.read()), 256)
        del weight
        gc.collect()
        self.assertIsNotNone(model_ref())  # grad still holds it
        del grad
        gc.collect()
        self.assertIsNone(model_ref())
        # The model keeps the input of its latest forward alive until the backward reads it.
        ctx = fp8.Context()
        model = fp8.Model(ctx)
        fc = model.add_linear("fc", 4, 4)
        x, y = fp8.Tensor(ctx, fp8.DTYPE_F32, (2, 4)), fp8.Tensor(ctx, fp8.DTYPE_F32, (2, 4))
        x.write_floats([1.0] * 8)
        x_ref = weakref.ref(x)
        model.run(x, y)
        model.forward(fc, fp8.Tensor(ctx, fp8.DTYPE_F32, (2, 4)), y)
        del x
        gc.collect()
        self.assertIsNotNone(x_ref())

    def test_two_ranks_on_threads_average_their_gradients_and_stay_identical(self):
        self._two_ranks(backward_sync=False)

    def test_backward_sync_averages_inside_the_backward(self):
        self._two_ranks(backward_sync=True)

    def _two_ranks(self, backward_sync):
        ctxs = [fp8.Context(), fp8.Context()]
        comms = fp8.Comm.local(ctxs)
        self.assertEqual([(c.rank, c.size) for c in comms], [(0, 2), (1, 2)])
        self.assertEqual(comms[0].timeout, fp8.DEFAULT_COMM_TIMEOUT_S)
        comms[1].timeout = 120
        self.assertEqual(comms[1].timeout, 120.0)
        with self.assertRaises(fp8.Fp8Error) as refused:
            comms[1].timeout = -1
        self.assertIn("seconds", str(refused.exception))
        models, grads = [], []
        for k, ctx in enumerate(ctxs):
            m = fp8.Model(ctx)
            m.add_linear("fc", 4, 2, bias=False)
            w, g = m.parameter("fc.weight")
            w.write_floats([0.1 * (i + k) for i in range(8)])  # rank 1's differ: set_comm gives rank 0's
            m.set_bucket_bytes(fp8.MIN_BUCKET_BYTES)
            models.append(m)
            grads.append(g)
        errors = []

        def on_rank(k, fn):
            try:
                fn(k)
            except Exception as e:  # pylint: disable=broad-except
                errors.append(e)

        def run(fn):
            threads = [threading.Thread(target=on_rank, args=(k, fn)) for k in range(2)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(60)
            self.assertFalse(errors, errors)

        run(lambda k: models[k].set_comm(comms[k]))
        if backward_sync:
            for m in models:
                m.set_backward_sync(True)
        self.assertEqual(models[0].parameter("fc.weight")[0].read_floats(), models[1].parameter("fc.weight")[0].read_floats())
        xs = []

        def step(k):
            x, y = fp8.Tensor(ctxs[k], fp8.DTYPE_F32, (1, 4)), fp8.Tensor(ctxs[k], fp8.DTYPE_F32, (1, 2))
            x.write_floats([float(k + 1)] * 4)
            models[k].run(x, y)
            dy = fp8.Tensor(ctxs[k], fp8.DTYPE_F32, (1, 2))
            dy.write_floats([1.0, 2.0])
            models[k].run_backward(dy)
            if not backward_sync:
                models[k].sync_grads()
            xs.append(x)

        run(step)
        # dW[o][i] = dy[o] * x[i], averaged over x = 1 and x = 2: dy[o] * 1.5 on both ranks.
        for g in grads:
            self.assertEqual(g.read_floats(), [1.5] * 4 + [3.0] * 4)
        comms[1].abort()
        with self.assertRaises(fp8.Fp8Error) as err:
            models[0].zero_grad()
            models[0].sync_grads()
        self.assertEqual(err.exception.status_name, "FP8_ERR_NCCL")

    def test_whole_model_run_and_an_sgd_step(self):
        ctx = fp8.Context()
        model = fp8.Model(ctx)
        model.add_linear("fc1", 4, 8)
        model.add_activation("relu", fp8.ACTIVATION_RELU)
        model.add_linear("fc2", 8, 2, bias=False)
        w1, _ = model.parameter("fc1.weight")
        w2, g2 = model.parameter("fc2.weight")
        w1.write_floats([0.25 * ((i % 5) - 2) for i in range(32)])
        w2.write_floats([0.5] * 16)
        x, y = fp8.Tensor(ctx, fp8.DTYPE_F32, (3, 4)), fp8.Tensor(ctx, fp8.DTYPE_F32, (3, 2))
        xs = [float(i % 4) for i in range(12)]
        x.write_floats(xs)
        model.run(x, y)
        w1v = w1.read_floats()
        hidden = [[max(0.0, sum(xs[r * 4 + k] * w1v[j * 4 + k] for k in range(4))) for j in range(8)] for r in range(3)]
        expected = [0.5 * sum(hidden[r]) for r in range(3) for _ in range(2)]
        for got, want in zip(y.read_floats(), expected):
            self.assertAlmostEqual(got, want, places=5)
        dy = fp8.Tensor(ctx, fp8.DTYPE_F32, (3, 2))
        dy.write_floats([1.0] * 6)
        model.run_backward(dy)
        grad = g2.read_floats()  # dW2[o][j] = sum_r dy[r][o] * hidden[r][j]
        for j in range(8):
            self.assertAlmostEqual(grad[j], sum(hidden[r][j] for r in range(3)), places=5)
        opt = fp8.Optimizer(model, fp8.OPTIMIZER_SGD, lr=0.1)
        self.assertAlmostEqual(opt["lr"], 0.1)
        before = w2.read_floats()
        opt.step()
        after = w2.read_floats()
        for i in range(16):
            self.assertAlmostEqual(after[i], before[i] - 0.1 * grad[i], places=5)
        stats = opt.stats()
        self.assertEqual((stats.steps, stats.skipped_steps, stats.parameters), (1, 0, 32 + 8 + 16))
        with self.assertRaises(fp8.Fp8Error) as err:
            opt["beta1"] = 0.9  # SGD has no betas
        self.assertIn("FP8_OPTIM_BETA1", str(err.exception))
        opt.zero_grad()
        self.assertEqual(g2.read_floats(), [0.0] * 16)
        with self.assertRaises(fp8.Fp8Error) as err:
            model.run_backward(dy)  # already differentiated
        self.assertEqual(err.exception.status_name, "FP8_ERR_INVALID_STATE")

    def test_checkpoint_resumes_an_o2_run_and_safetensors_round_trip(self):
        import tempfile
        def build():
            ctx = fp8.Context()
            model = fp8.Model(ctx)
            model.add_linear("fc", 32, 16, bias=False)
            w, _ = model.parameter("fc.weight")
            w.write_floats([0.01 * ((i * 7) % 13 - 6) for i in range(512)])
            model.convert(fp8.Recipe("backend=msamp, opt_level=O2, small_layer_fallback=0"))
            return ctx, model, fp8.Optimizer(model, fp8.OPTIMIZER_ADAMW, lr=1e-2)

        def step(ctx, model, opt, k):
            x, y = fp8.Tensor(ctx, fp8.DTYPE_F32, (16, 32)), fp8.Tensor(ctx, fp8.DTYPE_F32, (16, 16))
            x.write_floats([((i * (k + 3)) % 11 - 5) / 5.0 for i in range(512)])
            model.run(x, y)
            dy = fp8.Tensor(ctx, fp8.DTYPE_F32, (16, 16))
            dy.write_floats([((i * (k + 5)) % 7 - 3) / 30.0 for i in range(256)])
            model.run_backward(dy)
            opt.step()
            opt.zero_grad()

        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "run.fp8ckpt")
            ctx, model, opt = build()
            for k in range(2):
                step(ctx, model, opt, k)
            model.save_checkpoint(path, opt)
            for k in range(2, 4):
                step(ctx, model, opt, k)
            straight = model.parameter("fc.weight")[0].read()
            ctx2, model2, opt2 = build()
            model2.load_checkpoint(path, opt2)
            for k in range(2, 4):
                step(ctx2, model2, opt2, k)
            self.assertEqual(model2.parameter("fc.weight")[0].read(), straight)
            self.assertEqual(opt2.stats().steps, 4)
            self.assertEqual(opt2.stats().opt_level, 2)
            with open(path, "r+b") as f:  # one flipped bit: refused, nothing changed
                f.seek(40)
                b = f.read(1)
                f.seek(40)
                f.write(bytes([b[0] ^ 1]))
            with self.assertRaises(fp8.Fp8Error) as err:
                model2.load_checkpoint(path, opt2)
            self.assertEqual(err.exception.status_name, "FP8_ERR_CORRUPT")
            self.assertEqual(model2.parameter("fc.weight")[0].read(), straight)
            st = os.path.join(tmp, "w.safetensors")
            model2.export_safetensors(st)
            ctx3, model3, _ = build()
            model3.import_safetensors(st)
            self.assertEqual(model3.parameter("fc.weight")[0].read(), straight)

    @staticmethod
    def _linear(recipe="backend=te, small_layer_fallback=off", n=16):
        """A model with one n x n Linear, deterministic weights and bias, converted under `recipe`."""
        ctx = fp8.Context()
        model = fp8.Model(ctx)
        fc = model.add_linear("fc", n, n)
        model.write_parameter("fc.weight", [((i * 7) % 11 - 5) / 8.0 for i in range(n * n)])
        model.write_parameter(1, [((i * 3) % 5 - 2) / 4.0 for i in range(n)])  # fc.bias
        if recipe is not None:
            model.convert(fp8.Recipe(recipe))
        return ctx, model, fc

    @staticmethod
    def _tensor(ctx, values, shape):
        t = fp8.Tensor(ctx, fp8.DTYPE_F32, shape)
        t.write_floats(values)
        return t

    def test_forwards_in_flight_differentiated_in_reverse_equal_sequential_pairs(self):
        n = 16
        xs = [[((i * (k + 3)) % 13 - 6) / 3.0 for i in range(n * n)] for k in range(2)]
        dys = [[((i * (k + 5)) % 9 - 4) / 7.0 for i in range(n * n)] for k in range(2)]
        # FP8 on FP32 storage, FP8 on MS-AMP O2 storage (F16 weight, FP8 gradient), FP32. Under FP8 all
        # runs in one autocast region, so the scales stay put.
        for recipe in ["backend=te, small_layer_fallback=off", "backend=msamp, opt_level=O2, small_layer_fallback=off",
                       None]:
            # Two forwards in flight, their backwards in reverse order.
            ctx, model, fc = self._linear(recipe)
            x = [self._tensor(ctx, xs[k], (n, n)) for k in range(2)]
            y = [fp8.Tensor(ctx, fp8.DTYPE_F32, (n, n)) for _ in range(2)]
            dx = [fp8.Tensor(ctx, fp8.DTYPE_F32, (n, n)) for _ in range(2)]
            with model.autocast() if recipe else contextlib.nullcontext():
                saved = [model.forward_saved(fc, x[k], y[k]) for k in range(2)]
                # An FP8 wgrad keeps x's FP8 copy: the state lets x go; a high-precision one keeps x.
                self.assertEqual([s.needs_input for s in saved], [recipe is None] * 2)
                self.assertEqual([s.x is x[k] for k, s in enumerate(saved)], [recipe is None] * 2)
                for k in (1, 0):
                    model.backward_saved(fc, saved[k], self._tensor(ctx, dys[k], (n, n)), dx[k])
            # Two sequential forward/backward pairs on a fresh model with the same weights.
            ctx2, model2, fc2 = self._linear(recipe)
            y2 = [fp8.Tensor(ctx2, fp8.DTYPE_F32, (n, n)) for _ in range(2)]
            dx2 = [fp8.Tensor(ctx2, fp8.DTYPE_F32, (n, n)) for _ in range(2)]
            with model2.autocast() if recipe else contextlib.nullcontext():
                for k in range(2):
                    model2.forward(fc2, self._tensor(ctx2, xs[k], (n, n)), y2[k])
                    model2.backward(fc2, self._tensor(ctx2, dys[k], (n, n)), dx2[k])
            for m in (model, model2):  # the forwards, dgrads and wgrads ran in FP8 (or none did)
                row = m.report().splitlines()[1].split()  # layer kind converted scaling fprop dgrad wgrad calls fallbacks
                self.assertEqual(row[3:9], ["delayed", "fp8", "fp8", "fp8", "2", "0"] if recipe
                                 else ["-", "high", "high", "high", "0", "0"])
            for k in range(2):
                self.assertEqual(y[k].read(), y2[k].read(), f"y{k} ({recipe})")
                self.assertEqual(dx[k].read(), dx2[k].read(), f"dx{k} ({recipe})")
                self.assertNotEqual(dx[k].read_floats(), [0.0] * (n * n))
            self.assertNotEqual(dx[0].read(), dx[1].read())
            # The parameter gradients accumulate the same two contributions in the other order, which
            # shows in their last bits (a GEMM that accumulates adds its unrounded sum; db is summed
            # row by row). An FP8 gradient (O2) requantises its sum at each add: not compared.
            for name in ["fc.weight", "fc.bias"]:
                grads = [m.parameter(name)[1] for m in (model, model2)]
                if grads[0].dtype != fp8.DTYPE_F32:
                    self.assertEqual((name, model.storage_level()), ("fc.weight", fp8.OPT_O2))
                    continue
                a, b = grads[0].read_floats(), grads[1].read_floats()
                self.assertNotEqual(a, [0.0] * len(a))
                for u, v in zip(a, b):
                    self.assertAlmostEqual(u, v, delta=1e-6 * max(1.0, abs(v)))

    def test_accumulate_dx_adds_into_dx(self):
        n = 16
        ctx, model, fc = self._linear()
        x = self._tensor(ctx, [((i * 5) % 11 - 5) / 2.0 for i in range(n * n)], (n, n))
        dy = self._tensor(ctx, [((i * 3) % 7 - 3) / 5.0 for i in range(n * n)], (n, n))
        y1, y2 = fp8.Tensor(ctx, fp8.DTYPE_F32, (n, n)), fp8.Tensor(ctx, fp8.DTYPE_F32, (n, n))
        before = [((i * 11) % 17 - 8) / 3.0 for i in range(n * n)]
        plain, acc = fp8.Tensor(ctx, fp8.DTYPE_F32, (n, n)), self._tensor(ctx, before, (n, n))
        with model.autocast():  # the same x twice in one region: the same input gradient twice
            s1, s2 = model.forward_saved(fc, x, y1), model.forward_saved(fc, x, y2)
            model.backward_saved(fc, s1, dy, plain)
            model.backward_saved(fc, s2, dy, acc, accumulate_dx=True)
        g = plain.read_floats()
        self.assertNotEqual(g, [0.0] * (n * n))
        f32 = lambda v: struct.unpack("f", struct.pack("f", v))[0]
        self.assertEqual(acc.read_floats(), [f32(f32(b) + d) for b, d in zip(before, g)])

    def test_backward_of_a_consumed_eval_mode_or_foreign_saved_raises(self):
        n = 16
        ctx, model, fc = self._linear()
        x, y = self._tensor(ctx, [1.0] * (n * n), (n, n)), fp8.Tensor(ctx, fp8.DTYPE_F32, (n, n))
        dy, dx = self._tensor(ctx, [0.5] * (n * n), (n, n)), fp8.Tensor(ctx, fp8.DTYPE_F32, (n, n))
        saved = model.forward_saved(fc, x, y)
        self.assertIs(saved.x, x)  # kept until the backward reads it
        model.backward_saved(fc, saved, dy, dx)
        self.assertIsNone(saved.x)
        with self.assertRaises(fp8.Fp8Error) as err:
            model.backward_saved(fc, saved, dy, dx)  # already differentiated
        self.assertEqual(err.exception.status_name, "FP8_ERR_INVALID_STATE")
        self.assertEqual(err.exception.status, 4)
        _, other, other_fc = self._linear()
        with self.assertRaises(fp8.Fp8Error) as err:  # a state of another model
            model.backward_saved(fc, other.forward_saved(other_fc, x, y), dy, dx)
        self.assertEqual(err.exception.status_name, "FP8_ERR_INVALID_ARGUMENT")
        model.train(False)
        saved = model.forward_saved(fc, x, y)  # eval mode: a state the backward refuses
        with self.assertRaises(fp8.Fp8Error) as err:
            model.backward_saved(fc, saved, dy, dx)
        self.assertEqual(err.exception.status_name, "FP8_ERR_INVALID_STATE")
        with self.assertRaises(fp8.Fp8Error) as err:
            model.backward_saved(fc, saved, dy, dx, accumulate_dx=True)
        self.assertEqual(err.exception.status_name, "FP8_ERR_INVALID_STATE")

    def test_a_saved_keeps_its_model_and_input_alive_and_may_be_destroyed_last(self):
        n = 16
        ctx, model, fc = self._linear()
        x, y = self._tensor(ctx, [1.0] * (n * n), (n, n)), fp8.Tensor(ctx, fp8.DTYPE_F32, (n, n))
        saved = model.forward_saved(fc, x, y)
        eval_model = fp8.Model(ctx)
        eval_fc = eval_model.add_linear("fc", n, n)
        eval_model.train(False)
        eval_saved = eval_model.forward_saved(eval_fc, x, y)
        model_ref, x_ref, eval_ref = weakref.ref(model), weakref.ref(x), weakref.ref(eval_model)
        del model, x, ctx, eval_model
        gc.collect()
        self.assertIsNotNone(model_ref())
        self.assertIsNotNone(x_ref())
        self.assertIsNotNone(eval_ref())
        del saved, eval_saved  # fp8_saved_destroy first, then the last reference to each model goes
        gc.collect()
        self.assertIsNone(model_ref())
        self.assertIsNone(x_ref())
        self.assertIsNone(eval_ref())

    def test_write_parameter_round_trips_at_fp32_and_rounds_at_o2(self):
        ctx = fp8.Context()
        model = fp8.Model(ctx)
        model.add_layernorm("ln", 16)
        model.add_linear("fc", 16, 16)
        self.assertEqual(model.parameter_names(), ["ln.weight", "ln.bias", "fc.weight", "fc.bias"])
        weight, _ = model.parameter("fc.weight")
        values = [struct.unpack("f", struct.pack("f", 0.1 * i - 12.3))[0] for i in range(256)]  # F32, not F16
        model.write_parameter("fc.weight", values)
        self.assertEqual(weight.read_floats(), values)
        model.write_parameter(3, tuple(values[:16]))  # by index, any sequence
        self.assertEqual(model.parameter("fc.bias")[0].read_floats(), values[:16])
        import array
        model.write_parameter("ln.weight", array.array("f", values[16:32]))  # a buffer of C floats
        self.assertEqual(model.parameter("ln.weight")[0].read_floats(), values[16:32])
        with self.assertRaises(fp8.Fp8Error) as err:
            model.write_parameter("fc.weight", values[:255])
        self.assertEqual(err.exception.status_name, "FP8_ERR_SHAPE")
        with self.assertRaises(fp8.Fp8Error) as err:
            model.write_parameter("fc.nothing", values)
        self.assertEqual(err.exception.status_name, "FP8_ERR_INVALID_ARGUMENT")
        with self.assertRaises(fp8.Fp8Error) as err:
            model.write_parameter(4, values[:16])
        self.assertEqual(err.exception.status_name, "FP8_ERR_INVALID_ARGUMENT")
        self.assertEqual(model.storage_level(), 0)
        model.convert(fp8.Recipe("backend=msamp, opt_level=O2"))
        self.assertEqual(model.storage_level(), fp8.OPT_O2)
        self.assertEqual(weight.dtype, fp8.DTYPE_F16)
        f16 = lambda v: struct.unpack("e", struct.pack("e", v))[0]  # nearest even, as the library rounds
        self.assertEqual(list(struct.unpack("256e", weight.read())), [f16(v) for v in values])  # kept, rounded
        written = [v * 0.37 for v in values]
        model.write_parameter("fc.weight", written)
        rounded = [f16(struct.unpack("f", struct.pack("f", v))[0]) for v in written]
        self.assertEqual(list(struct.unpack("256e", weight.read())), rounded)
        self.assertNotEqual(rounded, [struct.unpack("f", struct.pack("f", v))[0] for v in written])
        model.write_parameter("fc.bias", values[:16])  # biases stay FP32 at every level
        self.assertEqual(model.parameter("fc.bias")[0].read_floats(), values[:16])
        with self.assertRaises(fp8.Fp8Error):  # an F16 weight takes no F32 bytes: write_parameter rounds
            weight.write_floats(values)

    def test_storage_level_and_flat_storage_at_o3(self):
        ctx = fp8.Context()
        model = fp8.Model(ctx)
        model.add_linear("fc1", 32, 16)
        model.add_linear("fc2", 16, 16, bias=False)
        self.assertEqual(model.flat_storage(fp8.STORAGE_VALUES, fp8.DTYPE_E4M3), (0, 0))
        address, nbytes = model.flat_storage(fp8.STORAGE_VALUES, fp8.DTYPE_F32)
        self.assertNotEqual(address, 0)
        self.assertGreaterEqual(nbytes, 4 * (512 + 16 + 256))
        model.convert(fp8.Recipe("backend=msamp, opt_level=O3"))
        self.assertEqual(model.storage_level(), 3)
        model.write_parameter("fc1.weight", [((i * 7) % 13 - 6) / 4.0 for i in range(512)])
        model.write_parameter("fc2.weight", [((i * 5) % 11 - 5) / 8.0 for i in range(256)])
        w1, g1 = model.parameter("fc1.weight")
        self.assertEqual((w1.dtype, g1.dtype), (fp8.DTYPE_E4M3, fp8.DTYPE_E5M2))
        address, nbytes = model.flat_storage(fp8.STORAGE_VALUES, fp8.DTYPE_E4M3)
        self.assertNotEqual(address, 0)
        self.assertGreaterEqual(nbytes, 512 + 256)
        arena = ctypes.string_at(address, nbytes)  # host memory on the CPU backend
        self.assertTrue(any(arena))
        offset = w1.address - address  # a parameter's slice inside the arena
        self.assertEqual(offset % 256, 0)
        self.assertEqual(arena[offset:offset + 512], w1.read())
        masters = model.flat_storage(fp8.STORAGE_MASTERS, fp8.DTYPE_F16)
        self.assertGreaterEqual(masters[1], 2 * (512 + 256))
        self.assertGreater(model.flat_storage(fp8.STORAGE_GRADS, fp8.DTYPE_E5M2)[1], 0)
        self.assertGreater(model.flat_storage(fp8.STORAGE_VALUES, fp8.DTYPE_F32)[1], 0)  # the bias
        with self.assertRaises(fp8.Fp8Error) as err:
            model.flat_storage(7, fp8.DTYPE_F32)
        self.assertEqual(err.exception.status_name, "FP8_ERR_INVALID_ARGUMENT")

    def test_versioned_structs_match_fp8_h_field_by_field(self):
        # The fields of each struct the binding passes (names, types, array lengths) as fp8.h declares
        # them, and its size as the library's own *_init writes it into struct_size.
        with open(HEADER) as f:
            text = f.read()
        c_types = {"uint32_t": ctypes.c_uint32, "int32_t": fp8._i32, "int64_t": fp8._i64, "float": fp8._f32,
                   "fp8_layer_kind_t": fp8._i32}
        lib = ctypes.CDLL(fp8.LIBRARY_PATH)  # its own function objects: argtypes of its own
        for py, c_name in [(fp8.LayerReport, "fp8_layer_report"), (fp8.OptimizerStats, "fp8_optimizer_stats")]:
            body = re.search(r"typedef struct %s \{(.*?)\} %s_t;" % (c_name, c_name), text, re.S).group(1)
            body = re.sub(r"/\*.*?\*/", "", body, flags=re.S)
            fields = re.findall(r"(\w+)\s+(\w+)(?:\[(\d+)\])?\s*;", body)
            self.assertEqual([n for _, n, _ in fields], [n for n, _ in py._fields_], c_name)
            for (c_type, name, length), (_, py_type) in zip(fields, py._fields_):
                want = (ctypes.c_char * int(length)) if length else c_types[c_type]
                self.assertEqual((ctypes.sizeof(py_type), getattr(py_type, "_type_", py_type)),
                                 (ctypes.sizeof(want), getattr(want, "_type_", want)), f"{c_name}.{name}")
            buf = (ctypes.c_uint8 * 4096)()
            init = getattr(lib, c_name + "_init")
            init.restype, init.argtypes = None, [ctypes.c_void_p]
            init(buf)
            self.assertEqual(ctypes.cast(buf, ctypes.POINTER(ctypes.c_uint32))[0], ctypes.sizeof(py), c_name)

    def test_a_handle_of_another_kind_is_refused_naming_the_argument(self):
        # libfp8 cannot tell its handles apart: a Model passed as a Tensor would be read as one.
        ctx, recipe = fp8.Context(), fp8.Recipe()
        model = fp8.Model(ctx)
        fc = model.add_linear("fc", 16, 16)
        s = fp8.Scaling(ctx, recipe)
        x, q = fp8.Tensor(ctx, fp8.DTYPE_F32, (4, 16)), fp8.Tensor(ctx, fp8.DTYPE_E4M3, (4, 16))
        cases = [(lambda: fp8.quantize(ctx, model, q, s), "quantize: x is Model; expected a libfp8.Tensor"),
                 (lambda: fp8.quantize(ctx, x, s, s), "quantize: out is Scaling"),
                 (lambda: fp8.quantize(ctx, x, q, x), "quantize: scaling is Tensor; expected a libfp8.Scaling"),
                 (lambda: fp8.quantize(x, x, q, s), "quantize: ctx is Tensor; expected a libfp8.Context"),
                 (lambda: fp8.gemm(ctx, x, x, x, bias=s), "gemm: bias is Scaling; expected a libfp8.Tensor or None"),
                 (lambda: fp8.scaling_update(ctx, [s, x], recipe), "scaling_update: states[1] is Tensor"),
                 (lambda: fp8.Tensor(model, fp8.DTYPE_F32, (2,)), "Tensor: ctx is Model"),
                 (lambda: fp8.Model(recipe), "Model: ctx is Recipe"),
                 (lambda: fp8.Scaling(ctx, "scaling=current"), "Scaling: recipe is str"),
                 (lambda: fp8.Optimizer(ctx), "Optimizer: model is Context"),
                 (lambda: model.forward(fc, x.handle, x), "Model.forward: x is c_void_p"),
                 (lambda: model.backward_saved(fc, x, x, x), "Model.backward_saved: saved is Tensor"),
                 (lambda: model.save_checkpoint("/nonexistent/c", optimizer=model), "optimizer is Model"),
                 (lambda: model.load_checkpoint(42), "Model.load_checkpoint: path is int"),
                 (lambda: fp8.layer_report(ctx, fc), "layer_report: model is Context"),
                 (lambda: fp8.Comm.local([ctx, model]), "Comm.local: ctxs[1] is Model"),
                 (lambda: recipe.parse(b"margin=1"), "Recipe.parse: text is bytes")]
        for call, message in cases:
            with self.assertRaises(TypeError) as err:
                call()
            self.assertIn(message, str(err.exception))
        with self.assertRaises(KeyError) as err:
            fp8.Optimizer(model, fp8.OPTIMIZER_SGD, betas=0.9)
        self.assertIn("no hyper-parameter 'betas'; expected one of lr, beta1", str(err.exception))

    def test_objects_of_another_context_and_bad_recipe_text_are_refused_by_libfp8(self):
        c1, c2 = fp8.Context(), fp8.Context()
        model = fp8.Model(c1)
        fc = model.add_linear("fc", 16, 16)
        y = fp8.Tensor(c1, fp8.DTYPE_F32, (4, 16))
        with self.assertRaises(fp8.Fp8Error) as err:
            model.forward(fc, fp8.Tensor(c2, fp8.DTYPE_F32, (4, 16)), y)
        self.assertIn("fp8_layer_forward: x belongs to another context", str(err.exception))
        with self.assertRaises(fp8.Fp8Error) as err:
            fp8.quantize(c1, y, fp8.Tensor(c1, fp8.DTYPE_E4M3, (4, 16)), fp8.Scaling(c2, fp8.Recipe()))
        self.assertIn("scaling belongs to another context", str(err.exception))
        for text, message in [("scaling=tensorwise", "scaling='tensorwise' is not allowed; expected delayed, current, "
                                                      "rowwise, block"),
                              ("power_2_scales=2", "power_2_scales='2' is not allowed; expected auto, on, off"),
                              ("scalng=block", "unknown key 'scalng'"), ("margin", "margin")]:
            r = fp8.Recipe("scaling=current")
            with self.assertRaises(fp8.Fp8Error) as err:
                r.parse(text)
            self.assertEqual(err.exception.status_name, "FP8_ERR_INVALID_ARGUMENT")
            self.assertIn(message, str(err.exception))
            self.assertEqual(r[fp8.RECIPE_SCALING], fp8.SCALING_CURRENT)  # all or nothing
        r = fp8.Recipe("scaling=block")
        self.assertEqual((r[fp8.RECIPE_SCALING], r[fp8.RECIPE_POWER_2_SCALES]),
                         (fp8.SCALING_BLOCK, fp8.POWER_2_SCALES_AUTO))
        for attr, value, message in [
                (fp8.RECIPE_SCALING, 4, "scaling = 4 is out of range; expected 0..3"),
                (fp8.RECIPE_POWER_2_SCALES, -2, "power_2_scales = -2 is out of range; expected -1..1")]:
            with self.assertRaises(fp8.Fp8Error) as err:
                r[attr] = value
            self.assertIn(message, str(err.exception))

    def test_no_copy_shares_a_handle(self):
        # A copy of an object owning a handle would destroy it a second time (a double free); a
        # Recipe copies through fp8_recipe_clone.
        import copy
        import pickle
        ctx = fp8.Context()
        model = fp8.Model(ctx)
        model.add_linear("fc", 16, 16)
        for obj in (ctx, fp8.Tensor(ctx, fp8.DTYPE_F32, (4,)), model, fp8.Scaling(ctx, fp8.Recipe()),
                    fp8.Optimizer(model), model.parameter("fc.weight")[0]):
            for make in (copy.copy, copy.deepcopy, pickle.dumps):
                with self.assertRaises(TypeError) as err:
                    make(obj)
                self.assertIn(f"libfp8.{type(obj).__name__} cannot be copied", str(err.exception))
        r = fp8.Recipe("scaling=rowwise, margin=2")
        for c in (copy.copy(r), copy.deepcopy(r)):
            self.assertNotEqual(c.handle.value, r.handle.value)
            self.assertEqual(str(c), str(r))
            c[fp8.RECIPE_MARGIN] = 5
            self.assertEqual(r[fp8.RECIPE_MARGIN], 2)
        del r
        gc.collect()

    def test_paths_may_be_path_likes_and_a_checkpoint_gives_its_recipe_back(self):
        import pathlib
        import tempfile
        ctx, model, _ = self._linear("backend=te, scaling=block, margin=3")
        with tempfile.TemporaryDirectory() as tmp:
            path = pathlib.Path(tmp) / "m.fp8ckpt"
            model.save_checkpoint(path)
            back = fp8.Recipe.from_checkpoint(path)
            self.assertEqual(str(back), str(fp8.Recipe("backend=te, scaling=block, margin=3")))
            model.load_checkpoint(str(path))
            model.export_safetensors(pathlib.Path(tmp) / "m.safetensors")
            model.import_safetensors(pathlib.Path(tmp) / "m.safetensors")
            with self.assertRaises(fp8.Fp8Error) as err:
                fp8.Recipe.from_checkpoint(pathlib.Path(tmp) / "missing")
            self.assertEqual(err.exception.status_name, "FP8_ERR_IO")


if __name__ == "__main__":
    sys.exit(0 if unittest.main(exit=False).result.wasSuccessful() else 1)
