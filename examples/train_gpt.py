#!/usr/bin/env python3
"""A GPT trained on the bytes of the King James Bible, three (or four) ways with the same seed, the
same initial weights and the same batches: torch bf16 (fp32 on the CPU), libfp8 FP8 at te, libfp8
FP8 at O2, and with --compile torch.compile bf16 too. Prints progress lines, each FP8 run's layer
report, and a table last.

    sudo apt-get install bible-kjv && bible Genesis1:1-Revelation22:21 > kjv.txt
    FP8_LIBRARY=build/release/libfp8.so.0 PYTHONPATH=bindings/python \\
        python3 examples/train_gpt.py --data kjv.txt --preset gpt2s --compile

The model: byte tokens (vocabulary 256), learned positions, pre-LN blocks (LayerNorm, causal
self-attention through scaled_dot_product_attention, LayerNorm, GELU MLP), a final LayerNorm and an
untied output layer (untied so that it converts: libfp8 owns one copy of each parameter it runs).
A block's LayerNorm -> QKV and LayerNorm -> fc -> GELU -> fc are nn.Sequential, which
convert_model makes libfp8 stacks (one call each way, the norms' and the GELU's outputs handed to
the Linears in E4M3, the GELU's backward folded into the fc's gradient cast).
The FP8 runs swap nn.Linear and nn.LayerNorm with libfp8.torch.convert_model (which leaves to
torch the Linears the small-layer rule would run in high precision anyway, in_features or
out_features < 2048, and the norms when no Linear converts: gpt2s keeps torch's modules), wrap the
forward with apply_fp8_autowrap and train with libfp8.torch.Optimizer (AdamW, one gradient clip over
all parameters). On CUDA every run computes under torch.autocast(bfloat16) with float32 weights.
"""
import argparse
import gc
import json
import math
import os
import subprocess
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bindings", "python"))
import libfp8.torch as lt  # noqa: E402

PRESETS = {
    # name: d, layers, heads, T, batch, steps, lr, eval batches, FP8 small-layer fallback
    "cpu-tiny": dict(d=32, layers=2, heads=2, T=32, batch=4, steps=30, lr=3e-3, eval_batches=2, fallback=False),
    "gpt2s": dict(d=768, layers=12, heads=12, T=1024, batch=8, steps=300, lr=6e-4, eval_batches=8, fallback=True),
    "1b": dict(d=2048, layers=16, heads=16, T=1024, batch=8, steps=200, lr=3e-4, eval_batches=8, fallback=True),
}


def attention(q, k, v):
    if hasattr(F, "scaled_dot_product_attention"):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    # torch < 2.0 (Debian's 1.13 in CI): the same causal softmax attention, spelt out.
    t = q.shape[-2]
    scores = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
    mask = torch.ones(t, t, dtype=torch.bool, device=q.device).triu(1)
    return scores.masked_fill(mask, float("-inf")).softmax(-1) @ v


class Block(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.heads = heads
        # The runs of layers as nn.Sequential, which convert_model hands to libfp8 as one stack each.
        self.qkv = nn.Sequential(nn.LayerNorm(d), nn.Linear(d, 3 * d))
        self.proj = nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.GELU(approximate="tanh"),
                                 nn.Linear(4 * d, d))

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = attention(q, k, v).transpose(1, 2).reshape(b, t, d)
        # x + proj(y) and x + mlp(x); for libfp8's layers the sums come from their last GEMMs (torch's
        # modules: torch adds them).
        x = lt.residual(self.proj, y, x)
        return lt.residual(self.mlp, x)


