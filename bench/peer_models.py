"""The peers of :mod:`bench.peers`: the plain GPT (the shape and parameter names of
:class:`axo4d.models.plain.PlainGPT`) sharded by torch's own tools, loaded with axo4d's initial
weights, stepped on axo4d's samples with the same AdamW.

* ``tp``: ``parallelize_module`` in Megatron's pattern with sequence parallelism (torchtitan's
  plan): the embeddings vocabulary/row-parallel into sequence shards, ``SequenceParallel`` norms,
  QKV and MLP up ``ColwiseParallel`` after an all-gather of the sequence, the output projections
  ``RowwiseParallel`` reduce-scattering into sequence shards, the LM head ``ColwiseParallel``
  with the loss vocabulary-parallel (``loss_parallel``);
* ``fsdp2``: ``fully_shard`` on every block and the root;
* ``ddp``: ``DistributedDataParallel``;
* ``fsdp2+tp``: the TP plan on the inner mesh axis, ``fully_shard`` over the outer (2D).
"""

from __future__ import annotations

import contextlib

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from axo4d.config import RunConfig
from axo4d.facts.grid import Grid
from axo4d.facts.placement import placement_of
from axo4d.training.trainer import lr_at


class Attention(nn.Module):
    def __init__(self, c: int, n_head: int, bias: bool) -> None:
        super().__init__()
        self.head_dim = c // n_head
        self.qkv = nn.Linear(c, 3 * c, bias=bias)
        self.proj = nn.Linear(c, c, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, C); under TP the heads of this rank
        b, t, _ = x.shape
        qkv = self.qkv(x).view(b, t, -1, 3, self.head_dim)  # per-head [q k v] rows, as axo4d's
        q, k, v = (u.transpose(1, 2) for u in qkv.unbind(3))  # (B, H, T, C/H)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, c: int, mult: int, bias: bool) -> None:
        super().__init__()
        self.up = nn.Linear(c, mult * c, bias=bias)
        self.down = nn.Linear(mult * c, c, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, cfg) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.n_embd, eps=cfg.ln_eps, bias=cfg.bias)
        self.attn = Attention(cfg.n_embd, cfg.n_head, cfg.bias)
        self.ln2 = nn.LayerNorm(cfg.n_embd, eps=cfg.ln_eps, bias=cfg.bias)
        self.mlp = MLP(cfg.n_embd, cfg.ffn_mult, cfg.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class PeerGPT(nn.Module):
    """PlainGPT's model with ``nn.Embedding`` modules (``tok`` = ``wte``, ``pos`` = ``wpe``) so
    torch's TP plans apply; the forward returns the mean token loss."""

    def __init__(self, cfg, vocab: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.pos = nn.Embedding(cfg.seq_len, cfg.n_embd)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd, eps=cfg.ln_eps, bias=cfg.bias)
        self.lm_head = nn.Linear(cfg.n_embd, vocab, bias=False)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device).expand_as(idx)
        x = self.tok(idx) + self.pos(pos)
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))  # (B, T, V) (a DTensor sharded on V under TP)
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())

    def load_plain(self, sd: dict[str, torch.Tensor]) -> None:
        """Load PlainGPT-named full weights (``wte``, ``wpe``, ``blocks.*``, ``ln_f.*``, ``lm_head.*``)."""
        ren = {"wte": "tok.weight", "wpe": "pos.weight"}
        missing, unexpected = self.load_state_dict({ren.get(k, k): v for k, v in sd.items()}, strict=True)
        assert not missing and not unexpected, (missing, unexpected)


def full_weights(trainer) -> dict[str, torch.Tensor]:
    """Every parameter of the axo4d model unsharded (a collective over the world)."""
    trainer.settle()
    grid: Grid = trainer.comm.grid
    out = {}
    for name, p in trainer.model.named_parameters():
        pieces = [torch.empty_like(p.data) for _ in range(grid.world_size)]
        dist.all_gather(pieces, p.data.contiguous())
        out[name] = placement_of(p).assemble(pieces, grid).cpu()
    return out


