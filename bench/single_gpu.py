"""axo4d on the 1x1x1x1 grid against plain PyTorch of the same shape, in the same run.

    python -m bench.single_gpu                 # gpt-1.3b, micro-batch 8, seq 2048, bf16 (CUDA)
    python -m bench.single_gpu --config llama3.2-1b --batch 4     # Llama 3.2 1B shape, seq 2048
    python -m bench.single_gpu --reduced       # 2 layers, hidden 256, seq 128, batch 4, fp32 (CPU, < 1 min)
    python -m bench.single_gpu --reduced --config llama-tiny      # the Llama contenders on the CPU
    python -m bench.single_gpu --no-compile    # skip the torch.compile rows

Contenders, each timed on the same random token batches:

* ``plain eager``: :class:`axo4d.models.plain.PlainGPT` / ``PlainLlama`` (nn.Linear, norms, SDPA);
* ``plain compiled``: the same under ``torch.compile`` (whole model) -- the baseline;
* ``hf eager`` / ``hf compiled``: ``transformers``' model of the architecture (``LlamaForCausalLM`` ...) with SDPA;
* ``axo4d eager``: the axo4d model on the 1x1x1x1 grid with the default ``parallel`` settings
  (overlap and tuner on; every collective is skipped on groups of one);
* ``axo4d compiled``: the same with ``train.compile`` (:func:`axo4d.models.apply_compile`: each
  block, and the head with its loss, compiled; on this grid every layer is ``F.linear`` and the
  loss ``F.cross_entropy`` inside those graphs).

On a GPU the contenders run one after the other (memory); on a CPU they take turns step by step
(a machine shared with other jobs then loads all alike). One step = ``zero_grad`` + forward +
backward (+ ``finish_gradients``) + AdamW step (fused on
CUDA, foreach on CPU; decay on matrices), the same for all. TFLOP/s use docs/design.md section 5:
``6*N_matmul*tokens + 12*l*h*s*tokens`` per step (no recomputation; for the GPT this is
``72*B*s*l*h^2*(1 + s/(6h) + V/(12*l*h))``). MFU is against the vendor's dense bf16 peak, and the
fraction of the measured GEMM ceiling is printed beside it (:mod:`axo4d.training.perf`; H200: 989
and 813 TFLOP/s). Peak memory: ``torch.cuda.max_memory_allocated`` per contender.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time

import torch

from axo4d.config import ModelConfig, TrainConfig, load_config
from axo4d.dist.comm import Comm
from axo4d.facts.archs import get_arch, model_spec
from axo4d.facts.grid import Grid
from axo4d.models import apply_compile, build_model
from axo4d.nn.blas_tuner import GemmTuner
from axo4d.nn.context import LayerContext
from axo4d.nn.overlap_schedule import OverlapSchedule
from axo4d.training.optim.build import plain_adamw
from axo4d.training.perf import device_peaks


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="python -m bench.single_gpu", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--reduced", action="store_true", help="small CPU shape (fp32)")
    ap.add_argument("--steps", type=int, default=0, help="timed steps (default 10)")
    ap.add_argument("--warmup", type=int, default=0, help="untimed steps (default 3, reduced 2)")
    ap.add_argument("--no-compile", action="store_true", help="skip the torch.compile contenders")
    ap.add_argument("--config", default="", help="model config (default gpt-1.3b; with --reduced a small GPT)")
    ap.add_argument("--batch", type=int, default=0, help="micro-batch (default 8 on GPU, 4 reduced)")
    ap.add_argument("--seq", type=int, default=0, help="sequence length (default: the config's, 2048 on GPU)")
    ap.add_argument(
        "--only", default="", help="comma-separated contenders to run (e.g. 'plain compiled,axo4d compiled')"
    )
    ap.add_argument("--json", default="", help="also write the figures to this JSON file")
    return ap.parse_args(argv)


def setup(a: argparse.Namespace) -> tuple[ModelConfig, int, torch.device, torch.dtype]:
    import dataclasses

    if a.reduced:
        cfg = (
            load_config(a.config).model
            if a.config
            else ModelConfig(n_layer=2, n_embd=256, n_head=4, vocab_size=256, seq_len=128, vocab_multiple=64)
        )
        cfg = dataclasses.replace(cfg, seq_len=a.seq or cfg.seq_len)
        return cfg, a.batch or 4, torch.device("cpu"), torch.float32
    if not torch.cuda.is_available():
        raise SystemExit("bench.single_gpu: no CUDA device; use --reduced for the CPU shape")
    cfg = load_config(a.config or "gpt-1.3b").model
    return dataclasses.replace(cfg, seq_len=a.seq or 2048), a.batch or 8, torch.device("cuda"), torch.bfloat16


def _hf_model(cfg: ModelConfig):
    """transformers' model of the same architecture and shape (its registry entry's ``config.json``,
    SDPA attention); loss per token."""
    import transformers

    fields = get_arch(cfg.arch).to_hf(cfg, {}, "float32", False)
    hc = transformers.AutoConfig.for_model(fields.pop("model_type"), **fields)
    hf = transformers.AutoModelForCausalLM.from_config(hc, attn_implementation="sdpa")

    class Loss(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.m = hf

        def forward(self, x, y):
            lg = self.m(x).logits
            return torch.nn.functional.cross_entropy(lg.float().flatten(0, 1), y.flatten(), reduction="none").view_as(y)

    return Loss()


def build(kind: str, cfg: ModelConfig, device: torch.device, compiled: bool):
    """(model, optimizer, loss_fn, finish) for ``kind`` in {'plain', 'hf', 'axo4d'}."""
    comm = Comm(Grid(), 0, init_groups=False)
    if kind == "axo4d":
        # compiled on one device: no tuner, the compiler picks the layouts (axo4d.training.startup.make_tuner)
        ctx = LayerContext(comm, OverlapSchedule(comm), None if compiled else GemmTuner(comm, verbose=False))
        model = build_model(cfg, ctx).to(device)
        if compiled:
            apply_compile(model)
        opt = plain_adamw(model, TrainConfig(), device)
        return model, opt, model, model.finish_gradients
    vocab = model_spec(cfg, Grid()).vocab
    if kind == "hf":
        model = _hf_model(cfg).to(device)
    else:
        model = get_arch(cfg.arch).plain_class()(cfg, vocab).to(device)
    decay = [p for p in model.parameters() if p.ndim >= 2]
    other = [p for p in model.parameters() if p.ndim < 2]
    t = TrainConfig()
    kw = {"fused": True} if device.type == "cuda" else {"foreach": True}
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": t.weight_decay}, {"params": other, "weight_decay": 0.0}],
        lr=t.lr,
        betas=(t.beta1, t.beta2),
        eps=t.eps,
        **kw,
    )
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
        torch._dynamo.reset()  # drop compiled code that still references the model
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def _have_transformers() -> bool:
    try:
        import transformers  # noqa: F401

        return True
    except ImportError:
        return False


def run_all(a, cfg, device, dtype, batches, warmup) -> dict[str, tuple[float, float, float]]:
    """{contender: (median s, min s, peak GiB)}: one after the other on a GPU (memory), interleaved
    on a CPU (load)."""
    hf = ("hf",) if _have_transformers() else ()
    kinds = [(k, c) for k in ("plain", *hf, "axo4d") for c in (False, True) if not (c and a.no_compile)]
    names = [f"{k} {'compiled' if c else 'eager'}" for k, c in kinds]
    if a.only:
        keep = {n.strip() for n in a.only.split(",")}
        kinds, names = [kc for kc, n in zip(kinds, names) if n in keep], [n for n in names if n in keep]
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


def _print_ratios(rows: dict[str, float], c: dict[str, dict]) -> None:
    """Print each axo4d contender's throughput (and peak memory) ratio to the plain and HF baselines."""
    for base in (
        "plain compiled" if "plain compiled" in rows else "plain eager",
        "hf compiled" if "hf compiled" in rows else "hf eager",
    ):
        for name, t in rows.items():
            if name.startswith("axo4d") and base in rows:
                print(f"  ratio {name} / {base} (throughput): {rows[base] / t:.3f}")
                if c[name]["peak_gib"] is not None:
                    print(f"  ratio {name} / {base} (peak memory): {c[name]['peak_gib'] / c[base]['peak_gib']:.3f}")


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    cfg, batch, device, dtype = setup(a)
    steps, warmup = a.steps or 10, a.warmup or (2 if a.reduced else 3)
    g = torch.Generator().manual_seed(0)
    batches = [
        tuple(torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len), generator=g).to(device) for _ in "xy")
        for _ in range(steps + warmup)
    ]
    spec = model_spec(cfg, Grid())
    flops = spec.flops_per_step(batch)
    peaks = device_peaks(device, dtype)
    print(
        f"bench.single_gpu: {'reduced ' if a.reduced else ''}{cfg.arch} {cfg.n_layer} layers, hidden {cfg.n_embd}, "
        f"{cfg.n_head} heads, seq {cfg.seq_len}, vocab {cfg.vocab_size}, {spec.param_count() / 1e9:.3f}B params, "
        f"micro-batch {batch}, {dtype}, {device.type}; grid 1x1x1x1"
    )
    print(f"FLOPs/step = {spec.flops_formula()} = {flops:.4g}; step = fwd+bwd+AdamW")
    print(f"  {peaks.describe()}")
    rows, report = (
        {},
        {
            "config": a.config or ("reduced" if a.reduced else "gpt-1.3b"),
            "batch": batch,
            "seq": cfg.seq_len,
            "flops_per_step": flops,
            "vendor_peak": peaks.vendor,
            "gemm_ceiling": peaks.ceiling,
            "contenders": {},
        },
    )
    stat = "median" if device.type == "cuda" else "min"  # a shared CPU: the least disturbed step
    print(f"  (TFLOP/s and ratios from the {stat} step time)")
    for name, (med, best, mem) in run_all(a, cfg, device, dtype, batches, warmup).items():
        t = rows[name] = med if stat == "median" else best
        tf = flops / t / 1e12
        mfu, frac = peaks.mfu(tf), peaks.ceiling_frac(tf)
        report["contenders"][name] = {
            "median_s": med,
            "min_s": best,
            "tflops": tf,
            "mfu": mfu,
            "gemm_ceiling_frac": frac,
            "peak_gib": mem if device.type == "cuda" else None,
        }
        print(
            f"  {name:16s} median {med * 1e3:9.1f} ms, min {best * 1e3:9.1f} ms  {tf:8.3f} TFLOP/s"
            + (f"  MFU {100 * mfu:5.1f}%" if mfu is not None else "  MFU n/a")
            + (f"  {100 * frac:5.1f}% of GEMM ceiling" if frac is not None else "")
            + (f"  peak mem {mem:.1f} GiB" if device.type == "cuda" else ""),
            flush=True,
        )
    _print_ratios(rows, report["contenders"])
    if a.json:
        with open(a.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
