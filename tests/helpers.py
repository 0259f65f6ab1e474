"""Test helpers: full (unsharded) tensors of a sharded model and back, by each parameter's
placement, and the blocks of activations. Collectives over the whole world; for tests only
(production code never gathers a full model: checkpoints and exports go chunk by chunk).
"""

from __future__ import annotations

import os
import shutil
import subprocess

import torch
import torch.distributed as dist
from torch import nn

from axo4d.config.errors import GridError
from axo4d.dist.comm import Comm
from axo4d.facts.grid import Grid
from axo4d.facts.placement import Block3D, Placement, Split, placement_of
from axo4d.nn.linear import Linear3D
from axo4d.nn.schedule import Schedule


def can_netns() -> bool:
    """Whether this process may create network namespaces and shape links (root, ``ip``, ``tc``):
    the precondition of the ``launch.vcluster`` tests."""
    if os.geteuid() != 0 or not shutil.which("ip") or not shutil.which("tc"):
        return False
    probe = f"axo4dprobe{os.getpid()}"
    ok = subprocess.run(["ip", "netns", "add", probe], capture_output=True).returncode == 0
    if ok:
        subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return ok


def reduce_gradients(params, comm: Comm, bucket_mb: float = 25.0) -> None:
    """Sum every gradient over its ``grad_sum`` axes now, in the eager schedule's buckets (for
    layers used outside a model; a model's schedule does this in ``finish``)."""
    s = Schedule(comm, bucket_mb)
    s.attach(params)
    s.finish()


def gather_world(t: torch.Tensor, comm: Comm) -> list[torch.Tensor]:
    """``t`` of every rank, indexed by global rank."""
    if comm.grid.world_size == 1:
        return [t]
    out = [torch.empty_like(t) for _ in range(comm.grid.world_size)]
    dist.all_gather(out, t.contiguous())
    return out


def shard_full_tensor(full: torch.Tensor, p: torch.Tensor, comm: Comm) -> torch.Tensor:
    """This rank's piece (shaped like ``p``) of the full tensor of parameter ``p``."""
    pl = placement_of(p)
    if tuple(full.shape) != tuple(pl.full_shape):
        raise ValueError(
            f"full tensor of shape {tuple(full.shape)} does not match the parameter's full shape {tuple(pl.full_shape)}"
        )
    return pl.shard(full, comm.grid, comm.rank).view_as(p)


def gather_full_tensor(t: torch.Tensor, p: torch.Tensor, comm: Comm) -> torch.Tensor:
    """The full tensor from every rank's piece ``t`` of parameter ``p`` (collective)."""
    return placement_of(p).assemble(gather_world(t.detach(), comm), comm.grid)


def full_tensors(model: nn.Module, comm: Comm, of=lambda p: p.data, logical: bool = False) -> dict[str, torch.Tensor]:
    """``of(p)`` of every parameter unsharded (``logical``: padding rows dropped), keyed by name,
    identical on every rank (collective),
    also where ranks hold different parameters (the experts of expert parallelism: a rank that
    does not hold one sends zeros, which the placement does not read)."""
    mine = dict(model.named_parameters())
    every: dict = {}
    for names in comm.all_gather_object({n: placement_of(p) for n, p in mine.items()}):
        every.update(names)
    out = {}
    for name in sorted(every):
        pl = every[name]
        p = mine.get(name)
        t = of(p) if p is not None else None
        piece = t.detach() if t is not None else torch.zeros(pl.local_shape(comm.grid))
        full = pl.assemble(gather_world(piece, comm), comm.grid)
        out[name] = full[: pl.logical_shape[0]] if logical else full
    return out


def full_state_dict(model: nn.Module, comm: Comm) -> dict[str, torch.Tensor]:
    """Every parameter unsharded, on CPU, keyed by name (identical on all ranks)."""
    return {n: t.cpu() for n, t in full_tensors(model, comm).items()}


def full_optimizer_state(opt, model: nn.Module, comm: Comm) -> dict[str, torch.Tensor]:
    """Every optimizer state tensor as its full logical tensor, keyed like the checkpoint
    (``optim/<name>/<key>``), on every rank (collective): from ``torch.optim.AdamW``'s per-piece
    state, or from the rectangles a sharded optimizer (``checkpoint_state``) owns on each rank.
    Also where ranks hold different parameters (the experts of expert parallelism): every rank
    learns every parameter's placement and state keys first, then enters the same collectives in
    the same order, a rank that does not hold a parameter sending zeros its placement does not read."""
    if not hasattr(opt, "checkpoint_state"):
        return _full_plain_state(opt, model, comm)
    entries, plain = opt.checkpoint_state()
    mine = (
        {
            k: [(ch.offsets, ch.sizes, v.detach().cpu().clone()) for ch, v in lst]
            for k, lst in entries.items()
            if k.startswith("optim/")
        },
        {k: v.detach().cpu().clone() for k, v in plain.items()},
        {n: tuple(placement_of(p).logical_shape) for n, p in model.named_parameters()},
    )
    every = comm.all_gather_object(mine)
    shapes = {n: s for _, _, sh in every for n, s in sh.items()}
    out: dict[str, torch.Tensor] = {}
    for rects, steps, _ in every:
        for key, lst in rects.items():
            full = out.setdefault(key, torch.zeros(shapes[key.split("/")[1]], dtype=lst[0][2].dtype))
            for off, size, v in lst:
                full[tuple(slice(o, o + n) for o, n in zip(off, size))] = v
        for key, v in steps.items():
            out.setdefault(key, v)
    return out


