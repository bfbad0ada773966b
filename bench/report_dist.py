# Joins bench_dist's JSON (libfp8 at one rank) and peer_dist.json (torch DDP at world size 1) into
# the data-parallel table of bench/RESULTS.md. Missing rows print as "–".
# Usage: python3 report_dist.py libfp8.json peer.json
import json, os, sys

rows = {}
for f in sys.argv[1:3]:
    if os.path.exists(f):
        rows.update({r["name"]: r["ms"] for r in json.load(open(f))})

def fmt(v): return "–" if v is None else f"{v:.3f}"
def pct(a, b): return "–" if a is None or b is None else f"{100.0 * (a / b - 1.0):+.1f}%"

lf_plain = rows.get("O2 linear step 16384x8192->8192, no communicator")
lf_dp = rows.get("O2 linear step 16384x8192->8192, NCCL 1 rank")
lf_bs = rows.get("O2 linear step 16384x8192->8192, NCCL 1 rank, backward sync")
t_plain = rows.get("torch bf16 linear step 16384x8192->8192")
t_dp = rows.get("torch bf16 linear step 16384x8192->8192, DDP 1 rank")
print("| Linear step 16384x8192->8192 (fwd, bwd, AdamW, zero_grad) | alone ms | data-parallel, 1 rank ms | cost | target |")
print("|---|---|---|---|---|")
status = "–" if lf_plain is None or lf_dp is None else ("met" if lf_dp <= 1.02 * lf_plain else "NOT met")
print(f"| libfp8 MS-AMP O2 (FP8 gradient exchange) | {fmt(lf_plain)} | {fmt(lf_dp)} | {pct(lf_dp, lf_plain)} | <= 2%: {status} |")
status = "–" if lf_plain is None or lf_bs is None else ("met" if lf_bs <= 1.02 * lf_plain else "NOT met")
print(f"| libfp8 MS-AMP O2, backward sync (buckets started in the backward) | {fmt(lf_plain)} | {fmt(lf_bs)} | {pct(lf_bs, lf_plain)} | <= 2%: {status} |")
print(f"| torch bf16 + DDP | {fmt(t_plain)} | {fmt(t_dp)} | {pct(t_dp, t_plain)} | |")
print()
print("| all-reduce of an 8192x8192 gradient, NCCL 1 rank (what DDP runs per step) | ms |")
print("|---|---|")
for n in ("torch all_reduce bf16 8192x8192, NCCL 1 rank", "torch all_reduce fp32 8192x8192, NCCL 1 rank"):
    print(f"| {n} | {fmt(rows.get(n))} |")
