"""Hugging Face model folders in and out.

**In** (:func:`load_hf_weights`; the config by :mod:`axo4d.training.hf.hf_config`): a folder with ``config.json``,
``model.safetensors`` or ``model.safetensors.index.json`` + shards, and ``tokenizer.json``.
Each ``architectures`` value loads into its registry entry's ``model.arch`` (:mod:`axo4d.facts.archs`). Every
rank builds its model on its grid, then, for each parameter, asks the placement which
rectangles of the logical tensor its piece holds (:meth:`Placement.chunks`) and reads just those
rows and columns from the files through safetensors' lazy slices: no rank holds the full model.

**Out** (:func:`export_hf`): a checkpoint is read one tensor at a time (``torch.distributed.
checkpoint`` reads only the chunks of the tensor asked for), split into Hugging Face tensors and
written into safetensors shards of at most ``shard_gb`` with an index, plus ``config.json`` and
the tokenizer files when known. Memory: the largest tensor plus one shard, never the model.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any, Iterator

import torch
from torch import nn

from axo4d.config import ModelConfig
from axo4d.config.errors import CheckpointError
from axo4d.facts.archs import get_arch
from axo4d.facts.archs.layout import RowMap
from axo4d.facts.grid import Grid
from axo4d.facts.placement import chunk_view, placement_of
from axo4d.training.hf.hf_config import hf_config_dict

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json")
INDEX = "model.safetensors.index.json"


# ---- safetensors -------------------------------------------------------------------------------
class SafetensorsFolder:
    """The tensors of a folder's ``model.safetensors`` (or index-sharded files), opened lazily."""

    def __init__(self, folder: str | Path) -> None:
        from safetensors import safe_open

        self.folder = Path(folder)
        index = self.folder / INDEX
        if index.is_file():
            try:
                self.where = {k: self.folder / v for k, v in json.loads(index.read_text())["weight_map"].items()}
            except (OSError, ValueError, KeyError) as e:
                raise CheckpointError(f"{str(index)!r} is not a valid safetensors index: {e}") from None
        else:
            single = self.folder / "model.safetensors"
            if not single.is_file():
                raise CheckpointError(f"{str(self.folder)!r} has neither model.safetensors nor {INDEX}")
            self.where = None
            self.single = single
        self._open: dict[Path, Any] = {}
        self._safe_open = safe_open

    def _file(self, name: str) -> Path:
        if self.where is None:
            return self.single
        if name not in self.where:
            raise KeyError(name)
        return self.where[name]

    def handle(self, name: str):
        f = self._file(name)
        if f not in self._open:
            try:
                self._open[f] = self._safe_open(str(f), framework="pt")
            except Exception as e:  # safetensors raises its own error types
                raise CheckpointError(f"cannot read safetensors file {str(f)!r}: {e}") from None
        h = self._open[f]
        if name not in h.keys():
            raise KeyError(name)
        return h

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.handle(name).get_slice(name).get_shape())

    def has(self, name: str) -> bool:
        try:
            self.handle(name)
            return True
        except KeyError:
            return False

    def rows(self, name: str, rows: slice, cols: slice | None, transposed: bool) -> torch.Tensor:
        """``tensor[rows, cols]`` of the logical (out, in) view, read lazily."""
        sl = self.handle(name).get_slice(name)
        if transposed:  # stored (in, out): logical rows are columns
            return sl[cols or slice(None), rows].t()
        return sl[rows] if cols is None else sl[rows, cols]


def _expected_shapes(layout: dict[str, RowMap], model: nn.Module) -> dict[str, tuple[int, ...]]:
    """Shape each HF tensor must have, from the model's logical shapes and the row maps."""
    out: dict[str, tuple[int, ...]] = {}
    for pname, p in model.named_parameters():
        rm, cols = layout[pname], tuple(placement_of(p).logical_shape[1:])
        for part in rm.parts:
            shape = (_hf_rows(layout, part.name), *cols)
            out[part.name] = tuple(reversed(shape)) if rm.transposed else shape
    return out


def check_hf_weights(files: SafetensorsFolder, layout: dict[str, RowMap], model: nn.Module) -> None:
    """Every tensor the model needs is there with the right shape, else one clear error."""
    for name, shape in _expected_shapes(layout, model).items():
        if not files.has(name):
            raise CheckpointError(
                f"{str(files.folder)!r}: tensor {name!r} (shape {shape}) is missing from the safetensors files"
            )
        got = files.shape(name)
        if got != shape:
            raise CheckpointError(f"{str(files.folder)!r}: tensor {name!r} has shape {got}, this model needs {shape}")


