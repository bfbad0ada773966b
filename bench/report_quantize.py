# Joins bench_quantize.json (libfp8) and peer_quantize.json (torch) into the ratio table that
# bench/RESULTS.md records. Usage: python3 report_quantize.py libfp8.json peer.json
import json, sys

ours = {r["name"]: r for r in json.load(open(sys.argv[1]))}
peer = {r["name"]: r for r in json.load(open(sys.argv[2]))}
copy = ours["d2d copy 1 GiB"]["gbps"]
print(f"copy bandwidth (d2d, 1 GiB, read+write): {copy:.0f} GB/s")
print("| work | shape | libfp8 ms | GB/s | % of copy | torch eager ms | torch.compile ms | vs eager | vs compile |")
print("|---|---|---|---|---|---|---|---|---|")
for shape, suffix in [(s, x) for x in ["", " batched"] for s in ["8192x8192", "16384x8192"]]:
    for work, ours_name, peer_work in [("quantize + amax", "quantize bf16->e4m3 + amax", "quantize+amax"),
                                       ("quantize + transpose + amax", "quantize+transpose+amax", "quantize+transpose+amax")]:
        o = ours[f"{ours_name} {shape}{suffix}"]
        e = peer[f"torch eager {peer_work} {shape}{suffix}"]
        c = peer[f"torch.compile {peer_work} {shape}{suffix}"]
        timing = "20 calls per timed region" if suffix else "1 call per timed region"
        print(f"| {work} | {shape} bf16->e4m3, {timing} | {o['ms']:.4f} | {o['gbps']:.0f} | {100 * o['gbps'] / copy:.1f}% | "
              f"{e['ms']:.4f} | {c['ms']:.4f} | {e['ms'] / o['ms']:.2f}x | {c['ms'] / o['ms']:.2f}x |")