# ---- sharding by torch --------------------------------------------------------------------------
def _tp_plan(model: PeerGPT, mesh) -> None:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    emb = RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1), use_local_output=False)
    parallelize_module(
        model,
        mesh,
        {
            "tok": emb,
            "pos": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1), use_local_output=False),
            "ln_f": SequenceParallel(),
            "lm_head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False),
        },
    )
    gather = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
    for block in model.blocks:
        plan = {
            "ln1": SequenceParallel(),
            "attn": gather,
            "attn.qkv": ColwiseParallel(),
            "attn.proj": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
            "ln2": SequenceParallel(),
            "mlp": gather,
            "mlp.up": ColwiseParallel(),
            "mlp.down": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
        }
        parallelize_module(block, mesh, plan)


def _fully_shard(model: PeerGPT, mesh) -> None:
    from torch.distributed.fsdp import fully_shard

    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)


class Peer:
    """A sharded peer model, its optimizer, its data rank and its loss context."""

    def __init__(self, kind: str, model: nn.Module, opt, dp_rank: int, dp: int, tp: bool, device: torch.device) -> None:
        self.kind, self.model, self.opt, self.dp_rank, self.dp, self.tp = kind, model, opt, dp_rank, dp, tp
        self.device = device

    def loss_context(self):
        if not self.tp:
            return contextlib.nullcontext()
        from torch.distributed.tensor.parallel import loss_parallel

        return loss_parallel()


def build_peer(
    kind: str,
    cfg: RunConfig,
    sd: dict[str, torch.Tensor],
    rank: int,
    world: int,
    grid: Grid,
    device: torch.device,
) -> Peer:
    """The peer ``kind`` on ``world`` ranks, its weights on ``device`` (axo4d's rank device): the
    data ranks are ``grid``'s data axis (its other axes, the tensor/FSDP ranks, form the inner mesh
    axis, as axo4d's default rank order has them)."""
    from torch.distributed.device_mesh import init_device_mesh

    m = cfg.model
    vocab = sd["lm_head.weight"].shape[0]
    if vocab != m.vocab_size:
        raise SystemExit(
            f"bench.peers: padded vocabulary {vocab} != {m.vocab_size}: choose a vocabulary the grid divides"
        )
    torch.manual_seed(0)
    model = PeerGPT(m, vocab)
    model.load_plain(sd)
    model.to(device)
    dt = device.type  # the meshes' device type: the process group (gloo) is the same either way
    dp = grid.size("data") if kind in ("ddp", "fsdp2+tp") else 1
    if kind == "fsdp2":
        dp = world  # FSDP2 shards and splits the batch over every rank
    inner = world // dp
    if kind == "tp":
        _tp_plan(model, init_device_mesh(dt, (world,)))
    elif kind == "fsdp2":
        _fully_shard(model, init_device_mesh(dt, (world,)))
    elif kind == "ddp":
        model = nn.parallel.DistributedDataParallel(model, device_ids=None if dt == "cpu" else [device])
    elif kind == "fsdp2+tp":
        mesh = init_device_mesh(dt, (dp, inner), mesh_dim_names=("dp", "tp"))
        _tp_plan(model, mesh["tp"])
        _fully_shard(model, mesh["dp"])
    t = cfg.train
    decay = [p for p in model.parameters() if p.ndim >= 2]
    other = [p for p in model.parameters() if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": t.weight_decay}, {"params": other, "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=t.lr, betas=(t.beta1, t.beta2), eps=t.eps, foreach=True)
    return Peer(kind, model, opt, rank // inner, dp, kind in ("tp", "fsdp2+tp"), device)


def peer_step(peer: Peer, plan, ds, cfg: RunConfig, step: int) -> float:
    """One training step of the peer on axo4d's samples of ``step``; returns the global mean loss."""
    _, idx = plan.samples(step)  # (global_batch,)
    rows = np.array_split(idx, peer.dp)[peer.dp_rank]
    b = ds.batch("train", rows, peer.device)
    t = cfg.train
    peer.opt.zero_grad(set_to_none=True)
    with peer.loss_context():
        loss = peer.model(b.x, b.y)
        loss.backward()
    if t.grad_clip:
        torch.nn.utils.clip_grad_norm_(peer.model.parameters(), t.grad_clip, foreach=True)
    for g in peer.opt.param_groups:
        g["lr"] = lr_at(step, t)
    peer.opt.step()
    val = loss.full_tensor() if hasattr(loss, "full_tensor") else loss
    val = val.detach().reshape(1).double()
    dist.all_reduce(val)
    return float(val) / dist.get_world_size()
