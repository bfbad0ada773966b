# The peers of libfp8's linear layer, one full training step (forward + backward) each: torch's bf16
# nn.Linear, an FP8 linear in torchao's tensorwise dynamic-scaling style (torch._scaled_mm, e4m3
# forward, e5m2 gradients), and a transformer MLP block with either. Eager over the sweep; at the
# headline shapes (16384x8192->8192, 512x8192->8192, the MLP block) also under torch.compile, bf16 and
# FP8 (what a PyTorch user gets without TransformerEngine). A peer torch cannot compile here is
# reported and left out, the others go on. Median of 20 CUDA-event-timed steps after 3 warm-ups
# (compilation happens in the warm-ups), random bf16 data. Usage: python3 peer_linear.py out.json
import json, sys
import torch
from peer_util import median_ms  # bench/ is the script's directory, so on sys.path
import torch.nn as nn

dev = torch.device("cuda")
bf16, e4m3, e5m2 = torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2


def to_fp8(t, dtype, fmax):
    """Current (just-in-time) per-tensor scaling: returns the fp8 tensor and the dequant scale 1/scale."""
    amax = t.abs().amax().float().clamp(min=1e-12)
    scale = fmax / amax
    return (t.float() * scale).clamp(-fmax, fmax).to(dtype), scale.reciprocal()

class Fp8Linear(torch.autograd.Function):
    # _scaled_mm wants its first operand row-major and its second column-major; `.t().contiguous().t()`
    # gives a column-major view of a row-major tensor.
    @staticmethod
    def forward(ctx, x, w, b):
        x8, sx = to_fp8(x, e4m3, 448.0)
        w8, sw = to_fp8(w, e4m3, 448.0)
        ctx.save_for_backward(x8, w8, sx, sw)
        return torch._scaled_mm(x8, w8.t(), scale_a=sx, scale_b=sw, bias=b, out_dtype=bf16, use_fast_accum=True)

    @staticmethod
    def backward(ctx, dy):
        x8, w8, sx, sw = ctx.saved_tensors
        dy = dy.contiguous()
        dy8, sdy = to_fp8(dy, e5m2, 57344.0)
        dx = torch._scaled_mm(dy8, w8.t().contiguous().t(), scale_a=sdy, scale_b=sw, out_dtype=bf16, use_fast_accum=False)
        dw = torch._scaled_mm(dy8.t().contiguous(), x8.t().contiguous().t(), scale_a=sdy, scale_b=sx, out_dtype=bf16, use_fast_accum=False)
        return dx, dw, dy.sum(0)

def fp8_linear(x, w, b):
    return Fp8Linear.apply(x, w, b)


class Fp8LinearModule(nn.Module):
    """nn.Linear's parameters, its GEMMs in FP8 through Fp8Linear."""
    def __init__(self, k, n):
        super().__init__()
        self.inner = nn.Linear(k, n, bias=True, dtype=bf16, device=dev)

    def forward(self, x):
        return fp8_linear(x, self.inner.weight, self.inner.bias)


class WrongResult(Exception):
    """A peer computed something else than the layer: the run stops (timing it would mean nothing)."""


def rel_err(a, ref):
    return ((a.float() - ref).norm() / ref.norm()).item()

def check_fp8(m, k, n, compiled):
    # Non-square on purpose: a transposed operand then fails loudly instead of silently giving wrong numbers.
    lin = nn.Linear(k, n, bias=True, dtype=bf16, device=dev)
    x = torch.randn(m, k, device=dev, dtype=bf16, requires_grad=True)
    dy = torch.randn(m, n, device=dev, dtype=bf16)
    xf, wf, dyf = x.detach().float(), lin.weight.detach().float(), dy.float()
    ref = (xf @ wf.t() + lin.bias.detach().float(), dyf @ wf, dyf.t() @ xf)
    cases = [("bf16", lambda: lin(x)), ("fp8 eager", lambda: fp8_linear(x, lin.weight, lin.bias))]
    if compiled:
        cases.append(("fp8 compiled", lambda: compiled(x, lin.weight, lin.bias)))
    for name, f in cases:
        x.grad = None; lin.weight.grad = None; lin.bias.grad = None
        y = f(); y.backward(dy)
        errs = [rel_err(t, r) for t, r in zip((y, x.grad, lin.weight.grad), ref)]
        print(f"check {name} {m}x{k}->{n}: rel err y {errs[0]:.4f} dx {errs[1]:.4f} dW {errs[2]:.4f}", flush=True)
        if max(errs) > 0.1: raise WrongResult(f"{name} linear is wrong: relative errors {errs}")

