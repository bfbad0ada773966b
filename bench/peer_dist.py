# The torch peer of bench_dist: DDP's gradient all-reduce of the same 8192 x 8192 weight gradient
# (bf16 and fp32, NCCL, world size 1) and a device copy of it, timed as bench_dist times libfp8.
#
# With --ranks N, the peer of bench_dist --ranks N: the bf16 training step of the MLP block
# (LayerNorm -> Linear 4096->16384 -> GELU(tanh) -> Linear 16384->4096, bf16 parameters, fused
# AdamW, 16384 tokens per rank, the input's gradient computed as libfp8's step computes dx) on 1 GPU
# without DDP and on N GPUs in DDP (one process per GPU, torch.multiprocessing.spawn, NCCL), timed
# the same way: 5 warm-ups, then 30 repetitions, the two steps alternating within each; each
# repetition the ranks synchronise, meet at a host barrier and time their step with CUDA events;
# the repetition's time is the slowest rank's (an all_reduce MAX of the times); the median of the
# 30. Throughput = N * 16384 tokens / step time; scaling = throughput(N) / throughput(1). Checks
# (exit status 3 when one fails): the ranks' parameters are bit-identical after the steps, they
# moved, the output is finite and not zero, and the step is not faster than the GPU's bf16 peak.
# Usage: python3 peer_dist.py [out.json]
#        python3 peer_dist.py --ranks N [out.json]
import json
import os
import sys

# NVLink multicast stays off, in this process and in the ranks it spawns (before torch loads NCCL).
os.environ["NCCL_NVLS_ENABLE"] = "0"
os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"

import torch
import torch.distributed as dist

from peer_util import median_ms


def one_rank(path):
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
    json.dump(rows, open(path, "w"), indent=1)


# --ranks N ---------------------------------------------------------------------------------------
T, D, F = 16384, 4096, 16384
WARM, REPS = 5, 30
STEP_FLOPS = 3 * 2 * 2.0 * T * D * F  # forward, dgrad and wgrad GEMMs of both Linears
MAX_TFLOPS = 1000.0  # above the dense bf16 peak of an H100 or H200 (989 TFLOP/s): work was skipped


def make_mlp(dev):
    torch.manual_seed(0)  # (DDP starts every rank from rank 0's parameters anyway)
    mlp = torch.nn.Sequential(torch.nn.LayerNorm(D), torch.nn.Linear(D, F), torch.nn.GELU(approximate="tanh"),
                              torch.nn.Linear(F, D))
    return mlp.to(dev, torch.bfloat16)


def flat_params(model):
    # The bits, as bytes: NCCL broadcasts uint8 (not int16) and equality is of the bits.
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).view(torch.uint8)


