"""Each rank's shards as chunks of the full logical tensors, for ``torch.distributed.checkpoint``.

A checkpoint stores every parameter (and every optimizer state tensor, which is
sharded like its parameter) as its *full logical* tensor: ``model/<name>`` of
shape ``full_shape`` (the LM head without its vocabulary padding rows). No rank
ever materialises a full tensor. Instead each rank describes its shard as a few
rectangular chunks of the full tensor (DCP ``ChunkStorageMetadata``):

:meth:`axo4d.facts.placement.Placement.chunks`: one chunk for a replicated or a split tensor, up
to three for a :class:`~axo4d.facts.placement.Block3D` weight piece (a partial first row, a run
of whole rows and a partial last row).

Replicas (every rank of the ``data`` axis, y-ranks of a LayerNorm, ...) describe
identical chunks; DCP's save planner keeps one writer per chunk (its dedup by
``MetadataIndex(fqn, offsets)``), so each element is written once, by the rank that
holds it, in parallel across ranks. On load each rank asks for the chunks of *its*
shard on *its* grid and DCP's resharding reads just the overlapping slices of the
stored chunks: a checkpoint from one grid loads on any other grid of the same model.

The sharded optimizer (:class:`axo4d.training.optim.sharded.ShardedAdamW`) describes its
own state instead (``checkpoint_state``): each owned slice as the rectangles of the
full tensors it holds, under the same keys (its fp32 masters are ``model/<name>``), so
checkpoints move between runs with and without it (docs/design.md section 9).

:func:`write_shards` / :func:`read_shards` are the collective save and load of one
rank's model, AdamW state (created as zeros first, so a never-stepped optimizer
saves and loads like any other) and RNG states; :mod:`axo4d.training.checkpointing.checkpointer` wraps
them in the folder protocol (partial folder, COMPLETE marker, rename, pruning).
"""

from __future__ import annotations

import dataclasses
import io
import random
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import (
    ChunkStorageMetadata,
    DefaultLoadPlanner,
    DefaultSavePlanner,
    LoadPlan,
    SavePlan,
)
from torch.distributed.checkpoint.default_planner import create_default_local_load_plan
from torch.distributed.checkpoint.metadata import MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from axo4d.config.errors import CheckpointError, CheckpointWriteError, CommError
from axo4d.dist.comm import Comm
from axo4d.facts.placement import Chunk, chunk_view, placement_of
from axo4d.nn.fp8_plan import weights_restored


def logical_shapes(model: nn.Module) -> dict[str, tuple[int, ...]]:
    """Full shape of every parameter as stored (padding rows dropped)."""
    return {n: tuple(placement_of(p).logical_shape) for n, p in model.named_parameters()}


@dataclass
class ShardedEntry:
    """A full logical tensor of which this rank holds ``chunks`` (views into its shard)."""

    size: tuple[int, ...]
    chunks: list[tuple[Chunk, torch.Tensor]]


def _narrow(t: torch.Tensor, offsets, lengths) -> torch.Tensor:
    for d, (o, n) in enumerate(zip(offsets, lengths)):
        if o != 0 or n != t.size(d):
            t = t.narrow(d, o, n)
    return t


def _md_index(fqn: str, ch: Chunk) -> MetadataIndex:
    return MetadataIndex(fqn, torch.Size(ch.offsets))


class ShardSavePlanner(DefaultSavePlanner):
    """Default planning for plain values, plus one ``SHARD`` write item per chunk of ``entries``
    (``staged``: the chunks are host copies of their own, written as they are)."""

    def __init__(self, entries: dict[str, ShardedEntry], staged: bool = False) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.entries, self.staged = entries, staged
        self._views = {(fqn, tuple(ch.offsets)): v for fqn, e in entries.items() for ch, v in e.chunks}

    def create_local_plan(self) -> SavePlan:
        plan = super().create_local_plan()
        items = []
        for fqn, e in self.entries.items():
            for ch, v in e.chunks:
                items.append(
                    WriteItem(
                        index=_md_index(fqn, ch),
                        type=WriteItemType.SHARD,
                        tensor_data=TensorWriteData(
                            chunk=ChunkStorageMetadata(offsets=torch.Size(ch.offsets), sizes=torch.Size(ch.sizes)),
                            properties=TensorProperties.create_from_tensor(v),
                            size=torch.Size(e.size),
                        ),
                    )
                )
        self.plan = dataclasses.replace(plan, items=list(plan.items) + items)
        return self.plan

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor | io.BytesIO:
        key = (write_item.index.fqn, tuple(write_item.index.offset or ()))
        if write_item.index.fqn in self.entries:
            v = self._views[key].detach()
            if self.staged:
                return v
            return v.cpu() if v.device.type != "cpu" else v.clone()  # own storage: no view of the shard
        return super().resolve_data(write_item)