rows = []
def record(name, fn):
    ms = median_ms(fn)
    rows.append({"name": name, "ms": ms})
    print(f"{name:48s} {ms:9.4f} ms", flush=True)
    json.dump(rows, open(sys.argv[1], "w"), indent=1)  # progressive, so a crash late in the sweep keeps the rest

def record_compiled(name, fn):
    """A torch.compile peer: its failure to compile is reported, not fatal."""
    try:
        record(name, fn)
    except Exception as e:  # noqa: BLE001 (any compiler error: the peer is left out, the run goes on)
        print(f"{name:48s} not measured: torch.compile failed: {type(e).__name__}: {str(e).splitlines()[0][:200]}",
              flush=True)

compiled_fp8 = torch.compile(fp8_linear, dynamic=False)  # (one graph per shape, as the eager peers run)
try:
    check_fp8(512, 1024, 2048, compiled_fp8)
except WrongResult:
    raise
except Exception as e:  # noqa: BLE001 (torch.compile's errors are RuntimeErrors too)
    print(f"check fp8 compiled: torch.compile failed ({type(e).__name__}); the compiled FP8 peers are left out", flush=True)
    compiled_fp8 = None
    check_fp8(512, 1024, 2048, None)
headline = {(16384, 8192), (512, 8192)}
for m in [512, 1024, 2048, 4096, 8192, 16384]:
    for k in [1024, 2048, 4096, 8192]:
        n = k
        lin = nn.Linear(k, n, bias=True, dtype=bf16, device=dev)
        x = torch.randn(m, k, device=dev, dtype=bf16, requires_grad=True)
        dy = torch.randn(m, n, device=dev, dtype=bf16)
        def bf16_step():
            x.grad = None
            lin(x).backward(dy)
        def fp8_step():
            x.grad = None
            Fp8Linear.apply(x, lin.weight, lin.bias).backward(dy)
        record(f"torch bf16 linear {m}x{k}->{n}", bf16_step)
        record(f"torch fp8 eager linear {m}x{k}->{n}", fp8_step)
        if (m, k) in headline:
            clin = torch.compile(lin, dynamic=False)
            def bf16_compiled_step():
                x.grad = None
                clin(x).backward(dy)
            record_compiled(f"torch compile bf16 linear {m}x{k}->{n}", bf16_compiled_step)
            if compiled_fp8:
                def fp8_compiled_step():
                    x.grad = None
                    compiled_fp8(x, lin.weight, lin.bias).backward(dy)
                record_compiled(f"torch compile fp8 linear {m}x{k}->{n}", fp8_compiled_step)
        del lin, x, dy
        torch.cuda.empty_cache()

T, D, F = 16384, 4096, 16384
x = torch.randn(T, D, device=dev, dtype=bf16, requires_grad=True)
dy = torch.randn(T, D, device=dev, dtype=bf16)
def mlp_of(linear):
    return nn.Sequential(nn.LayerNorm(D), linear(D, F), nn.GELU(approximate="tanh"), linear(F, D)).to(dev, bf16)
def step_of(module):
    def step():
        x.grad = None
        module(x).backward(dy)
    return step
mlp = mlp_of(lambda k, n: nn.Linear(k, n))
mlp8 = mlp_of(Fp8LinearModule)
record(f"torch bf16 mlp {T}x{D}x{F}", step_of(mlp))
record(f"torch fp8 eager mlp {T}x{D}x{F}", step_of(mlp8))
record_compiled(f"torch compile bf16 mlp {T}x{D}x{F}", step_of(torch.compile(mlp, dynamic=False)))
if compiled_fp8:
    record_compiled(f"torch compile fp8 mlp {T}x{D}x{F}", step_of(torch.compile(mlp8, dynamic=False)))
json.dump(rows, open(sys.argv[1], "w"), indent=1)
