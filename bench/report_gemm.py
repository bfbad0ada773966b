# Joins bench_gemm.json (libfp8) and peer_gemm.json (torch) into the GEMM table of bench/RESULTS.md.
# Usage: python3 report_gemm.py libfp8.json peer.json
import json, sys

ours = {r["name"]: r for r in json.load(open(sys.argv[1]))}
peer = {r["name"]: r for r in json.load(open(sys.argv[2]))}
print("| m x n x k | libfp8 fp8 fast ms | TFLOP/s | _scaled_mm fast ms | vs _scaled_mm | libfp8 fp8 ms | vs _scaled_mm (no fast) | libfp8 bf16 ms | torch bf16 ms | fp8 fast vs our bf16 |")
print("|---|---|---|---|---|---|---|---|---|---|")
for tag in ["8192x8192x8192", "16384x14336x4096", "16384x4096x14336", "4096x4096x4096", "16384x4096x4096", "1024x1024x1024"]:
    f, s, b = ours[f"fp8 e4m3 fast_accum {tag}"], ours[f"fp8 e4m3 {tag}"], ours[f"bf16 {tag}"]
    pf, ps, pb = peer[f"torch._scaled_mm fast_accum {tag}"], peer[f"torch._scaled_mm {tag}"], peer[f"torch bf16 matmul {tag}"]
    print(f"| {tag} | {f['ms']:.3f} | {f['tflops']:.0f} | {pf['ms']:.3f} | {pf['ms'] / f['ms']:.3f}x | {s['ms']:.3f} | "
          f"{ps['ms'] / s['ms']:.3f}x | {b['ms']:.3f} | {pb['ms']:.3f} | {b['ms'] / f['ms']:.2f}x |")