class ShardLoadPlanner(DefaultLoadPlanner):
    """Reads into this rank's chunk views of ``entries``; plain values load the default way."""

    def __init__(self, entries: dict[str, ShardedEntry]) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.entries = entries
        self._views = {(fqn, tuple(ch.offsets)): v for fqn, e in entries.items() for ch, v in e.chunks}

    def create_local_plan(self) -> LoadPlan:
        assert self.metadata is not None
        plan = create_default_local_load_plan(self.state_dict, self.metadata, True)
        items = list(plan.items)
        for fqn, e in self.entries.items():
            md = self.metadata.state_dict_metadata[fqn]
            chunks = [
                ChunkStorageMetadata(offsets=torch.Size(ch.offsets), sizes=torch.Size(ch.sizes)) for ch, _ in e.chunks
            ]
            items += create_read_items_for_chunk_list(fqn, md, chunks)
        return dataclasses.replace(plan, items=items)

    def resolve_tensor(self, read_item):
        idx = read_item.dest_index
        if idx.fqn in self.entries:
            view = self._views[(idx.fqn, tuple(idx.offset))]
            return _narrow(view, read_item.dest_offsets, read_item.lengths)
        return super().resolve_tensor(read_item)


# ---- state of one rank: model, optimizer, RNG ---------------------------------------------
def _entries_for(
    name: str, tensors: dict[str, torch.Tensor], p: torch.Tensor, shape: tuple[int, ...], comm: Comm
) -> dict[str, ShardedEntry]:
    chunks = placement_of(p).chunks(comm.grid, comm.rank)
    return {key: ShardedEntry(shape, [(c, chunk_view(t.detach(), c)) for c in chunks]) for key, t in tensors.items()}


