"""The protocol on the grid: one starting model, then for every seed and arm, E epochs of training on
the treated buckets with every bucket measured before training and after each epoch.

Measuring (:func:`measure`): each document's first ``prefix`` tokens are the prompt; ``suffix``
tokens are generated greedily (argmax, ties to the lowest id; :func:`axo4d.models.generation.generate`,
prompts split over ``data`` and ``z``), always all of them (no stop at an end-of-text token), in the
training compute dtype; a document is an **exact match** when all ``suffix`` tokens equal its own,
and its **token match** is the fraction of positions that do.

Training (:meth:`Study.train_arm`): the :class:`~axo4d.training.trainer.Trainer` on
:class:`~axo4d.memorization.documents.DocumentEpochs` (each treated document once per epoch, as
one sample), from the starting model's weights, with ``train.goldfish_k = k`` for a Goldfish arm.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from axo4d.config import RunConfig
from axo4d.config.errors import DataError
from axo4d.dist.comm import Comm
from axo4d.memorization.documents import CONTROL, Corpus, DocumentEpochs, assign_buckets
from axo4d.memorization.study_config import StudyConfig
from axo4d.models import DecoderLM
from axo4d.models.generation import Sampling, generate
from axo4d.training.datasets.dataset import TokenDataset
from axo4d.training.init_from import load_init_weights
from axo4d.training.startup import build_model_on, make_tuner
from axo4d.training.trainer import Trainer, compute_dtype


@dataclass
class Size:
    """One model of the study (one point of a size sweep)."""

    name: str
    """The config name or Hugging Face folder it came from."""
    cfg: RunConfig
    init_from: str | None = None
    """A Hugging Face folder (or axo4d checkpoint) the weights come from; None = from scratch."""


@dataclass
class ArmRun:
    """One arm trained under one seed: every document's results after each epoch (row 0: before)."""

    seed: int
    arm: str
    k: int
    buckets: list[str]
    epochs: list[int]
    """The measured epochs (``study.measured_epochs``; 0 = before training): rows of the arrays."""
    exact: np.ndarray
    """``(len(epochs), M)`` bool."""
    token: np.ndarray
    """``(len(epochs), M)`` float: fraction of the suffix's positions generated right."""
    losses: list[float] = field(default_factory=list)
    dropped: float = 0.0
    seconds: float = 0.0


@dataclass
class SizeResult:
    name: str
    params: int
    start: str
    """How the starting model was made (in words)."""
    runs: list[ArmRun]
    pretrain: dict | None = None
    seconds: float = 0.0


@torch.no_grad()
def measure(
    model: DecoderLM, docs: np.ndarray, prefix: int, suffix: int, dtype: torch.dtype, batch: int = 0
) -> tuple[np.ndarray, np.ndarray]:
    """``(exact (M,) bool, token match (M,) float)`` of greedy continuations of ``docs[:, :prefix]``
    against ``docs[:, prefix:prefix + suffix]``; collective over the model's grid."""
    device = next(model.parameters()).device
    batch = batch or len(docs)
    got = []
    ctx = torch.autocast(device.type, dtype=dtype) if dtype != torch.float32 else contextlib.nullcontext()
    for i in range(0, len(docs), batch):
        prompts = [d[:prefix].tolist() for d in docs[i : i + batch]]
        with ctx:
            got += generate(
                model,
                prompts,
                suffix,
                Sampling(greedy=True),
                eos_id=None,
                dtype=None if dtype == torch.float32 else dtype,
            )
    same = np.asarray(got, dtype=np.int64) == docs[:, prefix : prefix + suffix]  # (M, suffix)
    return same.all(1), same.mean(1)


def pretrain_data(cfg: RunConfig, corpus: Corpus, steps: int) -> TokenDataset:
    """The rest of the corpus as pre-training windows; :class:`DataError` naming study.pretrain_steps
    when it is too short for them."""
    try:
        return TokenDataset(
            corpus.rest, cfg.model.seq_len, cfg.data.val_fraction, cfg.train.seed, name="the rest of the corpus"
        )
    except DataError as e:
        raise DataError(f"study.pretrain_steps={steps}: {e}") from None


