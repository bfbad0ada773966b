"""libfp8.torch against torch itself (run by CTest on the CPU backend with Debian's torch; the same
cases run on CUDA from tests/gpu/test_torch_gpu.py with LIBFP8_TEST_DEVICE=cuda).

Exits 77 (CTest's skip code here) when torch is not installed."""
import copy
import ctypes
import io
import json
import math
import os
import pickle
import struct
import sys
import tempfile
import threading
import time
import unittest
import warnings

try:
    import torch
except ImportError:
    print("SKIP: torch is not installed (Debian: apt-get install python3-torch)")
    sys.exit(77)

import libfp8
import libfp8.torch as lt

DEVICE = torch.device(os.environ.get("LIBFP8_TEST_DEVICE", "cpu"))
FP8 = dict(small_layer_fallback=False)  # FP8 even for these small layers
ALL = dict(small_layers="libfp8")  # convert_model converts these small layers (else torch's stay)


def mlp(seed=0, d=32, h=64, out=16, norm=True):
    torch.manual_seed(seed)
    layers = ([torch.nn.LayerNorm(d)] if norm else []) + [torch.nn.Linear(d, h), torch.nn.GELU(), torch.nn.Linear(h, out)]
    return torch.nn.Sequential(*layers).to(DEVICE)


def rel_err(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def train_beside_torch(test, ref, ro, m, mo, x, t, steps, max_norm, tol):
    """`steps` steps on one batch: torch's `ref` with AdamW `ro` and clip_grad_norm_(max_norm), `m`
    with libfp8.torch.Optimizer `mo`; then every parameter of m within `tol` of ref's."""
    for _ in range(steps):
        (ref(x) - t).square().mean().backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm)
        ro.step()
        ro.zero_grad()
        (m(x) - t).square().mean().backward()
        mo.step()
        mo.zero_grad()
    for (n, p), (_, q) in zip(m.named_parameters(), ref.named_parameters()):
        test.assertLess(rel_err(p, q), tol, n)


def expect_high_precision_match(test, ref, m, x):
    """m(x) and its gradients (input and parameters) against torch's ref: FP32 arithmetic both, but
    libfp8's reference GEMM sums in double and torch in float, so to float rounding, not bit for bit."""
    xr, xm = x.clone().requires_grad_(), x.clone().requires_grad_()
    yr, ym = ref(xr), m(xm)
    test.assertLess(rel_err(ym, yr), 1e-6)
    yr.square().sum().backward()
    ym.square().sum().backward()
    test.assertLess(rel_err(xm.grad, xr.grad), 1e-5)
    for (n, p), (_, q) in zip(m.named_parameters(), ref.named_parameters()):
        test.assertLess(rel_err(p.grad, q.grad), 1e-5, n)


def fprops(model):
    """Each libfp8 layer's latest forward precision: 1 FP8, 0 high, -1 none yet."""
    return [libfp8.layer_report(m._group.model, m._layer_id).fprop for m in model.modules()
            if isinstance(m, lt._Module)]


