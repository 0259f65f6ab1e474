"""What each model keeps for backward, per layer type: axo4d against plain PyTorch, same shape.

    python -m bench.saved_bytes                       # gpt-1.3b's shape scaled to hidden 128, CPU, bf16 autocast
    python -m bench.saved_bytes --config llama3.2-1b  # Llama 3.2 1B's
    python -m bench.saved_bytes --compile             # also both under torch.compile (a C++ compiler on CPU)
    python -m bench.saved_bytes --predict-batch 8 --predict-seq 2048

Both models are built on one process (axo4d on the 1x1x1x1 grid with the default schedule and
tuner) with the configuration's proportions -- head size, heads per kv head, MLP ratio -- scaled
down to ``--hidden`` and a vocabulary of ``--vocab`` (a CPU runs bf16 GEMMs slowly), ``--layers``
blocks and a short sequence, and run one forward under autocast (``--dtype``, bf16 by default)
inside ``torch.autograd.graph.saved_tensors_hooks``. Every tensor an autograd node saves is
counted once (by storage), under the innermost module that was running (``attn.qkv``,
``mlp.down``, ...; the loss and the embeddings run at the top level); the model's parameters are
not counted (they exist anyway), copies of them (bf16 casts) are.

Each saved tensor is one of three kinds, scaled to the configuration's real shape and the
``--predict-*`` micro-batch and sequence (default gpt-1.3b's: 8 x 2048) in the last table:
activations with a hidden-size dimension (x tokens x hidden), activations over the vocabulary
(x tokens x vocabulary) and weight copies (x parameters). The result estimates the activation
memory held at the end of the forward on a GPU. Not counted: temporaries that live only inside
an operation (their peak is what ``bench.single_gpu``'s peak-memory column measures on a GPU).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import re
import sys
import tempfile
from collections import defaultdict

import torch

from axo4d.config import ModelConfig, load_config
from axo4d.dist.comm import Comm
from axo4d.facts.archs import get_arch, model_spec
from axo4d.facts.grid import Grid
from axo4d.models import apply_compile, build_model
from axo4d.nn.blas_tuner import GemmTuner
from axo4d.nn.context import LayerContext
from axo4d.nn.overlap_schedule import OverlapSchedule

GIB = 2**30
KINDS = ("hidden", "vocab", "weights")


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="python -m bench.saved_bytes", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--config", default="gpt-1.3b", help="model config whose proportions are used")
    ap.add_argument("--hidden", type=int, default=128, help="hidden size measured (the head size is kept)")
    ap.add_argument("--vocab", type=int, default=2048, help="vocabulary measured")
    ap.add_argument("--layers", type=int, default=2, help="blocks (>= 2: one block is the difference to one fewer)")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=48, help="sequence (batch x seq apart from every width)")
    ap.add_argument("--dtype", default="bf16", choices=("bf16", "fp32"))
    ap.add_argument("--compile", action="store_true", help="also measure both models under torch.compile")
    ap.add_argument("--list", action="store_true", help="print every saved tensor (part, shape, dtype)")
    ap.add_argument("--predict-batch", type=int, default=8)
    ap.add_argument("--predict-seq", type=int, default=2048)
    return ap.parse_args(argv)


def scaled(cfg: ModelConfig, a: argparse.Namespace) -> ModelConfig:
    """``cfg`` with hidden ``a.hidden`` (same head size, same heads per kv head, same MLP ratio),
    vocabulary ``a.vocab``, ``a.layers`` blocks and sequence ``a.seq``."""
    hd = cfg.head_dim or cfg.n_embd // cfg.n_head
    heads = max(1, a.hidden // hd)
    group = cfg.n_head // (cfg.n_kv_head or cfg.n_head)
    kv = max(1, heads // group)
    ffn = (cfg.ffn_hidden or cfg.ffn_mult * cfg.n_embd) * a.hidden // cfg.n_embd
    return dataclasses.replace(
        cfg,
        n_embd=heads * hd,
        n_head=kv * group,
        n_kv_head=kv if cfg.n_kv_head else 0,
        head_dim=hd if cfg.head_dim else 0,
        ffn_hidden=ffn if cfg.ffn_hidden else 0,
        vocab_size=a.vocab,
        n_layer=a.layers,
        seq_len=a.seq,
    )


class SavedCounter:
    """Bytes of distinct storages saved for backward, by (innermost running module, kind)."""

    def __init__(self, model: torch.nn.Module, vocab: tuple[int, ...]) -> None:
        self.bytes: dict[tuple[str, str], int] = defaultdict(int)
        self.seen: set[int] = set()
        self.listing: list[tuple] = []
        self.params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        shapes = {tuple(getattr(m, "block_shape", ())) for m in model.modules()}
        shapes |= {tuple(p.shape) for p in model.parameters() if p.dim() == 2}
        self.shapes = shapes | {s[::-1] for s in shapes}  # a weight may be saved transposed
        self.stack: list[str] = []
        self.vocab = vocab
        self.handles = []
        for name, m in model.named_modules():
            if name:
                self.handles.append(m.register_forward_pre_hook(self._enter(name)))
                self.handles.append(m.register_forward_hook(self._leave))

    def _enter(self, name: str):
        def hook(module, args) -> None:
            self.stack.append(name)

        return hook

    def _leave(self, module, args, out) -> None:
        self.stack.pop()

    def classify(self, t: torch.Tensor) -> tuple[str, str]:
        kind = (
            "weights"
            if t.dim() == 2 and tuple(t.shape) in self.shapes
            else "vocab"
            if t.dim() and t.shape[-1] in self.vocab
            else "hidden"
        )
        if self.stack:
            name = re.sub(r"(_orig_mod\.)|(^blocks\.\d+\.)", "", self.stack[-1])
            return name or "block", kind
        return ("loss" if kind == "vocab" else "embedding/top"), kind

    def pack(self, t: torch.Tensor):
        st = t.untyped_storage()
        ptr = st.data_ptr()
        if ptr not in self.seen and ptr not in self.params and st.nbytes():
            self.seen.add(ptr)
            key = self.classify(t)
            self.bytes[key] += st.nbytes()
            self.listing.append((*key, tuple(t.shape), str(t.dtype).replace("torch.", ""), st.nbytes()))
        return t

    @contextlib.contextmanager
    def counting(self):
        with torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t):
            yield

    def close(self) -> None:
        for h in self.handles:
            h.remove()


def build(kind: str, cfg: ModelConfig, compiled: bool, tuner_path: str):
    if kind == "axo4d":
        comm = Comm(Grid(), 0, init_groups=False)
        tuner = None if compiled else GemmTuner(comm, tuner_path, reps=1, verbose=False)  # as make_tuner
        model = build_model(cfg, LayerContext(comm, OverlapSchedule(comm), tuner))
        if compiled:
            apply_compile(model)
        return model, model
    vocab = model_spec(cfg, Grid()).vocab
    model = get_arch(cfg.arch).plain_class()(cfg, vocab)
    return model, (torch.compile(model) if compiled else model)


def measure(
    kind: str, cfg: ModelConfig, a: argparse.Namespace, compiled: bool, tuner_path: str
) -> dict[tuple[str, str], int]:
    model, fwd = build(kind, cfg, compiled, tuner_path)
    g = torch.Generator().manual_seed(0)
    x, y = (torch.randint(0, cfg.vocab_size, (a.batch, cfg.seq_len), generator=g) for _ in "xy")
    dtype = torch.bfloat16 if a.dtype == "bf16" else torch.float32
    vocab = (cfg.vocab_size, model_spec(cfg, Grid()).vocab)
    for _ in range(2):  # the first pass tunes (axo4d) or compiles; the second is counted
        counter = SavedCounter(model, vocab)
        with counter.counting(), torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
            loss = fwd(x, y).float().mean()
        counter.close()
        loss.backward()
        if kind == "axo4d":
            model.finish_gradients()
        model.zero_grad(set_to_none=True)
    if a.list:
        print(f"{kind} {'compiled' if compiled else 'eager'}:")
        for row in counter.listing:
            print("   ", *row)
    return dict(counter.bytes)


def per_block(label: str) -> bool:
    return label not in ("loss", "embedding/top", "lm_head", "ln_f", "norm")


def by_kind(r: dict[tuple[str, str], int]) -> dict[str, int]:
    out: dict[str, int] = defaultdict(int)
    for (_, kind), b in r.items():
        out[kind] += b
    return out


def _print_parts(res: dict[str, dict], names: list[str], a: argparse.Namespace, tokens: int) -> None:
    """Print the eager runs' bytes saved for backward per token, by part and kind."""
    parts = sorted({lab for n in names if "eager" in n for lab, _ in res[n]}, key=lambda s: (not per_block(s), s))
    eager = [n for n in names if "eager" in n]
    print(f"  {'part':22s}" + "".join(f"{n:>17s}" for n in eager))
    for lab in parts:
        for kind in KINDS:
            if any(res[n].get((lab, kind)) for n in eager):
                div = tokens * (a.layers if per_block(lab) else 1)
                print(
                    f"  {lab + ' (' + kind[0] + ')':22s}"
                    + "".join(f"{res[n].get((lab, kind), 0) / div:17.1f}" for n in eager)
                )


