# The peer of libfp8's AdamW step: torch.optim.AdamW(fused=True) over 2^30 parameters (16 tensors of
# 8192 x 8192, .grad random), lr 1e-3, weight_decay 0.01, with FP32 parameters and states (the figure
# PERFORMANCE.md quotes: 28 bytes moved per parameter) and with bf16 parameters (states in bf16 too, as
# torch keeps them in the parameters' dtype: 14 bytes). Median of 20 CUDA-event-timed steps after 3
# warm-ups, as bench_optimizer times libfp8. Memory per parameter: torch.cuda.memory_allocated once the
# optimizer's states exist (parameters + gradients + exp_avg + exp_avg_sq + step) over 2^30.
# Correct first: the fused step is checked against torch's single-tensor (for-loop) AdamW.
# Usage: python3 peer_optimizer.py out.json
import json, sys
import torch
from peer_util import median_ms  # bench/ is the script's directory, so on sys.path

dev = torch.device("cuda")
LAYERS, DIM = 16, 8192
N = LAYERS * DIM * DIM  # 2^30


def check_fused():
    g = torch.Generator(device=dev).manual_seed(0)
    ps = [torch.randn(512, 256, device=dev, generator=g).mul_(0.02) for _ in range(2)]
    qs = [p.clone() for p in ps]
    for a, b in zip(ps, qs):
        a.requires_grad_(True); b.requires_grad_(True)
        a.grad = torch.randn(a.shape, device=dev, generator=g).mul_(1e-3); b.grad = a.grad.clone()
    fused = torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.01, fused=True)
    loop = torch.optim.AdamW(qs, lr=1e-3, weight_decay=0.01, foreach=False)
    for _ in range(2): fused.step(); loop.step()
    err = max(((a - b).abs().max() / b.abs().max()).item() for a, b in zip(ps, qs))
    print(f"check: torch fused AdamW vs single-tensor AdamW, 2 steps: max rel diff {err:.2e}", flush=True)
    if err > 1e-5: raise RuntimeError(f"fused AdamW disagrees with the reference: {err}")

rows = []
def bench(dtype, tag, moved):
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    ps = []
    for i in range(LAYERS):
        p = torch.randn(DIM, DIM, device=dev, dtype=dtype).mul_(0.02).requires_grad_(True)
        p.grad = torch.randn(DIM, DIM, device=dev, dtype=dtype).mul_(1e-3)
        ps.append(p)
    opt = torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.01, fused=True)
    opt.step()  # the states exist from here on
    torch.cuda.synchronize()
    bpp = (torch.cuda.memory_allocated() - base) / N
    ms = median_ms(opt.step)
    gparam = N / (ms * 1e6)
    name = f"torch adamw fused {tag} 2^30"
    rows.append({"name": name, "ms": ms, "gparam_per_s": gparam, "gb_per_s": gparam * moved,
                 "bytes_moved_per_param": moved, "bytes_per_param_measured": bpp})
    print(f"{name:32s} {ms:9.3f} ms {gparam:8.1f} Gparam/s {gparam * moved:7.0f} GB/s ({moved} B/param moved)  "
          f"state {bpp:5.2f} B/param (measured)", flush=True)
    json.dump(rows, open(sys.argv[1], "w"), indent=1)
    del opt, ps, p
    torch.cuda.empty_cache()

check_fused()
bench(torch.float32, "fp32", 28)  # read p, g, m, v and write p, m, v: 7 x 4 bytes
bench(torch.bfloat16, "bf16", 14)  # the same in bf16 (states follow the parameters' dtype)
json.dump(rows, open(sys.argv[1], "w"), indent=1)