class ConversionTest(unittest.TestCase):
    def test_convert_keeps_torch_names_and_values_and_converts_back_exactly(self):
        m = mlp()
        before = {k: v.clone() for k, v in m.state_dict().items()}
        rep = lt.convert_model(m, recipe=lt.Recipe(backend="te"), **ALL)
        self.assertEqual([n for n, _ in rep.converted], ["0", "1", "3"])
        self.assertIsInstance(m[1], lt.Linear)
        self.assertIsInstance(m[0], lt.LayerNorm)
        self.assertEqual(list(m.state_dict().keys()), list(before.keys()))
        for k, v in m.state_dict().items():
            self.assertTrue(torch.equal(v, before[k]), k)
        back = lt.convert_model(m, to_fp8=False)
        self.assertEqual(len(back.converted), 3)
        self.assertIs(type(m[1]), torch.nn.Linear)
        self.assertIs(type(m[0]), torch.nn.LayerNorm)
        for k, v in m.state_dict().items():
            self.assertTrue(torch.equal(v, before[k]), k)

    def test_small_layers_stay_torchs_unless_asked(self):
        # The recipe's small_layer_fallback would run both Linears of mlp() (32 -> 64 -> 16) in high
        # precision at every call: they stay torch's, and so does the norm, each with the reason.
        m = mlp()
        rep = lt.convert_model(m, recipe=lt.Recipe(backend="te"))
        self.assertEqual(rep.converted, [])
        self.assertFalse(lt.has_fp8_layers(m))
        self.assertIs(type(m[1]), torch.nn.Linear)
        reasons = {name: reason for name, _, reason in rep.skipped}
        self.assertIn(f"a small layer (min(in_features, out_features) = 32 < {libfp8.SMALL_LAYER_MIN_FEATURES})",
                      reasons["1"])
        self.assertIn("min(in_features, out_features) = 16", reasons["3"])
        self.assertIn("no Linear converts", reasons["0"])
        # Asked for, or FP8 for them (the fallback off), they convert.
        self.assertEqual(len(lt.convert_model(mlp(), recipe=lt.Recipe(backend="te"), small_layers="libfp8").converted), 3)
        self.assertEqual(len(lt.convert_model(mlp(), recipe=lt.Recipe(backend="te", **FP8)).converted), 3)
        # Beside a Linear of 2048 features, the norm converts and the small Linear stays.
        torch.manual_seed(0)
        m = torch.nn.Sequential(torch.nn.LayerNorm(64), torch.nn.Linear(64, 2048), torch.nn.Linear(2048, 2048)).to(DEVICE)
        rep = lt.convert_model(m, recipe=lt.Recipe(backend="te"))
        self.assertEqual(rep.converted, [("0", "LayerNorm"), ("2", "Linear")])
        self.assertEqual([name for name, _, _ in rep.skipped], ["1"])
        with self.assertRaises(ValueError) as err:
            lt.convert_model(mlp(), small_layers="yes")
        self.assertIn("small_layers='yes'; expected 'torch' or 'libfp8'", str(err.exception))

    def test_o2_weights_are_f16_parameters_over_libfp8_storage(self):
        m = mlp()
        before = {k: v.clone() for k, v in m.state_dict().items()}
        lt.convert_model(m, recipe=lt.Recipe(backend="msamp", opt_level="O2"), **ALL)
        self.assertEqual(m[1].weight.dtype, torch.float16)
        self.assertFalse(m[1].weight.requires_grad)
        self.assertTrue(m[1].bias.requires_grad)
        self.assertTrue(torch.equal(m[1].weight.float(), before["1.weight"].half().float()))
        self.assertTrue(torch.equal(m[1].bias, before["1.bias"]))
        # The Parameter IS libfp8's memory: libfp8's own view of the parameter sees a torch write.
        with torch.no_grad():
            m[1].bias.fill_(0.5)
        _, grad = ctypes.c_void_p(), ctypes.c_void_p()
        value = ctypes.c_void_p()
        libfp8._check(libfp8._lib.fp8_model_parameter(m[1]._group.model.handle, b"1.bias", ctypes.byref(value), None))
        self.assertTrue(torch.all(lt.to_torch(value) == 0.5))

    def test_load_state_dict_reaches_the_layers(self):
        m, ref = mlp(0), mlp(1)
        lt.convert_model(m, recipe=lt.Recipe(backend="te"), **ALL)
        x = torch.randn(8, 32, device=DEVICE)
        y0 = m(x)
        m.load_state_dict(ref.state_dict())
        self.assertLess(rel_err(m(x), ref(x)), 1e-5)
        self.assertGreater(rel_err(y0, ref(x)), 1e-2)

    def test_report_names_what_was_skipped_and_why(self):
        torch.manual_seed(0)
        emb = torch.nn.Embedding(16, 32)
        tied = torch.nn.Linear(32, 16, bias=False)
        tied.weight = emb.weight
        hooked = torch.nn.Linear(32, 32)
        hooked.register_forward_hook(lambda *a: None)
        m = torch.nn.ModuleDict(dict(emb=emb, tied=tied, odd=torch.nn.Linear(32, 10), hooked=hooked,
                                     ok=torch.nn.Linear(32, 32), ln2d=torch.nn.LayerNorm((4, 8)))).to(DEVICE)
        rep = lt.convert_model(m, recipe=lt.Recipe(backend="te"), **ALL)
        self.assertEqual([n for n, _ in rep.converted], ["ok"])
        why = {n: r for n, _, r in rep.skipped}
        self.assertIn("tied", why["tied"])
        self.assertIn("out_features = 10", why["odd"])
        self.assertIn("hooks", why["hooked"])
        self.assertIn("normalized_shape", why["ln2d"])
        self.assertIn("skipped tied", str(rep))
        self.assertTrue(lt.has_fp8_layers(m))
        self.assertFalse(lt.has_fp8_layers(mlp()))
        again = lt.convert_model(m, recipe=lt.Recipe(backend="te"), **ALL)
        self.assertIn("already", dict((n, r) for n, _, r in again.skipped)["ok"])

    def test_bad_arguments_raise_naming_the_argument_and_what_it_takes(self):
        cases = [(lambda: lt.Recipe(margin=-1), ValueError, "margin"),
                 (lambda: lt.Recipe(fp8_format="E5M2"), ValueError, "fp8_format"),
                 (lambda: lt.Recipe(amax_history_len=1.5), TypeError, "amax_history_len"),
                 (lambda: lt.Recipe(override_linear_precision=(True,)), TypeError, "override_linear_precision"),
                 (lambda: lt.Recipe(power_2_scales="yes"), TypeError, "power_2_scales"),
                 (lambda: lt.Recipe(scaling="tensorwise"), ValueError, "scaling"),
                 (lambda: lt.convert_model("model"), TypeError, "module"),
                 (lambda: lt.convert_model(mlp(), to_fp8="yes"), TypeError, "to_fp8"),
                 (lambda: lt.convert_model(mlp(), recipe=lt.Recipe(opt_level="O3")), ValueError, "O3"),
                 (lambda: lt.Optimizer(mlp(), "lamb"), ValueError, "kind"),
                 (lambda: lt.Optimizer(mlp(), lr=-1.0), ValueError, "lr"),
                 (lambda: lt.fp8_autocast(enabled=1).__enter__(), TypeError, "enabled")]
        for make, exc, word in cases:
            with self.assertRaises(exc) as ctx:
                make()
            self.assertIn(word, str(ctx.exception))
        self.assertIn("power_2_scales=on", lt.Recipe(power_2_scales=True).text())
        self.assertIn("scaling=current", lt.Recipe(scaling="Current").text())
        self.assertIn("power_2_scales=auto, scaling=block", lt.Recipe(scaling="block").text())
        m = mlp(norm=False)
        lt.convert_model(m, recipe=lt.Recipe(backend="te"), **ALL)
        with self.assertRaises(TypeError) as ctx:
            m(torch.randn(2, 32, device=DEVICE, dtype=torch.float16))
        self.assertIn("float16", str(ctx.exception))
        with self.assertRaises(ValueError) as ctx:
            m(torch.randn(2, 31, device=DEVICE))
        self.assertIn("[..., 32]", str(ctx.exception))

    def test_recipe_from_accelerate_kwargs_takes_every_field(self):
        # Accelerate's FP8RecipeKwargs as an object with its fields, and as a dict with one more key.
        fields = dict(backend="msamp", opt_level="O1", margin=1, interval=2, fp8_format="E4M3",
                      amax_history_len=16, amax_compute_algo="most_recent",
                      override_linear_precision=(False, False, True), use_autocast_during_eval=True)
        kwargs = type("FP8RecipeKwargs", (), dict(fields))()
        for r in (lt.Recipe.from_kwargs(kwargs), lt.Recipe.from_kwargs(dict(fields, not_a_field=1))):
            for k, v in fields.items():
                self.assertEqual(getattr(r, k), v, k)
            self.assertEqual(r.text(), lt.Recipe(**fields).text())

    @unittest.skipUnless(hasattr(torch.nn, "RMSNorm"), "torch.nn.RMSNorm needs torch >= 2.4")
    def test_rmsnorm_converts_and_matches_torch(self):
        def model():
            torch.manual_seed(0)
            return torch.nn.Sequential(torch.nn.RMSNorm(32, eps=1e-5), torch.nn.Linear(32, 64),
                                       torch.nn.RMSNorm(64, eps=1e-6)).to(DEVICE)
        ref, m = model(), model()
        with torch.no_grad():
            for norm in (ref[0], ref[2]):
                norm.weight.uniform_(0.5, 1.5)
        m.load_state_dict(ref.state_dict())
        rep = lt.convert_model(m, recipe=lt.Recipe(backend="te"), **ALL)
        self.assertEqual(rep.converted, [("0", "RMSNorm"), ("1", "Linear"), ("2", "RMSNorm")])
        self.assertIsInstance(m[0], lt.RMSNorm)
        self.assertEqual(list(m.state_dict()), list(ref.state_dict()))
        expect_high_precision_match(self, ref, m, torch.randn(24, 32, device=DEVICE))
        # eps=None (torch's float32 epsilon) converts too; no weight stays torch's, with the reason.
        torch.manual_seed(1)
        ref2 = torch.nn.Sequential(torch.nn.RMSNorm(32), torch.nn.Linear(32, 32)).to(DEVICE)
        m2 = copy.deepcopy(ref2)
        lt.convert_model(m2, recipe=lt.Recipe(backend="te"), **ALL)
        self.assertIsInstance(m2[0], lt.RMSNorm)
        expect_high_precision_match(self, ref2, m2, torch.randn(8, 32, device=DEVICE))
        odd = torch.nn.Sequential(torch.nn.RMSNorm(32, elementwise_affine=False), torch.nn.Linear(32, 32)).to(DEVICE)
        rep = lt.convert_model(odd, recipe=lt.Recipe(backend="te"), **ALL)
        self.assertIs(type(odd[0]), torch.nn.RMSNorm)
        self.assertIn("elementwise_affine=False", dict((n, r) for n, _, r in rep.skipped)["0"])
        lt.convert_model(m, to_fp8=False)
        self.assertIs(type(m[0]), torch.nn.RMSNorm)
        self.assertEqual(m[2].eps, 1e-6)

    def test_a_parameter_moved_after_conversion_is_refused(self):
        m = mlp(norm=False)
        lt.convert_model(m, recipe=lt.Recipe(backend="te"), **ALL)
        m[0].weight.data = m[0].weight.data.clone()
        with self.assertRaises(RuntimeError) as ctx:
            m(torch.randn(2, 32, device=DEVICE))
        self.assertIn("no longer uses libfp8's memory", str(ctx.exception))

    def test_frozen_parameters_stay_frozen(self):
        # Frozen before the conversion: still frozen after it (and after converting back), and no
        # .grad for a torch optimizer to step; libfp8's optimizer, which updates every parameter of
        # its model, refuses them naming one.
        x = torch.randn(8, 32, device=DEVICE)
        for level in (dict(backend="te"), dict(backend="msamp", opt_level="O2")):
            m = mlp(norm=False)
            m[0].requires_grad_(False)
            lt.convert_model(m, recipe=lt.Recipe(**level), **ALL)
            self.assertEqual([p.requires_grad for p in m[0].parameters()], [False, False])
            self.assertIsNone(m[0].weight.grad)
            with self.assertRaises(RuntimeError) as err:
                lt.Optimizer(m, "adamw")
            self.assertIn("libfp8 layer '0': parameter 'weight' is frozen (requires_grad=False)", str(err.exception))
            before = [p.detach().clone() for p in m[0].parameters()]
            opt = torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=0.1)
            m(x).square().sum().backward()
            opt.step()
            self.assertEqual([torch.equal(p, q) for p, q in zip(m[0].parameters(), before)], [True, True])
            self.assertEqual([p.grad is None for p in m[0].parameters()], [True, True])
            lt.convert_model(m, to_fp8=False)
            self.assertEqual([p.requires_grad for p in m.parameters()], [False, False, True, True])
        # Frozen after the conversion: torch's optimizers find no .grad, libfp8's step refuses.
        m = mlp(norm=False)
        lt.convert_model(m, recipe=lt.Recipe(backend="te"), **ALL)
        opt = lt.Optimizer(m, "adamw", lr=0.1)
        m[2].bias.requires_grad_(False)
        b0 = m[2].bias.detach().clone()
        m(x).square().sum().backward()
        self.assertIsNone(m[2].bias.grad)
        torch.optim.SGD(m.parameters(), lr=0.1).step()
        with self.assertRaises(RuntimeError) as err:
            opt.step()
        self.assertIn("libfp8 layer '2': parameter 'bias' is frozen", str(err.exception))
        self.assertTrue(torch.equal(m[2].bias, b0))

    def test_a_converted_module_is_not_copied_and_a_recipe_copies_and_pickles(self):
        m = mlp()
        lt.convert_model(m, recipe=lt.Recipe(backend="te"), **ALL)
        with self.assertRaises(TypeError) as err:  # its parameters are its libfp8 model's memory
            copy.deepcopy(m)
        self.assertIn("libfp8 layer '0': a module made by convert_model cannot be copied", str(err.exception))
        with self.assertRaises(TypeError) as err:
            pickle.dumps(m)
        self.assertIn("cannot be copied or pickled", str(err.exception))
        r = lt.Recipe(backend="msamp", opt_level="O1", scaling="rowwise", power_2_scales=True, margin=2)
        self.assertIs(copy.copy(r), r)  # immutable
        self.assertIs(copy.deepcopy(r), r)
        back = pickle.loads(pickle.dumps(r))
        self.assertEqual((back, back.text()), (r, r.text()))
        self.assertEqual(lt.Recipe(power_2_scales="AUTO"), lt.Recipe())


