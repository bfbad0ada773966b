"""The ctypes binding against the real library on the CPU reference backend (run by CTest)."""
import gc
import os
import re
import struct
import sys
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
        r = fp8.Recipe("fp8_format=E4M3, margin=1")
        self.assertEqual(r[fp8.RECIPE_MARGIN], 1)
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
        model.convert(fp8.Recipe("small_layer_fallback=off"))
        self.assertTrue(model.has_fp8_layers)
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
        # An MS-AMP optimizer gives the weight new storage (F16 value, FP8 gradient) and frees the
        # tensors fetched before: the Parameter objects follow.
        model.convert(fp8.Recipe("backend=msamp, opt_level=O2"))
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


if __name__ == "__main__":
    sys.exit(0 if unittest.main(exit=False).result.wasSuccessful() else 1)
