# Joins bench_dist's JSON (libfp8 at one rank) and peer_dist.json (torch DDP at world size 1) into
# the data-parallel table of bench/RESULTS.md. Missing rows print as "–".
# Given the JSON of `bench_dist --ranks N` and `peer_dist.py --ranks N` instead (rows with a
# "config"), it prints the scaling table: the MLP block's training step on 1 GPU and on N, libfp8
# (backward sync on and off) against torch DDP bf16. Both kinds of file may be given together.
# Usage: python3 report_dist.py libfp8.json peer.json [more.json ...]
import json, os, sys

rows = {}
scaling = {}  # config -> row, from the --ranks files
for f in sys.argv[1:]:
    if os.path.exists(f):
        for r in json.load(open(f)):
            if "config" in r:
                scaling[r["config"]] = r
            else:
                rows[r["name"]] = r["ms"]

def fmt(v): return "–" if v is None else f"{v:.3f}"
def pct(a, b): return "–" if a is None or b is None else f"{100.0 * (a / b - 1.0):+.1f}%"


def one_rank_tables():
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


def scaling_table():
    # (label, config, config of its 1-GPU baseline)
    lines = [("libfp8 MS-AMP O2 (FP8), 1 GPU", "libfp8 O2", "libfp8 O2"),
             ("libfp8 MS-AMP O2 (FP8), backward sync (buckets exchanged during the backward)",
              "libfp8 O2 backward sync", "libfp8 O2"),
             ("libfp8 MS-AMP O2 (FP8), exchange at the step", "libfp8 O2 exchange at step", "libfp8 O2"),
             ("torch bf16, 1 GPU", "torch bf16", "torch bf16"),
             ("torch bf16 + DDP", "torch bf16 DDP", "torch bf16")]
    tokens = next((r.get("tokens_per_rank") for r in scaling.values() if r.get("tokens_per_rank")), None)
    tokens = "" if tokens is None else f" {tokens} tokens per GPU"
    print(f"| step: MLP block (LayerNorm, 4096->16384, GELU, 16384->4096),{tokens} (fwd, bwd, AdamW, zero_grad) | GPUs | ms/step | tokens/s | scaling vs 1 GPU |")
    print("|---|---|---|---|---|")
    def ratio(r, base):
        if r is None or base is None: return None
        return r["tokens_per_s"] / base["tokens_per_s"]
    for label, cfg, base in lines:
        r = scaling.get(cfg)
        gpus = "–" if r is None else r["gpus"]
        ms = None if r is None else r["ms"]
        tps = "–" if r is None else f"{r['tokens_per_s']:,.0f}"
        s = ratio(r, scaling.get(base))
        print(f"| {label} | {gpus} | {fmt(ms)} | {tps} | {'–' if s is None else f'{s:.3f}x'} |")
    print()
    t_dp = scaling.get("torch bf16 DDP")
    n = "N" if t_dp is None else t_dp["gpus"]
    print(f"| libfp8 {n}-GPU throughput / torch DDP {n}-GPU throughput | ratio |")
    print("|---|---|")
    for label, cfg in (("backward sync", "libfp8 O2 backward sync"), ("exchange at the step", "libfp8 O2 exchange at step")):
        s = ratio(scaling.get(cfg), t_dp)
        print(f"| libfp8 MS-AMP O2, {label} / torch bf16 + DDP | {'–' if s is None else f'{s:.3f}x'} |")
    print()
    bs = scaling.get("libfp8 O2 backward sync")
    s = ratio(bs, scaling.get("libfp8 O2"))
    if bs is not None and bs["gpus"] == 2:
        print(f"Target: libfp8 scaling at 2 GPUs >= 1.85x (backward sync): {'–' if s is None else ('met' if s >= 1.85 else 'NOT met')} "
              f"({'–' if s is None else f'{s:.3f}x'})")
    failed = sorted(c for c, r in scaling.items() if r.get("checks", "passed") != "passed")
    if failed:
        print(f"WARNING: the checks FAILED in the runs of: {', '.join(failed)} (see their output)")


# The one-rank tables unless only --ranks files were given (their invocation prints as before).
if rows or not scaling:
    one_rank_tables()
if scaling:
    if rows:
        print()
    scaling_table()