class NumericsTest(unittest.TestCase):
    def _pair(self, recipe, **kw):
        ref, m = mlp(**kw), mlp(**kw)
        lt.convert_model(m, recipe=recipe, **ALL)
        return ref, m

    def test_high_precision_forward_and_backward_match_torch(self):
        # te with FP8 off (outside fp8_autocast).
        ref, m = self._pair(lt.Recipe(backend="te"))
        expect_high_precision_match(self, ref, m, torch.randn(64, 32, device=DEVICE))
        self.assertEqual(fprops(m), [0, 0, 0])

    def test_fp8_forward_and_backward_within_fp8_bounds(self):
        # E4M3 keeps 3 mantissa bits (relative rounding <= 2^-4), E5M2 2 (<= 2^-3); errors of a
        # whole layer average out: the bounds below are a few times the expected RMS error. Every
        # scaling recipe, each within the same bounds.
        for scaling in ("delayed", "current", "rowwise", "block"):
            with self.subTest(scaling=scaling):
                ref, m = self._pair(lt.Recipe(backend="te", scaling=scaling, **FP8))
                x = torch.randn(64, 32, device=DEVICE)
                xr, xm = x.clone().requires_grad_(), x.clone().requires_grad_()
                yr = ref(xr)
                with lt.fp8_autocast():
                    ym = m(xm)
                self.assertEqual(fprops(m)[1:], [1, 1])
                e = rel_err(ym, yr)
                self.assertLess(e, 0.08)
                self.assertGreater(e, 1e-4)  # FP8 did run
                yr.square().sum().backward()
                ym.square().sum().backward()
                self.assertLess(rel_err(xm.grad, xr.grad), 0.15)
                self.assertLess(rel_err(m[1].weight.grad, ref[1].weight.grad), 0.15)

    def test_autocast_and_eval_rules(self):
        m = mlp(norm=False)
        lt.convert_model(m, recipe=lt.Recipe(backend="te", **FP8), **ALL)
        x = torch.randn(16, 32, device=DEVICE)
        m(x)
        self.assertEqual(fprops(m), [0, 0])  # outside any region
        with lt.fp8_autocast():
            m(x)
        self.assertEqual(fprops(m), [1, 1])
        with lt.fp8_autocast(enabled=False):
            m(x)
        self.assertEqual(fprops(m), [0, 0])
        with lt.fp8_autocast():
            with lt.fp8_autocast(enabled=False):
                m(x)
            self.assertEqual(fprops(m), [0, 0])
            m(x)
            self.assertEqual(fprops(m), [1, 1])
        m.eval()
        with lt.fp8_autocast():
            m(x)
        self.assertEqual(fprops(m), [0, 0])  # eval: high precision unless use_autocast_during_eval
        with self.assertRaises(ValueError):
            with lt.fp8_autocast(recipe=lt.Recipe(backend="te", margin=3)):
                m(x)
        # apply_fp8_autowrap: FP8 while training, not in eval (the recipe's use_autocast_during_eval off).
        lt.apply_fp8_autowrap(m, lt.Recipe(backend="te", **FP8))
        m.train()
        m(x)
        self.assertEqual(fprops(m), [1, 1])
        m.eval()
        m(x)
        self.assertEqual(fprops(m), [0, 0])
        # use_during_eval: FP8 in eval too (the model converted with the recipe that allows it).
        e = mlp(norm=False)
        r = lt.Recipe(backend="te", use_autocast_during_eval=True, **FP8)
        lt.convert_model(e, recipe=r, **ALL)
        e.forward = lt.contextual_fp8_autocast(e.forward, r, use_during_eval=True).__get__(e)
        e.eval()
        with torch.no_grad():
            e(x)
        self.assertEqual(fprops(e), [1, 1])

    def test_a_module_used_twice_accumulates_both_uses(self):
        torch.manual_seed(0)
        ref = torch.nn.Linear(32, 32).to(DEVICE)
        m = torch.nn.Sequential(torch.nn.Linear(32, 32)).to(DEVICE)
        m[0].load_state_dict(ref.state_dict())
        lt.convert_model(m, recipe=lt.Recipe(backend="te"), **ALL)
        x = torch.randn(8, 32, device=DEVICE)
        ref(torch.tanh(ref(x))).sum().backward()
        m(torch.tanh(m(x))).sum().backward()
        self.assertLess(rel_err(m[0].weight.grad, ref.weight.grad), 1e-5)
        self.assertLess(rel_err(m[0].bias.grad, ref.bias.grad), 1e-5)

    def test_gradient_accumulation_equals_one_large_batch(self):
        ref, m = self._pair(lt.Recipe(backend="te"))
        x = torch.randn(32, 32, device=DEVICE)
        ref(x).square().sum().backward()
        for half in x.split(16):
            m(half).square().sum().backward()
        for (n, p), (_, q) in zip(m.named_parameters(), ref.named_parameters()):
            self.assertLess(rel_err(p.grad, q.grad), 1e-5, n)

    def test_checkpoint_recompute_matches_a_plain_backward(self):
        for use_reentrant in (True, False):
            for fp8 in (False, True):
                a, b = mlp(), mlp()
                recipe = lt.Recipe(backend="te", **FP8)
                lt.convert_model(a, recipe=recipe, **ALL)
                lt.convert_model(b, recipe=recipe, **ALL)
                x = torch.randn(16, 32, device=DEVICE)
                xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
                with lt.fp8_autocast(enabled=fp8):
                    ya = a(xa)
                    yb = lt.checkpoint(b, xb, use_reentrant=use_reentrant)
                ya.square().sum().backward()
                yb.square().sum().backward()
                self.assertTrue(torch.equal(ya, yb))
                bound = 0.15 if fp8 else 1e-6  # the recompute may use the scales the region's end set
                self.assertLess(rel_err(xb.grad, xa.grad), bound, (use_reentrant, fp8))
                self.assertLess(rel_err(b[1].weight.grad, a[1].weight.grad), bound, (use_reentrant, fp8))

    def test_an_fp8_linear_lets_its_input_go_and_a_norm_keeps_it(self):
        # An FP8 Linear's backward reads x's FP8 copy (fp8_saved_needs_input says 0): the activation
        # is freed once the forward returns, and the backward still matches one that kept it. A
        # norm's backward reads x: it stays alive until the backward.
        import weakref
        results = []
        for keep in (True, False):
            m = mlp(norm=False)
            lt.convert_model(m, recipe=lt.Recipe(backend="te", **FP8), **ALL)
            x = torch.randn(64, 32, device=DEVICE, requires_grad=True)
            with lt.fp8_autocast():
                h = torch.tanh(m[0](x)) * 2.0  # autograd keeps nothing of h: only the Linear could
                seen = weakref.ref(h)
                y = m[2](h)
            held = [h] if keep else []
            del h
            if not keep:
                self.assertIsNone(seen(), "the FP8 Linear's input is still alive after its forward")
                held = [torch.full((64, 64), math.nan, device=DEVICE) for _ in range(8)]  # reuse its memory
            y.square().sum().backward()
            results.append((x.grad.clone(), m[0].weight.grad.clone(), m[2].weight.grad.clone()))
            del held
        for a, b in zip(*results):
            self.assertTrue(torch.equal(a, b))
        norm = torch.nn.Sequential(torch.nn.LayerNorm(32)).to(DEVICE)
        lt.convert_model(norm, recipe=lt.Recipe(backend="te", **FP8), **ALL)
        x = torch.randn(8, 32, device=DEVICE, requires_grad=True)
        h = x * 2.0
        seen = weakref.ref(h)
        y = norm(h)
        del h
        self.assertIsNotNone(seen(), "a norm's input was let go before its backward")
        y.sum().backward()
        self.assertIsNone(seen())

    def test_no_grad_and_eval_forwards_keep_nothing_for_a_backward(self):
        m = mlp()
        lt.convert_model(m, recipe=lt.Recipe(backend="te", **FP8), **ALL)
        x = torch.randn(8, 32, device=DEVICE, requires_grad=True)
        with torch.no_grad(), lt.fp8_autocast():
            y = m(x)
        self.assertFalse(y.requires_grad)
        m.eval()
        self.assertFalse(m(x.detach()).requires_grad)
        m.train()
        y = m(x)
        self.assertTrue(y.requires_grad)
        y.sum().backward()
        with self.assertRaises(RuntimeError):
            y.sum().backward()  # the graph is freed; torch says so before libfp8 is asked


class Block(torch.nn.Module):
    """A residual MLP block whose body is an nn.Sequential that libfp8 can run as one stack."""

    def __init__(self, seed=0, d=32, h=64, act=None):
        super().__init__()
        torch.manual_seed(seed)
        act = act if act is not None else torch.nn.GELU(approximate="tanh")
        self.body = torch.nn.Sequential(torch.nn.LayerNorm(d), torch.nn.Linear(d, h), act, torch.nn.Linear(h, d))
        for p in self.body.parameters():  # away from LayerNorm's 1 / 0, so every gradient is distinct
            torch.nn.init.normal_(p, std=0.3)
        self.to(DEVICE)

    def forward(self, x):
        return x + self.body(x)


