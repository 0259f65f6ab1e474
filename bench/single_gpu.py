"""axo4d on the 1x1x1x1 grid against plain PyTorch of the same shape, in the same run.

    python -m bench.single_gpu                 # gpt-1.3b, micro-batch 8, seq 2048, bf16 (CUDA)
    python -m bench.single_gpu --reduced       # 2 layers, hidden 256, seq 128, batch 4, fp32 (CPU, < 1 min)
    python -m bench.single_gpu --no-compile    # skip the torch.compile rows

Contenders, each timed on the same random token batches:

* ``plain eager``: :class:`axo4d.models.plain.PlainGPT` (nn.Linear, nn.LayerNorm, SDPA);
* ``plain compiled``: the same under ``torch.compile`` (whole model) -- the baseline;
* ``axo4d eager``: :class:`axo4d.models.gpt.GPT` on the 1x1x1x1 grid with the default
  ``parallel`` settings (overlap and tuner on; every collective is skipped on groups of one);
* ``axo4d compiled``: the same with ``train.compile`` (each block compiled; the Linear3D
  autograd function stays eager).

On a GPU the contenders run one after the other (memory); on a CPU they take turns step by step
(a machine shared with other jobs then loads all alike). One step = ``zero_grad`` + forward + backward (+ ``finish_gradients``) + AdamW step (fused on
CUDA, foreach on CPU; decay on matrices), the same for all. TFLOP/s use docs/design.md section 5:
``72*B*s*l*h^2*(1 + s/(6h) + V/(12*l*h))`` per step (no recomputation); the fraction of peak
uses the H200's measured 813 TFLOP/s bf16 GEMM ceiling (other GPUs: :mod:`axo4d.training.perf`).
"""
from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time

import torch

from axo4d.dist.comm import Comm
from axo4d.config import ModelConfig, TrainConfig, load_config
from axo4d.dist.grid import Grid
from axo4d.models import apply_compile
from axo4d.models.gpt import GPT
from axo4d.models.plain import PlainGPT
from axo4d.nn.context import LayerContext
from axo4d.nn.schedule import OverlapSchedule
from axo4d.nn.tuner import GemmTuner
from axo4d.spec import gpt_spec
from axo4d.training.trainer import build_optimizer


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m bench.single_gpu", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reduced", action="store_true", help="small CPU shape (fp32)")
    ap.add_argument("--steps", type=int, default=0, help="timed steps (default 10)")
    ap.add_argument("--warmup", type=int, default=0, help="untimed steps (default 3, reduced 2)")
    ap.add_argument("--no-compile", action="store_true", help="skip the torch.compile contenders")
    return ap.parse_args(argv)


def setup(a: argparse.Namespace) -> tuple[ModelConfig, int, torch.device, torch.dtype]:
    if a.reduced:
        cfg = ModelConfig(n_layer=2, n_embd=256, n_head=4, vocab_size=256, seq_len=128, vocab_multiple=64)
        return cfg, 4, torch.device("cpu"), torch.float32
    if not torch.cuda.is_available():
        raise SystemExit("bench.single_gpu: no CUDA device; use --reduced for the CPU shape")
    cfg = load_config("gpt-1.3b").model
    return cfg, 8, torch.device("cuda"), torch.bfloat16


def build(kind: str, cfg: ModelConfig, device: torch.device, compiled: bool):
    """(model, optimizer, loss_fn, finish) for ``kind`` in {'plain', 'axo4d'}."""
    comm = Comm(Grid(), 0, init_groups=False)
    if kind == "axo4d":
        ctx = LayerContext(comm, OverlapSchedule(comm), GemmTuner(comm, verbose=False))
        model = GPT(cfg, ctx).to(device)
        if compiled:
            apply_compile(model)
        opt = build_optimizer(model, TrainConfig(), device)
        return model, opt, model, model.finish_gradients
    model = PlainGPT(cfg, gpt_spec(cfg, Grid()).vocab).to(device)
    decay = [p for p in model.parameters() if p.ndim >= 2]
    other = [p for p in model.parameters() if p.ndim < 2]
    t = TrainConfig()
    kw = {"fused": True} if device.type == "cuda" else {"foreach": True}
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": t.weight_decay}, {"params": other, "weight_decay": 0.0}],
                            lr=t.lr, betas=(t.beta1, t.beta2), eps=t.eps, **kw)
    fwd = torch.compile(model) if compiled else model
    return model, opt, fwd, lambda: None


