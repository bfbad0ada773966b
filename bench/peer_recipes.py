# The peers of libfp8's scaled GEMMs (bench/bench_recipes): torch._scaled_mm with per-tensor scales
# (with and without fast accumulation), row-wise scales (scale_a [m, 1], scale_b [1, n]) and, where
# this torch takes them, DeepSeek-style blocks (1x128 for a, 128x128 for b), e4m3, bf16 out, at the
# same shapes and with the same timing (median of 20 CUDA-event-timed calls after 3 warm-ups). A mode
# this torch refuses is reported with its error and left out. Usage: python3 peer_recipes.py out.json
import json, sys
import torch
from peer_util import median_ms  # bench/ is the script's directory, so on sys.path

dev = torch.device("cuda")
rows = []
for m, n, k in [(8192, 8192, 8192), (16384, 14336, 4096), (16384, 4096, 14336), (4096, 4096, 4096),
                (16384, 4096, 4096)]:
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
