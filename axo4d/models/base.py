"""What every decoder model on the grid shares: blocks, a head, the schedule, and the features
applied to a built model as small functions (torchtitan's ``parallelize`` style).

A model subclass defines ``embed(idx, positions) -> ((B, T, C/(x*y)), extra block arguments)``,
``self.blocks`` (each called ``block(x, *extra, documents)`` in training, ``block(x, *extra,
decoding=...)`` when decoding) and ``head(x) -> (B, T, V/(x*y))``;
this base runs them under its schedule's forward pass, optionally recomputing each block
(:func:`apply_activation_checkpointing`) and compiling each block (:func:`apply_compile`).
"""

from __future__ import annotations

import contextlib
from typing import Callable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from axo4d.config.errors import GridError
from axo4d.dist.eager import prepare_for_compile
from axo4d.facts.spec import ModelSpec
from axo4d.nn.attention import Decoding, document_positions
from axo4d.nn.context import LayerContext
from axo4d.nn.init import init_parameters
from axo4d.nn.loss import vocab_parallel_cross_entropy
from axo4d.nn.seqsplit import SequenceSplit


class DecoderLM(nn.Module):
    """Embeddings, ``n_layer`` blocks and a vocabulary-parallel head on the grid of ``ctx``."""

    def __init__(self, spec: ModelSpec, ctx: LayerContext, micro_batch: int | None = None) -> None:
        super().__init__()
        bad = spec.divisibility_reasons(micro_batch)
        if bad:
            raise GridError(f"model does not fit grid {ctx.grid.spec()}: {'; '.join(bad)}")
        self.spec, self.ctx, self.comm, self.schedule = spec, ctx, ctx.comm, ctx.schedule
        self.vocab = spec.vocab
        self.blocks = nn.ModuleList()

    def _finish_init(self, seed: int | None) -> None:
        """Subclasses call this at the end of ``__init__``: initial weights (``seed=None``: zeros,
        for a caller that loads weights next), then the schedule."""
        if seed is not None:
            init_parameters(self, seed, self.comm)
        self.schedule.attach(self.parameters())

    @property
    def split_sequence(self) -> bool:
        """Whether z splits every sample's sequence (``parallel.z_split``) rather than the batch."""
        return self.ctx.z_split == "sequence" and self.comm.size("z") > 1

    # ---- the model ----------------------------------------------------------------------------------
    def embed(self, idx: torch.Tensor, positions: torch.Tensor | None) -> tuple[torch.Tensor, tuple]:
        """``(x (B, T, C/(x*y)), extra block arguments)``; ``positions`` (B, T) when decoding, else
        ``None`` (positions 0..T-1)."""
        raise NotImplementedError

    def head(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def forward(
        self,
        idx: torch.Tensor,
        targets: torch.Tensor | None = None,
        *,
        decoding: Decoding | None = None,
        loss_mask: torch.Tensor | None = None,
        documents: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``idx``: (B, T) token ids. Returns per-token losses (B, T) if ``targets`` is given,
        else this rank's logits block (B, T, V/(x*y)). ``decoding``: generation with KV caches.
        ``loss_mask``: bool (B, T), targets that count (False: loss 0, no gradient; Goldfish loss,
        padding). ``documents``: (B, T) the document of each token of a packed sequence: attention
        stays inside documents and positions restart at each (``data.document_mask``).
        With :attr:`split_sequence` (training and evaluation), ``idx``, ``targets``, ``loss_mask``
        and ``documents`` hold this z rank's tokens of every sample (:func:`axo4d.nn.seqsplit.local_part`),
        and so do the losses and logits returned."""
        limit = self.spec.seq_len if decoding is None else decoding.caches[0].k.shape[2]
        if idx.shape[1] > limit:
            raise ValueError(f"sequence of {idx.shape[1]} tokens longer than seq_len={limit}")
        if documents is not None and decoding is not None:
            raise ValueError("documents are for training and evaluation, not decoding")
        with self.schedule.forward_pass(self.training):
            positions = decoding.positions if decoding is not None else None
            if decoding is None and self.split_sequence:
                documents = SequenceSplit.of(self.comm, idx.shape[1], documents, idx.device)
                positions = documents.positions  # (T/z,) true positions
                if documents.documents is not None:
                    positions = document_positions(documents.documents)[:, positions]  # (B, T/z)
            elif documents is not None:
                positions = document_positions(documents)  # (B, T)
            x, extra = self.embed(idx, positions)  # (B, T, C/(x*y))
            for block in self.blocks:
                x = block(x, *extra, documents) if decoding is None else block(x, *extra, decoding=decoding)
            if targets is None:
                return self.head(x)  # (B, T, V/(x*y))
            return self.head_loss(x, targets, loss_mask)  # (B, T)

    def head_loss(self, x: torch.Tensor, targets: torch.Tensor, loss_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Per-token losses (B, T) of the head's logits (:func:`apply_compile` compiles this whole)."""
        return vocab_parallel_cross_entropy(self.head(x), targets, self.comm, self.spec.vocab_size, loss_mask)

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
class Recomputed(nn.Module):
    """A block whose activations are recomputed in backward (``torch.utils.checkpoint``, not
    reentrant) when it runs in training with autograd on; decoding and evaluation call the block
    itself. The wrapper holds the block's own children and parameters, so parameter names
    (``blocks.0.attn.qkv.weight``), placements and checkpoints are those of the unwrapped model."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        object.__setattr__(self, "inner", block)  # not a child: its children are the wrapper's
        for name, child in block.named_children():
            self.add_module(name, child)
        for name, p in block.named_parameters(recurse=False):
            self.register_parameter(name, p)
        for name, b in block.named_buffers(recurse=False):
            self.register_buffer(name, b)

    def forward(self, x: torch.Tensor, *extra, decoding: Decoding | None = None) -> torch.Tensor:
        if decoding is not None:
            return self.inner(x, *extra, decoding=decoding)
        if not (self.training and torch.is_grad_enabled()):
            return self.inner(x, *extra)
        return checkpoint(self.inner, x, *extra, use_reentrant=False)


def apply_activation_checkpointing(model: DecoderLM) -> DecoderLM:
    """Recompute each block's activations in backward: every block is replaced by a
    :class:`Recomputed` wrapper of itself (names unchanged)."""
    for i, block in enumerate(model.blocks):
        if not isinstance(block, Recomputed):
            model.blocks[i] = Recomputed(block)
    return model


def apply_compile(model: DecoderLM, **kw) -> DecoderLM:
    """``torch.compile`` each block in place (parameter names unchanged; inside a
    :class:`Recomputed` wrapper, the block it recomputes) and the head with its loss
    (:meth:`DecoderLM.head_loss`); the Linear3D autograd function, the vocabulary-parallel loss and
    the grid collectives stay eager (``@eager``: ``torch.compiler.disable``). A model meant to be compiled on a
    grid whose x, y and z are of one rank is built without a tuner (its layers then are plain
    ``F.linear``, :func:`axo4d.training.startup.make_tuner`), and with ``G_y = 1`` the loss is
    ``F.cross_entropy``: on the 1x1x1x1 grid each block, and the head with the loss, compile into
    one graph each."""
    prepare_for_compile()
    for block in model.blocks:
        (block.inner if isinstance(block, Recomputed) else block).compile(**kw)
    model.head_loss = torch.compile(model.head_loss, **kw)
    return model
