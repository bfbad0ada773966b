# Joins the libfp8 linear/MLP step timings and peer_linear.json (torch) into the headline targets and
# the per-shape sweep table of bench/RESULTS.md. Missing rows print as "–".
# Usage: python3 report_linear.py libfp8.json peer.json
import json, sys

rows = {r["name"]: r for f in sys.argv[1:3] for r in json.load(open(f))}
ms = {name: r["ms"] for name, r in rows.items()}

def fmt(v): return "–" if v is None else f"{v:.3f}"
def ratio(num, den): return None if num is None or den is None else num / den
def fmt_x(r): return "–" if r is None else f"{r:.2f}x"

big, small, mlp = "16384x8192->8192", "1024x1024->1024", "16384x4096x16384"
few = "512x8192->8192"
print("| comparison | libfp8 ms | peer ms | peer / libfp8 | target | |")
print("|---|---|---|---|---|---|")
for what, ours, peer, target in [
        (f"{big}: libfp8 fp8 vs torch bf16", f"libfp8 fp8 linear {big}", f"torch bf16 linear {big}", 1.6),
        (f"{big}: libfp8 fp8 vs torch fp8 eager", f"libfp8 fp8 linear {big}", f"torch fp8 eager linear {big}", 1.75),
        (f"{small}: libfp8 auto vs torch bf16", f"libfp8 auto linear {small}", f"torch bf16 linear {small}", 1.0),
        (f"mlp {mlp}: libfp8 fp8 vs torch bf16", f"libfp8 fp8 mlp {mlp}", f"torch bf16 mlp {mlp}", 1.4),
        # Issue 17's targets, against the compiled peers of the same run.
        (f"{big}: libfp8 fp8 vs torch bf16 (issue 17)", f"libfp8 fp8 linear {big}", f"torch bf16 linear {big}", 2.0),
        (f"{big}: libfp8 fp8 vs torch.compile fp8", f"libfp8 fp8 linear {big}", f"torch compile fp8 linear {big}", 1.3),
        (f"{big}: libfp8 fp8 vs torch.compile bf16", f"libfp8 fp8 linear {big}", f"torch compile bf16 linear {big}", None),
        (f"{few}: libfp8 auto vs torch bf16", f"libfp8 auto linear {few}", f"torch bf16 linear {few}", 1.0),
        (f"{few}: libfp8 auto vs torch.compile bf16", f"libfp8 auto linear {few}", f"torch compile bf16 linear {few}", None),
        (f"mlp {mlp}: libfp8 fp8 vs torch bf16 (issue 17)", f"libfp8 fp8 mlp {mlp}", f"torch bf16 mlp {mlp}", 1.85),
        (f"mlp {mlp}: libfp8 fp8 vs torch.compile fp8", f"libfp8 fp8 mlp {mlp}", f"torch compile fp8 mlp {mlp}", 1.4),
        (f"mlp {mlp}: libfp8 fp8 layer by layer vs torch bf16", f"libfp8 fp8 mlp layer by layer {mlp}",
         f"torch bf16 mlp {mlp}", None),
        (f"mlp {mlp}: libfp8 fp8 vs torch fp8 eager", f"libfp8 fp8 mlp {mlp}", f"torch fp8 eager mlp {mlp}", None),
        (f"mlp {mlp}: libfp8 fp8 vs torch.compile bf16", f"libfp8 fp8 mlp {mlp}", f"torch compile bf16 mlp {mlp}", None),
        # Issue 17's floors: the step's FP8 GEMMs alone (same run) over the step, as a fraction.
        (f"{big}: its FP8 GEMMs alone vs libfp8 fp8 (share of the floor)", f"libfp8 fp8 linear {big}",
         f"gemm floor linear {big}", 0.9),
        (f"mlp {mlp}: its FP8 GEMMs alone vs libfp8 fp8 (share of the floor)", f"libfp8 fp8 mlp {mlp}",
         f"gemm floor mlp {mlp}", 0.8),
        # Issue 14: current scaling (each cast scaled by its own amax), the recipe of the compiled FP8 peer.
        (f"{big}: libfp8 fp8 current vs torch bf16", f"libfp8 fp8 current linear {big}", f"torch bf16 linear {big}", 1.7),
        (f"{big}: libfp8 fp8 current vs torch.compile fp8", f"libfp8 fp8 current linear {big}",
         f"torch compile fp8 linear {big}", None),
        (f"mlp {mlp}: libfp8 fp8 current vs torch bf16", f"libfp8 fp8 current mlp {mlp}", f"torch bf16 mlp {mlp}", None),
        (f"mlp {mlp}: libfp8 fp8 current vs torch.compile fp8", f"libfp8 fp8 current mlp {mlp}",
         f"torch compile fp8 mlp {mlp}", None),
        # Issue 14: rowwise and block scaling (grids of scales, cuBLASLt's scaled GEMMs).
        (f"{big}: libfp8 fp8 rowwise vs torch bf16", f"libfp8 fp8 rowwise linear {big}", f"torch bf16 linear {big}", None),
        (f"{big}: libfp8 fp8 block vs torch bf16", f"libfp8 fp8 block linear {big}", f"torch bf16 linear {big}", 1.5),
        (f"{big}: libfp8 fp8 block vs libfp8 fp8 (delayed)", f"libfp8 fp8 block linear {big}", f"libfp8 fp8 linear {big}", None),
        (f"mlp {mlp}: libfp8 fp8 rowwise vs torch bf16", f"libfp8 fp8 rowwise mlp {mlp}", f"torch bf16 mlp {mlp}", None),
        (f"mlp {mlp}: libfp8 fp8 block vs torch bf16", f"libfp8 fp8 block mlp {mlp}", f"torch bf16 mlp {mlp}", None)]:
    o, p = ms.get(ours), ms.get(peer)
    r = ratio(p, o)
    status = "–" if r is None or target is None else ("met" if r >= target else "NOT met")
    print(f"| {what} | {fmt(o)} | {fmt(p)} | {fmt_x(r)} | {'–' if target is None else f'>= {target}x'} | {status} |")

print()
print("| M | K=N | libfp8 fp8 ms | libfp8 bf16 ms | fp8 vs our bf16 | libfp8 auto ms | torch bf16 ms | auto vs torch bf16 | auto chose |")
print("|---|---|---|---|---|---|---|---|---|")
for m in [512, 1024, 2048, 4096, 8192, 16384]:
    for k in [1024, 2048, 4096, 8192]:
        tag = f"{m}x{k}->{k}"
        f8, b16, auto, tb = (ms.get(f"{who} linear {tag}") for who in ("libfp8 fp8", "libfp8 bf16", "libfp8 auto", "torch bf16"))
        path = rows.get(f"libfp8 auto linear {tag}", {}).get("path", "–")  # from the layer's report
        print(f"| {m} | {k} | {fmt(f8)} | {fmt(b16)} | {fmt_x(ratio(b16, f8))} | {fmt(auto)} | {fmt(tb)} | "
              f"{fmt_x(ratio(tb, auto))} | {path} |")
