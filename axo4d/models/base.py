"""What every decoder model on the grid shares: blocks, a head, the schedule, and the features
applied to a built model as small functions (torchtitan's ``parallelize`` style).

A model subclass defines ``embed(idx) -> (B, T, C/x)``, ``self.blocks`` and ``head(x) -> (B, T,
V/y)``; this base runs them under its schedule's forward pass, optionally recomputing each block
(:func:`apply_activation_checkpointing`) and compiling each block (:func:`apply_compile`).
"""
from __future__ import annotations

import contextlib
from typing import Callable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from axo4d.errors import GridError
from axo4d.nn.context import LayerContext
from axo4d.nn.init import init_parameters
from axo4d.nn.linear import Linear3D
from axo4d.nn.loss import vocab_parallel_cross_entropy
from axo4d.spec import ModelSpec


class DecoderLM(nn.Module):
    """Embeddings, ``n_layer`` blocks and a vocabulary-parallel head on the grid of ``ctx``."""

    def __init__(self, spec: ModelSpec, ctx: LayerContext, micro_batch: int | None = None) -> None:
        super().__init__()
        bad = spec.divisibility_reasons(micro_batch)
        if bad:
            raise GridError(f"model does not fit grid {ctx.grid.spec()}: {'; '.join(bad)}")
        self.spec, self.ctx, self.comm, self.schedule = spec, ctx, ctx.comm, ctx.schedule
        self.vocab = spec.vocab
        self.checkpointing = False
        self.blocks = nn.ModuleList()

    def _finish_init(self, seed: int) -> None:
        """Subclasses call this at the end of ``__init__``: initial weights, then the schedule."""
        init_parameters(self, seed, self.comm)
        self.schedule.attach(self.parameters())

    # ---- the model ----------------------------------------------------------------------------------
    def embed(self, idx: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def head(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """``idx``: (B, T) token ids. Returns per-token losses (B, T) if ``targets`` is given,
        else this rank's logits block (B, T, V/y)."""
        if idx.shape[1] > self.spec.seq_len:
            raise ValueError(f"sequence of {idx.shape[1]} tokens longer than seq_len={self.spec.seq_len}")
        with self.schedule.forward_pass(self.training):
            x = self.embed(idx)                                        # (B, T, C/x)
            for block in self.blocks:
                x = checkpoint(block, x, use_reentrant=False) if self.checkpointing and self.training else block(x)
            logits = self.head(x)                                      # (B, T, V/y)
        if targets is None:
            return logits
        return vocab_parallel_cross_entropy(logits, targets, self.comm, self.spec.vocab_size)

    # ---- gradients -------------------------------------------------------------------------------------
    def finish_gradients(self) -> None:
        """Make every gradient final (summed over z and data); call after a step's last backward."""
        self.schedule.finish()

    def no_sync(self) -> contextlib.AbstractContextManager:
        """Accumulation micro-steps: backward passes inside skip the data-parallel reduction."""
        return self.schedule.no_sync()

    def on_gradients_ready(self, fn: Callable[[], None]) -> None:
        """Call ``fn()`` once all gradients of a step are final."""
        self.schedule.on_gradients_ready(fn)

    def num_params(self) -> int:
        """Parameters of the full (unsharded) model, without vocabulary padding."""
        return self.spec.param_count()


# ---- features applied to a built model ---------------------------------------------------------------
def apply_activation_checkpointing(model: DecoderLM) -> DecoderLM:
    """Recompute each block's activations in backward (blocks run under ``torch.utils.checkpoint``)."""
    model.checkpointing = True
    return model


def apply_compile(model: DecoderLM, **kw) -> DecoderLM:
    """``torch.compile`` each block in place (parameter names unchanged); the Linear3D autograd
    function and the grid collectives stay eager (``torch.compiler.disable``). Layers with x, y
    and z of one rank drop the GEMM tuner: they are plain ``F.linear`` then, so on such grids a
    block compiles into one graph."""
    for m in model.blocks.modules():
        if isinstance(m, Linear3D) and m.trivial:
            m.tuner = None
    for block in model.blocks:
        block.compile(**kw)
    return model
