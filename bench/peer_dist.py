# The torch peer of bench_dist: DDP's gradient all-reduce of the same 8192 x 8192 weight gradient
# (bf16 and fp32, NCCL, world size 1) and a device copy of it, timed as bench_dist times libfp8.
import json
import os
import sys

import torch
import torch.distributed as dist

from peer_util import median_ms

os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
os.environ.setdefault("MASTER_PORT", "29533")
dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda:0"))
rows = []
for dtype, name in ((torch.bfloat16, "bf16"), (torch.float32, "fp32")):
    g = torch.randn(8192, 8192, device="cuda", dtype=dtype)
    ms = median_ms(lambda: dist.all_reduce(g), warm=5, reps=30)
    rows.append({"name": f"torch all_reduce {name} 8192x8192, NCCL 1 rank", "ms": ms})
    print(f"{rows[-1]['name']:52s} {ms:9.4f} ms", flush=True)

# A bf16 Linear training step 16384 x 8192 -> 8192 with AdamW, alone and wrapped in DDP (world size 1):
# what data parallelism costs torch at one rank. (torch.compile does not take the collective.)
x = torch.randn(16384, 8192, device="cuda", dtype=torch.bfloat16)
dy = torch.randn(16384, 8192, device="cuda", dtype=torch.bfloat16) * 1e-3
for wrap in (False, True):
    lin = torch.nn.Linear(8192, 8192, device="cuda", dtype=torch.bfloat16)
    model = torch.nn.parallel.DistributedDataParallel(lin) if wrap else lin
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)

    def step():
        y = model(x)
        y.backward(dy)
        opt.step()
        opt.zero_grad(set_to_none=False)

    ms = median_ms(step, warm=3, reps=20)
    rows.append({"name": "torch bf16 linear step 16384x8192->8192" + (", DDP 1 rank" if wrap else ""), "ms": ms})
    print(f"{rows[-1]['name']:52s} {ms:9.4f} ms", flush=True)
dist.destroy_process_group()
json.dump(rows, open(sys.argv[1] if len(sys.argv) > 1 else "peer_dist.json", "w"), indent=1)
