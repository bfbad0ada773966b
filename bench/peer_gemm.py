# The peers of fp8_gemm: torch._scaled_mm (cuBLASLt, e4m3, per-tensor scales, bf16 out) with and
# without fast accumulation, and torch's bf16 matmul, at the same shapes and with the same timing
# (median of 20 CUDA-event-timed calls after 3 warm-ups). Usage: python3 peer_gemm.py out.json
import json, sys
import torch
from peer_util import median_ms  # bench/ is the script's directory, so on sys.path

dev = torch.device("cuda")


rows = []
one = torch.tensor(1.0 / 16, device=dev)
for m, n, k in [(8192, 8192, 8192), (16384, 14336, 4096), (16384, 4096, 14336), (4096, 4096, 4096),
                (16384, 4096, 4096), (1024, 1024, 1024)]:
    a8 = (torch.randn(m, k, device=dev) * 16).to(torch.float8_e4m3fn)
    b8 = (torch.randn(n, k, device=dev) * 16).to(torch.float8_e4m3fn)
    ab = torch.randn(m, k, device=dev, dtype=torch.bfloat16); bb = torch.randn(n, k, device=dev, dtype=torch.bfloat16)
    tag = f"{m}x{n}x{k}"
    for name, fn in [(f"torch._scaled_mm fast_accum {tag}", lambda: torch._scaled_mm(a8, b8.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16, use_fast_accum=True)),
                     (f"torch._scaled_mm {tag}", lambda: torch._scaled_mm(a8, b8.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16, use_fast_accum=False)),
                     (f"torch bf16 matmul {tag}", lambda: ab @ bb.t())]:
        ms = median_ms(fn)
        rows.append({"name": name, "ms": ms, "tflops": 2 * m * n * k / ms / 1e9})
        print(f"{name:48s} {ms:9.4f} ms {2 * m * n * k / ms / 1e9:8.1f} TFLOP/s", flush=True)
    del a8, b8, ab, bb
json.dump(rows, open(sys.argv[1], "w"), indent=1)
