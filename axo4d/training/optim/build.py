"""The optimizer of a run, one interface for its three modes (the run plan's ``optimizer``):
:class:`PlainAdamW` (``torch.optim.AdamW`` over the model's parameters) for 'plain', or
:class:`~axo4d.training.optim.sharded.ShardedAdamW` over the slices this rank owns for 'sharded'
(``parallel.shard_optimizer``) and 'offload' (``train.offload``).

The interface the trainer uses (:class:`RunOptimizer`): ``zero_grad``, ``grad_norm()`` (the global
norm, identical on every rank), ``update(lr, norm, defer)`` (clip to ``train.grad_clip`` and step),
``skip()`` (a non-finite step not taken), ``settle()`` (weights current before they are read outside
a forward), ``after_load(optimizer_loaded)`` (after weights were replaced), and ``queues_step``:
whether :meth:`PlainAdamW.queued_update` can run norm, clipping and the step on the device with no
host sync (``train.nonfinite='stop'``).

Every mode advances the FP8 weight scales' update counter after each step it takes
(:class:`axo4d.nn.fp8.WeightScales`): the one signal that the weights changed."""

from __future__ import annotations

import math
from typing import Protocol

import torch
from torch import nn

from axo4d.config import RunConfig, TrainConfig
from axo4d.dist.comm import Comm
from axo4d.facts.placement import placement_of
from axo4d.facts.run import OptimizerMode, optimizer_mode
from axo4d.nn.fp8_plan import plan_of
from axo4d.nn.grads import clip_gradients, clip_gradients_, global_grad_norm, grad_norm_tensor
from axo4d.training.optim.owned import adamw_kernel
from axo4d.training.optim.sharded import ShardedAdamW


class RunOptimizer(Protocol):
    """What the trainer calls on every optimizer mode (module docstring)."""

    queues_step: bool

    def zero_grad(self, set_to_none: bool = True) -> None: ...

    def grad_norm(self) -> float: ...

    def update(self, lr: float, norm: float, defer: bool = False) -> None: ...

    def skip(self) -> None: ...

    def settle(self) -> None: ...

    def after_load(self, optimizer_loaded: bool) -> None: ...


def _groups(model: nn.Module, t: TrainConfig) -> list[dict]:
    """Decoupled weight decay on matrices only (not norms, biases)."""
    decay = [p for p in model.parameters() if placement_of(p).weight_decay]
    other = [p for p in model.parameters() if not placement_of(p).weight_decay]
    return [{"params": decay, "weight_decay": t.weight_decay}, {"params": other, "weight_decay": 0.0}]


def plain_adamw(model: nn.Module, t: TrainConfig, device: torch.device) -> torch.optim.AdamW:
    """AdamW with decoupled weight decay on matrices only (not norms, biases)."""
    return torch.optim.AdamW(_groups(model, t), lr=t.lr, betas=(t.beta1, t.beta2), eps=t.eps, **adamw_kernel())


class PlainAdamW(torch.optim.AdamW):
    """:func:`plain_adamw` behind the run-optimizer interface: every rank updates its whole shards
    of the parameters; the global norm is an all-reduce over the parameters' split axes."""

    queues_step = True

    def __init__(self, model: nn.Module, comm: Comm, t: TrainConfig, device: torch.device) -> None:
        super().__init__(_groups(model, t), lr=t.lr, betas=(t.beta1, t.beta2), eps=t.eps, **adamw_kernel())
        self.comm, self.grad_clip = comm, t.grad_clip
        self.params = list(model.parameters())

    def grad_norm(self) -> float:
        return global_grad_norm(self.params, self.comm)

    def _set_lr(self, lr: float) -> None:
        for g in self.param_groups:
            g["lr"] = lr

    def update(self, lr: float, norm: float, defer: bool = False) -> None:
        """Clip to ``train.grad_clip`` against ``norm``, then AdamW (``defer``: nothing to defer)."""
        clip_gradients(self.params, self.grad_clip, norm)
        self._set_lr(lr)
        self.step()

    def queued_update(self, lr: float) -> torch.Tensor:
        """Norm, clipping and AdamW queued on the device; returns the norm (0-d, not read)."""
        norm = grad_norm_tensor(self.params, self.comm)
        clip_gradients_(self.params, self.grad_clip, norm)
        self._set_lr(lr)
        self.step()
        return norm

    def skip(self) -> None:
        """A step not taken: nothing changes."""

    def settle(self) -> None:
        """Nothing in flight."""

    def after_load(self, optimizer_loaded: bool) -> None:
        """The parameters are the masters: nothing to copy."""


def make_optimizer(
    model: nn.Module,
    cfg: RunConfig,
    comm: Comm,
    device: torch.device,
    weights_dtype: torch.dtype,
    device_state_bytes: float = math.inf,
    mode: OptimizerMode | None = None,
) -> PlainAdamW | ShardedAdamW:
    """The run's optimizer (module docstring); ``device_state_bytes``: what offload 'auto' may keep
    on the device (the memory model's plan); ``weights_dtype``: the compute dtype, in which the
    parameters are kept when the state is offloaded; ``mode``: the run plan's optimizer mode
    (:func:`axo4d.facts.run.optimizer_mode`, derived here when not given)."""
    offload = cfg.train.offload
    if (mode or optimizer_mode(cfg, comm.grid)) == "plain":
        opt: PlainAdamW | ShardedAdamW = PlainAdamW(model, comm, cfg.train, device)
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


__all__ = ["RunOptimizer", "PlainAdamW", "plain_adamw", "make_optimizer"]