def _full_plain_state(opt, model: nn.Module, comm: Comm) -> dict[str, torch.Tensor]:
    """:func:`full_optimizer_state` of a ``torch.optim`` optimizer (state per local piece)."""
    mine = {
        n: (placement_of(p), {k: (v.detach().cpu().clone() if v.dim() == 0 else None) for k, v in opt.state[p].items()})
        for n, p in model.named_parameters()
    }
    every: dict = {}
    for part in comm.all_gather_object(mine):
        for n, (pl, keys) in part.items():
            held = every.setdefault(n, (pl, {}))[1]
            for k, v in keys.items():
                held[k] = v if held.get(k) is None else held[k]
    params = dict(model.named_parameters())
    out: dict[str, torch.Tensor] = {}
    for name in sorted(every):  # the same order on every rank
        pl, keys = every[name]
        cut = tuple(slice(0, n) for n in pl.logical_shape)
        state = opt.state[params[name]] if name in params else {}
        for k in sorted(keys):
            if keys[k] is not None:  # a 0-d tensor (the step): any holder's
                out[f"optim/{name}/{k}"] = keys[k]
                continue
            v = state.get(k)
            piece = v.detach() if v is not None else torch.zeros(pl.local_shape(comm.grid))
            out[f"optim/{name}/{k}"] = pl.assemble(gather_world(piece, comm), comm.grid)[cut].clone()
    return out


@torch.no_grad()
def load_full_state_dict(model: nn.Module, sd: dict[str, torch.Tensor], comm: Comm) -> None:
    """Load unsharded tensors (as from :func:`full_state_dict`) into a model on any grid."""
    names = dict(model.named_parameters())
    missing, unexpected = sorted(set(names) - set(sd)), sorted(set(sd) - set(names))
    if missing or unexpected:
        raise ValueError(f"state_dict does not match the model: missing {missing[:5]}, unexpected {unexpected[:5]}")
    for n, p in names.items():
        p.copy_(shard_full_tensor(sd[n].to(p.dtype), p, comm))


# ---- linear layers -------------------------------------------------------------------------------
def shard_linear_weight(weight: torch.Tensor, comm: Comm, in_axis: str, out_axis: str) -> torch.Tensor:
    """Flat z piece of ``weight[out-slice, in-slice]`` for this rank (pure)."""
    return Block3D(tuple(weight.shape), in_axis=in_axis, out_axis=out_axis).shard(weight, comm.grid, comm.rank)


def gather_linear_weight(
    piece: torch.Tensor, comm: Comm, in_axis: str, out_axis: str, full_shape: tuple[int, int]
) -> torch.Tensor:
    """Inverse of :func:`shard_linear_weight` (collective over the world)."""
    return Block3D(tuple(full_shape), in_axis=in_axis, out_axis=out_axis).assemble(
        gather_world(piece.detach().reshape(-1), comm), comm.grid
    )


@torch.no_grad()
def load_linear(lin: Linear3D, weight: torch.Tensor, bias: torch.Tensor | None = None) -> Linear3D:
    """Load a full ``nn.Linear``-shaped weight (and bias) into ``lin``."""
    if tuple(weight.shape) != (lin.out_features, lin.in_features):
        raise ValueError(
            f"{lin.name}: full weight shape {tuple(weight.shape)} != {(lin.out_features, lin.in_features)}"
        )
    lin.weight.copy_(shard_full_tensor(weight, lin.weight, lin.comm))
    if lin.bias is not None:
        if bias is None:
            raise ValueError(f"{lin.name}: layer has a bias but none was given")
        lin.bias.copy_(shard_full_tensor(bias, lin.bias, lin.comm))
    return lin


def from_linear(linear: nn.Linear, ctx, *, transposed: bool = False, name: str = "linear") -> Linear3D:
    """A :class:`Linear3D` holding ``linear``'s weights."""
    lin = Linear3D(
        linear.in_features, linear.out_features, ctx, transposed=transposed, bias=linear.bias is not None, name=name
    )
    return load_linear(lin, linear.weight.detach(), None if linear.bias is None else linear.bias.detach())


