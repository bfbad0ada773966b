"""libfp8.torch on CUDA with the device's torch (2.x): every case of bindings/python/test_torch.py
on cuda, and what only a GPU has: torch's current stream (a non-default one), no host
synchronisation in a training step, libfp8's memory in torch's caching allocator, a converted
module's training step captured with torch.cuda.graphs and replayed.

    FP8_LIBRARY=build/device/libfp8.so.0 PYTHONPATH=bindings/python python3 tests/gpu/test_torch_gpu.py

Exits 77 without torch or a CUDA device of compute capability 8.9 or newer."""
import gc
import os
import sys
import unittest

os.environ["LIBFP8_TEST_DEVICE"] = "cuda"
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "bindings", "python"))
try:
    import torch
except ImportError:
    print("SKIP: torch is not installed")
    sys.exit(77)
if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9):
    print("SKIP: no CUDA device of compute capability 8.9 or newer")
    sys.exit(77)

import libfp8.torch as lt  # noqa: E402
from test_torch import *  # noqa: E402,F401,F403  (the CPU cases, now on cuda)
from test_torch import ALL, FP8, Block, mlp, rel_err  # noqa: E402


def gpt_like(d=256):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.LayerNorm(d), torch.nn.Linear(d, 4 * d), torch.nn.GELU(),
                               torch.nn.Linear(4 * d, d)).cuda()