def scaling_rank(rank, n, init, barrier, path):
    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    dist.init_process_group("nccl", init_method=init, rank=rank, world_size=n, device_id=dev)
    # This rank's own data: x and the output gradient, random, never zeros.
    gen = torch.Generator(device=dev)
    gen.manual_seed(1000 + rank)
    x = torch.randn(T, D, device=dev, dtype=torch.bfloat16, generator=gen).requires_grad_(True)
    dy = torch.randn(T, D, device=dev, dtype=torch.bfloat16, generator=gen) * 1e-3

    configs = []  # (model, optimizer) of the 1-GPU step (rank 0 alone) and of the DDP step
    for ddp in (False, True):
        if not ddp and rank != 0:
            configs.append(None)
            continue
        mlp = make_mlp(dev)
        model = torch.nn.parallel.DistributedDataParallel(mlp, device_ids=[rank]) if ddp else mlp
        configs.append((model, torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)))
    initial = [None if c is None else flat_params(c[0]).clone() for c in configs]

    def step(model, opt):
        x.grad = None
        y = model(x)
        y.backward(dy)
        opt.step()
        opt.zero_grad(set_to_none=False)

    times = [[0.0] * REPS for _ in configs]
    torch.cuda.synchronize()
    for it in range(WARM + REPS):
        for c, cfg in enumerate(configs):
            barrier.wait()  # every rank has synchronised: its previous step is done
            if cfg is None:
                continue
            s = torch.cuda.Event(enable_timing=True)
            e = torch.cuda.Event(enable_timing=True)
            s.record()
            step(*cfg)
            e.record()
            e.synchronize()
            if it >= WARM:
                times[c][it - WARM] = s.elapsed_time(e)
    # Each repetition's time is its slowest rank's.
    t = torch.tensor(times, dtype=torch.float64, device=dev)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    ms = [sorted(row)[REPS // 2] for row in t.tolist()]

    # The checks: the DDP ranks' parameters bit-identical, every model's parameters moved, the
    # output finite and not zero.
    fails = []
    mine = flat_params(configs[1][0])
    ref = mine.clone()
    dist.broadcast(ref, 0)
    same = torch.tensor([1 if torch.equal(mine, ref) else 0], device=dev)
    dist.all_reduce(same, op=dist.ReduceOp.MIN)
    for c, cfg in enumerate(configs):
        if cfg is None:
            continue
        if torch.equal(flat_params(cfg[0]), initial[c]):
            fails.append(f"rank {rank}: the parameters of the {'DDP' if c else '1-GPU'} model did not change")
        with torch.no_grad():
            y = cfg[0](x)
        if not torch.isfinite(y).all().item() or not y.ne(0).any().item():
            fails.append(f"rank {rank}: the {'DDP' if c else '1-GPU'} model's output is not finite, or all zeros")
    bad = torch.tensor([len(fails)], device=dev)
    dist.all_reduce(bad, op=dist.ReduceOp.MAX)
    for f in fails:
        print(f"FAIL: {f}", flush=True)

    if rank == 0:
        gpus = (1, n)
        tflops = [STEP_FLOPS / (m * 1e-3) / 1e12 for m in ms]
        ok = same.item() == 1 and bad.item() == 0 and all(tf <= MAX_TFLOPS for tf in tflops)
        if not same.item():
            print(f"FAIL: the DDP ranks' parameters differ after {WARM + REPS} steps", flush=True)
        for c, tf in enumerate(tflops):
            print(f"check: torch {'DDP' if c else '1 GPU'}: {tf:.0f} TFLOP/s per GPU ({STEP_FLOPS / 1e12:.2f} TFLOP a step)")
            if tf > MAX_TFLOPS:
                print(f"FAIL: {tf:.0f} TFLOP/s per GPU is above the bf16 peak: the step skipped work", flush=True)
        print(f"check: DDP parameters after {WARM + REPS} steps bit-identical on all {n} ranks: "
              f"{'yes' if same.item() else 'NO'}; parameters moved, outputs finite and non-zero: "
              f"{'yes' if bad.item() == 0 else 'NO (see FAIL above)'}")
        names = (f"torch bf16 mlp step {T}x{D}x{F}, 1 GPU", f"torch bf16 mlp step {T}x{D}x{F} per rank, DDP {n} ranks")
        keys = ("torch bf16", "torch bf16 DDP")
        tps = [g * T / (m * 1e-3) for g, m in zip(gpus, ms)]
        rows = []
        for c in range(2):
            rows.append({"name": names[c], "ms": ms[c], "config": keys[c], "gpus": gpus[c], "tokens_per_rank": T,
                         "tokens_per_s": tps[c], "scaling": tps[c] / tps[0], "checks": "passed" if ok else "FAILED"})
            print(f"{names[c]:66s} {ms[c]:9.4f} ms {tps[c]:11.0f} tokens/s  scaling {tps[c] / tps[0]:.3f}x", flush=True)
        print(f"scaling {n} GPUs vs 1 (throughput ratio): torch DDP {tps[1] / tps[0]:.3f}x", flush=True)
        json.dump(rows, open(path, "w"), indent=1)
    dist.barrier()
    dist.destroy_process_group()


def scaling(n, path):
    import shutil
    import tempfile

    import torch.multiprocessing as mp

    if torch.cuda.device_count() < n:
        print(f"--ranks {n} needs {n} GPUs; this machine has {torch.cuda.device_count()}", file=sys.stderr)
        sys.exit(2)
    print(f"torch DDP scaling: bf16 MLP block {T}x{D}x{F} per rank, fused AdamW; {n} x "
          f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}", flush=True)
    barrier = mp.get_context("spawn").Barrier(n)
    store = tempfile.mkdtemp(prefix="peer_dist_")
    try:
        mp.spawn(scaling_rank, args=(n, "file://" + os.path.join(store, "init"), barrier, path), nprocs=n, join=True)
    finally:
        shutil.rmtree(store, ignore_errors=True)
    if any(r["checks"] != "passed" for r in json.load(open(path))):
        sys.exit(3)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--ranks":
        if len(sys.argv) not in (3, 4) or not sys.argv[2].isdigit() or int(sys.argv[2]) < 1:
            print("usage: python3 peer_dist.py --ranks N [out.json]", file=sys.stderr)
            sys.exit(2)
        scaling(int(sys.argv[2]), sys.argv[3] if len(sys.argv) > 3 else "peer_dist_ranks.json")
    else:
        one_rank(sys.argv[1] if len(sys.argv) > 1 else "peer_dist.json")
