"""Loss sanity: axo4d's trainer against plain PyTorch from the same initial weights, same batches.

    python -m bench.loss_sanity                              # GPU: gpt-1.3b from scratch, 20 steps, bf16
    python -m bench.loss_sanity --reduced                    # CPU: gpt-1.3b's layout at hidden 128, 4 layers, fp32
    python -m bench.loss_sanity --set train.warmup_steps=2   # any config key, as for python -m axo4d.train

axo4d: :class:`axo4d.training.trainer.Trainer` on one process (the path of ``python -m
axo4d.train``: the named config, its data, LR schedule, clipping, AdamW, overlap and tuner on).
Plain: :class:`axo4d.models.plain.PlainGPT` loaded with axo4d's initial weights, trained by a loop
written with ``torch.optim.AdamW`` (fused on CUDA; decay on the same parameters),
``torch.nn.utils.clip_grad_norm_`` and ``F.cross_entropy``, the same LR schedule and the same
batches, under the same autocast. Prints both loss curves and gradient norms, the largest
relative loss difference, and the loss a model reaches by predicting token frequencies only
(the unigram entropy of the data).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import sys
import time
from typing import Any

import torch
import torch.nn.functional as F

from axo4d.config import load_config
from axo4d.dist.comm import Comm
from axo4d.facts.archs import get_arch
from axo4d.facts.grid import Grid
from axo4d.facts.placement import placement_of
from axo4d.training.datasets.dataset import open_dataset
from axo4d.training.trainer import Trainer, lr_at

REDUCED = [
    "model.n_layer=4",
    "model.n_embd=128",
    "model.n_head=1",
    "model.seq_len=128",
    "train.dtype=fp32",
    "train.compile=false",
]


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="python -m bench.loss_sanity", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--config", default="gpt-1.3b")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--reduced", action="store_true", help="CPU: " + " ".join(REDUCED))
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override (repeatable)")
    ap.add_argument("--tol", type=float, default=0.0, help="exit 1 if the max relative loss difference exceeds this")
    ap.add_argument("--json", default="", help="also write the figures to this JSON file")
    return ap.parse_args(argv)


def full_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The 1x1x1x1 model's parameters as full tensors (padding rows included), by name."""
    return {n: placement_of(p).assemble([p.detach()], Grid()).clone() for n, p in model.named_parameters()}


def plain_run(cfg, trainer: Trainer, init: dict[str, torch.Tensor], steps: int) -> list[tuple[float, float]]:
    """(loss, grad norm) per step of the plain-PyTorch loop on the trainer's batches."""
    device, t = trainer.device, cfg.train
    model = get_arch(cfg.model.arch).plain_class()(cfg.model, trainer.model.vocab).to(device)
    model.load_state_dict(init)
    decay_of = {n: placement_of(p).weight_decay for n, p in trainer.model.named_parameters()}
    groups = [
        {"params": [p for n, p in model.named_parameters() if decay_of[n]], "weight_decay": t.weight_decay},
        {"params": [p for n, p in model.named_parameters() if not decay_of[n]], "weight_decay": 0.0},
    ]
    opt = torch.optim.AdamW(
        groups,
        lr=t.lr,
        betas=(t.beta1, t.beta2),
        eps=t.eps,
        **({"fused": True} if device.type == "cuda" else {"foreach": True}),
    )
    amp = (
        torch.autocast(device.type, dtype=trainer.dtype) if trainer.dtype != torch.float32 else contextlib.nullcontext()
    )
    out = []
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        total = 0.0
        idx = trainer.plan.samples(step)[1]  # the step's samples, as the trainer takes them
        for micro in range(t.grad_accum):
            b = trainer.data.batch("train", trainer.plan.micro_ids(idx, micro), device)
            x, y = b.x, b.y
            with amp:
                logits = model(x)
            loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), reduction="sum") / trainer.tokens_per_step
            loss.backward()
            total += float(loss.detach())
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip if t.grad_clip > 0 else math.inf)
        for g in opt.param_groups:
            g["lr"] = lr_at(step, t)
        opt.step()
        out.append((total, float(norm)))
    return out