class SequentialTest(unittest.TestCase):
    def _stacked_and_per_layer(self, recipe, **kw):
        """A converted Block (its body a libfp8 Sequential) and a twin whose converted layers run one
        call each (the same children in a plain nn.Sequential)."""
        stacked, per_layer = Block(**kw), Block(**kw)
        lt.convert_model(stacked, recipe=recipe, **ALL)
        lt.convert_model(per_layer, recipe=recipe, **ALL)
        per_layer.body = torch.nn.Sequential(*per_layer.body)
        return stacked, per_layer

    def test_a_sequential_whose_children_all_convert_becomes_one_stack_and_converts_back(self):
        m = Block()
        before = {k: v.clone() for k, v in m.state_dict().items()}
        rep = lt.convert_model(m, recipe=lt.Recipe(backend="te"), **ALL)
        self.assertIs(type(m.body), lt.Sequential)
        self.assertIsInstance(m.body[2], lt.Activation)
        self.assertIn(("body", "Sequential"), rep.converted)
        self.assertIn(("body.2", "GELU"), rep.converted)
        self.assertEqual(list(m.state_dict().keys()), list(before.keys()))
        for k, v in m.state_dict().items():
            self.assertTrue(torch.equal(v, before[k]), k)
        back = lt.convert_model(m, to_fp8=False)
        self.assertIn(("body", "Sequential"), back.converted)
        self.assertIs(type(m.body), torch.nn.Sequential)
        self.assertIs(type(m.body[2]), torch.nn.GELU)
        self.assertEqual(m.body[2].approximate, "tanh")
        for k, v in m.state_dict().items():
            self.assertTrue(torch.equal(v, before[k]), k)

    def test_a_sequential_with_a_child_libfp8_cannot_run_stays_torchs(self):
        for act in (torch.nn.GELU(), torch.nn.Dropout(0.0), torch.nn.SiLU()):
            with self.subTest(act=type(act).__name__):
                m = Block(act=act)
                rep = lt.convert_model(m, recipe=lt.Recipe(backend="te"), **ALL)
                self.assertIs(type(m.body), torch.nn.Sequential)
                self.assertIs(m.body[2], act)
                self.assertIsInstance(m.body[1], lt.Linear)
                self.assertNotIn(("body", "Sequential"), rep.converted)
        # Nor is the module passed in swapped (as for a bare layer: pass its parent).
        root = mlp(norm=True)
        lt.convert_model(root, recipe=lt.Recipe(backend="te"), **ALL)
        self.assertIs(type(root), torch.nn.Sequential)

    def test_a_child_used_twice_or_hooked_leaves_the_sequential_torchs(self):
        # One ReLU twice in the container is one module (one libfp8 layer, not two): no stack.
        relu = torch.nn.ReLU()
        m = torch.nn.Module()
        m.body = torch.nn.Sequential(torch.nn.Linear(32, 32), relu, torch.nn.Linear(32, 32), relu,
                                     torch.nn.Linear(32, 32))
        m.head = torch.nn.Linear(32, 32)
        m.to(DEVICE)
        lt.convert_model(m, recipe=lt.Recipe(backend="te"), **ALL)
        self.assertIs(type(m.body), torch.nn.Sequential)
        self.assertIsInstance(m.body[0], lt.Linear)
        hooked = Block()
        hooked.body[2].register_forward_hook(lambda *a: None)
        lt.convert_model(hooked, recipe=lt.Recipe(backend="te"), **ALL)
        self.assertIs(type(hooked.body), torch.nn.Sequential)

    def test_a_stack_sliced_changed_or_hooked_after_conversion_runs_its_children(self):
        ref, m = Block(), Block()
        lt.convert_model(m, recipe=lt.Recipe(backend="te"), **ALL)
        x = torch.randn(4, 16, 32, device=DEVICE)
        whole = m.body(x)
        self.assertIs(type(m.body[:2]), torch.nn.Sequential)
        self.assertLess(rel_err(m.body[2:](m.body[:2](x)), whole), 1e-6)
        fired = []
        handle = m.body[0].register_forward_hook(lambda *a: fired.append(1))
        self.assertLess(rel_err(m.body(x), whole), 1e-6)
        self.assertEqual(fired, [1])  # the child ran its own call, so its hook fired
        handle.remove()
        m.body.append(torch.nn.Identity())  # no longer the layers libfp8 stacked
        self.assertLess(rel_err(m.body(x), ref.body(x)), 1e-5)

    def test_high_precision_stack_matches_torch(self):
        ref, m = Block(), Block()
        lt.convert_model(m, recipe=lt.Recipe(backend="te"), **ALL)
        expect_high_precision_match(self, ref, m, torch.randn(4, 16, 32, device=DEVICE))

    def test_fp8_stack_matches_the_per_layer_calls_in_float32(self):
        # In FP32 activations the E4M3 hand-offs and the folded GELU backward compute what the
        # per-layer calls do: the norm's and the GELU's FP8 outputs are the codes the next Linear's
        # cast would make (same scales at the first step), and the GELU's dx rounds to FP32 exactly.
        for act in (torch.nn.GELU(approximate="tanh"), torch.nn.ReLU()):
            with self.subTest(act=type(act).__name__):
                stacked, per_layer = self._stacked_and_per_layer(lt.Recipe(backend="te", **FP8), act=act)
                x = torch.randn(4, 16, 32, device=DEVICE)
                out = []
                for m in (stacked, per_layer):
                    xm = x.clone().requires_grad_()
                    with lt.fp8_autocast():
                        y = m(xm)
                    y.square().sum().backward()
                    out.append((y.detach(), xm.grad, [p.grad.clone() for p in m.parameters()]))
                self.assertTrue(torch.equal(out[0][0], out[1][0]), "y")
                self.assertLess(rel_err(out[0][1], out[1][1]), 1e-6)
                for a, b in zip(out[0][2], out[1][2]):
                    self.assertLess(rel_err(a, b), 1e-6)
                self.assertEqual(fprops(stacked), [1, 1, 1])  # norm (its E4M3 hand-off), both Linears

    def test_fp8_stack_under_autocast_within_fp8_bounds(self):
        # torch.autocast: an FP32 residual into a stack of the autocast dtype (the norm reads FP32);
        # the same with the sum made by libfp8 (lt.residual), which keeps the residual's dtype.
        for name, call in (("x + stack(x)", lambda m, x: m(x)), ("lt.residual", lambda m, x: lt.residual(m.body, x))):
            with self.subTest(name):
                ref, m = Block(), Block()
                lt.convert_model(m, recipe=lt.Recipe(backend="te", **FP8), **ALL)
                x = torch.randn(4, 16, 32, device=DEVICE)
                xr, xm = x.clone().requires_grad_(), x.clone().requires_grad_()
                with torch.autocast(DEVICE.type, dtype=torch.bfloat16):
                    yr = ref(xr)
                    with lt.fp8_autocast():
                        ym = call(m, xm)
                self.assertEqual(ym.dtype, torch.float32)  # the residual's
                self.assertLess(rel_err(ym, yr), 0.08)
                yr.float().square().sum().backward()
                ym.float().square().sum().backward()
                self.assertEqual(xm.grad.dtype, torch.float32)
                self.assertLess(rel_err(xm.grad, xr.grad), 0.15)
                for (n, p), (_, q) in zip(m.named_parameters(), ref.named_parameters()):
                    self.assertLess(rel_err(p.grad, q.grad), 0.15, n)

    def test_no_grad_forward_and_a_second_backward(self):
        m = Block()
        lt.convert_model(m, recipe=lt.Recipe(backend="te", **FP8), **ALL)
        x = torch.randn(4, 16, 32, device=DEVICE)
        with torch.no_grad():
            y0 = m(x)
        y1 = m(x)
        self.assertTrue(torch.equal(y0, y1.detach()))
        loss = y1.square().sum()
        loss.backward(retain_graph=True)
        with self.assertRaisesRegex(RuntimeError, "Sequential 'body': backward through the same graph"):
            loss.backward()

    def test_stacks_and_residuals_run_every_scaling(self):
        for scaling in ("current", "rowwise", "block"):
            with self.subTest(scaling=scaling):
                ref, m = Block(), Block()
                lt.convert_model(m, recipe=lt.Recipe(backend="te", scaling=scaling, **FP8), **ALL)
                self.assertIs(type(m.body), lt.Sequential)
                x = torch.randn(64, 32, device=DEVICE)
                xr, xm = x.clone().requires_grad_(), x.clone().requires_grad_()
                with lt.fp8_autocast():
                    ym = lt.residual(m.body, xm)
                yr = ref(xr)
                e = rel_err(ym, yr)
                self.assertLess(e, 0.08)
                self.assertGreater(e, 1e-4)  # FP8 did run
                ym.square().sum().backward()
                yr.square().sum().backward()
                self.assertLess(rel_err(xm.grad, xr.grad), 0.15)
                self.assertLess(rel_err(m.body[1].weight.grad, ref.body[1].weight.grad), 0.15)
                reports = [libfp8.layer_report(layer._group.model, layer._layer_id) for layer in m.body._layers]
                self.assertEqual([r.scaling for r in reports], [getattr(libfp8, "SCALING_" + scaling.upper())] * 3)
                self.assertEqual([r.fprop for r in reports if r.kind == libfp8.LAYER_LINEAR], [1, 1])


