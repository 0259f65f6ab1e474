"""Rank side of test_seqsplit.py: the sequence split over z (``parallel.z_split=sequence``).

``parity``: for GPT and Llama at sequence 256, with Goldfish loss off and on and with document
masks, every grid's logits, per-token losses, loss and every gradient against the one-process
model (fp32; each rank computes the reference itself, deterministic on CPU). ``train``: a run with
the sequence split against one process, step by step (tests.dist.cases_train). ``resume``: a
checkpoint saved with one split resumes with the other.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import torch

from axo4d.config import load_config
from axo4d.dist.comm import Comm
from axo4d.facts.grid import Grid
from axo4d.facts.placement import placement_of
from axo4d.nn.goldfish import goldfish_keep
from axo4d.nn.seqsplit import local_part
from axo4d.training.checkpointing.checkpointer import Checkpointer
from axo4d.training.datasets.dataset import open_dataset, prepare_tokens
from axo4d.training.startup import build_model_on
from axo4d.training.trainer import Trainer
from tests.dist.cases_train import _compare
from tests.helpers import gather_full_tensor, shard_full_tensor

SEQ, BATCH = 256, 2
#: fixed GEMM layouts; gradients left in ``p.grad`` (no ZeRO-1 reduce-scatter); one block (tiny: CI time)
FIXED = ("parallel.tuner=false", "parallel.shard_optimizer=false", "model.n_layer=1")
#: (name, config, Goldfish k, document masks)
VARIANTS = [
    ("gpt", "tiny", 0, False),
    ("gpt goldfish", "tiny", 2, False),
    ("gpt documents", "tiny", 0, True),
    ("llama", "llama-tiny", 0, False),
    ("llama goldfish", "llama-tiny", 2, False),
    ("llama documents", "llama-tiny", 0, True),
]


def _cfg(config: str, spec: str, split: str, extra: tuple[str, ...] = ()):
    return load_config(
        config,
        [f"model.seq_len={SEQ}", f"parallel.grid={spec}", f"parallel.z_split={split}", *FIXED, *extra],
    )


def _inputs(k: int, docs: bool):
    g = torch.Generator().manual_seed(1234)
    w = torch.randint(0, 256, (BATCH, SEQ + 1), generator=g)
    x, y = w[:, :-1], w[:, 1:]
    keep = goldfish_keep(x, y, k, 13) if k else None
    d = None
    if docs:  # documents of random lengths, some crossing the chunk boundaries
        starts = (torch.rand(BATCH, SEQ, generator=g) < 0.03).long()
        starts[:, 0] = 0
        d = starts.cumsum(1)
    return x, y, keep, d


def _run(model, x, y, keep, d, kept: int) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """(logits, per-token losses, global loss over ``kept`` targets), the loss's gradients accumulated
    (logits None with Goldfish loss: its mask changes only the loss, the logits are the plain case's)."""
    logits = None
    if keep is None:
        with torch.no_grad():
            logits = model(x, documents=d)
    losses = model(x, y, loss_mask=keep, documents=d)
    loss = losses.sum() / kept
    loss.backward()
    model.finish_gradients()
    total = model.comm.all_reduce(loss.detach().reshape(1).clone(), ("z", "data"))
    return logits, losses.detach(), total[0]


def _rel(a: torch.Tensor, b: torch.Tensor, scale: torch.Tensor | None = None) -> float:
    """max|a - b| relative to max|scale| (default ``b``)."""
    scale = b if scale is None else scale
    return float((a - b).abs().max() / scale.abs().max().clamp_min(1e-12))


def _ref_piece(full: torch.Tensor, p: torch.Tensor, comm: Comm) -> torch.Tensor:
    """This rank's piece of the one-process full tensor ``full`` of ``p`` (zero-padded to the grid's
    padded shape, e.g. a vocabulary padded to a multiple of G_y)."""
    shape = placement_of(p).full_shape
    pad = torch.zeros(shape, dtype=full.dtype)
    pad[tuple(slice(0, n) for n in full.shape)] = full
    return shard_full_tensor(pad, p, comm)


def _cases(model, variants: list, kept: list[int]) -> list[tuple]:
    """(logits, losses, loss, grads by name) of each variant's inputs on ``model``."""
    out = []
    for (x, y, keep, d), n in zip(variants, kept):
        for p in model.parameters():
            p.grad = None
        logits, losses, loss = _run(model, x, y, keep, d, n)
        out.append((logits, losses, loss, {name: p.grad.clone() for name, p in model.named_parameters()}))
    return out


def parity(info, specs: list[str]) -> list[dict]:
    """Every rank compares its own blocks: logits, losses and gradient pieces against the same pieces
    of the one-process model's (relative to the largest element of the whole reference tensor)."""
    one = Comm(Grid(), 0, init_groups=False)
    world = Comm(Grid(data=info.world_size), info.rank)
    out = []
    for config, arch_variants in (("tiny", VARIANTS[:3]), ("llama-tiny", VARIANTS[3:])):
        inputs = [_inputs(k, docs) for _, _, k, docs in arch_variants]
        kept = [int(keep.sum()) if keep is not None else x.numel() for x, _, keep, _ in inputs]
        refs = full = vocab = None
        if info.rank == 0:  # the one-process reference, computed once and broadcast
            ref = build_model_on(_cfg(config, "data=1", "batch"), one, torch.device("cpu"), seed=0)
            cases = _cases(ref, inputs, kept)
            refs = [c[:3] for c in cases]
            full = [{n: gather_full_tensor(c[3][n], p, one) for n, p in ref.named_parameters()} for c in cases]
            vocab = ref.spec.vocab_size
        refs, full, vocab = world.broadcast_object((refs, full, vocab))
        for spec in specs:
            t0 = time.perf_counter()
            comm = Comm(Grid.parse(spec), info.rank, timeout_s=60)
            model = build_model_on(_cfg(config, spec, "sequence"), comm, torch.device("cpu"), seed=0)
            nd = comm.size("data")
            rows = slice(comm.coord("data") * BATCH // nd, (comm.coord("data") + 1) * BATCH // nd)

            def mine(t, rows=rows, comm=comm):
                return None if t is None else local_part(t[rows], comm, 1)

            # document masks on the first grid of a group only (CI time); Goldfish on and off on every grid
            todo = [i for i, (_, _, _, docs) in enumerate(arch_variants) if not docs or spec == specs[0]]
            got = _cases(model, [tuple(mine(t) for t in inputs[i]) for i in todo], [kept[i] for i in todo])
            for (name, *_), (logits, losses, loss, grads), (r_logits, r_losses, r_loss), rg in zip(
                [arch_variants[i] for i in todo], got, [refs[i] for i in todo], [full[i] for i in todo]
            ):
                nv = losses.shape[-1] if logits is None else logits.shape[-1]
                c0 = comm.index(("x", "y")) * nv  # the logits: block x of y slice (design.md section 2.1)
                real = max(0, min(nv, vocab - c0))
                err = {
                    "logits": None
                    if logits is None
                    else _rel(logits[..., :real], mine(r_logits)[..., c0 : c0 + real], r_logits),
                    "losses": _rel(losses, mine(r_losses), r_losses),
                    "loss": abs(float(loss) - float(r_loss)) / abs(float(r_loss)),
                }
                gerr = {n: _rel(grads[n], _ref_piece(rg[n], p, comm), rg[n]) for n, p in model.named_parameters()}
                worst = max(gerr, key=gerr.get)
                err["grad"], err["worst_grad"] = gerr[worst], worst
                out.append({"case": name, "grid": spec, "seconds": time.perf_counter() - t0, **err})
    return out


def train(info, spec: str, overrides: list[str], config: str = "tiny") -> dict:
    base = load_config(config, ["parallel.tuner=false", *overrides])
    world = Comm(Grid(data=info.world_size), info.rank)
    if info.rank == 0:
        prepare_tokens(base.data)
    world.barrier()
    ds = open_dataset(base.data, base.model.seq_len, base.train.seed, base.model.vocab_size)

    def run(cfg, comm):
        tr = Trainer(cfg, comm, ds, torch.device("cpu"))
        from tests.helpers import full_state_dict

        losses = [tr.step(i).loss for i in range(cfg.train.steps)]
        return {"losses": losses, "val": tr.evaluate(), "state": full_state_dict(tr.model, comm)}

    ref = run(base, Comm(Grid(), 0, init_groups=False)) if info.rank == 0 else None
    ref = world.broadcast_object(ref)
    par = dataclasses.replace(base.parallel, grid=spec, z_split="sequence")
    got = run(dataclasses.replace(base, parallel=par), Comm(Grid.parse(spec), info.rank, timeout_s=60))
    return _compare(ref, got, spec + " sequence")


def resume(info, tmp: str, spec: str, steps: int, k: int) -> dict:
    """Save at step ``k`` with one split, resume with the other (both ways); losses of the resumed
    steps against the uninterrupted run of the saving split, and whether the loaded weights are
    exactly those saved."""
    world = Comm(Grid(data=info.world_size), info.rank)
    base = load_config("tiny", [f"train.steps={steps}", "train.eval_interval=0", "parallel.tuner=false"])
    if info.rank == 0:
        prepare_tokens(base.data)
    world.barrier()
    ds = open_dataset(base.data, base.model.seq_len, base.train.seed, base.model.vocab_size)

    def trainer(split: str) -> Trainer:
        par = dataclasses.replace(base.parallel, grid=spec, z_split=split)
        cfg = dataclasses.replace(base, parallel=par)
        return Trainer(cfg, Comm(Grid.parse(spec), info.rank, timeout_s=60), ds, torch.device("cpu"))

    def weights(tr: Trainer) -> dict:
        return {n: gather_full_tensor(p.data, p, tr.comm) for n, p in tr.model.named_parameters()}

    out = {}
    for saved, loaded in (("sequence", "batch"), ("batch", "sequence")):
        tr = trainer(saved)
        ck = Checkpointer(Path(tmp) / saved, tr.cfg, tr.comm, tr.model, tr.opt)
        ref = [tr.step(i).loss for i in range(k)]
        path = ck.save(k)
        at_k = weights(tr)
        ref += [tr.step(i).loss for i in range(k, steps)]
        tr = trainer(loaded)
        start = Checkpointer(Path(tmp) / f"{saved}-{loaded}", tr.cfg, tr.comm, tr.model, tr.opt).load(path, spec)
        same = all(torch.equal(at_k[n], w) for n, w in weights(tr).items())
        resumed = [tr.step(i).loss for i in range(start, steps)]
        out[f"{saved}->{loaded}"] = {"start": start, "ref": ref[k:], "resumed": resumed, "weights_equal": same}
    return out


def generation(info, spec: str) -> list[dict]:
    """Greedy and sampled continuations with the prefill split over z equal the one-process model's
    (prompts of different lengths: left padding; GPT's learned positions and Llama's RoPE)."""
    from axo4d.models.generation import Sampling, generate

    one = Comm(Grid(), 0, init_groups=False)
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (5, 17, 9)]
    out = []
    for config in ("tiny", "llama-tiny"):
        ref_model = build_model_on(_cfg(config, "data=1", "batch"), one, torch.device("cpu"), seed=0)
        comm = Comm(Grid.parse(spec), info.rank, timeout_s=60)
        model = build_model_on(_cfg(config, spec, "sequence"), comm, torch.device("cpu"), seed=0)
        assert model.split_sequence  # the prefill is split (axo4d.models.generation._split_prefill)
        for sampling in (Sampling(), Sampling(greedy=False, temperature=0.8, top_p=0.9, seed=3)):
            ref = generate(ref_model, prompts, 6, sampling)
            got = generate(model, prompts, 6, sampling)
            out.append({"case": f"{config} {sampling.describe()}", "grid": spec, "equal": got == ref, "got": got})
    return out


def group(info, tmp: str, parity_specs: list[str], train_spec: str | None, resume_spec: str | None) -> dict:
    """One spawned group's cases."""
    res = {"parity": parity(info, parity_specs)}
    if train_spec:
        res["train"] = train(info, train_spec, ["train.steps=20", "model.seq_len=64"])
    if resume_spec:
        res["resume"] = resume(info, tmp, resume_spec, 6, 3)
        res["generation"] = generation(info, resume_spec)
    return res