def _print_setup(cfg: Any, tr: Trainer, device: torch.device, ds: Any, ent: float) -> None:
    """Print the run's model, batch, optimizer and data settings."""
    m, t = cfg.model, cfg.train
    print(
        f"bench.loss_sanity: {cfg.name} ({m.n_layer} layers, hidden {m.n_embd}, vocab {m.vocab_size}, seq "
        f"{m.seq_len}), global batch {t.global_batch}, {tr.dtype}, {device.type}; lr {t.lr:g} (warm-up "
        f"{t.warmup_steps}, cosine to {t.min_lr:g} at step {t.steps}), grad_clip {t.grad_clip:g}, weight decay "
        f"{t.weight_decay:g}, init_std {m.init_std:g}; data {ds.name}: unigram entropy {ent:.3f} nats, "
        f"ln(vocab) {math.log(m.vocab_size):.3f}"
    )


def _write_json(
    path: str,
    cfg: Any,
    device: torch.device,
    tr: Trainer,
    ours: list[tuple[float, float]],
    theirs: list[tuple[float, float]],
    worst: float,
    ent: float,
    med: float,
    flops: float,
) -> None:
    """Write the figures to ``path`` (``--json``)."""
    m, t = cfg.model, cfg.train
    with open(path, "w") as f:
        json.dump(
            {
                "config": cfg.name,
                "device": device.type,
                "dtype": str(tr.dtype),
                "axo4d": ours,
                "plain": theirs,
                "max_rel": worst,
                "unigram_entropy": ent,
                "trainer_median_s": med,
                "trainer_tflops": flops / med / 1e12,
                "compile": t.compile,
                "flops_per_step": flops,
                "batch": t.global_batch,
                "seq": m.seq_len,
            },
            f,
            indent=1,
        )


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    device = torch.device("cuda" if torch.cuda.is_available() and not a.reduced else "cpu")
    if device.type == "cpu" and not a.reduced:
        raise SystemExit("bench.loss_sanity: no CUDA device; use --reduced for the CPU shape")
    cfg = load_config(a.config, (REDUCED if a.reduced else []) + [f"train.steps={a.steps}"] + a.set)
    ds = open_dataset(cfg.data, cfg.model.seq_len, cfg.train.seed, cfg.model.vocab_size)
    t0 = time.perf_counter()
    tr = Trainer(cfg, Comm(Grid(), 0, init_groups=False), ds, device)
    init = full_weights(tr.model)
    ours, times = [], []
    for i in range(a.steps):
        s = tr.step(i)
        ours.append((s.loss, s.grad_norm))
        times.append(s.step_time_s)
    t_ours = time.perf_counter() - t0
    flops = tr.model.spec.flops_per_step(cfg.train.global_batch, cfg.train.activation_checkpointing)
    steady = sorted(times[min(3, len(times) - 1) :])
    med = steady[len(steady) // 2]
    del tr.opt  # keep the GPU for the plain run: no AdamW state, no gradients
    tr.model.zero_grad(set_to_none=True)
    theirs = plain_run(cfg, tr, init, a.steps)
    ent, _ = ds.unigram_entropy("train")
    _print_setup(cfg, tr, device, ds, ent)
    t = cfg.train
    print(
        f"  {'step':>4s} {'lr':>9s} {'axo4d loss':>11s} {'plain loss':>11s} {'rel diff':>9s} "
        f"{'axo4d gnorm':>12s} {'plain gnorm':>12s}"
    )
    worst = 0.0
    for i, ((la, ga), (lp, gp)) in enumerate(zip(ours, theirs)):
        rel = abs(la - lp) / abs(lp)
        worst = max(worst, rel)
        print(f"  {i:4d} {lr_at(i, t):9.2e} {la:11.4f} {lp:11.4f} {rel:9.2e} {ga:12.3f} {gp:12.3f}")
    print(
        f"  max relative loss difference axo4d vs plain: {worst:.2e} over {a.steps} steps "
        f"(axo4d {t_ours:.1f} s incl. set-up)"
    )
    print(
        f"  axo4d trainer (Trainer.step, the step of python -m axo4d.train; compile={t.compile}): median step "
        f"{med * 1e3:.1f} ms after step 3 = {flops / med / 1e12:.3f} TFLOP/s ({cfg.model.arch} FLOPs/step "
        f"{flops:.4g}, docs/design.md section 5)"
    )
    if a.json:
        _write_json(a.json, cfg, device, tr, ours, theirs, worst, ent, med, flops)
    return 1 if a.tol and worst > a.tol else 0


if __name__ == "__main__":
    sys.exit(main())
