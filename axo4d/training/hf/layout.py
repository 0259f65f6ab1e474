"""Where each axo4d parameter's rows come from in a Hugging Face checkpoint, and back.

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

    from axo4d.config import ModelConfig


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


def _one(name: str, n: int, transposed: bool = False) -> RowMap:
    """All ``n`` rows of ``name`` in order."""
    return RowMap((Part(name, n),), 1, transposed)


def llama_layout(cfg: ModelConfig) -> dict[str, RowMap]:
    """axo4d parameter name -> RowMap of a ``LlamaForCausalLM`` checkpoint."""
    h, nh = cfg.n_embd, cfg.n_head
    kv, hd = cfg.n_kv_head or nh, cfg.head_dim or cfg.n_embd // cfg.n_head
    f = cfg.ffn_hidden or cfg.ffn_mult * h
    out: dict[str, RowMap] = {}
    for i in range(cfg.n_layer):
        p, q = f"model.layers.{i}.", f"blocks.{i}."
        out[q + "attn.qkv.weight"] = RowMap(
            (
                Part(p + "self_attn.q_proj.weight", nh // kv * hd),
                Part(p + "self_attn.k_proj.weight", hd),
                Part(p + "self_attn.v_proj.weight", hd),
            ),
            kv,
        )
        out[q + "attn.proj.weight"] = _one(p + "self_attn.o_proj.weight", h)
        out[q + "mlp.gate_up.weight"] = RowMap(
            (Part(p + "mlp.gate_proj.weight", 1), Part(p + "mlp.up_proj.weight", 1)), f
        )
        out[q + "mlp.down.weight"] = _one(p + "mlp.down_proj.weight", h)
        out[q + "attn_norm.weight"] = _one(p + "input_layernorm.weight", h)
        out[q + "mlp_norm.weight"] = _one(p + "post_attention_layernorm.weight", h)
    out["norm.weight"] = _one("model.norm.weight", h)
    if cfg.tie_embeddings:
        out["lm_head.weight"] = _one("model.embed_tokens.weight", cfg.vocab_size)
    else:
        out["embed_tokens"] = _one("model.embed_tokens.weight", cfg.vocab_size)
        out["lm_head.weight"] = _one("lm_head.weight", cfg.vocab_size)
    return out


def gpt2_layout(cfg: ModelConfig) -> dict[str, RowMap]:
    """axo4d parameter name -> RowMap of a ``GPT2LMHeadModel`` checkpoint (``lm_head`` read from the
    tied ``wte`` unless the checkpoint has its own ``lm_head.weight``)."""
    h, nh = cfg.n_embd, cfg.n_head
    hd, f = h // nh, cfg.ffn_hidden or cfg.ffn_mult * h
    out: dict[str, RowMap] = {
        "wte": _one("transformer.wte.weight", cfg.vocab_size),
        "wpe": _one("transformer.wpe.weight", cfg.seq_len),
    }
    for i in range(cfg.n_layer):
        p, q = f"transformer.h.{i}.", f"blocks.{i}."
        for kind in ("weight", "bias"):
            name = p + f"attn.c_attn.{kind}"
            out[q + f"attn.qkv.{kind}"] = RowMap(
                (Part(name, hd, 0), Part(name, hd, h), Part(name, hd, 2 * h)), nh, transposed=kind == "weight"
            )
            out[q + f"attn.proj.{kind}"] = _one(p + f"attn.c_proj.{kind}", h, kind == "weight")
            out[q + f"mlp.up.{kind}"] = _one(p + f"mlp.c_fc.{kind}", f, kind == "weight")
            out[q + f"mlp.down.{kind}"] = _one(p + f"mlp.c_proj.{kind}", h, kind == "weight")
            out[q + f"ln1.{kind}"] = _one(p + f"ln_1.{kind}", h)
            out[q + f"ln2.{kind}"] = _one(p + f"ln_2.{kind}", h)
        if not cfg.bias:
            for k in [k for k in out if k.startswith(q) and k.endswith(".bias")]:
                del out[k]
    out["ln_f.weight"] = _one("transformer.ln_f.weight", h)
    if cfg.bias:
        out["ln_f.bias"] = _one("transformer.ln_f.bias", h)
    out["lm_head.weight"] = _one("lm_head.weight", cfg.vocab_size)
    return out


def hf_layout(cfg: ModelConfig) -> dict[str, RowMap]:
    return llama_layout(cfg) if cfg.arch == "llama" else gpt2_layout(cfg)