class Study:
    """The protocol of one study config on the grid of ``comm`` (``log``: rank 0's progress lines)."""

    def __init__(
        self,
        study: StudyConfig,
        comm: Comm,
        device: torch.device,
        local_ranks: int = 1,
        log: Callable[[str], None] = print,
    ) -> None:
        self.study, self.comm, self.device, self.local_ranks, self.log = study, comm, device, local_ranks, log

    def run(self, size: Size, corpus: Corpus) -> SizeResult:
        t0 = time.perf_counter()
        model, start, pretrain = self.starting_model(size, corpus)
        params = model.num_params()
        dtype = compute_dtype(size.cfg.train, self.device)
        s = self.study
        exact0, token0 = measure(model, corpus.tokens, s.prefix, s.suffix, dtype, s.generate_batch)
        state = {n: p.detach().clone() for n, p in model.named_parameters()}
        del model
        self.log(
            f"[{size.name}] {params / 1e6:.3g}M parameters, {start}; before training: exact match "
            f"{exact0.mean():.3f} ({int(exact0.sum())}/{len(exact0)} documents)"
        )
        runs = []
        for seed in s.seed_list:
            buckets = assign_buckets(s, seed)
            for arm, k in s.arms:
                runs.append(self.train_arm(size, corpus, state, buckets, seed, arm, k, exact0, token0))
        return SizeResult(size.name, params, start, runs, pretrain, time.perf_counter() - t0)

    # ---- the starting model ------------------------------------------------------------------
    def starting_model(self, size: Size, corpus: Corpus) -> tuple[DecoderLM, str, dict | None]:
        """The model every arm starts from: random (``train.seed``) or ``--init-from``, then
        ``study.pretrain_steps`` on the rest of the corpus."""
        cfg, steps = size.cfg, self.study.pretrain_steps
        start = (
            f"weights of {size.init_from}" if size.init_from else f"random initialisation (train.seed={cfg.train.seed})"
        )
        if not steps:
            seed = None if size.init_from else cfg.train.seed
            model = build_model_on(cfg, self.comm, self.device, seed=seed, tuner=make_tuner(cfg, self.comm))
            if size.init_from:
                load_init_weights(model, size.init_from, self.comm)
            return model, start, None
        data = pretrain_data(cfg, corpus, steps)
        pcfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, steps=steps, goldfish_k=0))
        tr = Trainer(
            pcfg, self.comm, data, self.device, init_weights=size.init_from is None, local_ranks=self.local_ranks
        )
        if size.init_from:
            load_init_weights(tr.model, size.init_from, self.comm)
            tr.weights_loaded()
        t0 = time.perf_counter()
        losses = []
        for i in range(steps):
            losses.append(tr.step(i).loss)
            if i == 0:
                self.comm.set_timeout(cfg.parallel.timeout_s)
            if (i + 1) % max(1, steps // 5) == 0 or i == steps - 1:
                self.log(f"[{size.name}] pre-training step {i + 1}/{steps}: loss {losses[-1]:.4f}")
        val = tr.evaluate()
        span = cfg.model.seq_len + 1  # a pre-training window: input and target
        windows_dropped, windows = corpus.windows_dropped(span)
        info = {
            "steps": steps,
            "tokens": len(corpus.rest),
            "span": span,
            "windows_dropped": windows_dropped,
            "windows": windows,
            "first_loss": losses[0],
            "last_loss": losses[-1],
            "val_loss": val,
            "seconds": time.perf_counter() - t0,
        }
        self.log(
            f"[{size.name}] pre-trained {steps} steps on {len(corpus.rest):,} tokens outside the study: "
            f"loss {losses[0]:.3f} -> {losses[-1]:.3f}, validation loss {val:.3f}"
        )
        return tr.model, start + f", then {steps} steps on the rest of the corpus", info

    # ---- one arm under one seed --------------------------------------------------------------
    def arm_config(self, cfg: RunConfig, k: int, steps: int) -> RunConfig:
        t, s = cfg.train, self.study
        lr = s.lr or t.lr
        return dataclasses.replace(
            cfg,
            train=dataclasses.replace(  # constant after warm-up: epochs alike
                t,
                steps=steps,
                lr=lr,
                min_lr=lr,
                warmup_steps=min(t.warmup_steps, steps),
                decay_steps=0,
                goldfish_k=k,
                goldfish_h=s.goldfish_h,
            ),
        )

    def train_arm(
        self,
        size: Size,
        corpus: Corpus,
        state: dict,
        buckets: list[str],
        seed: int,
        arm: str,
        k: int,
        exact0: np.ndarray,
        token0: np.ndarray,
    ) -> ArmRun:
        s, t0 = self.study, time.perf_counter()
        treated = np.array([b != CONTROL for b in buckets])
        data = DocumentEpochs(corpus.tokens[treated], size.cfg.train.global_batch, size.cfg.train.grad_accum, seed)
        cfg = self.arm_config(size.cfg, k, s.epochs * data.steps_per_epoch)
        tr = Trainer(cfg, self.comm, data, self.device, init_weights=False, local_ranks=self.local_ranks)
        with torch.no_grad():
            for n, p in tr.model.named_parameters():
                p.copy_(state[n])
        tr.weights_loaded()
        measured = s.measured_epochs
        run = ArmRun(
            seed,
            arm,
            k,
            buckets,
            measured,
            np.zeros((len(measured), len(buckets)), bool),
            np.zeros((len(measured), len(buckets))),
        )
        run.exact[0], run.token[0] = exact0, token0
        dropped = []
        for epoch in range(1, s.epochs + 1):
            for i in range(data.steps_per_epoch):
                st = tr.step((epoch - 1) * data.steps_per_epoch + i)
                run.losses.append(st.loss)
                dropped.append(st.dropped)
                if epoch == 1 and i == 0:  # set up and warmed: a hung rank now stops the others quickly
                    self.comm.set_timeout(size.cfg.parallel.timeout_s)
            if epoch not in measured:
                continue
            row = measured.index(epoch)
            run.exact[row], run.token[row] = measure(
                tr.model, corpus.tokens, s.prefix, s.suffix, tr.dtype, s.generate_batch
            )
            tr.model.train()
            self.log(
                f"[{size.name}] seed {seed} {arm} epoch {epoch}/{s.epochs}: loss {run.losses[-1]:.4f} | exact "
                f"match treated {run.exact[row][treated].mean():.3f}, control "
                f"{run.exact[row][~treated].mean():.3f} | {time.perf_counter() - t0:.0f} s"
            )
        run.dropped = float(np.mean(dropped))
        run.seconds = time.perf_counter() - t0
        return run