def weight_layout(cfg: ModelConfig, files: SafetensorsFolder) -> dict[str, RowMap]:
    """The row maps of ``cfg``'s parameters for these files (a head the files leave out because it
    is tied to the embedding, :attr:`Arch.hf_tied_head`: read from the embedding's rows)."""
    arch = get_arch(cfg.arch)
    layout = arch.layout(cfg)
    if arch.hf_tied_head is not None:
        head, emb = arch.hf_tied_head
        if not any(files.has(p.name) for p in layout[head].parts):
            layout[head] = layout[emb]
    return layout


@torch.no_grad()
def load_hf_weights(model: nn.Module, folder: str | Path, grid: Grid, rank: int) -> None:
    """Fill this rank's pieces of ``model`` from a Hugging Face folder (its own rows only)."""
    files = SafetensorsFolder(folder)
    layout = weight_layout(model.cfg, files)
    check_hf_weights(files, layout, model)
    for pname, p in model.named_parameters():
        rm, pl = layout[pname], placement_of(p)
        local = torch.zeros(p.shape, dtype=torch.float32)
        for ch in pl.chunks(grid, rank):
            r0, r1 = ch.offsets[0], ch.offsets[0] + ch.sizes[0]
            cols = slice(ch.offsets[1], ch.offsets[1] + ch.sizes[1]) if len(ch.sizes) > 1 else None
            view = chunk_view(local, ch)
            for name, src, dst in rm.segments(r0, r1):
                view[dst] = files.rows(name, src, cols, rm.transposed).to(torch.float32)
        p.copy_(local.to(p.dtype))


def export_hf(ckpt: str | Path, out: str | Path, *, dtype: str = "auto", shard_gb: float = 2.0) -> dict[str, Any]:
    """Write checkpoint ``ckpt`` as a Hugging Face folder ``out`` (see the module docstring)."""
    from axo4d.training.checkpointing.checkpointer import find_checkpoint, read_info

    ckpt = find_checkpoint(ckpt)
    info = read_info(ckpt, verify=True)  # every file against its crc32 before a tensor is read
    cfg: ModelConfig = info["config"].model
    run = ckpt.parent.parent
    src = run / "hf"
    template = json.loads((src / "config.json").read_text()) if (src / "config.json").is_file() else None
    torch_dtype = _export_dtype(dtype, template)
    arch = get_arch(cfg.arch)
    layout = arch.layout(cfg)
    names = saved_tensor_names(ckpt)
    tied_head = arch.hf_tied_head
    tied = tied_head is not None and template is not None and template.get("tie_word_embeddings", True) is not False
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise CheckpointError(f"output folder {str(out)!r} exists and is not empty; give a new folder")
    out.mkdir(parents=True, exist_ok=True)
    writer = _ShardWriter(out, shard_gb)
    pending: dict[str, torch.Tensor] = {}
    need: dict[str, int] = {}
    for pname in names:
        rm = layout.get(pname)
        if rm is None:
            raise CheckpointError(
                f"checkpoint {str(ckpt)!r} has parameter {pname!r} that a {cfg.arch} Hugging Face model does not"
            )
        full = read_logical_tensor(ckpt, pname)
        if tied_head is not None and pname == tied_head[0]:
            if tied and torch.equal(full, read_logical_tensor(ckpt, tied_head[1])):
                continue  # tied and still equal: stored once, as the embedding
            tied = False
        for hf_name, base, rows in _pieces(rm, full):
            total = need.setdefault(hf_name, _hf_rows(layout, hf_name))
            if base == 0 and rows.shape[0] == total:
                writer.add(hf_name, _orient(rows, rm.transposed).to(torch_dtype))
                continue
            buf = pending.setdefault(hf_name, torch.empty(total, *rows.shape[1:], dtype=rows.dtype))
            buf[base : base + rows.shape[0]] = rows
            need[hf_name] -= rows.shape[0]
            if need[hf_name] == 0:
                writer.add(hf_name, _orient(pending.pop(hf_name), rm.transposed).to(torch_dtype))
    index = writer.close()
    (out / "config.json").write_text(json.dumps(hf_config_dict(cfg, template, torch_dtype, tied), indent=2))
    copied = _copy_tokenizer(info["config"], src, out)
    return {
        "files": len(set(index["weight_map"].values())),
        "tensors": len(index["weight_map"]),
        "dtype": str(torch_dtype),
        "tokenizer": copied,
        "tied": tied,
        "folder": str(out),
    }


