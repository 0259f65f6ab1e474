"""Rank-side checks of the mixture-of-experts models (Qwen3-MoE, Mixtral, Qwen2-MoE) on grids
(run by test_moe.py): each rank builds the model (overlapped schedule), reads its own slices of
the Hugging Face folder and compares logits, the load-balancing loss, the training loss, every
gradient and greedy generation with the references ``transformers`` computed in the test process;
training with expert parallelism against one process (:func:`train`)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from axo4d.config import TrainConfig, load_config
from axo4d.dist.comm import Comm
from axo4d.facts.grid import Grid
from axo4d.models import build_model
from axo4d.models.moe import apply_expert_gemm
from axo4d.nn.context import LayerContext
from axo4d.nn.experts import GroupedExperts
from axo4d.nn.overlap_schedule import make_schedule
from axo4d.training.checkpointing.checkpointer import Checkpointer
from axo4d.training.datasets.dataset import open_dataset, prepare_tokens
from axo4d.training.hf.hf_config import read_hf_config
from axo4d.training.hf.weights import load_hf_weights
from axo4d.training.trainer import Trainer
from tests import moe_models as M
from tests.helpers import full_optimizer_state, full_tensors


def run(info, base: str, plan: dict) -> dict:
    """Each model of ``plan`` on each grid it names."""
    torch.set_num_threads(1)
    out = {}
    for name, grids in plan.items():
        folder = Path(base) / name
        ref = torch.load(Path(base) / f"{name}.ref.pt")
        cfg, _ = read_hf_config(folder)
        for spec in grids:  # 'data=4 ep=2': G_ep = 2
            grid, _, ep = spec.partition(" ep=")
            comm = Comm(Grid.parse(grid, expert=int(ep or 1)), info.rank, timeout_s=120)
            model = build_model(cfg, LayerContext(comm, make_schedule(comm, True)), seed=None)
            apply_expert_gemm(model, TrainConfig().expert_gemm)  # the default: grouped where the experts are whole
            load_hf_weights(model, folder, comm.grid, comm.rank)
            out[f"{name} {spec}"] = M.moe_errors(
                model, comm, folder, ref, ref["idx"], ref["prompts"], ref["new_tokens"]
            )
            comm.close()
    return out


# ---- grouped expert GEMM vs the per-expert loop on grids ------------------------------------------------
def _forward_backward(model, comm, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """Full logits, the training loss (mean cross-entropy + the aux loss as the trainer weighs it)
    and every full gradient of ``model`` on ``idx`` (rows split over the batch ranks)."""
    from tests.helpers import gather_blocks, shard_rows

    rows = shard_rows(idx, comm)  # (B/(data*z), T)
    model.eval()
    with torch.no_grad():
        lg = model(rows[:, :-1])  # (b, T-1, V/y)
    logits = gather_blocks(lg.reshape(-1, lg.shape[-1]), comm, ("z", "data"), ("x", "y"))
    model.train()
    losses = model(rows[:, :-1], rows[:, 1:])  # (b, T-1)
    n = idx[:, 1:].numel()
    aux = model.router_loss()
    (losses.sum() / n + model.router_loss_weight() * aux).backward()
    model.finish_gradients()
    mine = losses.detach().sum().reshape(1) / n + model.router_loss_weight() * aux.detach()  # this rank's part
    loss = comm.all_reduce(mine, ("z", "data"))
    return logits, loss, full_tensors(model, comm, lambda p: p.grad, logical=True)


def grouped_vs_loop(info, base: str, grids: list[str]) -> dict:
    """Mixtral (4 experts, top 2) on each of ``grids`` twice from the same folder: the experts as
    grouped GEMMs (:func:`~axo4d.models.moe.apply_expert_gemm` 'grouped') and as the per-expert loop;
    per grid the MoE layers replaced and the max relative differences of logits, loss and every
    gradient. Where x splits the experts nothing is replaced (they loop)."""
    torch.set_num_threads(1)
    folder = Path(base) / "mixtral"
    ref = torch.load(folder.parent / "mixtral.ref.pt")
    cfg, _ = read_hf_config(folder)
    out = {}
    for spec in grids:
        grid, _, ep = spec.partition(" ep=")
        comm = Comm(Grid.parse(grid, expert=int(ep or 1)), info.rank, timeout_s=120)
        runs, replaced = [], 0
        for kernel in ("grouped", "loop"):
            model = build_model(cfg, LayerContext(comm, make_schedule(comm, True)), seed=None)
            load_hf_weights(model, folder, comm.grid, comm.rank)
            replaced = apply_expert_gemm(model, kernel) if kernel == "grouped" else replaced
            runs.append(_forward_backward(model, comm, ref["idx"]))
        (lg, loss, grads), (lg0, loss0, grads0) = runs
        rel = lambda a, b: float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))  # noqa: E731
        out[spec] = {
            "replaced": replaced,
            "logits": rel(lg, lg0),
            "loss": rel(loss, loss0),
            "grad": max(rel(grads[k], g) for k, g in grads0.items() if g.abs().max() > 0),
            "zero_grads_equal": all(torch.equal(grads[k], g) for k, g in grads0.items() if not g.abs().max() > 0),
        }
        comm.close()
    return out


# ---- training with expert parallelism (moe-tiny: 8 experts, 2 layers) vs one process ---------------------
def _unbalance(model) -> None:
    """Most tokens to expert 0 in every layer: a constant added to every embedding (a direction all
    tokens share after the norms) and router row 0 along it (x = y = z = 1: full tensors)."""
    with torch.no_grad():
        (model.lm_head.weight if model.tied else model.embed_tokens).add_(0.05)
        for block in model.blocks:
            block.mlp.router.weight[0] = 1.0


def train(info, base: str, steps: int, k: int) -> dict:
    """``steps`` steps of moe-tiny on one process (rank 0), then on data=4 with experts over 4 ranks
    (saved after ``k``); that checkpoint resumed with experts over 2 ranks, the optimizer offloaded
    to the host; 3 steps of an unbalanced router (:func:`_unbalance`) on one process and on data=4,
    experts over 2 ranks (their GEMMs grouped, and again one expert after the other); 3 steps on
    data=2,z=2 with experts over 2 ranks, z splitting every sequence and the blocks recomputed."""
    torch.set_num_threads(1)
    cfg = load_config("moe-tiny", [f"train.steps={steps}", "train.eval_interval=0", "parallel.tuner=false"])
    world = Comm(Grid(data=info.world_size), info.rank)
    if info.rank == 0:
        prepare_tokens(cfg.data)
    world.barrier()
    ds = open_dataset(cfg.data, cfg.model.seq_len, cfg.train.seed, cfg.model.vocab_size)

    def trainer(
        spec: str,
        ep: int,
        unbalanced: bool = False,
        offload: str = "none",
        z_split: str = "batch",
        ckpt: bool = False,
        gemm: str = "auto",
    ) -> Trainer:
        c = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, grid=spec, expert=ep, z_split=z_split))
        t = dataclasses.replace(c.train, offload=offload, activation_checkpointing=ckpt, expert_gemm=gemm)
        c = dataclasses.replace(c, train=t)
        grid = Grid.parse(spec, expert=ep)
        comm = Comm(grid, info.rank, timeout_s=120) if grid.world_size > 1 else Comm(grid, 0, init_groups=False)
        tr = Trainer(c, comm, ds, torch.device("cpu"))
        if unbalanced:
            _unbalance(tr.model)
        return tr

    ref = None
    if info.rank == 0:
        tr = trainer("data=1", 1)
        st = [tr.step(i) for i in range(steps)]
        tr = trainer("data=1", 1, unbalanced=True)
        ref = {"losses": [s.loss for s in st], "norms": [s.grad_norm for s in st]}
        ref["unbalanced"] = [tr.step(i).loss for i in range(3)]
    ref = world.broadcast_object(ref)
    tr = trainer("data=4", 4)
    ck = Checkpointer(Path(base) / "ep4", tr.cfg, tr.comm, tr.model, tr.opt)
    st = [tr.step(i) for i in range(k)]
    path = ck.save(k)
    tr.settle()
    state_k = full_tensors(tr.model, tr.comm)
    state_k.update(full_optimizer_state(tr.opt, tr.model, tr.comm))  # each expert's moments from its holders
    st += [tr.step(i) for i in range(k, steps)]
    tr = trainer("data=4", 2, offload="optimizer")  # the sharded optimizer's state on the host
    start = Checkpointer(Path(base) / "ep2", tr.cfg, tr.comm, tr.model, tr.opt).load(path, "data=4")
    tr.settle()
    loaded = full_tensors(tr.model, tr.comm)
    loaded.update(full_optimizer_state(tr.opt, tr.model, tr.comm))
    resumed = [tr.step(i) for i in range(start, steps)]
    tr = trainer("data=4", 2, unbalanced=True, gemm="grouped")
    grouped_layers = sum(isinstance(b.mlp.experts, GroupedExperts) for b in tr.model.blocks)
    unbalanced = [tr.step(i) for i in range(3)]
    a2a = tr.comm.calls[("ep", "all_to_all")]  # counts and rows, both ways, in every layer
    tr = trainer("data=4", 2, unbalanced=True, gemm="loop")  # the same 3 steps, one expert after the other
    unbalanced_loop = [tr.step(i) for i in range(3)]
    tr = trainer("data=2,z=2", 2, z_split="sequence", ckpt=True)  # experts over 2, z splitting sequences, recomputed
    seq_ckpt = [tr.step(i).loss for i in range(3)]
    return {
        "ref": ref,
        "ep4": [s.loss for s in st],
        "ep4_norms": [s.grad_norm for s in st],
        "start": start,
        "load_diff": [n for n in state_k if n not in loaded or not torch.equal(state_k[n], loaded[n])],
        "resumed_ep2": [s.loss for s in resumed],
        "resumed_ep2_norms": [s.grad_norm for s in resumed],
        "unbalanced": [s.loss for s in unbalanced],
        "unbalanced_norms": [s.grad_norm for s in unbalanced],
        "unbalanced_loop": [s.loss for s in unbalanced_loop],
        "unbalanced_loop_norms": [s.grad_norm for s in unbalanced_loop],
        "grouped_layers": grouped_layers,
        "unbalanced_moe": unbalanced[0].moe,
        "tokens": cfg.train.global_batch * cfg.model.seq_len,
        "all_to_all_calls": a2a,
        "ep2_sequence_recompute": seq_ckpt,
    }


def run_all(info, base: str, plan: dict, steps: int, k: int, grouped_grids: list[str]) -> dict:
    """:func:`run`, :func:`grouped_vs_loop` and :func:`train` in one spawned group."""
    return {
        "models": run(info, base, plan),
        "grouped": grouped_vs_loop(info, base, grouped_grids),
        "train": train(info, base, steps, k),
    }
