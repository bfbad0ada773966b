# Joins bench_optimizer's JSON (libfp8's AdamW at te/O1/O2/O3) and peer_optimizer.json (torch fused
# AdamW) into the step table, the "O2 >= 2x torch fused AdamW" target and the memory table of
# bench/RESULTS.md. Missing rows print as "–".
# Usage: python3 report_optimizer.py libfp8.json peer.json
import json, os, sys

rows = {}
for f in sys.argv[1:3]:
    if os.path.exists(f):
        rows.update({r["name"]: r for r in json.load(open(f))})

def fmt(v, d=3): return "–" if v is None else f"{v:.{d}f}"
def get(name, key): return rows.get(name, {}).get(key)
def ratio(num, den): return None if num is None or den is None or den == 0 else num / den
def fmt_x(r): return "–" if r is None else f"{r:.2f}x"
def fmt_less(r): return "–" if r is None else f"{r:.2f}x less"

levels = ["te", "O1", "O2", "O3"]
torch32, torch16 = "torch adamw fused fp32 2^30", "torch adamw fused bf16 2^30"
torch_ms = get(torch32, "ms")

print("| AdamW step, 2^30 params | ms | Gparam/s | GB/s | bytes moved/param | state bytes/param (stats) | state bytes/param (measured) | speed vs torch fused fp32 |")
print("|---|---|---|---|---|---|---|---|")
for lv in levels:
    n = f"libfp8 adamw {lv} 2^30"
    print(f"| libfp8 {lv} | {fmt(get(n, 'ms'))} | {fmt(get(n, 'gparam_per_s'), 1)} | {fmt(get(n, 'gb_per_s'), 0)} | "
          f"{get(n, 'bytes_moved_per_param') or '–'} | {fmt(get(n, 'bytes_per_param_stats'), 2)} | "
          f"{fmt(get(n, 'bytes_per_param_measured'), 2)} | {fmt_x(ratio(torch_ms, get(n, 'ms')))} |")
for n, label in [(torch32, "torch fused AdamW fp32"), (torch16, "torch fused AdamW bf16 params")]:
    print(f"| {label} | {fmt(get(n, 'ms'))} | {fmt(get(n, 'gparam_per_s'), 1)} | {fmt(get(n, 'gb_per_s'), 0)} | "
          f"{get(n, 'bytes_moved_per_param') or '–'} | – | {fmt(get(n, 'bytes_per_param_measured'), 2)} | "
          f"{fmt_x(ratio(torch_ms, get(n, 'ms')))} |")

print()
print("| target | libfp8 | peer | ratio | target | |")
print("|---|---|---|---|---|---|")
o2 = get("libfp8 adamw O2 2^30", "ms")
r = ratio(torch_ms, o2)
status = "–" if r is None else ("met" if r >= 2.0 else "NOT met")
print(f"| AdamW step 2^30: O2 vs torch fused AdamW (fp32) | {fmt(o2)} ms | {fmt(torch_ms)} ms | {fmt_x(r)} | >= 2x | {status} |")
for lv, limit in [("O2", 6.0), ("O3", 7.0)]:
    b = get(f"libfp8 adamw {lv} 2^30", "bytes_per_param_stats")
    m = get(f"libfp8 adamw {lv} 2^30", "bytes_per_param_measured")
    # Judged on the state itself (stats); the measured figure adds the optimizer's tables, the norm
    # partials and the allocator's rounding (~0.05 B/param at 2^30).
    status = "–" if b is None else ("met" if b <= limit else "NOT met")
    print(f"| training-state bytes/param, {lv} (stats / measured) | {fmt(b, 2)} / {fmt(m, 2)} | 16 (bf16 mixed precision) | "
          f"{fmt_less(ratio(16.0, b))} | <= {limit:g} | {status} |")

print()
print("| training state, bytes per parameter | stats | measured | vs bf16 mixed precision (16) | vs torch fused fp32 (measured) |")
print("|---|---|---|---|---|")
t_bpp = get(torch32, "bytes_per_param_measured")
for lv in levels:
    n = f"libfp8 adamw {lv} 2^30"
    b, m = get(n, "bytes_per_param_stats"), get(n, "bytes_per_param_measured")
    print(f"| libfp8 {lv} | {fmt(b, 2)} | {fmt(m, 2)} | {fmt_less(ratio(16.0, b))} | {fmt_less(ratio(t_bpp, m))} |")
print(f"| bf16 mixed precision (bf16 weights + FP32 master, m, v; bf16 grads) | 16 | – | 1.00x | – |")
print(f"| torch fused AdamW fp32 | – | {fmt(t_bpp, 2)} | – | 1.00x |")
print(f"| torch fused AdamW bf16 params (bf16 states) | – | {fmt(get(torch16, 'bytes_per_param_measured'), 2)} | – | – |")