def init_optimizer_state(opt: torch.optim.Optimizer) -> None:
    """Create AdamW's state (zeros, step 0) as its first step would, so it can be loaded into."""
    for group in opt.param_groups:
        fused = bool(group.get("fused")) or bool(group.get("capturable"))
        for p in group["params"]:
            st = opt.state[p]
            if len(st) == 0:
                sdt = torch.float32 if fused or torch.get_default_dtype() != torch.float64 else torch.float64
                st["step"] = torch.zeros((), dtype=sdt, device=p.device if fused else "cpu")
                st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                if group.get("amsgrad"):
                    st["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)


def rank_state(
    model: nn.Module, opt: torch.optim.Optimizer | None, comm: Comm
) -> tuple[dict[str, ShardedEntry], dict[str, torch.Tensor]]:
    """(sharded entries, plain 0-d tensors) of this rank's model and optimizer. An optimizer that
    describes its own state (``checkpoint_state``: :class:`axo4d.training.optim.sharded.ShardedAdamW`,
    whose fp32 masters are the model's weights) gives the rectangles of the slices it owns."""
    shapes, entries, plain = logical_shapes(model), {}, {}
    if opt is not None and hasattr(opt, "checkpoint_state"):
        owned, plain = opt.checkpoint_state()
        return {k: ShardedEntry(shapes[k.split("/")[1]], v) for k, v in owned.items()}, dict(plain)
    for name, p in model.named_parameters():
        tensors = {f"model/{name}": p.data}
        if opt is not None:
            st = opt.state[p]
            for k, v in st.items():
                if torch.is_tensor(v) and v.dim() == 0:
                    plain[f"optim/{name}/{k}"] = v
                elif torch.is_tensor(v):
                    tensors[f"optim/{name}/{k}"] = v
        entries.update(_entries_for(name, tensors, p, shapes[name], comm))
    return entries, plain


def rng_state() -> dict:
    st = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        st["cuda"] = torch.cuda.get_rng_state()
    return st


def set_rng_state(st: dict) -> None:
    torch.set_rng_state(st["torch"])
    np.random.set_state(st["numpy"])
    random.setstate(st["python"])
    if "cuda" in st and torch.cuda.is_available():
        torch.cuda.set_rng_state(st["cuda"])


def first_failure(e: BaseException) -> str:
    failures = getattr(e, "failures", None) or {}
    for rank, (exc, _tb) in sorted(failures.items()):
        return f"rank {rank}: {type(exc).__name__}: {exc}".splitlines()[0]
    return f"{type(e).__name__}: {e}".splitlines()[0]


def single_process() -> bool:
    """No process group: DCP then runs in one process (and would warn about it each call)."""
    if not dist.is_initialized():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        return True
    return False


# ---- collective save/load --------------------------------------------------------------
SaveState = tuple[dict[str, ShardedEntry], dict[str, object], bool]


def save_state(model: nn.Module, opt: torch.optim.Optimizer | None, step: int, comm: Comm) -> SaveState:
    """What this rank saves after ``step`` steps: (sharded entries viewing the live tensors, plain
    values, staged=False)."""
    if opt is not None and not hasattr(opt, "checkpoint_state"):
        init_optimizer_state(opt)
    entries, plain = rank_state(model, opt, comm)
    plain = dict(plain)
    plain["train/step"] = torch.tensor(step, dtype=torch.int64)
    plain[f"rng/rank{comm.rank}"] = rng_state()
    return entries, plain, False


def stage(state: SaveState, buffers: dict) -> SaveState:
    """A copy of ``state`` in host memory that training may run on past: every chunk copied into a
    contiguous host buffer of its own (kept in ``buffers`` and reused by the next save; pinned on
    CUDA), plain tensors cloned. ``staged=True``: the writer writes the copies as they are."""
    entries, plain, _ = state
    cuda = False
    out: dict[str, ShardedEntry] = {}
    for fqn, e in entries.items():
        chunks = []
        for ch, v in e.chunks:
            key = (fqn, tuple(ch.offsets))
            buf = buffers.get(key)
            if buf is None or buf.shape != v.shape or buf.dtype != v.dtype:
                pin = v.device.type == "cuda"
                buf = buffers[key] = torch.empty(v.shape, dtype=v.dtype, device="cpu", pin_memory=pin)
            buf.copy_(v.detach(), non_blocking=v.device.type == "cuda")
            cuda = cuda or v.device.type == "cuda"
            chunks.append((ch, buf))
        out[fqn] = ShardedEntry(e.size, chunks)
    if cuda:
        torch.cuda.synchronize()
    plain = {k: v.detach().to("cpu", copy=True) if torch.is_tensor(v) else v for k, v in plain.items()}
    return out, plain, True


def staged_bytes(state: SaveState) -> int:
    """Bytes of the chunks of ``state`` (the host copy an asynchronous save holds)."""
    return sum(v.numel() * v.element_size() for e in state[0].values() for _, v in e.chunks)


def write_shards(
    folder: Path,
    model: nn.Module,
    opt: torch.optim.Optimizer | None,
    step: int,
    comm: Comm,
    state: SaveState | None = None,
    process_group=None,
) -> dict[str, dict]:
    """Every rank writes its chunks of model/optimizer and its RNG state into ``folder`` (collective
    over ``process_group``, default: the world); ``state``: :func:`save_state` or :func:`stage`'s
    (default: the live state). Returns ``{file: {"bytes", "crc32"}}`` of the files this rank wrote,
    checksummed from the bytes written (:mod:`axo4d.training.checkpointing.writer`)."""
    from axo4d.training.checkpointing.writer import HashingWriter

    entries, plain, staged = state if state is not None else save_state(model, opt, step, comm)
    writer = HashingWriter(str(folder))
    try:
        dcp.save(
            plain,
            storage_writer=writer,
            planner=ShardSavePlanner(entries, staged),
            process_group=process_group,
            no_dist=single_process(),
        )
    except dcp.CheckpointException as e:
        raise CheckpointWriteError(
            f"rank {comm.rank}: writing checkpoint {str(folder)!r} failed: {first_failure(e)}"
        ) from None
    except Exception as e:  # a collective of DCP (plans, results) failed: a peer died or timed out
        raise CommError(
            f"rank {comm.rank}: checkpoint save collective over world (grid "
            f"{comm.grid.spec()}) failed or timed out: {str(e).splitlines()[0] if str(e) else e!r}"
        ) from None
    return writer.hashed


@torch.no_grad()
def read_shards(
    ckpt: Path,
    model: nn.Module,
    opt: torch.optim.Optimizer | None,
    comm: Comm,
    load_rng: bool,
    optimizer_state: bool = True,
) -> int:
    """Load this rank's shards (any grid) from a checked checkpoint; returns its step (collective).
    ``optimizer_state=False``: the checkpoint has none (``opt`` only learns the new weights)."""
    sharded_opt = opt is not None and hasattr(opt, "checkpoint_state")
    if opt is not None and not sharded_opt and optimizer_state:
        init_optimizer_state(opt)
    entries, plain = rank_state(model, opt if optimizer_state else None, comm)
    for p in model.parameters():  # parts not in the checkpoint (vocabulary padding) are zero
        p.data.zero_()
    for e in entries.values() if optimizer_state and opt is not None else ():
        for _, v in e.chunks:
            v.zero_()
    if optimizer_state and opt is not None and not sharded_opt:
        for st in opt.state.values():
            for v in st.values():
                if torch.is_tensor(v):
                    v.zero_()
    plain["train/step"] = torch.zeros((), dtype=torch.int64)
    key = f"rng/rank{comm.rank}"
    if load_rng:
        plain[key] = None
    try:
        dcp.load(
            plain,
            storage_reader=dcp.FileSystemReader(str(ckpt)),
            planner=ShardLoadPlanner(entries),
            no_dist=single_process(),
        )
    except dcp.CheckpointException as e:
        raise CheckpointError(f"checkpoint {str(ckpt)!r} cannot be read: {first_failure(e)}") from None
    except Exception as e:
        raise CommError(
            f"rank {comm.rank}: checkpoint load collective over world (grid "
            f"{comm.grid.spec()}) failed or timed out: {str(e).splitlines()[0] if str(e) else e!r}"
        ) from None
    if load_rng and plain.get(key) is not None:
        set_rng_state(plain[key])
    if sharded_opt:
        opt.after_load(optimizer_state)  # masters into the weights, other slices all-gathered
    step = int(plain["train/step"])
    weights_restored(model, step)  # FP8 weight scales: recomputed, counting updates from the step
    return step