class CudaOnlyTest(unittest.TestCase):
    def _step(self, m, opt, x, t):
        loss = (m(x).float() - t).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    def test_runs_on_a_non_default_stream_like_on_the_default_one(self):
        recipe = lt.Recipe(backend="te", **FP8)
        a, b = gpt_like(), gpt_like()
        for m in (a, b):
            lt.convert_model(m, recipe=recipe, **ALL)
            lt.apply_fp8_autowrap(m, recipe)
        oa, ob = lt.Optimizer(a, "adamw", lr=1e-3), lt.Optimizer(b, "adamw", lr=1e-3)
        x, t = torch.randn(64, 256, device="cuda"), torch.randn(64, 256, device="cuda")
        la = [self._step(a, oa, x, t) for _ in range(3)]
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            lb = [self._step(b, ob, x, t) for _ in range(3)]
            self.assertEqual(b[1]._group.dev.stream, s.cuda_stream)  # libfp8 queued on torch's stream
        torch.cuda.current_stream().wait_stream(s)
        self.assertEqual([v.item() for v in la], [v.item() for v in lb])
        for p, q in zip(a.parameters(), b.parameters()):
            self.assertTrue(torch.equal(p, q))

    def test_a_training_step_does_not_synchronise(self):
        recipe = lt.Recipe(backend="msamp", opt_level="O2", **FP8)
        m = gpt_like()
        lt.convert_model(m, recipe=recipe, **ALL)
        lt.apply_fp8_autowrap(m, recipe)
        opt = lt.Optimizer(m, "adamw", lr=1e-3, max_grad_norm=1.0)
        x, t = torch.randn(64, 256, device="cuda"), torch.randn(64, 256, device="cuda")
        self._step(m, opt, x, t)  # buffers grow at the first step
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")  # torch raises at any synchronising torch call
        try:
            for _ in range(3):
                self._step(m, opt, x, t)
        finally:
            torch.cuda.set_sync_debug_mode(0)

    def test_libfp8_memory_comes_from_torchs_caching_allocator(self):
        gc.collect()
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        m = torch.nn.Sequential(torch.nn.Linear(1024, 4096)).cuda()
        torch_bytes = torch.cuda.memory_allocated() - before
        lt.convert_model(m, recipe=lt.Recipe(backend="te"), **ALL)
        lent = torch.cuda.memory_allocated() - before - torch_bytes
        # libfp8's values (FP32, 16 MiB) are torch's allocations now ...
        self.assertGreaterEqual(lent, 4 * 1024 * 4096)
        torch.cuda.reset_peak_memory_stats()
        m(torch.randn(512, 1024, device="cuda")).sum().backward()
        # ... and the weight and its gradient live in segments of torch's caching allocator.
        segments = [(s["address"], s["address"] + s["total_size"]) for s in torch.cuda.memory_snapshot()]
        for name, ptr in (("weight", m[0].weight.data_ptr()), ("weight.grad", m[0].weight.grad.data_ptr())):
            self.assertTrue(any(lo <= ptr < hi for lo, hi in segments), name + " is not in torch's memory")
        self.assertGreater(torch.cuda.max_memory_allocated(), before + torch_bytes + lent)  # activations too
        del m
        gc.collect()
        torch.cuda.synchronize()
        self.assertLess(torch.cuda.memory_allocated() - before, lent // 2)  # given back on destruction

    def test_a_converted_modules_step_captured_in_a_cuda_graph_replays(self):
        recipe = lt.Recipe(backend="te", **FP8)
        m, ref = gpt_like(), gpt_like()
        lt.convert_model(m, recipe=recipe, **ALL)
        lt.convert_model(ref, recipe=recipe, **ALL)
        opt = lt.Optimizer(m, "adamw", lr=1e-3, max_grad_norm=1.0)
        ropt = lt.Optimizer(ref, "adamw", lr=1e-3, max_grad_norm=1.0)
        x, t = torch.randn(64, 256, device="cuda"), torch.randn(64, 256, device="cuda")

        def step(model, o):
            with lt.fp8_autocast():
                loss = (model(x).float() - t).square().mean()
            loss.backward()
            o.step()
            o.zero_grad(set_to_none=False)
            return loss

        self._replays_like_eager(lambda: step(m, opt), lambda: step(ref, ropt))
        self.assertLess(rel_err(m[1].weight, ref[1].weight), 1e-4)

    def _replays_like_eager(self, step, eager_step, check_sync=False):
        """Warms both up on a side stream (libfp8's buffers and torch's reach their sizes; with
        check_sync one more step each where any synchronising torch call raises), captures `step` in
        a CUDA graph, then replays it beside `eager_step` (its twin): the losses agree and fall."""
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(3):
                step()
                eager_step()
            if check_sync:
                torch.cuda.synchronize()
                torch.cuda.set_sync_debug_mode("error")
                try:
                    step()
                    eager_step()
                finally:
                    torch.cuda.set_sync_debug_mode(0)
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            static_loss = step()
        replayed, eager = [], []
        for _ in range(5):
            g.replay()
            replayed.append(static_loss.item())
            eager.append(eager_step().item())
        self.assertLess(replayed[-1], replayed[0])
        for a, b in zip(replayed, eager):
            self.assertLess(abs(a - b), 1e-3 * abs(b) + 1e-6)

    def test_a_stacked_block_trains_without_synchronising_and_replays_in_a_cuda_graph(self):
        # A libfp8 Sequential (norm -> Linear -> GELU -> Linear as one stack) under bf16 autocast at
        # O2: no host synchronisation in a step, and a captured step replays like its eager twin.
        recipe = lt.Recipe(backend="msamp", opt_level="O2", **FP8)
        m, ref = Block(d=256, h=1024), Block(d=256, h=1024)
        for model in (m, ref):
            lt.convert_model(model, recipe=recipe, **ALL)
            self.assertIs(type(model.body), lt.Sequential)
        opt = lt.Optimizer(m, "adamw", lr=1e-3, max_grad_norm=1.0)
        ropt = lt.Optimizer(ref, "adamw", lr=1e-3, max_grad_norm=1.0)
        x, t = torch.randn(8, 32, 256, device="cuda"), torch.randn(8, 32, 256, device="cuda")

        def step(model, o):
            with torch.autocast("cuda", dtype=torch.bfloat16), lt.fp8_autocast():
                loss = (model(x).float() - t).square().mean()
            loss.backward()
            o.step()
            o.zero_grad(set_to_none=False)
            return loss

        self._replays_like_eager(lambda: step(m, opt), lambda: step(ref, ropt), check_sync=True)


    def test_a_residual_block_trains_without_synchronising_and_replays_in_a_cuda_graph(self):
        # lt.residual over the stack (x + block(x), the sum in the last GEMM, its gradient in the
        # norm's pass) at O2 under bf16 autocast: the eager step against x + block(x) on a twin, no host
        # synchronisation, and a captured step replays like its eager twin.
        recipe = lt.Recipe(backend="msamp", opt_level="O2", **FP8)
        models = [Block(d=256, h=1024) for _ in range(4)]
        for model in models:
            lt.convert_model(model, recipe=recipe, **ALL)
        fused, plain, m, ref = models
        opt = lt.Optimizer(m, "adamw", lr=1e-3, max_grad_norm=1.0)
        ropt = lt.Optimizer(ref, "adamw", lr=1e-3, max_grad_norm=1.0)
        x, t = torch.randn(8, 32, 256, device="cuda"), torch.randn(8, 32, 256, device="cuda")
        xs = [x.clone().requires_grad_() for _ in range(2)]
        with torch.autocast("cuda", dtype=torch.bfloat16), lt.fp8_autocast():
            ys = [lt.residual(fused.body, xs[0]), plain(xs[1])]
        self.assertEqual(ys[0].dtype, torch.float32)
        self.assertLess(rel_err(ys[0], ys[1]), 1e-2)
        for y in ys:
            (y.float() - t).square().mean().backward()
        self.assertLess(rel_err(xs[0].grad, xs[1].grad), 5e-2)

        def step(model, o):
            with torch.autocast("cuda", dtype=torch.bfloat16), lt.fp8_autocast():
                loss = (lt.residual(model.body, x).float() - t).square().mean()
            loss.backward()
            o.step()
            o.zero_grad(set_to_none=False)
            return loss

        self._replays_like_eager(lambda: step(m, opt), lambda: step(ref, ropt), check_sync=True)

if __name__ == "__main__":
    unittest.main(verbosity=2)