class GPT(nn.Module):
    def __init__(self, d, layers, heads, T, vocab=256):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(T, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln_f, self.head = nn.LayerNorm(d), nn.Linear(d, vocab, bias=False)
        for name, p in self.named_parameters():
            if p.dim() == 2:  # GPT-2's init, the residual projections scaled by depth
                std = 0.02 / math.sqrt(2 * layers) if name.endswith(("proj.weight", "mlp.3.weight")) else 0.02
                nn.init.normal_(p, std=std)
            elif name.endswith("bias"):
                nn.init.zeros_(p)

    def forward(self, idx):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def load_text(path):
    if not os.path.exists(path):
        if not os.path.exists("/usr/bin/bible"):
            sys.exit(f"{path} not found and no `bible` program: apt-get install bible-kjv, then\n"
                     f"  bible Genesis1:1-Revelation22:21 > {path}")
        with open(path, "wb") as f:
            subprocess.run(["bible", "Genesis1:1-Revelation22:21"], stdout=f, check=True)
    with open(path, "rb") as f:
        data = torch.frombuffer(bytearray(f.read()), dtype=torch.uint8).long()
    if data.numel() < 100000:
        sys.exit(f"{path}: {data.numel()} bytes; expected the whole King James Bible (about 4.3 MB)")
    return data


def batches(data, count, batch, T, seed, device=torch.device("cpu")):
    """`count` batches of (input, target) on `device`, drawn the same way for every run. To a GPU
    each batch goes whole from pinned memory: a copy from pageable memory would wait for the GPU's
    queue to drain (stalling every step's start), and one of a strided slice would stage it first."""
    g = torch.Generator().manual_seed(seed)
    for _ in range(count):
        starts = torch.randint(0, data.numel() - T - 1, (batch,), generator=g)
        chunk = torch.stack([data[s:s + T + 1] for s in starts.tolist()])
        if device.type == "cuda":
            chunk = chunk.pin_memory().to(device, non_blocking=True)
        yield chunk[:, :-1], chunk[:, 1:]


def device_used_bytes():
    free, total = torch.cuda.mem_get_info()
    return total - free


def fp8_layer_summary(model):
    """'k/n FP8': how many of libfp8's layers ran forwards in FP8 (the rest fell back to high
    precision, or are norms, which hand FP8 over only inside libfp8's own sequential runs)."""
    layers = [m for m in model.modules() if isinstance(m, lt._Module)]
    if not layers:
        return "-"
    fp8 = sum(lt._f.layer_report(m._group.model, m._layer_id).fp8_calls > 0 for m in layers)
    return f"{fp8}/{len(layers)} FP8"


def profile(name, train_step, data):
    """Runs train_step over `data` under torch.profiler and prints the GPU time per step by kernel
    (the 40 largest) and the host's time per step: where a step's time goes."""
    from torch.profiler import ProfilerActivity
    data = list(data)

    def timed():  # (host seconds to queue the steps, wall seconds until they are done)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for x, y in data:
            train_step(x, y)
        host = time.perf_counter() - t0
        torch.cuda.synchronize()
        return host, time.perf_counter() - t0

    host_plain, wall_plain = timed()  # first unprofiled: is the host or the GPU the bound?
    with torch.profiler.profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        host, wall = timed()
    events = prof.key_averages()
    kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
    self_us = lambda e: getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0)  # noqa: E731
    kernels.sort(key=self_us, reverse=True)
    n, total = len(data), sum(self_us(e) for e in kernels)
    print(f"\nprofile {name}: {n} steps; per step: {wall_plain / n * 1e3:.1f} ms wall, the host queued it in "
          f"{host_plain / n * 1e3:.1f} ms; profiled: {wall / n * 1e3:.1f} ms wall, host {host / n * 1e3:.1f} ms, "
          f"GPU kernels {total / n / 1e3:.1f} ms")
    print("| kernel | calls/step | ms/step | share |\n|---|---|---|---|")
    for e in kernels[:40]:
        print(f"| {e.key[:120]} | {e.count / n:.0f} | {self_us(e) / n / 1e3:.2f} | {100 * self_us(e) / total:.1f}% |")
    ops = [e for e in events if e.device_type == torch.autograd.DeviceType.CPU]
    ops.sort(key=lambda e: e.self_cpu_time_total, reverse=True)
    print(f"\nhost of {name}: {sum(e.count for e in ops) / n:.0f} operator calls/step")
    print("| operator (host) | calls/step | self ms/step |\n|---|---|---|")
    for e in ops[:12]:
        print(f"| {e.key[:90]} | {e.count / n:.0f} | {e.self_cpu_time_total / n / 1e3:.2f} |")


