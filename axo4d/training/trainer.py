"""One training run's state and step: the library behind ``python -m axo4d.train``.

:class:`Trainer` holds the model, optimizer and dataset of one rank; ``step(i)``
runs optimizer step ``i`` (gradient accumulation, data-parallel reduction,
global-norm clipping, AdamW) and returns its statistics, identical on every
rank. Batches (:class:`~axo4d.training.datasets.batches.StepPlan`: a step's samples
are fixed before they are cut into micro-batches and shards), initialisation and
the LR schedule depend only on the config and the step, never on the grid,
``grad_accum`` or offload.
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass

import numpy as np
import torch

from axo4d.config import RunConfig, TrainConfig
from axo4d.config.errors import TrainError
from axo4d.dist.comm import Comm
from axo4d.facts.run import check_batch as facts_check_batch
from axo4d.nn.fp8_plan import stats_of, weights_restored
from axo4d.nn.goldfish import goldfish_keep
from axo4d.nn.seqsplit import KERNEL, local_part
from axo4d.training.datasets.batches import StepPlan
from axo4d.training.datasets.dataset import Dataset, shard_of
from axo4d.training.optim.build import make_optimizer
from axo4d.training.run_plan import RunPlan, make_plan
from axo4d.training.startup import build_model_on, make_tuner, z_split_of


def lr_at(step: int, t: TrainConfig) -> float:
    """Linear warm-up to ``lr`` over ``warmup_steps``, then cosine decay to ``min_lr``."""
    if step < t.warmup_steps:
        return t.lr * (step + 1) / t.warmup_steps
    decay = t.decay_steps or max(1, t.steps - t.warmup_steps)
    frac = min(1.0, (step - t.warmup_steps) / decay)
    return t.min_lr + 0.5 * (t.lr - t.min_lr) * (1 + math.cos(math.pi * frac))


def check_batch(cfg: RunConfig, comm: Comm) -> int:
    """Global micro-batch size; one clear error when it does not divide
    (:func:`axo4d.facts.run.check_batch`, as the run plan derives it)."""
    t = cfg.train
    z_split = z_split_of(cfg, comm.grid)[0]
    return facts_check_batch(t.global_batch, t.grad_accum, z_split, comm.grid, cfg.model.seq_len)


def compute_dtype(cfg: TrainConfig, device: torch.device) -> torch.dtype:
    if cfg.dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return torch.bfloat16 if cfg.dtype == "bf16" else torch.float32


def fp8_summary(model: torch.nn.Module, cfg: RunConfig) -> str:
    """One line: which linear layers run FP8 GEMMs under ``train.fp8`` / ``train.fp8_layers``."""
    lins = {m.name: m.fp8 is not None for m in model.modules() if hasattr(m, "fp8") and hasattr(m, "block_shape")}
    on = sorted(n for n, v in lins.items() if v)
    t = cfg.train
    return (
        f"train.fp8={t.fp8} (layers: {t.fp8_layers}): FP8 GEMMs in {', '.join(on) or 'no layer'}; "
        f"compute dtype in {', '.join(sorted(n for n, v in lins.items() if not v)) or 'no layer'}"
    )


def moe_stats(model: torch.nn.Module, aux_loss: torch.Tensor) -> dict:
    """The step's MoE record (:attr:`StepStats.moe`): the aux loss and the min/mean/max over every
    (layer, expert) of the tokens it received over the step (global, every micro-step)."""
    counts = model.router_stats.take_counts()  # (layers, E)
    out = {"aux_loss": float(aux_loss)}
    if counts is not None:
        out.update(
            moe_tokens_per_expert_min=int(counts.min()),
            moe_tokens_per_expert_mean=float(counts.mean()),
            moe_tokens_per_expert_max=int(counts.max()),
        )
    return out


@dataclass
class StepStats:
    step: int
    loss: float
    lr: float
    grad_norm: float
    step_time_s: float
    skipped: bool = False
    dropped: float = 0.0
    """Fraction of the step's target tokens Goldfish loss left out (0 when off)."""
    epoch: int = 0
    """The epoch of the step's last sample (0-based)."""
    epoch_fraction: float = 0.0
    """Fraction of that epoch consumed after the step."""
    samples_seen: int = 0
    """Samples consumed after the step (positions of the run's sample stream)."""
    samples: list[int] | None = None
    """The step's sample indices (``data.log_samples``; -1 = an empty slot past the last epoch)."""
    fp8: dict | None = None
    """With train.fp8: this rank's FP8 scale counts of the step (:class:`axo4d.nn.fp8.Fp8Stats`)."""
    moe: dict | None = None
    """Mixture of experts: the step's load-balancing loss ``aux_loss`` (mean over micro-steps,
    before ``router_aux_loss_coef``; ``loss`` includes it times the coefficient when
    ``model.output_router_logits`` is true) and the tokens
    each expert of each layer received over the step's global batch, ``moe_tokens_per_expert_min``
    / ``_mean`` / ``_max`` (:func:`moe_stats`)."""


