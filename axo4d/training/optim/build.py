"""The optimizer of a run: ``torch.optim.AdamW`` over the model's parameters, or
:class:`~axo4d.training.optim.sharded.ShardedAdamW` over the slices this rank owns when the
optimizer is sharded (``parallel.shard_optimizer``) or its state offloaded (``train.offload``).
Either advances the FP8 weight scales' update counter after each step it takes
(:class:`axo4d.nn.fp8.WeightScales`): the one signal that the weights changed."""

from __future__ import annotations

import math

import torch
from torch import nn

from axo4d.config import RunConfig, TrainConfig
from axo4d.dist.comm import Comm
from axo4d.facts.placement import placement_of
from axo4d.nn.fp8 import plan_of
from axo4d.training.optim.sharded import ShardedAdamW, shard_optimizer_on


def plain_adamw(model: nn.Module, t: TrainConfig, device: torch.device) -> torch.optim.AdamW:
    """AdamW with decoupled weight decay on matrices only (not norms, biases)."""
    decay = [p for p in model.parameters() if placement_of(p).weight_decay]
    other = [p for p in model.parameters() if not placement_of(p).weight_decay]
    groups = [{"params": decay, "weight_decay": t.weight_decay}, {"params": other, "weight_decay": 0.0}]
    kw = {"fused": True} if device.type == "cuda" else {"foreach": True}
    return torch.optim.AdamW(groups, lr=t.lr, betas=(t.beta1, t.beta2), eps=t.eps, **kw)


def make_optimizer(
    model: nn.Module,
    cfg: RunConfig,
    comm: Comm,
    device: torch.device,
    weights_dtype: torch.dtype,
    device_state_bytes: float = math.inf,
) -> torch.optim.AdamW | ShardedAdamW:
    """The run's optimizer (module docstring); ``device_state_bytes``: what offload 'auto' may keep
    on the device (the memory model's plan); ``weights_dtype``: the compute dtype, in which the
    parameters are kept when the state is offloaded."""
    offload = cfg.train.offload
    if not (shard_optimizer_on(cfg.parallel, comm.grid) or offload != "none"):
        opt = plain_adamw(model, cfg.train, device)
    else:
        opt = ShardedAdamW(
            model,
            comm,
            cfg.train,
            device,
            offload=offload,
            device_state_bytes=device_state_bytes,
            weights_dtype=weights_dtype if offload != "none" else torch.float32,
        )
    fp8 = plan_of(model)
    if fp8 is not None:  # every update the optimizer applies makes the weights' FP8 scales stale
        scales = fp8.weight_scales
        opt.register_step_post_hook(lambda *_: scales.advance())
    return opt


__all__ = ["plain_adamw", "make_optimizer"]