class ResidualTest(unittest.TestCase):
    """libfp8.torch.residual: r + module(x), the sum made by the last Linear's GEMM."""

    def _twins(self, recipe):
        a, b = Block(), Block()
        for m in (a, b):
            lt.convert_model(m, recipe=recipe, **ALL)
        return a, b

    def test_a_stacks_residual_matches_x_plus_the_stack(self):
        # FP32: the GEMM adds x before its one rounding (y within an FP32 rounding of x + body(x)),
        # and the backward's dx = dy + the stack's dx is torch's own sum, bit for bit.
        for fp8 in (False, True):
            with self.subTest(fp8=fp8):
                fused, plain = self._twins(lt.Recipe(backend="te", **FP8))
                x = torch.randn(4, 16, 32, device=DEVICE)
                out = []
                for m, call in ((fused, lambda m, x: lt.residual(m.body, x)), (plain, lambda m, x: m(x))):
                    xm = x.clone().requires_grad_()
                    with lt.fp8_autocast(enabled=fp8):
                        y = call(m, xm)
                    y.square().sum().backward()
                    out.append((y.detach(), xm.grad, [p.grad.clone() for p in m.parameters()]))
                self.assertLess(rel_err(out[0][0], out[1][0]), 1e-6)
                self.assertLess(rel_err(out[0][0] - x, out[1][0] - x), 1e-5)  # the block itself
                self.assertLess(rel_err(out[0][1], out[1][1]), 1e-5)
                for a, b in zip(out[0][2], out[1][2]):
                    self.assertLess(rel_err(a, b), 1e-5)
                self.assertEqual(fprops(fused), [1, 1, 1] if fp8 else [0, 0, 0])

    def test_a_linear_adds_another_tensor_and_hands_it_dy(self):
        torch.manual_seed(3)
        parent = torch.nn.Module()
        parent.proj = torch.nn.Linear(32, 32)
        parent.to(DEVICE)
        ref = copy.deepcopy(parent)
        lt.convert_model(parent, recipe=lt.Recipe(backend="te"), **ALL)
        self.assertIsInstance(parent.proj, lt.Linear)
        a, r = torch.randn(4, 16, 32, device=DEVICE), torch.randn(4, 16, 32, device=DEVICE)
        grads = []
        for mod, call in ((parent.proj, lambda m, a, r: lt.residual(m, a, r)), (ref.proj, lambda m, a, r: r + m(a))):
            am, rm = a.clone().requires_grad_(), r.clone().requires_grad_()
            y = call(mod, am, rm)
            (y * torch.arange(y.numel(), device=DEVICE).view_as(y).sin()).sum().backward()
            grads.append((y.detach(), am.grad, rm.grad, mod.weight.grad.clone()))
        self.assertLess(rel_err(grads[0][0], grads[1][0]), 1e-6)
        self.assertTrue(torch.equal(grads[0][2], grads[1][2]), "the residual's gradient is dy")
        self.assertLess(rel_err(grads[0][1], grads[1][1]), 1e-5)
        self.assertLess(rel_err(grads[0][3], grads[1][3]), 1e-5)

    def _attention_twins(self, recipe):
        """Two converted pre-norm 'attention' blocks, y = x + proj(mix(qkv(x))), with a torch op between
        the qkv stack and proj (as attention is)."""
        blocks = []
        for _ in range(2):
            torch.manual_seed(5)
            m = torch.nn.Module()
            m.qkv = torch.nn.Sequential(torch.nn.LayerNorm(32), torch.nn.Linear(32, 96))
            m.proj = torch.nn.Linear(32, 32)
            for p in m.parameters():
                torch.nn.init.normal_(p, std=0.3)
            m.to(DEVICE)
            lt.convert_model(m, recipe=recipe, **ALL)
            blocks.append(m)
        return blocks

    @staticmethod
    def _mix(h):
        q, k, v = h.split(32, dim=-1)
        return torch.tanh(q) * torch.sigmoid(k) + v.transpose(0, 1).transpose(0, 1)

    def test_a_residual_hands_its_gradient_to_the_stack_it_went_through(self):
        # y = x + proj(mix(qkv(x))): proj's residual gradient goes to the qkv stack's backward, which
        # adds it in the norm's pass (fp8_stack_backward_saved_add) instead of autograd's sum. In FP32
        # the two give the same bits: dx, and every parameter gradient.
        for fp8 in (False, True):
            with self.subTest(fp8=fp8):
                a, b = self._attention_twins(lt.Recipe(backend="te", **FP8))
                x = torch.randn(4, 16, 32, device=DEVICE)
                out = []
                for m, handed in ((a, True), (b, False)):
                    xm = x.clone().requires_grad_()
                    with lt.fp8_autocast(enabled=fp8):
                        h = m.qkv(xm)
                        # (b: the residual is a view of x, which the stack did not see: autograd's sum)
                        y = lt.residual(m.proj, self._mix(h), xm if handed else xm.view_as(xm))
                    w = torch.linspace(-1, 1, y.numel(), device=DEVICE).view_as(y)  # (dy)
                    (y * w).sum().backward()
                    link = getattr(xm, "_fp8_base_link", None)
                    self.assertEqual((link.claimed, link.done), (handed, True))
                    self.assertIsNone(link.base)
                    out.append((y.detach(), xm.grad, [p.grad.clone() for p in m.parameters()]))
                self.assertTrue(torch.equal(out[0][0], out[1][0]))
                self.assertTrue(torch.equal(out[0][1], out[1][1]), "dx")
                for ga, gb in zip(out[0][2], out[1][2]):
                    self.assertTrue(torch.equal(ga, gb))
                self.assertGreater((out[0][1] - w).abs().max().item(), 1e-3, "dx is the residual's gradient alone")

    def test_a_residual_that_does_not_depend_on_the_stack_keeps_autograds_sum(self):
        # proj's input not computed from the qkv stack's output: no hand-off (the stack's backward
        # could run first), and the gradient is right.
        a, b = self._attention_twins(lt.Recipe(backend="te"))
        x, z = torch.randn(4, 16, 32, device=DEVICE), torch.randn(4, 16, 96, device=DEVICE)
        grads = []
        for m in (a, b):
            xm = x.clone().requires_grad_()
            h = m.qkv(xm)
            y = lt.residual(m.proj, self._mix(z), xm) if m is a else xm + m.proj(self._mix(z))
            (y.square().sum() + h.square().sum()).backward()
            self.assertFalse(xm._fp8_base_link.claimed)
            grads.append(xm.grad)
        self.assertLess(rel_err(grads[0], grads[1]), 1e-6)

    def test_a_stack_with_a_backward_hook_takes_no_residual_gradient(self):
        # A (legacy) module backward hook on the stack would see the residual's gradient inside its
        # grad_input: such a stack offers no link, and autograd sums as before.
        a, b = self._attention_twins(lt.Recipe(backend="te"))
        x = torch.randn(4, 16, 32, device=DEVICE)
        grads = []
        for m in (a, b):
            if m is a:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")  # (torch's deprecation of non-full hooks)
                    m.qkv.register_backward_hook(lambda mod, gin, gout: None)
            xm = x.clone().requires_grad_()
            h = m.qkv(xm)
            y = lt.residual(m.proj, self._mix(h), xm)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                y.square().sum().backward()
            self.assertEqual(getattr(xm, "_fp8_base_link", None) is None, m is a)
            grads.append(xm.grad)
        self.assertTrue(torch.equal(grads[0], grads[1]))

    def test_a_backward_that_stops_before_the_stack_drops_the_handed_gradient(self):
        # torch.autograd.grad for proj's input only: the qkv stack's backward never runs; the gradient
        # kept for it is dropped at the end of that backward pass (x's gradient was not asked for).
        a, b = self._attention_twins(lt.Recipe(backend="te"))
        x = torch.randn(4, 16, 32, device=DEVICE)
        grads = []
        for m in (a, b):
            xm = x.clone().requires_grad_()
            mixed = self._mix(m.qkv(xm))
            y = lt.residual(m.proj, mixed, xm) if m is a else xm + m.proj(mixed)
            grads.append(torch.autograd.grad(y.square().sum(), [mixed])[0])
            if m is a:
                link = xm._fp8_base_link
                self.assertEqual((link.claimed, link.done, link.base), (True, False, None))
        self.assertLess(rel_err(grads[0], grads[1]), 1e-6)

    def test_what_libfp8_does_not_run_is_torchs_sum(self):
        lin = torch.nn.Linear(32, 32).to(DEVICE)
        x = torch.randn(2, 32, device=DEVICE)
        self.assertTrue(torch.equal(lt.residual(lin, x), x + lin(x)))
        m = Block()
        lt.convert_model(m, recipe=lt.Recipe(backend="te"), **ALL)
        r16 = torch.randn(4, 16, 32, device=DEVICE).half()
        x = torch.randn(4, 16, 32, device=DEVICE)
        self.assertEqual(lt.residual(m.body, x, r16).dtype, torch.float32)  # float16 residual: torch's sum
        with torch.no_grad():
            self.assertLess(rel_err(lt.residual(m.body, x), m(x)), 1e-6)
        # In eval mode the residual still hands dy to a residual that wants a gradient.
        m.eval()
        xe = x.clone().requires_grad_()
        lt.residual(m.body, xe).sum().backward()
        self.assertTrue(torch.equal(xe.grad, torch.ones_like(xe)))
        m.train()
        # A hooked module runs its own call (which runs the hooks): torch's sum around it.
        seen = []
        handle = m.body.register_forward_hook(lambda mod, inp, out: seen.append(out.shape))
        with torch.no_grad():
            self.assertLess(rel_err(lt.residual(m.body, x), m(x)), 1e-6)
        self.assertEqual(len(seen), 2)
        handle.remove()


