"""The sequence split over z without process groups: chunk arithmetic, the 'auto' choice, the
batch checks, the model facts (collectives, divisibility, memory) and perfmodel's choice."""

import dataclasses

import pytest
import torch

from axo4d.config import load_config
from axo4d.config.errors import ConfigError, GridError
from axo4d.dist.comm import Comm
from axo4d.facts.archs import model_spec
from axo4d.facts.grid import Grid
from axo4d.facts.memory import kv_gather_bytes, split_mask_bytes
from axo4d.facts.spec import Dtypes
from axo4d.nn.seqsplit import chunk_positions, gathered_order, resolve_z_split, split_reasons
from axo4d.training.trainer import check_batch


@pytest.mark.parametrize("g", [1, 2, 3, 4, 8])
def test_chunks_cover_the_sequence_once_and_balance_causal_work(g):
    t = 2 * g * 5
    parts = [chunk_positions(t, g, r) for r in range(g)]
    assert torch.equal(torch.sort(torch.cat(parts)).values, torch.arange(t))
    # causal work of a rank: sum over its queries of the keys they see (position + 1): equal on every rank
    work = {int((p + 1).sum()) for p in parts}
    assert len(work) == 1
    # the all-gathered (rank-major) chunks put back in order give the sequence
    gathered = torch.cat(parts).view(2 * g, -1)
    assert torch.equal(gathered[gathered_order(g)].reshape(-1), torch.arange(t))


def test_auto_splits_the_sequence_only_when_the_batch_cannot_fill_data_z():
    assert resolve_z_split("auto", 1, 1, 8, 4096)[0] == "sequence"
    assert resolve_z_split("auto", 16, 2, 4, 64)[0] == "batch"
    assert resolve_z_split("auto", 4, 2, 4, 64)[0] == "sequence"
    assert resolve_z_split("auto", 3, 2, 4, 64)[0] == "batch"  # not even G_data divides: the batch error
    assert resolve_z_split("auto", 1, 1, 8, 60)[0] == "batch"  # 60 tokens do not cut into 16 chunks
    assert resolve_z_split("sequence", 16, 1, 2, 64)[0] == "sequence"
    assert split_reasons(60, 8) and not split_reasons(64, 8) and not split_reasons(7, 1)


def _cfg(*sets):
    return load_config("tiny", ["model.seq_len=64", *sets])


def test_check_batch_with_the_sequence_split():
    comm = Comm(Grid(z=8), 0, init_groups=False)
    with pytest.raises(GridError, match="or parallel.z_split=sequence"):
        check_batch(_cfg("train.global_batch=1"), comm)
    assert check_batch(_cfg("train.global_batch=1", "parallel.z_split=sequence"), comm) == 1
    assert check_batch(_cfg("train.global_batch=1", "parallel.z_split=auto"), comm) == 1
    with pytest.raises(GridError, match="not divisible by 2\\*G_z=16"):
        check_batch(_cfg("model.seq_len=40", "train.global_batch=1", "parallel.z_split=sequence"), comm)
    d2 = Comm(Grid(data=2, z=4), 0, init_groups=False)
    with pytest.raises(GridError, match="G_data=2"):
        check_batch(_cfg("train.global_batch=3", "parallel.z_split=sequence"), d2)


def test_z_split_choices_are_checked():
    with pytest.raises(ConfigError, match="z_split"):
        _cfg("parallel.z_split=rows")


def test_spec_collectives_divisibility_and_memory():
    cfg = load_config("llama-tiny", ["model.seq_len=64"])
    g = Grid(y=2, z=4)
    plain, split = model_spec(cfg.model, g), model_spec(cfg.model, g).with_sequence_split()
    assert plain.divisibility_reasons(2) and not split.divisibility_reasons(1)
    kv = [c for c in split.collectives(32, Dtypes.for_compute("fp32"), True) if c.layer == "attn.kv"]
    # forward and recompute all-gathers of K and V, backward reduce-scatters: the gathered size each
    # (32 rows x 1 kv head per y rank x 16 dims x 4 B x 4 z ranks)
    assert sorted((c.phase, c.kind, c.calls, c.nbytes) for c in kv) == [
        ("bwd", "reduce_scatter", 2, 8192.0),
        ("fwd", "all_gather", 2, 8192.0),
        ("recompute", "all_gather", 2, 8192.0),
    ]
    assert not [c for c in plain.collectives(32, Dtypes.for_compute("fp32"), True) if c.layer == "attn.kv"]
    assert kv_gather_bytes(plain, 32) == 0 and kv_gather_bytes(split, 32) == 4 * 32 * 3 * 2 * 16 / 2
    assert split_mask_bytes(split, Dtypes.for_compute("fp32")) == 8 * 8 * 9 * 5  # L = 64/8: L^2 (2z+1), bool + fp32
    long = model_spec(dataclasses.replace(cfg.model, seq_len=60), g).with_sequence_split()
    assert any("2*G_z=8" in r for r in long.divisibility_reasons(1))


def test_perfmodel_offers_the_sequence_split_where_batch_splitting_has_no_grid():
    from perfmodel.__main__ import main
    from perfmodel.machine import load_machine
    from perfmodel.model import rank_grids

    model = dataclasses.replace(load_config("llama3.1-8b").model, seq_len=131072)
    alps = load_machine("alps")
    batch = rank_grids(model, 64, 4, 8, alps, z_split="batch")
    auto = rank_grids(model, 64, 4, 8, alps, z_split="auto")
    assert not any(e.feasible for e in batch)
    feas = [e for e in auto if e.feasible]
    assert feas and all(e.z_split == "sequence" and e.z_split_note == "the only feasible split" for e in feas)
    assert all(0 < e.memory_bytes["total"] <= alps.usable_memory_bytes for e in feas)
    assert (
        main(
            ["explain", "--model", "llama3.1-8b", "--seq", "4096", "--batch", "1", "--grid", "z=8"]
            + ["--machine", "alps"]
        )
        == 0
    )
