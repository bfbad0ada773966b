# The peers a user would pick instead of libfp8's fused quantize: torch eager and torch.compile,
# measured the same way (median of CUDA-event-timed repeats, random bf16 data, two inputs alternated).
# Usage: python3 peer_quantize.py out.json
import json, sys
import torch

dev = torch.device("cuda")

def median_ms(fn, warm=10, reps=50, batch=1):
    """Median of event-timed repeats; with batch > 1, per call of `batch` calls queued back to back."""
    for i in range(warm): fn(i)
    torch.cuda.synchronize()
    ts = []
    for i in range(reps):
        s = torch.cuda.Event(enable_timing=True); e = torch.cuda.Event(enable_timing=True)
        s.record()
        for k in range(batch): fn(i * batch + k)
        e.record(); torch.cuda.synchronize()
        ts.append(s.elapsed_time(e) / batch)
    ts.sort(); return ts[len(ts) // 2]

rows = []
scale = torch.tensor(20.0, device=dev)
for m, k in [(8192, 8192), (16384, 8192)]:
    xs = [torch.randn(m, k, device=dev, dtype=torch.bfloat16) * 2 for _ in range(2)]
    n = m * k
    def fused(x):
        amax = x.abs().max()
        q = (x.float() * scale).clamp(-448, 448).to(torch.float8_e4m3fn)
        return amax, q, q.t().contiguous()
    def cast(x):
        amax = x.abs().max()
        return amax, (x.float() * scale).clamp(-448, 448).to(torch.float8_e4m3fn)
    tag = f"{m}x{k}"
    compiled_fused = torch.compile(fused)
    compiled_cast = torch.compile(cast)
    for name, fn, nbytes in [(f"torch eager quantize+amax {tag}", cast, 3 * n),
                             (f"torch.compile quantize+amax {tag}", compiled_cast, 3 * n),
                             (f"torch eager quantize+transpose+amax {tag}", fused, 4 * n),
                             (f"torch.compile quantize+transpose+amax {tag}", compiled_fused, 4 * n)]:
        for batch, suffix in [(1, ""), (20, " batched")]:
            ms = median_ms(lambda i: fn(xs[i & 1]), batch=batch)
            rows.append({"name": name + suffix, "ms": ms, "gbps": nbytes / ms / 1e6})
            print(f"{name + suffix:56s} {ms:9.4f} ms {nbytes / ms / 1e6:9.1f} GB/s", flush=True)
json.dump(rows, open(sys.argv[1], "w"), indent=1)
