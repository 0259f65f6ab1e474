"""Which samples a step trains on, and which of them this rank reads.

A run's training samples are one stream of positions (:mod:`axo4d.training.datasets.order` maps a
position to ``(epoch, sample)``). Step ``s`` takes the ``global_batch`` positions after those of
the steps before it -- a fixed list of sample indices, a pure function of the seed and the
position -- and only then is the list cut into ``grad_accum`` micro-batches, and each micro-batch
into ``data * z`` shards (rank shard ``i`` reads the ``i``-th contiguous piece). So
``grad_accum``, the micro-batch size, the grid, offload and the number of ranks never change which
samples a step sees, and a resume needs only the step and the position it starts from
(:attr:`StepPlan.origin`), on any grid and even with another ``global_batch``.

With ``train.epochs`` the stream ends after that many epochs; the last step's positions past the
end are empty samples (masked out of the loss), so every sample is trained exactly that often.
"""

from __future__ import annotations

import math

import numpy as np

from axo4d.config import TrainConfig
from axo4d.config.errors import DataError
from axo4d.training.datasets.dataset import Batch, Dataset


def steps_for_epochs(epochs: float, epoch_size: int, global_batch: int) -> int:
    """Optimizer steps that train ``epochs`` epochs of ``epoch_size`` samples."""
    return max(1, math.ceil(int(epochs * epoch_size + 1e-9) / global_batch))


def run_length(t: TrainConfig, epoch_size: int) -> str:
    """How long the run is, in steps and epochs (``t``: the train config). With ``train.epochs`` the
    last step's slots past the end stay empty, so the steps hold a little more than the epochs."""
    if not t.epochs:
        return f"{t.steps} steps ({t.steps * t.global_batch / epoch_size:.3g} epochs of {epoch_size:,} samples)"
    samples = int(t.epochs * epoch_size + 1e-9)
    empty = t.steps * t.global_batch - samples
    return (
        f"train.epochs={t.epochs:g}: {samples:,} samples ({epoch_size:,} an epoch) in {t.steps} steps, "
        f"the last step's {empty} slot(s) past the end left empty"
    )


class StepPlan:
    """The samples of every step of a run (module docstring), and this rank's part of them."""

    def __init__(
        self,
        data: Dataset,
        global_batch: int,
        grad_accum: int,
        shard: int = 0,
        n_shards: int = 1,
        epochs: float = 0.0,
    ) -> None:
        micro = global_batch // grad_accum
        if global_batch < 1 or global_batch % grad_accum or micro % n_shards:
            raise DataError(
                f"global batch {global_batch} does not cut into {grad_accum} micro-batches of a multiple of "
                f"{n_shards} batch shards (data*z)"
            )
        self.data, self.global_batch, self.grad_accum, self.micro = data, global_batch, grad_accum, micro
        self.shard, self.n_shards, self.local = shard, n_shards, micro // n_shards
        self.end = int(epochs * data.epoch_size + 1e-9) if epochs else None
        self.origin = (0, 0)
        """``(step, position)``: the step the plan counts from and the stream position it starts at."""

    def resume_at(self, step: int, position: int) -> None:
        """Count from ``step``, which starts at stream position ``position`` (a checkpoint's)."""
        self.origin = (int(step), int(position))

    def position(self, step: int) -> int:
        """Stream position of step ``step``'s first sample."""
        s0, p0 = self.origin
        if step < s0:
            raise DataError(f"step {step} is before the step {s0} this run resumed at")
        return p0 + (step - s0) * self.global_batch

    def samples(self, step: int) -> tuple[np.ndarray, np.ndarray]:
        """``(epoch, sample)`` of the step's ``global_batch`` positions; sample -1 past the end."""
        pos = self.position(step) + np.arange(self.global_batch, dtype=np.int64)
        epoch, idx = self.data.order.at(pos)
        if self.end is not None:
            idx = np.where(pos < self.end, idx, -1)
        return epoch, idx

    def micro_ids(self, idx: np.ndarray, micro: int) -> np.ndarray:
        """The samples of micro-batch ``micro`` of a step's samples ``idx``: ``(global_batch/grad_accum,)``."""
        return idx[micro * self.micro : (micro + 1) * self.micro]

    def rank_ids(self, idx: np.ndarray, micro: int) -> np.ndarray:
        """This rank's shard of micro-batch ``micro``: ``(global_batch/grad_accum/(data*z),)``."""
        m = self.micro_ids(idx, micro)
        return m[self.shard * self.local : (self.shard + 1) * self.local]

    def read(self, idx: np.ndarray, micro: int, device=None) -> Batch:
        return self.data.batch("train", self.rank_ids(idx, micro), device)

    def progress(self, step: int) -> dict:
        """After step ``step``: samples consumed, the epoch its last sample is from, and the fraction
        of that epoch consumed."""
        done = self.position(step) + self.global_batch
        if self.end is not None:
            done = min(done, self.end)
        n = self.data.epoch_size
        epoch = max(0, done - 1) // n
        return {"samples_seen": done, "epoch": epoch, "epoch_fraction": (done - epoch * n) / n}