def saved_tensor_names(ckpt: Path) -> list[str]:
    """Parameter names stored in a checkpoint (its ``model/`` keys), in save order."""
    import torch.distributed.checkpoint as dcp

    md = dcp.FileSystemReader(str(ckpt)).read_metadata().state_dict_metadata
    return [k[len("model/") :] for k in md if k.startswith("model/")]


def read_logical_tensor(ckpt: Path, name: str) -> torch.Tensor:
    """One parameter's full logical tensor from a checkpoint (DCP reads only its chunks)."""
    import torch.distributed.checkpoint as dcp

    from axo4d.training.checkpointing.shards import first_failure, single_process

    md = dcp.FileSystemReader(str(ckpt)).read_metadata().state_dict_metadata[f"model/{name}"]
    sd = {f"model/{name}": torch.empty(tuple(md.size), dtype=md.properties.dtype)}
    try:
        dcp.load(sd, storage_reader=dcp.FileSystemReader(str(ckpt)), no_dist=single_process() or True)
    except dcp.CheckpointException as e:
        raise CheckpointError(f"checkpoint {str(ckpt)!r} cannot be read: {first_failure(e)}") from None
    return sd[f"model/{name}"]


def _pieces(rm: RowMap, full: torch.Tensor) -> Iterator[tuple[str, int, torch.Tensor]]:
    for hf_name, pieces in rm.split(full).items():
        for base, rows in pieces:
            yield hf_name, base, rows


def _hf_rows(layout: dict[str, RowMap], hf_name: str) -> int:
    """Rows (logical orientation) of an HF tensor: the sum over every part that writes into it."""
    total = 0
    for rm in layout.values():
        for p in rm.parts:
            if p.name == hf_name:
                total = max(total, p.base + rm.groups * p.rows)
    return total


def _orient(t: torch.Tensor, transposed: bool) -> torch.Tensor:
    return t.t().contiguous() if transposed else t.contiguous()


def _export_dtype(dtype: str, template: dict | None) -> torch.dtype:
    names = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if dtype == "auto":
        dtype = (template or {}).get("torch_dtype") or (template or {}).get("dtype") or "bfloat16"
    if dtype not in names:
        raise CheckpointError(f"export dtype {dtype!r}; valid: auto, {', '.join(names)}")
    return names[dtype]


def _copy_tokenizer(run_cfg, src: Path, out: Path) -> list[str]:
    """Tokenizer files from the source folder (or beside the run's ``data.tokenizer``)."""
    candidates = [src]
    tok = Path(run_cfg.data.tokenizer) if run_cfg.data.tokenizer != "byte" else None
    if tok is not None:
        candidates.append(tok if tok.is_dir() else tok.parent)
    copied = []
    for folder in candidates:
        for name in TOKENIZER_FILES:
            if (folder / name).is_file() and not (out / name).exists():
                shutil.copyfile(folder / name, out / name)
                copied.append(name)
    return copied


class _ShardWriter:
    """Collects tensors into safetensors files of at most ``shard_gb`` and writes the index."""

    def __init__(self, out: Path, shard_gb: float) -> None:
        self.out, self.limit = out, max(1, int(shard_gb * 2**30))
        self.buf: dict[str, torch.Tensor] = {}
        self.size = 0
        self.files: list[dict[str, torch.Tensor] | str] = []
        self.weight_map: dict[str, str] = {}
        self.total = 0
        self.n = 0

    def add(self, name: str, t: torch.Tensor) -> None:
        nbytes = t.numel() * t.element_size()
        if self.buf and self.size + nbytes > self.limit:
            self._flush()
        self.buf[name] = t
        self.size += nbytes
        self.total += nbytes

    def _flush(self) -> None:
        from safetensors.torch import save_file

        self.n += 1
        name = f"model-{self.n:05d}.safetensors.tmp"
        save_file(self.buf, str(self.out / name), metadata={"format": "pt"})
        for k in self.buf:
            self.weight_map[k] = name
        self.buf, self.size = {}, 0

    def close(self) -> dict:
        if self.buf or not self.n:
            self._flush()
        final = {}
        for i in range(1, self.n + 1):  # names with the count, as transformers writes them
            tmp = f"model-{i:05d}.safetensors.tmp"
            real = f"model-{i:05d}-of-{self.n:05d}.safetensors"
            (self.out / tmp).rename(self.out / real)
            final[tmp] = real
        self.weight_map = {k: final[v] for k, v in self.weight_map.items()}
        index = {"metadata": {"total_size": self.total}, "weight_map": dict(sorted(self.weight_map.items()))}
        (self.out / INDEX).write_text(json.dumps(index, indent=2))
        return index