class OptimizerTest(unittest.TestCase):
    def _train(self, model, opt_step, zero, steps=5, set_to_none=True):
        torch.manual_seed(5)
        x, t = torch.randn(32, 32, device=DEVICE), torch.randn(32, 16, device=DEVICE)
        for _ in range(steps):
            (model(x) - t).square().mean().backward()
            opt_step()
            zero(set_to_none)
        return (model(x) - t).square().mean().item()

    def test_torch_optimizer_and_clip_grad_norm_train_te_parameters_like_torch(self):
        for set_to_none in (True, False):
            ref, m = mlp(), mlp()
            lt.convert_model(m, recipe=lt.Recipe(backend="te"), **ALL)
            ro = torch.optim.AdamW(ref.parameters(), lr=1e-2)
            mo = torch.optim.AdamW(m.parameters(), lr=1e-2)

            def rstep():
                torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
                ro.step()

            def mstep():
                # .grad is libfp8's gradient memory
                self.assertEqual(m[1].weight.grad.data_ptr(), m[1]._lent[0][3].data_ptr())
                torch.nn.utils.clip_grad_norm_(m.parameters(), 0.5)
                mo.step()

            lr_ = self._train(ref, rstep, lambda s: ro.zero_grad(set_to_none=s), set_to_none=set_to_none)
            lm = self._train(m, mstep, lambda s: mo.zero_grad(set_to_none=s), set_to_none=set_to_none)
            self.assertLess(abs(lm - lr_) / lr_, 1e-4, set_to_none)
            for (n, p), (_, q) in zip(m.named_parameters(), ref.named_parameters()):
                self.assertLess(rel_err(p, q), 1e-5, n)

    def test_libfp8_optimizer_at_te_matches_torch_adamw_with_one_clip_over_all(self):
        torch.manual_seed(0)
        ref = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Tanh(), torch.nn.Linear(32, 10)).to(DEVICE)
        m = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Tanh(), torch.nn.Linear(32, 10)).to(DEVICE)
        m.load_state_dict(ref.state_dict())
        rep = lt.convert_model(m, recipe=lt.Recipe(backend="te"), **ALL)
        self.assertEqual([n for n, _, _ in rep.skipped], ["2"])  # 10 outputs: stays torch's
        ro = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
        mo = lt.Optimizer(m, "adamw", lr=1e-2, weight_decay=0.1, max_grad_norm=0.1)
        self.assertEqual(len(mo.torch_params), 2)

        torch.manual_seed(5)
        x, t = torch.randn(32, 32, device=DEVICE), torch.randn(32, 10, device=DEVICE)
        train_beside_torch(self, ref, ro, m, mo, x, t, steps=5, max_norm=0.1, tol=1e-5)
        self.assertEqual(mo.stats()[0].steps, 5)

    def test_one_clip_over_layers_in_several_libfp8_models_matches_torch(self):
        # Two convert_model calls make two libfp8 models, which no single libfp8 step sees whole: the
        # clip runs in Python over both and torch's parameters, as clip_grad_norm_ does.
        def net():
            seq = torch.nn.Sequential
            return seq(seq(torch.nn.Linear(32, 32)), torch.nn.Tanh(), seq(torch.nn.Linear(32, 16)), torch.nn.Tanh(),
                       torch.nn.Linear(16, 10)).to(DEVICE)

        torch.manual_seed(0)
        ref, m = net(), net()
        m.load_state_dict(ref.state_dict())
        for part in (m[0], m[2]):
            lt.convert_model(part, recipe=lt.Recipe(backend="te"), **ALL)
        ro = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
        mo = lt.Optimizer(m, "adamw", lr=1e-2, weight_decay=0.1, max_grad_norm=0.1)
        self.assertEqual((len(mo.groups), len(mo.torch_params)), (2, 2))
        torch.manual_seed(5)
        x, t = torch.randn(32, 32, device=DEVICE), torch.randn(32, 10, device=DEVICE)
        train_beside_torch(self, ref, ro, m, mo, x, t, steps=5, max_norm=0.1, tol=1e-5)

    def test_a_module_with_nothing_converted_trains_as_torch_does(self):
        # Every Linear small (left to torch's): libfp8.torch.Optimizer is torch's AdamW and clip.
        torch.manual_seed(0)
        ref, m = mlp(), mlp()
        rep = lt.convert_model(m, recipe=lt.Recipe(backend="te"))
        self.assertEqual(rep.converted, [])
        ro = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
        mo = lt.Optimizer(m, "adamw", lr=1e-2, weight_decay=0.1, max_grad_norm=0.1)
        x, t = torch.randn(32, 32, device=DEVICE), torch.randn(32, 16, device=DEVICE)
        train_beside_torch(self, ref, ro, m, mo, x, t, steps=3, max_norm=0.1, tol=1e-6)

    def test_a_dropped_grad_of_a_layer_left_out_does_not_count_in_the_clip(self):
        # torch's zero_grad(set_to_none=True) drops .grad; a libfp8 layer the next forward leaves out
        # must not bring last step's gradient into the clip (here with two libfp8 models: the clip
        # over both runs in Python). Its own update differs from torch's (libfp8 steps every
        # parameter, torch skips those without .grad): only the others are compared.
        class Net(torch.nn.Module):
            def __init__(self):
                super().__init__()
                seq = torch.nn.Sequential
                self.a, self.b = seq(torch.nn.Linear(32, 32)), seq(torch.nn.Linear(32, 32))
                self.head = torch.nn.Linear(32, 10)

            def forward(self, x, use_b):
                h = torch.tanh(self.a(x))
                return self.head(torch.tanh(self.b(h)) if use_b else h)

        torch.manual_seed(0)
        ref, m = Net().to(DEVICE), Net().to(DEVICE)
        m.load_state_dict(ref.state_dict())
        for part in (m.a, m.b):
            lt.convert_model(part, recipe=lt.Recipe(backend="te"), **ALL)
        ro = torch.optim.AdamW(ref.parameters(), lr=1e-2)
        mo = lt.Optimizer(m, "adamw", lr=1e-2, max_grad_norm=0.05)
        x, t = torch.randn(32, 32, device=DEVICE), torch.randn(32, 10, device=DEVICE)
        for use_b in (True, False):
            (ref(x, use_b) - t).square().mean().backward()
            torch.nn.utils.clip_grad_norm_([p for p in ref.parameters() if p.grad is not None], 0.05)
            ro.step()
            ref.zero_grad(set_to_none=True)
            (m(x, use_b) - t).square().mean().backward()
            mo.step()
            m.zero_grad(set_to_none=True)
        for (n, p), (_, q) in zip(m.named_parameters(), ref.named_parameters()):
            if not n.startswith("b."):
                self.assertLess(rel_err(p, q), 1e-5, n)

    def test_o2_trains_and_clips_fp8_gradients(self):
        ref, m = mlp(), mlp()
        recipe = lt.Recipe(backend="msamp", opt_level="O2", **FP8)
        lt.convert_model(m, recipe=recipe, **ALL)
        lt.apply_fp8_autowrap(m, recipe)
        mo = lt.Optimizer(m, "adamw", lr=1e-2, max_grad_norm=0.05)
        self.assertEqual(mo.stats()[0].opt_level, 2)
        x, t = torch.randn(32, 32, device=DEVICE), torch.randn(32, 16, device=DEVICE)
        (m(x) - t).square().mean().backward()
        (ref(x) - t).square().mean().backward()
        # The clip over all, FP8 weight gradients included (inside libfp8's step), against torch's on
        # the same gradients: the norm within FP8 rounding, the factor the one of that norm.
        norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05).item()
        self.assertGreater(norm, 0.05)
        mo.step()
        got = mo.stats()[0].last_grad_norm
        self.assertLess(abs(got - norm) / norm, 0.15)
        self.assertAlmostEqual(mo._clip_coef.item(), 0.05 / (got + 1e-6), delta=1e-6)
        mo.max_grad_norm = 0.0  # reaches libfp8's step, which clips
        self.assertEqual(mo._fp8[0][1]["max_grad_norm"], 0.0)
        losses = []
        for _ in range(30):
            mo.zero_grad()
            loss = (m(x) - t).square().mean()
            loss.backward()
            mo.step()
            losses.append(loss.item())
        self.assertLess(losses[-1], 0.5 * losses[0])

    def test_state_dict_resumes_training_bit_for_bit(self):
        # libfp8's checkpoint of its model (scaling states with their amax histories, m and v in
        # their stored types, the step count) and torch's optimizer state for the rest, through
        # torch.save and torch.load.
        def build(level, margin=0):
            torch.manual_seed(0)
            m = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 32), torch.nn.Tanh(),
                                    torch.nn.Linear(32, 10)).to(DEVICE)
            recipe = lt.Recipe(**level, margin=margin, **FP8)
            rep = lt.convert_model(m, recipe=recipe, **ALL)
            self.assertEqual([n for n, _, _ in rep.skipped], ["4"])  # 10 outputs: torch's
            lt.apply_fp8_autowrap(m, recipe)
            return m, lt.Optimizer(m, "adamw", lr=1e-2, max_grad_norm=0.5)

        def step(m, opt, x, t):
            (m(x) - t).square().mean().backward()
            opt.step()
            opt.zero_grad()

        torch.manual_seed(3)
        batches = [(torch.randn(32, 32, device=DEVICE), torch.randn(32, 10, device=DEVICE)) for _ in range(5)]
        for level in (dict(backend="te"), dict(backend="msamp", opt_level="O2")):
            a, oa = build(level)
            for x, t in batches[:3]:
                step(a, oa, x, t)
            buf = io.BytesIO()
            torch.save({"model": a.state_dict(), "optimizer": oa.state_dict()}, buf)
            for x, t in batches[3:]:
                step(a, oa, x, t)
            b, ob = build(level)
            buf.seek(0)
            saved = torch.load(buf)
            b.load_state_dict(saved["model"])
            ob.load_state_dict(saved["optimizer"])
            self.assertEqual(ob.stats()[0].steps, 3)
            for x, t in batches[3:]:
                step(b, ob, x, t)
            for (n, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
                self.assertTrue(torch.equal(p, q), f"{level}: {n}")
            # Refused: another kind (before anything changes), another recipe (libfp8 names it and
            # leaves the model as it was).
            c, oc = build(level, margin=1)
            with self.assertRaises(ValueError) as err:
                oc.load_state_dict(dict(saved["optimizer"], kind="adam"))
            self.assertIn("the state is of kind 'adam'; this optimizer is 'adamw'", str(err.exception))
            before = [p.detach().clone() for p in c.parameters()]
            with self.assertRaises(libfp8.Fp8Error) as err:
                oc.load_state_dict(saved["optimizer"])
            self.assertIn("margin", str(err.exception))
            self.assertEqual([torch.equal(p, q) for p, q in zip(c.parameters(), before)], [True] * len(before))

    def test_set_lr_checks_the_value_before_setting_it(self):
        m = mlp(norm=False, out=10)  # the last Linear stays torch's
        lt.convert_model(m, recipe=lt.Recipe(backend="te"), **ALL)
        opt = lt.Optimizer(m, "adamw", lr=1e-3)
        for bad in (-1.0, math.nan, math.inf, "0.1", True):
            with self.assertRaises(ValueError) as err:
                opt.set_lr(bad)
            self.assertIn("expected a finite number >= 0", str(err.exception))
        self.assertEqual(opt.torch_optimizer.param_groups[0]["lr"], 1e-3)
        opt.set_lr(torch.tensor(0.5))  # (a scheduler's value)
        self.assertEqual((opt._fp8[0][1]["lr"], opt.torch_optimizer.param_groups[0]["lr"]), (0.5, 0.5))


def write_safetensors(path, tensors):
    """A safetensors file of `tensors` {name: CPU tensor} written by hand (the format: a little-endian
    u64 header length, the JSON header, the data), as Hugging Face's writer lays it out."""
    names = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.int64: "I64"}
    header, blobs, offset = {"__metadata__": {"format": "pt"}}, [], 0
    for name, t in tensors.items():
        t = t.detach().cpu().contiguous()
        data = t.view(torch.uint8).numpy().tobytes() if t.dtype != torch.bfloat16 else \
            t.view(torch.int16).numpy().tobytes()
        header[name] = {"dtype": names[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + b"".join(blobs))


class SafetensorsTest(unittest.TestCase):
    """lt.load_safetensors: a Hugging Face-style file of a whole model into a converted module."""

    @staticmethod
    def model(seed):
        torch.manual_seed(seed)
        m = torch.nn.ModuleDict(dict(wte=torch.nn.Embedding(16, 32), mlp=mlp(seed))).to(DEVICE)
        m.register_buffer("position_ids", torch.arange(8, device=DEVICE).view(1, 8) * (seed + 1))
        return m

    def setUp(self):
        self.dir = tempfile.TemporaryDirectory()
        self.path = os.path.join(self.dir.name, "model.safetensors")
        self.ref = self.model(1)
        sd = dict(self.ref.state_dict())
        sd["mlp.0.bias"] = sd["mlp.0.bias"].bfloat16()  # a BF16 tensor among the F32 ones
        write_safetensors(self.path, sd)

    def tearDown(self):
        self.dir.cleanup()

    def test_a_whole_models_file_loads_into_a_converted_module(self):
        for level in (dict(backend="te"), dict(backend="msamp", opt_level="O2")):
            m = self.model(0)
            lt.convert_model(m, recipe=lt.Recipe(**level), **ALL)
            versions = [p._version for p in m.mlp.parameters()]
            self.assertEqual(lt.load_safetensors(m, self.path), ([], []))
            # libfp8 read its layers' parameters itself: torch wrote none of them.
            self.assertEqual([p._version for p in m.mlp.parameters()], versions)
            for k, want in self.ref.state_dict().items():
                got = m.state_dict()[k]
                if k == "mlp.0.bias":
                    want = want.bfloat16()
                self.assertTrue(torch.equal(got, want.to(got.dtype)), f"{level}: {k}")
            x = torch.randn(4, 32, device=DEVICE)
            if level["backend"] == "te":
                self.assertLess(rel_err(m.mlp(x), self.ref.mlp(x)), 1e-2)  # (mlp.0.bias rounded to BF16)

    def test_under_another_root_torch_copies_libfp8s_parameters(self):
        m = self.model(0)
        lt.convert_model(m, recipe=lt.Recipe(backend="te"), **ALL)
        outer = torch.nn.ModuleDict(dict(inner=m))
        write_safetensors(self.path, {f"inner.{k}": v for k, v in self.ref.state_dict().items()})
        self.assertEqual(lt.load_safetensors(outer, self.path), ([], []))
        for k, want in self.ref.state_dict().items():
            self.assertTrue(torch.equal(m.state_dict()[k], want), k)
        x = torch.randn(4, 32, device=DEVICE)
        self.assertLess(rel_err(m.mlp(x), self.ref.mlp(x)), 1e-5)  # libfp8 noticed torch's writes

    def test_mismatches_are_refused_before_anything_is_written(self):
        m = self.model(0)
        lt.convert_model(m, recipe=lt.Recipe(backend="te"), **ALL)
        before = {k: v.clone() for k, v in m.state_dict().items()}
        sd = dict(self.ref.state_dict())
        cases = []
        short = dict(sd)
        del short["mlp.3.bias"]
        cases.append((short, RuntimeError, "mlp.3.bias"))
        cases.append((dict(sd, extra=torch.zeros(2)), RuntimeError, "extra"))
        cases.append((dict(sd, **{"mlp.1.weight": torch.zeros(64, 31)}), ValueError, "mlp.1.weight"))
        for tensors, exc, word in cases:
            write_safetensors(self.path, tensors)
            with self.assertRaises(exc) as ctx:
                lt.load_safetensors(m, self.path)
            self.assertIn(word, str(ctx.exception))
            for k, v in m.state_dict().items():
                self.assertTrue(torch.equal(v, before[k]), k)
        with open(self.path, "wb") as f:
            f.write(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}      ")
        with self.assertRaises(ValueError) as ctx:
            lt.load_safetensors(m, self.path)
        self.assertIn("JSON", str(ctx.exception))
        # Not strict: the missing key stays, the extra one is reported, the rest loads.
        write_safetensors(self.path, dict(short, extra=torch.zeros(2)))
        self.assertEqual(lt.load_safetensors(m, self.path, strict=False), (["mlp.3.bias"], ["extra"]))
        self.assertTrue(torch.equal(m.state_dict()["mlp.3.bias"], before["mlp.3.bias"]))
        self.assertTrue(torch.equal(m.state_dict()["mlp.3.weight"], sd["mlp.3.weight"]))


class DlpackTest(unittest.TestCase):
    def test_round_trips_share_memory_both_ways(self):
        t = torch.arange(12, dtype=torch.float32, device=DEVICE).view(3, 4)
        b = lt.from_torch(t)
        self.assertEqual(b.shape, (3, 4))
        back = lt.to_torch(b)
        self.assertEqual(back.data_ptr(), t.data_ptr())
        t.add_(1)
        self.assertTrue(torch.equal(back, t))
        del b  # the lent view keeps the memory alive past the libfp8 tensor
        self.assertTrue(torch.equal(back.cpu(), torch.arange(1, 13, dtype=torch.float32).view(3, 4)))
        ctx = lt._device_for(DEVICE).ctx
        own = libfp8.Tensor(ctx, libfp8.DTYPE_BF16, (5,))
        v = lt.to_torch(own)
        self.assertEqual((v.dtype, tuple(v.shape)), (torch.bfloat16, (5,)))
        v.fill_(2.0)
        del own
        self.assertTrue(torch.all(v == 2.0))
        q = libfp8.Tensor(ctx, libfp8.DTYPE_E4M3, (4,))
        self.assertEqual(lt.to_torch(q).dtype, torch.uint8)  # FP8 travels as its codes

    def test_empty_tensors_cross_whatever_their_strides(self):
        for shape in ((0, 5), (3, 0), (0,)):
            t = torch.zeros(*shape, device=DEVICE)  # torch gives (0, 5) the strides (1, 1)
            b = lt.from_torch(t)
            self.assertEqual(b.shape, shape)
            self.assertEqual(tuple(lt.to_torch(b).shape), shape)

    def test_refusals_name_what_was_wrong(self):
        base = torch.zeros(4, 6, device=DEVICE)
        cases = [(base.t(), "FP8_ERR_SHAPE", "stride"),
                 (torch.zeros(4, dtype=torch.int64, device=DEVICE), "FP8_ERR_DTYPE", "int64")]
        for t, status, word in cases:
            with self.assertRaises(libfp8.Fp8Error) as ctx:
                lt.from_torch(t)
            self.assertEqual(ctx.exception.status_name, status)
            self.assertIn(word, str(ctx.exception))
            self.assertEqual(t.sum().item(), 0)  # the refused capsule went back to torch, intact
        with self.assertRaises(TypeError):
            lt.from_torch([1.0])
        with self.assertRaises(TypeError) as ctx:
            lt.from_torch(base, ctx="cpu")
        self.assertIn("from_torch: ctx is str; expected a libfp8.Context", str(ctx.exception))
        # Anything but a libfp8 tensor (or a handle of one) would be read as a tensor by libfp8.
        for bad in (12345, ctypes.c_void_p(), lt._device_for(DEVICE).ctx):
            with self.assertRaises(TypeError) as ctx:
                lt.to_torch(bad)
            self.assertIn("expected a libfp8.Tensor or a non-NULL fp8_tensor_t handle", str(ctx.exception))


class ThreadsAndLifetimeTest(unittest.TestCase):
    def test_a_full_wrap_cache_frees_no_handle_on_its_way_into_a_call(self):
        # The cache of wrapped handles is emptied when full (every call, here): never between
        # taking a call's handles and the call (x's handle freed and reused for y, or for nothing).
        limit = lt._WRAP_CACHE_LIMIT
        lt._WRAP_CACHE_LIMIT = 1
        try:
            ref, m = mlp(), mlp()
            lt.convert_model(m, recipe=lt.Recipe(backend="te"), **ALL)
            stack_ref, stack = Block(), Block()
            lt.convert_model(stack, recipe=lt.Recipe(backend="te"), **ALL)
            for rows in (1, 5, 9, 3, 17):
                expect_high_precision_match(self, ref, m, torch.randn(rows, 32, device=DEVICE))
                expect_high_precision_match(self, stack_ref, stack, torch.randn(rows, 32, device=DEVICE))
        finally:
            lt._WRAP_CACHE_LIMIT = limit

    def test_every_libfp8_model_of_an_autocast_block_ends_its_region(self):
        seq = torch.nn.Sequential
        m = seq(seq(torch.nn.Linear(32, 32)), torch.nn.Tanh(), seq(torch.nn.Linear(32, 32)), torch.nn.Tanh(),
                seq(torch.nn.Linear(32, 32))).to(DEVICE)
        for part in (m[0], m[2], m[4]):
            lt.convert_model(part, recipe=lt.Recipe(backend="te", **FP8), **ALL)
        groups = lt._groups(m)
        self.assertEqual(len(groups), 3)
        with lt.fp8_autocast():
            m(torch.randn(16, 32, device=DEVICE))
        self.assertEqual(fprops(m), [1, 1, 1])
        for g in groups:  # libfp8 says so itself: a new region may begin
            self.assertEqual(libfp8._lib.fp8_autocast_begin(g.model.handle), libfp8.OK)
            libfp8._check(libfp8._lib.fp8_autocast_end(g.model.handle))

    def test_threads_sharing_a_module_get_their_own_results(self):
        # libfp8's objects are externally synchronised (one thread at a time per context): the calls
        # into a device's context are serialised, and each thread's fp8_autocast is its own. Under
        # current scaling a call's result depends on its input alone.
        torch.manual_seed(0)
        m = torch.nn.ModuleDict(dict(body=torch.nn.Sequential(
            torch.nn.LayerNorm(64), torch.nn.Linear(64, 128), torch.nn.GELU(approximate="tanh"),
            torch.nn.Linear(128, 64)))).to(DEVICE)
        lt.convert_model(m, recipe=lt.Recipe(backend="te", scaling="current", **FP8), **ALL)
        xs = [torch.randn(16 * (1 + k % 3), 64, device=DEVICE) for k in range(6)]
        with torch.no_grad(), lt.fp8_autocast():
            want = [m.body(x) for x in xs]
        with torch.no_grad():
            plain = [m.body(x) for x in xs]
        errors, wrong = [], []

        def work(k):
            try:
                for i in range(20):
                    with torch.no_grad(), lt.fp8_autocast(enabled=k % 2 == 0):
                        y = m.body(xs[k])
                    if not torch.equal(y, want[k] if k % 2 == 0 else plain[k]):
                        wrong.append((k, i))
            except Exception as e:  # noqa: BLE001
                errors.append(e)

        threads = [threading.Thread(target=work, args=(k,)) for k in range(len(xs))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        self.assertEqual((errors, wrong), ([], []))


class OverheadTest(unittest.TestCase):
    def test_python_overhead_per_layer_call(self):
        """Host time of one libfp8.torch Linear call beyond the C call itself (printed, and bounded
        loosely so that a regression to per-call wraps or syncs shows)."""
        lin = torch.nn.Sequential(torch.nn.Linear(16, 16)).to(DEVICE)
        lt.convert_model(lin, recipe=lt.Recipe(backend="te"), **ALL)
        layer, dev = lin[0], lin[0]._group.dev
        x = torch.randn(1, 16, device=DEVICE)
        y = torch.empty(1, 16, device=DEVICE)
        n = 2000

        def best(fn):
            times = []
            for _ in range(5):
                t0 = time.perf_counter()
                for _ in range(n):
                    fn()
                times.append((time.perf_counter() - t0) / n)
            return min(times) * 1e6

        saved = ctypes.c_void_p()

        def raw():
            libfp8._lib.fp8_layer_forward_saved(layer._group.model.handle, 0, dev.wrap(x), dev.wrap(y),
                                                ctypes.byref(saved))
            libfp8._lib.fp8_saved_destroy(saved)

        with torch.no_grad():
            c_call = best(raw)
            no_grad = best(lambda: layer(x))
        xg = x.clone().requires_grad_()
        fwd = best(lambda: layer(xg))
        out = layer(xg)
        g = torch.ones_like(out)

        def fwd_bwd():
            layer(xg).backward(g)

        both = best(fwd_bwd)
        print(f"\nlibfp8.torch per Linear call on {DEVICE} (16x16): C call {c_call:.1f} us; module call "
              f"no_grad {no_grad:.1f} us (+{no_grad - c_call:.1f}), with autograd {fwd:.1f} us, forward+backward "
              f"{both:.1f} us", file=sys.stderr)
        self.assertLess(no_grad - c_call, 200)


if __name__ == "__main__":
    unittest.main(verbosity=2)