class Trainer:
    """Model, optimizer and data of one rank for ``cfg`` on the grid of ``comm``."""

    def __init__(
        self,
        cfg: RunConfig,
        comm: Comm,
        dataset: Dataset,
        device: torch.device,
        init_weights: bool = True,
        local_ranks: int = 1,
        run_plan: RunPlan | None = None,
    ) -> None:
        self.cfg, self.comm, self.data, self.device = cfg, comm, dataset, device
        # the run plan (made here when not handed in): its memory check stops the run before
        # anything is allocated when it cannot fit
        self.run_plan = run_plan or make_plan(cfg, comm.grid, device, local_ranks)
        facts = self.run_plan.facts
        self.micro, self.memory = facts.micro_batch, self.run_plan.memory
        self.z_split, why = facts.z_split, facts.z_split_why
        self.split = self.z_split == "sequence" and comm.size("z") > 1  # z splits each sample's sequence
        self.shard, self.n_shards = shard_of(comm.grid, comm.rank)
        if self.split:  # every z rank reads its data shard's whole samples and keeps its chunks
            self.shard, self.n_shards = comm.index("data"), comm.size("data")
            if comm.rank == 0:
                print(
                    f"z splits the sequence ({why}): z rank i holds chunks i and {2 * comm.size('z')}-1-i of "
                    f"{2 * comm.size('z')}; attention: {KERNEL}",
                    flush=True,
                )
        self.dtype = compute_dtype(cfg.train, device)
        self.tuner = make_tuner(cfg, comm)
        seed = cfg.train.seed if init_weights else None
        self.model = build_model_on(cfg, comm, device, seed=seed, tuner=self.tuner, facts=facts)
        self.params = list(self.model.parameters())
        self.fp8_stats = stats_of(self.model)  # None unless some layer runs FP8 GEMMs
        if cfg.train.fp8 != "off" and comm.rank == 0:
            print(fp8_summary(self.model, cfg), flush=True)
        self.opt = make_optimizer(
            self.model, cfg, comm, device, self.dtype, self.memory.device_state_bytes, facts.optimizer
        )
        self.tokens_per_step = cfg.train.global_batch * dataset.seq_len  # targets per step (T of the samples)
        t = cfg.train
        self.plan = StepPlan(dataset, t.global_batch, t.grad_accum, self.shard, self.n_shards, t.epochs)

    def data_state(self, step: int) -> dict:
        """Where the sample stream stands after ``step`` completed steps (a checkpoint's ``data``)."""
        return {"position": self.plan.position(step), **self.data.state}

    def resume_data(self, step: int, state: dict | None, saved_global_batch: int) -> list[str]:
        """Continue the sample stream where a checkpoint of ``step`` left it (``state``: its ``data``;
        older checkpoints: ``step * saved_global_batch``); returns notes on what differs."""
        pos = int(state["position"]) if state and "position" in state else step * saved_global_batch
        self.plan.resume_at(step, pos)
        mine = self.data.state
        return [f"data {k} {state[k]!r} -> {mine[k]!r}" for k in mine if state and k in state and state[k] != mine[k]]

    def settle(self) -> None:
        """Make every parameter current: the sharded optimizer's all-gathers of the last step's
        new weights may still be in flight (they are waited for as the next forward reads each
        weight); anything reading the parameters outside a forward calls this first."""
        self.opt.settle()

    def weights_loaded(self) -> None:
        """The model's weights were replaced from outside (``--init-from``): the optimizer's fp32
        masters follow them, and the FP8 weight scales are recomputed."""
        self.opt.after_load(optimizer_loaded=False)
        weights_restored(self.model, 0)

    def _autocast(self):
        if self.dtype == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.dtype)

    def loss_tokens(self, idx: np.ndarray) -> int:
        """Targets of the step's samples ``idx`` that count in the loss, over all micro-steps and
        ranks: the real ones (not padding), or those of them Goldfish loss keeps. The samples are
        known on every rank, so each counts the whole global batch on the host itself: no
        collective, no device sync."""
        t = self.cfg.train
        if not t.goldfish_k:
            return self.data.targets("train", idx)
        kept = 0
        for micro in range(t.grad_accum):  # the whole global micro-batch, on the host
            b = self.data.batch("train", self.plan.micro_ids(idx, micro))  # (B/accum, T)
            keep = goldfish_keep(b.x, b.y, t.goldfish_k, t.goldfish_h)
            kept += int((keep if b.mask is None else keep & b.mask).sum())
        return kept

    def local(self, *ts: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        """Each ``(B, T)`` tensor of a batch (or None) cut to this z rank's tokens when z splits the
        sequence (:func:`axo4d.nn.seqsplit.local_part`), else as it is. Goldfish's mask is computed
        on the whole samples before this cut, so the hashed context may lie on another z rank."""
        return tuple(t if t is None or not self.split else local_part(t, self.comm, 1) for t in ts)

    def forward_backward(self, step: int) -> torch.Tensor:
        """Accumulate gradients of the global mean loss over all micro-steps (Goldfish loss: the mean
        over the kept targets); returns the loss, a 0-d float64 tensor on the device (no host sync)."""
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        aux_total = torch.zeros((), dtype=torch.float64, device=self.device)
        router_loss = getattr(self.model, "router_loss", None)  # mixture of experts: the aux loss
        t = self.cfg.train
        n = t.grad_accum
        self.epochs, self.idx = self.plan.samples(step)  # (global_batch,): fixed before any cut
        self.real = self.data.targets("train", self.idx)
        self.kept = self.loss_tokens(self.idx)
        for micro in range(n):
            b = self.plan.read(self.idx, micro, self.device)  # (B/(data*z), T)
            keep = goldfish_keep(b.x, b.y, t.goldfish_k, t.goldfish_h) if t.goldfish_k else None  # (B/(data*z), T)
            keep = b.mask if keep is None else (keep if b.mask is None else keep & b.mask)
            x, y, keep, docs = self.local(b.x, b.y, keep, b.documents)  # sequence split: this z rank's tokens
            # only the last micro-step's backward reduces over data (with overlap, in the background)
            with self.model.no_sync() if micro < n - 1 else contextlib.nullcontext():
                with self._autocast():
                    losses = self.model(x, y, loss_mask=keep, documents=docs)  # (B/(data*z), T)
                loss = losses.float().sum() / max(1, self.kept)
                aux = None if router_loss is None else router_loss()  # this rank's part, summed over (z, data)
                if aux is not None:  # logged always; in the loss as model.output_router_logits says
                    weight = self.model.router_loss_weight()
                    loss = loss + weight * aux / n if weight else loss
                    aux_total += aux.detach().double() / n
                loss.backward()
            total += loss.detach().double()
        if router_loss is None:
            return self.comm.all_reduce(total.reshape(1), ("z", "data"))[0]
        both = self.comm.all_reduce(torch.stack([total, aux_total]), ("z", "data"))
        self.aux_loss = both[1]
        return both[0]

    def step(self, step: int) -> StepStats:
        """Optimizer step ``step``. With the sharded optimizer and overlap on, the new weights'
        all-gathers are still in flight on return (the next forward waits for each weight as it
        reads it): call :meth:`settle` before reading the parameters otherwise."""
        t0 = time.perf_counter()
        t = self.cfg.train
        lr = lr_at(step, t)
        self.opt.zero_grad(set_to_none=True)
        loss_t = self.forward_backward(step)  # on the device
        self.model.finish_gradients()  # summed over z and data: final
        if self.opt.queues_step and t.nonfinite == "stop":  # nothing to decide before the update
            return self.step_unsynced(step, lr, loss_t, t0)
        loss = float(loss_t)
        norm = self.opt.grad_norm()
        skipped = False
        if not (math.isfinite(loss) and math.isfinite(norm)):
            if t.nonfinite != "skip":
                raise TrainError(f"non-finite loss {loss} (grad norm {norm}) at step {step}")
            skipped = True
            self.count_skip(step, loss, norm)
            self.opt.skip()
        else:  # sharded and overlapped: the new weights' all-gathers run behind the next forward
            self.opt.update(lr, norm, defer=self.model.schedule.overlapped)
        return self._stats(step, loss, lr, norm, t0, skipped)

    def _stats(self, step: int, loss: float, lr: float, norm: float, t0: float, skipped: bool) -> StepStats:
        if not skipped:
            self.skipped_in_row = 0
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        if self.tuner is not None:
            self.tuner.save()
            self.tuner.print_once()
        dropped = 1.0 - self.kept / max(1, self.real) if self.cfg.train.goldfish_k else 0.0
        p = self.plan.progress(step)
        samples = self.idx.tolist() if self.cfg.data.log_samples else None
        fp8 = self.fp8_stats.take() if self.fp8_stats is not None else None
        moe = moe_stats(self.model, self.aux_loss) if hasattr(self.model, "router_stats") else None
        return StepStats(
            step,
            loss,
            lr,
            norm,
            dt,
            skipped,
            dropped,
            fp8=fp8,
            moe=moe,
            epoch=p["epoch"],
            epoch_fraction=p["epoch_fraction"],
            samples_seen=p["samples_seen"],
            samples=samples,
        )

    def step_unsynced(self, step: int, lr: float, loss_t: torch.Tensor, t0: float) -> StepStats:
        """Norm, clipping and AdamW queued on the device, then loss and norm read once: no host sync
        inside the step (``train.nonfinite='stop'``: a non-finite step stops the run after its update)."""
        norm_t = self.opt.queued_update(lr)
        loss, norm = float(loss_t), float(norm_t)  # waits for the step's work
        if not (math.isfinite(loss) and math.isfinite(norm)):
            raise TrainError(f"non-finite loss {loss} (grad norm {norm}) at step {step}")
        return self._stats(step, loss, lr, norm, t0, False)

    def count_skip(self, step: int, loss: float, norm: float) -> None:
        """Count a skipped step (``train.nonfinite=skip``); TrainError past the caps
        ``train.nonfinite_max_consecutive`` / ``nonfinite_max_total`` (0 = no cap)."""
        t = self.cfg.train
        self.skipped_in_row = getattr(self, "skipped_in_row", 0) + 1
        self.skipped_total = getattr(self, "skipped_total", 0) + 1
        for n, cap, what in (
            (self.skipped_in_row, t.nonfinite_max_consecutive, "in a row"),
            (self.skipped_total, t.nonfinite_max_total, "in this run"),
        ):
            if cap and n >= cap:
                raise TrainError(
                    f"non-finite loss {loss} (grad norm {norm}) at step {step}: {n} steps skipped "
                    f"{what} (train.nonfinite_max_{'consecutive' if what == 'in a row' else 'total'}"
                    f"={cap}): training has diverged"
                )

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean validation loss over ``eval_batches * global_batch`` fixed held-out samples (all of
        them when fewer, or when ``eval_batches`` is 0), the same on every grid and ``grad_accum``."""
        self.model.eval()
        total = torch.zeros(1, dtype=torch.float64, device=self.device)
        idx = self.data.eval_ids(self.cfg.train.eval_batches * self.cfg.train.global_batch)
        idx = np.concatenate([idx, np.full(-len(idx) % self.micro, -1, np.int64)])  # whole micro-batches
        for i in range(0, len(idx), self.micro):
            b = self.data.batch("val", self.plan.rank_ids(idx[i:], 0), self.device)
            x, y, mask, docs = self.local(b.x, b.y, b.mask, b.documents)
            with self._autocast():
                losses = self.model(x, y, loss_mask=mask, documents=docs)
                total += losses.float().sum().double()
        self.model.train()
        self.comm.all_reduce(total, ("z", "data"))
        return float(total[0]) / max(1, self.data.targets("val", idx))