def run(name, args, cfg, init_state, data_train, data_val, device):
    torch.manual_seed(args.seed)
    model = GPT(cfg["d"], cfg["layers"], cfg["heads"], cfg["T"]).to(device)
    model.load_state_dict(init_state)
    cuda = device.type == "cuda"
    conversion = None
    if name in ("te", "O2"):
        level = dict(backend="te") if name == "te" else dict(backend="msamp", opt_level="O2")
        recipe = lt.Recipe(**level, small_layer_fallback=cfg["fallback"])
        conversion = lt.convert_model(model, recipe=recipe)
        lt.apply_fp8_autowrap(model, recipe)
        opt = lt.Optimizer(model, "adamw", lr=cfg["lr"], betas=(0.9, 0.95), weight_decay=0.1, max_grad_norm=1.0)
        set_lr, clip, step = opt.set_lr, (lambda: None), opt.step
    else:
        fused = {"fused": True} if cuda and "fused" in torch.optim.AdamW.__init__.__code__.co_varnames else {}
        opt = torch.optim.AdamW(model.parameters(), lr=cfg["lr"], betas=(0.9, 0.95), weight_decay=0.1, **fused)

        def set_lr(lr):
            for g in opt.param_groups:
                g["lr"] = lr

        params = list(model.parameters())
        clip, step = (lambda: torch.nn.utils.clip_grad_norm_(params, 1.0)), opt.step
    forward = torch.compile(model) if name == "compile" else model
    amp = torch.autocast("cuda", dtype=torch.bfloat16) if cuda else torch.autocast("cpu", enabled=False)

    steps, warmup = cfg["steps"], max(1, cfg["steps"] // 10)
    timed_from = min(steps - 1, max(warmup, steps // 5))  # after warmup and compilation
    if cuda:
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    peak_used, losses, t0, memory = 0, [], None, {}

    def train_step(x, y, measure=False):
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        if measure:  # what the step holds before its forward (weights, optimizer states) and after it
            memory["static_mib"] = torch.cuda.memory_allocated() / 2**20
        with amp:
            logits = forward(x)
        loss = F.cross_entropy(logits.float().view(-1, logits.shape[-1]), y.reshape(-1))
        if measure:
            memory["activations_mib"] = torch.cuda.memory_allocated() / 2**20 - memory["static_mib"]
        loss.backward()
        clip()
        step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    model.train()
    for i, (x, y) in enumerate(batches(data_train, steps, cfg["batch"], cfg["T"], args.seed, device)):
        if i < warmup:  # a linear warmup, then a constant rate (set_lr synchronises libfp8: warmup only)
            set_lr(cfg["lr"] * (i + 1) / warmup)
        if i == timed_from:
            if cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
        losses.append(train_step(x, y, measure=cuda and i == timed_from - 1))
        if (i + 1) % args.log_every == 0 or i + 1 == steps:
            if cuda:
                peak_used = max(peak_used, device_used_bytes())
            print(f"  {name:>7} step {i + 1:5d}/{steps}  loss {losses[-1].item():.4f}", flush=True)
    if cuda:
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - t0
    timed = steps - timed_from
    if args.profile and cuda:
        profile(name, train_step, batches(data_train, args.profile, cfg["batch"], cfg["T"], args.seed + 2, device))
    model.eval()
    with torch.no_grad(), amp:
        val = [F.cross_entropy(forward(x.to(device)).float().view(-1, 256), y.to(device).reshape(-1)).item()
               for x, y in batches(data_val, cfg["eval_batches"], cfg["batch"], cfg["T"], args.seed + 1)]
    losses = [v.item() for v in losses]
    tail = max(1, min(10, steps // 5))
    result = dict(run=name, first_loss=sum(losses[:tail]) / tail, train_loss=sum(losses[-tail:]) / tail,
                  val_loss=sum(val) / len(val), ms_per_step=1000 * elapsed / timed,
                  tokens_per_s=timed * cfg["batch"] * cfg["T"] / elapsed,
                  peak_torch_mib=torch.cuda.max_memory_allocated() / 2**20 if cuda else float("nan"),
                  peak_device_mib=max(peak_used, device_used_bytes() if cuda else 0) / 2**20 if cuda else float("nan"),
                  fp8_layers=fp8_layer_summary(model), **memory)
    if conversion is not None:
        result["skipped"] = [f"{n} ({k}): {r}" for n, k, r in conversion.skipped]
        print(f"\n{name}: {conversion}\n{lt.report(model)}")
    del model, forward, opt
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return result


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", choices=sorted(PRESETS), default="cpu-tiny")
    ap.add_argument("--data", default="kjv.txt", help="the Bible's text (written with `bible` if missing)")
    ap.add_argument("--steps", type=int, help="override the preset's step count")
    ap.add_argument("--batch", type=int, help="override the preset's batch size")
    ap.add_argument("--runs", default="bf16,te,O2", help="comma-separated, of bf16, compile, te, O2")
    ap.add_argument("--compile", action="store_true", help="add a torch.compile bf16 run")
    ap.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--log-every", type=int, default=None)
    ap.add_argument("--json", help="also write the results here")
    ap.add_argument("--profile", type=int, default=0, metavar="N",
                    help="on CUDA, profile N more steps of each run and print where their GPU time goes")
    ap.add_argument("--check-loss-falls", action="store_true",
                    help="exit 1 unless every run's final train loss is below its first by 10%% and finite")
    args = ap.parse_args()
    cfg = dict(PRESETS[args.preset])
    cfg["steps"] = args.steps or cfg["steps"]
    cfg["batch"] = args.batch or cfg["batch"]
    args.log_every = args.log_every or max(1, cfg["steps"] // 10)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    runs = [r.strip() for r in args.runs.split(",") if r.strip()]
    if args.compile and "compile" not in runs:
        runs.insert(1 if runs and runs[0] == "bf16" else 0, "compile")
    for r in runs:
        if r not in ("bf16", "compile", "te", "O2"):
            sys.exit(f"--runs: {r!r}; expected bf16, compile, te or O2")

    data = load_text(args.data)
    split = int(0.9 * data.numel())
    torch.manual_seed(args.seed)
    init_state = {k: v.clone() for k, v in GPT(cfg["d"], cfg["layers"], cfg["heads"], cfg["T"]).state_dict().items()}
    n_params = sum(v.numel() for v in init_state.values())
    print(f"preset {args.preset}: d={cfg['d']} layers={cfg['layers']} T={cfg['T']} batch={cfg['batch']} "
          f"steps={cfg['steps']} params={n_params / 1e6:.1f}M on {device}; {data.numel()} bytes of text", flush=True)
    results = []
    for r in runs:
        print(f"run {r}", flush=True)
        results.append(run(r, args, cfg, init_state, data[:split], data[split:], device))

    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(preset=args.preset, config=cfg, device=str(device), results=results), f, indent=1)
    base = results[0]
    hp = "bf16" if device.type == "cuda" else "fp32"
    print(f"\n| run | train loss | val loss | val vs {base['run']} | ms/step | tokens/s | speedup | "
          f"peak torch MiB | peak device MiB | held before a step MiB | activations MiB | libfp8 layers |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        label = {"bf16": f"torch {hp}", "compile": f"torch.compile {hp}", "te": "libfp8 FP8 te",
                 "O2": "libfp8 FP8 O2"}[r["run"]]
        print(f"| {label} | {r['train_loss']:.4f} | {r['val_loss']:.4f} | "
              f"{100 * (r['val_loss'] / base['val_loss'] - 1):+.2f}% | {r['ms_per_step']:.1f} | "
              f"{r['tokens_per_s']:.0f} | {base['ms_per_step'] / r['ms_per_step']:.2f}x | "
              f"{r['peak_torch_mib']:.0f} | {r['peak_device_mib']:.0f} | {r.get('static_mib', math.nan):.0f} | "
              f"{r.get('activations_mib', math.nan):.0f} | {r['fp8_layers']} |")
    if args.check_loss_falls:
        bad = [r["run"] for r in results
               if not (math.isfinite(r["train_loss"]) and r["train_loss"] < 0.9 * r["first_loss"])]
        if bad:
            sys.exit(f"loss did not fall by 10% in: {', '.join(bad)}")


if __name__ == "__main__":
    main()