def one_step(fwd, opt, finish, x, y, device, dtype) -> float:
    """Seconds of one training step (zero_grad, forward, backward, finish, AdamW)."""
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    opt.zero_grad(set_to_none=True)
    with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
        loss = fwd(x, y).float().mean()
    loss.backward()
    finish()
    opt.step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def time_steps(fwd, opt, finish, batches, device, dtype, warmup: int) -> list[float]:
    """Step times after ``warmup`` untimed steps."""
    times = [one_step(fwd, opt, finish, x, y, device, dtype) for x, y in batches]
    return times[warmup:]


def interleaved(contenders: dict, batches, device, dtype, warmup: int) -> dict[str, list[float]]:
    """Step times of every contender, taking turns step by step (a shared machine's load hits all alike)."""
    times: dict[str, list[float]] = {name: [] for name in contenders}
    for i, (x, y) in enumerate(batches):
        for name, (_, opt, fwd, finish) in contenders.items():
            t = one_step(fwd, opt, finish, x, y, device, dtype)
            if i >= warmup:
                times[name].append(t)
    return times


def release(device: torch.device, compiled: bool) -> None:
    if compiled:
        torch._dynamo.reset()          # drop compiled code that still references the model
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def run_all(a, cfg, device, dtype, batches, warmup) -> dict[str, tuple[float, float, float]]:
    """{contender: (median s, min s, peak GiB)}: one after the other on a GPU (memory), interleaved
    on a CPU (load)."""
    kinds = [(k, c) for k, c in (("plain", False), ("plain", True), ("axo4d", False), ("axo4d", True))
             if not (c and a.no_compile)]
    names = [f"{k} {'compiled' if c else 'eager'}" for k, c in kinds]
    if device.type != "cuda":
        contenders = {n: build(k, cfg, device, c) for n, (k, c) in zip(names, kinds)}
        times = interleaved(contenders, batches, device, dtype, warmup)
        return {n: (statistics.median(t), min(t), float("nan")) for n, t in times.items()}
    out = {}
    for n, (k, c) in zip(names, kinds):
        model, opt, fwd, finish = build(k, cfg, device, c)
        t = time_steps(fwd, opt, finish, batches, device, dtype, warmup)
        out[n] = (statistics.median(t), min(t), torch.cuda.max_memory_allocated() / 2**30)
        del model, opt, fwd, finish
        release(device, c)
    return out


def peak(device: torch.device) -> tuple[float, str]:
    if device.type != "cuda":
        return 0.0, "CPU: no stated peak"
    from axo4d.training.perf import GPU_PEAKS_BF16
    name = torch.cuda.get_device_name(device)
    for key, val in GPU_PEAKS_BF16:
        if key in name:
            return val, f"{name}: {val:.0f} TFLOP/s bf16 (docs/design.md s5)"
    return 0.0, f"{name}: no stated peak"


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    cfg, batch, device, dtype = setup(a)
    steps, warmup = a.steps or 10, a.warmup or (2 if a.reduced else 3)
    g = torch.Generator().manual_seed(0)
    batches = [tuple(torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len), generator=g).to(device) for _ in "xy")
               for _ in range(steps + warmup)]
    flops = gpt_spec(cfg, Grid()).flops_per_step(batch)
    pk, pk_src = peak(device)
    print(f"bench.single_gpu: {'reduced ' if a.reduced else ''}GPT {cfg.n_layer} layers, hidden {cfg.n_embd}, "
          f"{cfg.n_head} heads, seq {cfg.seq_len}, vocab {cfg.vocab_size}, micro-batch {batch}, {dtype}, "
          f"{device.type}; grid 1x1x1x1")
    print(f"FLOPs/step = 72*B*s*l*h^2*(1 + s/(6h) + V/(12*l*h)) = {flops:.4g}; step = fwd+bwd+AdamW; peak: {pk_src}")
    rows = {}
    stat = "median" if device.type == "cuda" else "min"      # a shared CPU: the least disturbed step
    print(f"  (TFLOP/s and ratios from the {stat} step time)")
    for name, (med, best, mem) in run_all(a, cfg, device, dtype, batches, warmup).items():
        t = rows[name] = med if stat == "median" else best
        print(f"  {name:16s} median {med * 1e3:9.1f} ms, min {best * 1e3:9.1f} ms  {flops / t / 1e12:8.3f} TFLOP/s"
              + (f"  {100 * flops / t / 1e12 / pk:5.1f}% of peak" if pk else "")
              + (f"  peak mem {mem:.1f} GiB" if device.type == "cuda" else ""), flush=True)
    base = "plain compiled" if "plain compiled" in rows else "plain eager"
    for name, t in rows.items():
        if name.startswith("axo4d"):
            print(f"  ratio {name} / {base} (throughput): {rows[base] / t:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
