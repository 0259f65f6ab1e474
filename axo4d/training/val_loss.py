"""The validation loss of a model on a dataset's validation samples, outside a training run
(``python -m axo4d.eval``): the same samples and the same mean as the trainer's evaluation
(:meth:`axo4d.training.trainer.Trainer.evaluate`), in batches of ``batch`` samples split over
``(z, data)``. Collective over the model's grid."""

from __future__ import annotations

import contextlib

import numpy as np
import torch

from axo4d.models.base import DecoderLM
from axo4d.training.datasets.dataset import Dataset, shard_of


@torch.no_grad()
def validation_loss(
    model: DecoderLM, data: Dataset, samples: int, batch: int, dtype: torch.dtype | None = None
) -> tuple[float, int]:
    """``(mean loss per target, targets)`` over ``samples`` validation samples (0: all of them),
    ``batch`` samples a forward (rounded up to a multiple of ``G_data * G_z``)."""
    comm, device = model.comm, next(model.parameters()).device
    shard, shards = shard_of(comm.grid, comm.rank)
    per = -(-max(1, batch) // shards)  # samples of this rank a forward
    idx = data.eval_ids(samples)
    idx = np.concatenate([idx, np.full(-len(idx) % (per * shards), -1, np.int64)])  # whole batches; -1: empty
    total = torch.zeros(1, dtype=torch.float64, device=device)
    cast = torch.autocast(device.type, dtype=dtype) if dtype not in (None, torch.float32) else contextlib.nullcontext()
    was_training = model.training
    model.eval()
    try:
        for i in range(0, len(idx), per * shards):
            b = data.batch("val", idx[i + shard * per : i + (shard + 1) * per], device)  # (B/(data*z), T)
            with cast:
                losses = model(b.x, b.y, loss_mask=b.mask, documents=b.documents)  # (B/(data*z), T)
            total += losses.float().sum().double()
    finally:
        model.train(was_training)
    comm.all_reduce(total, ("z", "data"))
    n = data.targets("val", idx)
    return float(total[0]) / max(1, n), n
