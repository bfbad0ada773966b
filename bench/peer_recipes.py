# The peers of libfp8's recipe quantize and scaled GEMMs (bench/bench_recipes). Quantize: the same
# recipe written in torch (bf16 in, e4m3 codes and float32 scales out, scale = 448 / amax of each
# cell; "+T" adds the transposed copy with its own cells), eager and torch.compile'd, at 8192x8192
# (torch.compile compiles each mode once per shape). GEMMs: torch._scaled_mm with per-tensor scales
# (with and without fast accumulation), row-wise scales (scale_a [m, 1], scale_b [1, n]) and, where
# this torch takes them, DeepSeek-style blocks (1x128 for a, 128x128 for b), e4m3, bf16 out, at the
# same shapes. Timing as libfp8's (median of 20 CUDA-event-timed calls after 3 warm-ups). A mode
# this torch refuses is reported with its error and left out.
# Usage: python3 peer_recipes.py out.json [quantize|gemm] (default: both)
import json, sys
import torch
from peer_util import median_ms  # bench/ is the script's directory, so on sys.path

dev = torch.device("cuda")
rows = []
parts = sys.argv[2:] or ["quantize", "gemm"]
E4M3_MAX = 448.0


def codes(x, amax):
    """x (bf16, any shape) cast with the scale of its cells' amax (broadcast to x): codes, scale_inv."""
    scale = E4M3_MAX / amax.float().clamp_min(1e-30)
    return (x.float() * scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn), 1.0 / scale


def per_tensor(x, with_t):
    q, si = codes(x, x.abs().amax())
    return (q, si, q.t().contiguous()) if with_t else (q, si)


def per_row(x, with_t):
    q, si = codes(x, x.abs().amax(1, keepdim=True))
    if not with_t:
        return q, si
    qt, sit = codes(x, x.abs().amax(0, keepdim=True))  # the transposed copy's rows: x's columns
    return q, si, qt.t().contiguous(), sit


def block_1x128(x, with_t):
    m, k = x.shape
    xv = x.view(m, k // 128, 128)
    q, si = codes(xv, xv.abs().amax(2, keepdim=True))
    if not with_t:
        return q.view(m, k), si
    xc = x.view(m // 128, 128, k)  # the transposed copy's 1x128 cells: 128-high column segments of x
    qt, sit = codes(xc, xc.abs().amax(1, keepdim=True))
    return q.view(m, k), si, qt.view(m, k).t().contiguous(), sit


def block_128x128(x, with_t):
    m, k = x.shape
    xv = x.view(m // 128, 128, k // 128, 128)
    q, si = codes(xv, xv.abs().amax((1, 3), keepdim=True))
    q = q.view(m, k)
    return (q, si, q.t().contiguous()) if with_t else (q, si)


if "quantize" in parts:
    m, k = 8192, 8192
    x = torch.randn(m, k, device=dev, dtype=torch.bfloat16) * 4
    for mode, fn in [("per-tensor", per_tensor), ("per-row", per_row), ("1x128-block", block_1x128),
                     ("128x128-block", block_128x128)]:
        for with_t in (False, True):
            label = f"quantize {mode}{' +T' if with_t else ''} {m}x{k}"
            compiled = torch.compile(lambda t, f=fn, w=with_t: f(t, w))
            for kind, run in [("torch eager", lambda f=fn, w=with_t: f(x, w)), ("torch.compile", lambda c=compiled: c(x))]:
                try:
                    ms = median_ms(run)
                except Exception as e:  # noqa: BLE001 - reported, not fatal
                    print(f"{kind + ' ' + label:56s} not run: {type(e).__name__}: {str(e).splitlines()[0][:160]}")
                    continue
                rows.append({"name": f"{kind} {label}", "ms": ms})
                print(f"{kind + ' ' + label:56s} {ms:9.4f} ms", flush=True)
    del x
gemm_shapes = [(8192, 8192, 8192), (16384, 14336, 4096), (16384, 4096, 14336), (4096, 4096, 4096), (16384, 4096, 4096)]
for m, n, k in gemm_shapes if "gemm" in parts else []:
    a8 = (torch.randn(m, k, device=dev) * 16).to(torch.float8_e4m3fn)
    b8 = (torch.randn(n, k, device=dev) * 16).to(torch.float8_e4m3fn)
    one = torch.tensor(1.0 / 16, device=dev)
    row_a = torch.full((m, 1), 1.0 / 16, device=dev)
    row_b = torch.full((1, n), 1.0 / 16, device=dev)
    kb = (k + 127) // 128
    # 1x128 scales of a: [m, kb] stored column-major (stride (1, m)); 128x128 scales of b (as
    # b.t() [k, n]): [kb padded to 4, n / 128] ... as torch's ScaledBlas checks them.
    blk_a = torch.full((kb, m), 1.0 / 16, device=dev).t()
    blk_b = torch.full(((n + 127) // 128, (kb + 3) // 4 * 4), 1.0 / 16, device=dev).t()
    tag = f"{m}x{n}x{k}"
    for name, fn in [
            (f"torch._scaled_mm per-tensor fast {tag}", lambda: torch._scaled_mm(a8, b8.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16, use_fast_accum=True)),
            (f"torch._scaled_mm per-tensor {tag}", lambda: torch._scaled_mm(a8, b8.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16, use_fast_accum=False)),
            (f"torch._scaled_mm per-row fast {tag}", lambda: torch._scaled_mm(a8, b8.t(), scale_a=row_a, scale_b=row_b, out_dtype=torch.bfloat16, use_fast_accum=True)),
            (f"torch._scaled_mm per-row {tag}", lambda: torch._scaled_mm(a8, b8.t(), scale_a=row_a, scale_b=row_b, out_dtype=torch.bfloat16, use_fast_accum=False)),
            (f"torch._scaled_mm 1x128 x 128x128 {tag}", lambda: torch._scaled_mm(a8, b8.t(), scale_a=blk_a, scale_b=blk_b, out_dtype=torch.bfloat16, use_fast_accum=False))]:
        try:
            ms = median_ms(fn)
        except Exception as e:  # noqa: BLE001 - a mode this torch lacks is reported, not fatal
            print(f"{name:48s} not run: {type(e).__name__}: {str(e).splitlines()[0][:160]}", flush=True)
            continue
        rows.append({"name": name, "ms": ms, "tflops": 2 * m * n * k / ms / 1e9})
        print(f"{name:48s} {ms:9.4f} ms {2 * m * n * k / ms / 1e9:8.1f} TFLOP/s", flush=True)
    del a8, b8
json.dump(rows, open(sys.argv[1], "w"), indent=1)