def _predicted(
    res: dict[str, dict],
    shallow: dict[str, dict],
    names: list[str],
    a: argparse.Namespace,
    full: ModelConfig,
    cfg: ModelConfig,
    tokens: int,
) -> dict[str, tuple[float, float]]:
    """Each run's predicted GiB for the full configuration: (blocks, head/loss/embedding)."""
    pt = a.predict_batch * a.predict_seq
    sh, sv = full.n_embd / cfg.n_embd, full.vocab_size / cfg.vocab_size
    act = {"hidden": pt / tokens * sh, "vocab": pt / tokens * sv}
    tot = {}
    for n in names:
        deep, one = by_kind(res[n]), by_kind(shallow[n])
        block = {k: deep[k] - one[k] for k in KINDS}
        head = {k: one[k] - (a.layers - 1) * block[k] for k in KINDS}
        tot[n] = (
            sum(block[k] * act.get(k, sh * sh) for k in KINDS) * full.n_layer / GIB,
            sum(head[k] * act.get(k, sh * sv) for k in KINDS) / GIB,
        )
    return tot


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    full = load_config(a.config).model
    cfg = scaled(full, a)
    tokens = a.batch * a.seq
    kinds = [("plain", False), ("axo4d", False)] + ([("plain", True), ("axo4d", True)] if a.compile else [])
    res, shallow = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        for k, c in kinds:
            name = f"{k} {'compiled' if c else 'eager'}"
            res[name] = measure(k, cfg, a, c, f"{tmp}/tuner.json")
            shallow[name] = measure(k, dataclasses.replace(cfg, n_layer=a.layers - 1), a, c, f"{tmp}/tuner.json")
            torch._dynamo.reset()
    names = list(res)
    hd = cfg.head_dim or cfg.n_embd // cfg.n_head
    print(
        f"bench.saved_bytes: {a.config}'s proportions at hidden {cfg.n_embd} ({cfg.n_head} heads of {hd}), "
        f"vocabulary {cfg.vocab_size}, {a.layers} layers, {a.batch} x {a.seq} tokens, {a.dtype} autocast, CPU"
    )
    print(
        "  bytes saved for backward per token by part (eager; block parts per layer); kind: h = with a hidden "
        "dimension, V = over the vocabulary, w = weight copies"
    )
    _print_parts(res, names, a, tokens)
    # one block = the difference of two depths (compiled code saves outside any module's hooks); each
    # kind scaled to the configuration's shape: hidden by tokens x hidden, vocabulary by tokens x
    # vocabulary, weight copies by the parameters (blocks: hidden^2, head: hidden x vocabulary)
    tot = _predicted(res, shallow, names, a, full, cfg, tokens)
    print(
        f"  predicted for {a.config} ({full.n_layer} layers, hidden {full.n_embd}, vocabulary {full.vocab_size}) "
        f"at micro-batch {a.predict_batch} x seq {a.predict_seq} (GiB; a block measured as the difference of "
        f"{a.layers} and {a.layers - 1} layers):"
    )
    print(f"  {'':22s}" + "".join(f"{n:>17s}" for n in names))
    print(f"  {'blocks':22s}" + "".join(f"{tot[n][0]:17.2f}" for n in names))
    print(f"  {'head, loss, embedding':22s}" + "".join(f"{tot[n][1]:17.2f}" for n in names))
    print(f"  {'total':22s}" + "".join(f"{sum(tot[n]):17.2f}" for n in names))
    for c in ("eager", "compiled"):
        if f"plain {c}" in tot and f"axo4d {c}" in tot:
            p, x = sum(tot[f"plain {c}"]), sum(tot[f"axo4d {c}"])
            print(f"  axo4d {c} - plain {c}: {x - p:+.2f} GiB ({x / p:.3f}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