def full_weight(lin: Linear3D) -> torch.Tensor:
    """The unsharded ``(N, K)`` weight, assembled on every rank (collective)."""
    return gather_full_tensor(lin.weight, lin.weight, lin.comm)


# ---- activations ---------------------------------------------------------------------------------
def shard_rows(x_full: torch.Tensor, comm: Comm) -> torch.Tensor:
    """Rows of ``x_full`` for this rank: split over (z, data), z fastest."""
    n = comm.size(("z", "data"))
    if x_full.shape[0] % n:
        raise GridError(f"batch of {x_full.shape[0]} rows not divisible by G_data*G_z={n}")
    return x_full.chunk(n, 0)[comm.index(("z", "data"))]


def shard_input(lin: Linear3D, x_full: torch.Tensor) -> torch.Tensor:
    """This rank's block of a full input ``(M, K)`` of ``lin``: rows over (z, data), features over G_in
    and, inside this rank's input-axis slice, over G_out (docs/design.md section 2.1)."""
    return shard_features(shard_rows(x_full, lin.comm), lin.comm, (lin.out_axis, lin.in_axis))


def shard_features(t: torch.Tensor, comm: Comm, axes: tuple[str, ...]) -> torch.Tensor:
    """This rank's block of the last dimension over ``axes`` (block index first axis fastest)."""
    return t.chunk(comm.size(axes), -1)[comm.index(axes)]


def gather_blocks(
    blk: torch.Tensor, comm: Comm, row_axes: tuple[str, ...], col_axis: str | tuple[str, ...] | None
) -> torch.Tensor:
    """Assemble a 2D tensor split over ``row_axes`` on dim 0 and ``col_axis`` on dim -1 (axes: the
    block index in that group, first axis fastest)."""
    blocks = gather_world(blk.detach(), comm)
    g = comm.grid
    cols = () if not col_axis else (col_axis,) if isinstance(col_axis, str) else tuple(col_axis)
    n_cols = g.size(*cols) if cols else 1
    rows = [[None] * n_cols for _ in range(g.size(*row_axes))]
    for r, b in enumerate(blocks):
        rows[g.group_index(r, row_axes)][g.group_index(r, cols) if cols else 0] = b
    return torch.cat([torch.cat(row, -1) for row in rows], 0)


def gather_output(lin: Linear3D, y_blk: torch.Tensor) -> torch.Tensor:
    """The full ``(M, N)`` output of ``lin`` from every rank's block (collective over the world):
    block ``in`` of the output axis's slice ``out`` (docs/design.md section 2.1)."""
    return gather_blocks(y_blk, lin.comm, row_axes=("z", "data"), col_axis=(lin.in_axis, lin.out_axis))


def plain_grads(plain, n_head: int) -> dict[str, torch.Tensor]:
    """The plain reference's gradients as the model has them: the key third of every
    ``attn.qkv.bias`` zeroed (the model holds the key bias at zero by design; nothing else)."""
    out = {}
    for name, p in plain.named_parameters():
        g = p.grad
        if name.endswith("attn.qkv.bias"):
            g = g.view(n_head, 3, -1).clone()
            g[:, 1] = 0
            g = g.reshape(-1)
        out[name] = g
    return out


def assert_grads_match_plain(model, plain, n_head: int) -> None:
    """Every gradient of a one-rank ``model`` equals its plain PyTorch reference's (1e-4 rel.)."""
    grads = plain_grads(plain, n_head)
    for name, p in model.named_parameters():
        g_ref = grads[name]
        torch.testing.assert_close(p.grad.view_as(g_ref), g_ref, rtol=1e-4, atol=1e-6, msg=name)


def why_not_even(pl: Placement, grid: Grid) -> str | None:
    """Why ``pl`` does not split into equal pieces on ``grid``, from its shape alone (None when it
    does): the precondition of the tests that cut placements on many grids."""
    if isinstance(pl, Split):
        d = pl.dim % len(pl.full_shape)
        n, g = pl.full_shape[d], grid.size(pl.axis)
        return None if n % g == 0 else f"dim {d} of size {n} over {pl.axis}={g}"
    if isinstance(pl, Block3D):
        (n, k), g_out, g_in = pl.full_shape, grid.size(pl.out_axis), grid.size(pl.in_axis)
        if n % g_out or k % g_in:
            return f"{n}x{k} over {pl.out_axis}={g_out} (rows), {pl.in_axis}={g_in} (columns)"
        if (n // g_out) * (k // g_in) % grid.z:
            return f"block of {n // g_out}x{k // g_in} elements over z={grid.z}"
    return None
