"""A GPT written once: single-device code whose parallel parts follow DESIGN.md section 2.

On the grid 1x1x1x1 every collective is skipped and this is an ordinary GPT.
Shapes in comments use B = local batch (global micro-batch / (G_data*G_z)),
T = sequence, C = hidden, H = heads, V = padded vocabulary.

The residual stream is split over x on features and replicated over y:
``(B, T, C/x)``. Each block: LayerNorm (statistics summed over x) -> QKV
(non-transposed, heads over y) -> causal attention (local heads) -> output
projection (transposed) -> residual; LayerNorm -> MLP up (non-transposed) ->
GELU -> MLP down (transposed) -> residual.
"""
from __future__ import annotations

import contextlib
import hashlib
import math
from dataclasses import replace
from typing import TYPE_CHECKING, Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from axo4d.comm import Comm, all_reduce_sum
from axo4d.config import ModelConfig
from axo4d.grads import reduce_gradients
from axo4d.grid import GridError
from axo4d.layers import Linear3D
from axo4d.overlap import Overlap
from axo4d.sharding import Sharding, set_sharding
from axo4d.vocab_parallel import vocab_parallel_cross_entropy

if TYPE_CHECKING:
    from axo4d.tuner import GemmTuner


def padded_vocab(cfg: ModelConfig, g_y: int) -> int:
    """Vocabulary rounded up to a multiple of ``vocab_multiple * G_y``, the same on
    every grid whose G_y divides ``vocab_multiple``-multiples."""
    m = cfg.vocab_multiple * g_y
    return ((cfg.vocab_size + m - 1) // m) * m


def check_divisibility(cfg: ModelConfig, comm: Comm) -> None:
    """One clear error when the model does not divide by the grid."""
    g = comm.grid
    checks = [
        (cfg.n_embd % cfg.n_head == 0, f"n_embd={cfg.n_embd} not divisible by n_head={cfg.n_head}"),
        (cfg.n_head % g.y == 0, f"n_head={cfg.n_head} not divisible by G_y={g.y}; G_y must divide the heads"),
        (cfg.n_embd % g.x == 0, f"n_embd={cfg.n_embd} not divisible by G_x={g.x}"),
        (cfg.n_embd % g.y == 0, f"n_embd={cfg.n_embd} not divisible by G_y={g.y}"),
        ((cfg.ffn_mult * cfg.n_embd) % (g.x * g.y) == 0,
         f"MLP width {cfg.ffn_mult * cfg.n_embd} not divisible by G_x*G_y={g.x * g.y}"),
    ]
    for ok, msg in checks:
        if not ok:
            raise GridError(f"model does not fit grid {g.spec()}: {msg}")


def _seed(base: int, name: str) -> int:
    """A per-parameter seed: initial weights do not depend on the grid."""
    return int.from_bytes(hashlib.sha256(f"{base}:{name}".encode()).digest()[:8], "little") % (2**63)


def _normal(shape: tuple[int, ...], std: float, seed: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * std


class LayerNorm(nn.Module):
    """LayerNorm of a feature-split activation: the two statistics are summed over x."""

    def __init__(self, dim: int, comm: Comm, eps: float, bias: bool) -> None:
        super().__init__()
        self.comm, self.dim, self.eps = comm, dim, eps
        n = dim // comm.size("x")
        spec = Sharding(split=("x",), grad_sum=("z", "data"), layout="cols", full_shape=(dim,))
        self.weight = set_sharding(nn.Parameter(torch.ones(n)), spec)
        self.bias = set_sharding(nn.Parameter(torch.zeros(n)), spec) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:     # (B, T, C/x)
        if self.comm.size("x") == 1:                       # whole features here: the fused kernel
            return F.layer_norm(x, (self.dim,), self.weight, self.bias, self.eps)
        xf = x.float()
        stats = torch.stack([xf.sum(-1), (xf * xf).sum(-1)], -1)   # (B, T, 2)
        stats = all_reduce_sum(stats, self.comm, "x") / self.dim
        mean, meansq = stats[..., :1], stats[..., 1:]
        y = (xf - mean) * torch.rsqrt(meansq - mean * mean + self.eps)
        y = y * self.weight if self.bias is None else torch.addcmul(self.bias, y, self.weight)
        return y.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, comm: Comm) -> None:
        super().__init__()
        self.head_dim = cfg.n_embd // cfg.n_head
        self.local_heads = cfg.n_head // comm.size("y")
        # rows of the QKV weight ordered per head: [h0: q k v][h1: q k v]... so a y-slice holds whole heads
        self.qkv = Linear3D(cfg.n_embd, 3 * cfg.n_embd, comm, bias=cfg.bias, name="attn.qkv")
        self.proj = Linear3D(cfg.n_embd, cfg.n_embd, comm, transposed=True, bias=cfg.bias, name="attn.proj")
        if cfg.bias:
            # A key bias only adds q.b_k to every score of a query; softmax ignores it, so its
            # gradient is zero up to rounding, which AdamW would amplify. Keep it exactly 0.
            mask = torch.ones(self.local_heads, 3, self.head_dim)
            mask[:, 1] = 0
            self.qkv.bias.register_hook(lambda g, m=mask.reshape(-1): g * m.to(g))

    def forward(self, x: torch.Tensor) -> torch.Tensor:      # (B, T, C/x)
        b, t, _ = x.shape
        qkv = self.qkv(x).view(b, t, self.local_heads, 3, self.head_dim)   # (B, T, H/y, 3, C/H)
        q, k, v = (u.transpose(1, 2) for u in qkv.unbind(3))               # (B, H/y, T, C/H)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)         # (B, H/y, T, C/H)
        y = y.transpose(1, 2).reshape(b, t, self.local_heads * self.head_dim)  # (B, T, C/y)
        return self.proj(y)                                                  # (B, T, C/x)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, comm: Comm) -> None:
        super().__init__()
        hidden = cfg.ffn_mult * cfg.n_embd
        self.up = Linear3D(cfg.n_embd, hidden, comm, bias=cfg.bias, name="mlp.up")
        self.down = Linear3D(hidden, cfg.n_embd, comm, transposed=True, bias=cfg.bias, name="mlp.down")

    def forward(self, x: torch.Tensor) -> torch.Tensor:      # (B, T, C/x)
        return self.down(F.gelu(self.up(x), approximate="tanh"))  # (B, T, 4C/y) -> (B, T, C/x)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, comm: Comm) -> None:
        super().__init__()
        self.ln1 = LayerNorm(cfg.n_embd, comm, cfg.ln_eps, cfg.bias)
        self.attn = Attention(cfg, comm)
        self.ln2 = LayerNorm(cfg.n_embd, comm, cfg.ln_eps, cfg.bias)
        self.mlp = MLP(cfg, comm)

    def forward(self, x: torch.Tensor) -> torch.Tensor:      # (B, T, C/x)
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """GPT on the grid of ``comm``; ``GPT(cfg, Comm(Grid()))`` is a single-device model.

    ``overlap=True`` hands communication to an :class:`~axo4d.overlap.Overlap` scheduler
    (weight prefetch, background reduce-scatter and data-parallel reduction, all finished by
    the end of ``loss.backward()``); ``tuner`` (a :class:`~axo4d.tuner.GemmTuner`) picks each
    GEMM's layout. Either way, call :meth:`finish_gradients` after the last backward of a step.
    """

    def __init__(self, cfg: ModelConfig, comm: Comm, *, seed: int = 0, checkpointing: bool = False,
                 overlap: bool = False, dp_bucket_mb: float = 25.0, tuner: "GemmTuner | None" = None) -> None:
        super().__init__()
        check_divisibility(cfg, comm)
        self.cfg, self.comm, self.checkpointing = cfg, comm, checkpointing
        self.dp_bucket_mb = dp_bucket_mb
        self.vocab = padded_vocab(cfg, comm.size("y"))
        cx = cfg.n_embd // comm.size("x")
        emb = Sharding(split=("x",), grad_sum=("z", "data"), layout="cols", weight_decay=True)
        self.wte = set_sharding(nn.Parameter(torch.empty(cfg.vocab_size, cx)),
                                replace(emb, full_shape=(cfg.vocab_size, cfg.n_embd)))
        self.wpe = set_sharding(nn.Parameter(torch.empty(cfg.seq_len, cx)),
                                replace(emb, full_shape=(cfg.seq_len, cfg.n_embd)))
        self.blocks = nn.ModuleList(Block(cfg, comm) for _ in range(cfg.n_layer))
        self.ln_f = LayerNorm(cfg.n_embd, comm, cfg.ln_eps, cfg.bias)
        self.lm_head = Linear3D(cfg.n_embd, self.vocab, comm, bias=False, name="lm_head")
        self.init_weights(seed)
        self._callbacks: list[Callable[[], None]] = []
        self.overlap = Overlap(self, comm, checkpointing=checkpointing, bucket_mb=dp_bucket_mb) if overlap else None
        for m in self.modules():
            if isinstance(m, Linear3D):
                m.tuner = tuner

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """Normal(0, init_std) weights (residual projections / sqrt(2 n_layer)), unit norms,
        zero biases; each parameter drawn in full from its own seed, then sharded."""
        std = self.cfg.init_std
        for name, mod in self.named_modules():
            if isinstance(mod, Linear3D):
                s = std / math.sqrt(2 * self.cfg.n_layer) if name.endswith(("proj", "down")) else std
                n_real = self.cfg.vocab_size if mod is self.lm_head else mod.out_features
                full = torch.zeros(mod.out_features, mod.in_features)
                full[:n_real] = _normal((n_real, mod.in_features), s, _seed(seed, name))
                mod.weight.copy_(mod.shard_full_weight(full))
        x = self.comm.coord("x")
        for p, name in ((self.wte, "wte"), (self.wpe, "wpe")):
            p.copy_(_normal(p.sharding.full_shape, std, _seed(seed, name)).chunk(self.comm.size("x"), 1)[x])

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """``idx``: (B, T) token ids. Returns per-token losses (B, T) if ``targets`` is given,
        else this rank's logits block (B, T, V/y)."""
        t = idx.shape[1]
        if t > self.cfg.seq_len:
            raise ValueError(f"sequence of {t} tokens longer than seq_len={self.cfg.seq_len}")
        if self.overlap is not None:
            self.overlap.begin_forward(self.training)
        try:
            x = F.embedding(idx, self.wte) + self.wpe[:t]      # (B, T, C/x)
            for block in self.blocks:
                x = checkpoint(block, x, use_reentrant=False) if self.checkpointing and self.training else block(x)
            logits = self.lm_head(self.ln_f(x))               # (B, T, V/y)
        finally:
            if self.overlap is not None:
                self.overlap.end_forward()
        if targets is None:
            return logits
        return vocab_parallel_cross_entropy(logits, targets, self.comm, self.cfg.vocab_size)

    # ---- gradients ------------------------------------------------------------------------
    def finish_gradients(self) -> None:
        """Make every gradient final: with overlap, wait for anything still in flight (normally
        nothing: the synchronised backward finished it and ran the callbacks); without, the
        bucketed data-parallel reduction now, then the :meth:`on_gradients_ready` callbacks."""
        if self.overlap is not None:
            self.overlap.finish()
            return
        reduce_gradients(self.parameters(), self.comm, self.dp_bucket_mb)
        for fn in self._callbacks:
            fn()

    def no_sync(self) -> contextlib.AbstractContextManager:
        """Gradient accumulation: backward passes inside skip the data-parallel reduction
        (with overlap; without it nothing is reduced before :meth:`finish_gradients` anyway)."""
        return self.overlap.no_sync() if self.overlap is not None else contextlib.nullcontext()

    def on_gradients_ready(self, fn: Callable[[], None]) -> None:
        """Call ``fn()`` once all gradients of a step are final (summed over z and data): at the
        end of the synchronised backward with overlap, in :meth:`finish_gradients` without."""
        if self.overlap is not None:
            self.overlap.on_gradients_ready(fn)
        else:
            self._callbacks.append(fn)

    def compile_blocks(self, **kw) -> None:
        """``torch.compile`` each block in place (parameter names unchanged); the Linear3D
        autograd function and the grid collectives stay eager (``torch.compiler.disable``).
        Layers with x, y and z of one rank drop the GEMM tuner: they are plain ``F.linear``
        then, so on such grids a block compiles into one graph."""
        for m in self.blocks.modules():
            if isinstance(m, Linear3D) and m.trivial:
                m.tuner = None
        for block in self.blocks:
            block.compile(**kw)

    def num_params(self) -> int:
        """Parameters of the full (unsharded) model, without vocabulary padding."""
        c, h = self.cfg, self.cfg.n_embd
        per_block = (4 + 2 * c.ffn_mult) * h * h + ((9 + c.ffn_mult) * h if c.bias else 2 * h)
        return c.n_layer * per_block + (2 * c.vocab_size + c.seq_len) * h + (2 if c.bias else 1) * h


def flops_per_step(cfg: ModelConfig, global_batch: int, checkpointing: bool = False) -> float:
    """DESIGN.md section 5: 72*B*s*l*h^2*(1 + s/(6h) + V/(12*l*h)); 96 and V/(16*l*h) with recompute."""
    b, s, l, h, v = global_batch, cfg.seq_len, cfg.n_layer, cfg.n_embd, cfg.vocab_size
    if checkpointing:
        return 96 * b * s * l * h * h * (1 + s / (6 * h) + v / (16 * l * h))
    return 72 * b * s * l * h * h * (1 + s / (6 * h) + v / (12 * l * h))
