"""Where each axo4d parameter's rows come from in a Hugging Face checkpoint, and back.

Each architecture's entry (:mod:`axo4d.facts.archs`) gives its map; this module holds the machinery.

An axo4d parameter's logical tensor is built from one or more Hugging Face tensors by a
:class:`RowMap`: groups of rows taken in turn from several sources. The fused Llama QKV is
``n_kv_head`` groups of (that group's query rows, its key rows, its value rows); the fused
gate|up is ``ffn`` groups of (one gate row, one up row); GPT-2's per-head QKV takes its rows from
three row ranges of ``c_attn`` (a ``Conv1D``, stored transposed). :meth:`RowMap.segments` says,
for any range of logical rows, which contiguous source rows land where -- so a rank reads only
the rows of its own chunks -- and :meth:`RowMap.split` turns a full logical tensor back into the
Hugging Face tensors (export). Pure: no torch at import, no files.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class Part:
    """Rows ``base + g*rows ... base + (g+1)*rows`` of HF tensor ``name`` for group ``g``."""

    name: str
    rows: int
    base: int = 0


@dataclass(frozen=True)
class RowMap:
    """Logical rows = for each of ``groups`` groups, each part's rows in turn. ``transposed``: the
    HF tensors are stored ``(in, out)`` (GPT-2's ``Conv1D``), logical rows are their columns."""

    parts: tuple[Part, ...]
    groups: int = 1
    transposed: bool = False

    @property
    def group_rows(self) -> int:
        return sum(p.rows for p in self.parts)

    def segments(self, r0: int, r1: int) -> list[tuple[str, slice, slice]]:
        """``(hf name, source rows, destination rows relative to r0)`` covering logical rows
        ``[r0, r1)``; destination slices may be strided (interleaved parts of one row each)."""
        g_rows, out = self.group_rows, []
        ga, gb = -(-r0 // g_rows), r1 // g_rows  # whole groups inside [r0, r1)
        if ga < gb:
            off = 0
            for p in self.parts:
                if p.rows == 1 and g_rows > 1:  # one row per group: one strided run
                    out.append(
                        (
                            p.name,
                            slice(p.base + ga, p.base + gb),
                            slice(ga * g_rows + off - r0, gb * g_rows + off - r0, g_rows),
                        )
                    )
                else:
                    for g in range(ga, gb):
                        d = g * g_rows + off - r0
                        out.append(
                            (p.name, slice(p.base + g * p.rows, p.base + (g + 1) * p.rows), slice(d, d + p.rows))
                        )
                off += p.rows
        edges = [(r0, min(r1, ga * g_rows))] if ga < gb else [(r0, r1)]
        if ga < gb:
            edges.append((max(r0, gb * g_rows), r1))
        for a, b in edges:  # partial groups at the ends
            r = a
            while r < b:
                g, o = divmod(r, g_rows)
                for p in self.parts:
                    if o < p.rows:
                        n = min(p.rows - o, b - r)
                        out.append(
                            (
                                p.name,
                                slice(p.base + g * p.rows + o, p.base + g * p.rows + o + n),
                                slice(r - r0, r - r0 + n),
                            )
                        )
                        r += n
                        break
                    o -= p.rows
        return out

    def split(self, full: torch.Tensor) -> dict[str, list[tuple[int, torch.Tensor]]]:
        """The HF pieces of a full logical tensor: ``name -> [(base row, rows)]`` (not transposed)."""
        out: dict[str, list] = {}
        grouped = full.reshape(self.groups, self.group_rows, *full.shape[1:])
        off = 0
        for p in self.parts:
            rows = grouped[:, off : off + p.rows].reshape(self.groups * p.rows, *full.shape[1:])
            out.setdefault(p.name, []).append((p.base, rows))
            off += p.rows
        return out


def one(name: str, n: int, transposed: bool = False) -> RowMap:
    """All ``n`` rows of ``name`` in order."""
    return RowMap((Part(name, n),), 1, transposed)


__all__ = ["Part", "RowMap", "one"]
