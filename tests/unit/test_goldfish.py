"""Goldfish loss: the hashed mask against a plain-Python reference, its drop rate, and the loss,
gradients and step normalisation against plain PyTorch (docs/design.md section 8)."""

import math
import random

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from axo4d.config import ModelConfig, check_values, load_config
from axo4d.config.errors import ConfigError
from axo4d.dist.comm import Comm
from axo4d.facts.grid import Grid
from axo4d.models.gpt import GPT
from axo4d.models.plain import PlainGPT
from axo4d.nn import goldfish
from axo4d.nn.goldfish import goldfish_keep
from axo4d.training.datasets.dataset import TokenDataset
from axo4d.training.trainer import Trainer
from tests.helpers import assert_grads_match_plain, full_state_dict, plain_grads


def _reference_hash(context: list[int]) -> int:
    """The hash of docs/design.md section 8 on Python ints, token by token (no vectorisation)."""
    p = goldfish.P
    acc = 0
    for t in context:
        acc = (acc * goldfish.M + ((t % p) * goldfish.A + goldfish.B) % p) % p
    for _ in range(2):
        acc ^= acc >> 15
        acc = (acc * goldfish.C) % p
    return acc


def _reference_keep(window: list[int], k: int, h: int) -> list[bool]:
    """Keep flags of the targets window[1:], from the definition: target i (window index) is
    dropped when hash(window[i-h:i]) % k == 0; targets with fewer than h tokens before them in
    the sample are kept."""
    out = []
    for i in range(1, len(window)):
        out.append(True if i < h else _reference_hash(window[i - h : i]) % k != 0)
    return out


@pytest.mark.parametrize(
    "k,h,t,vocab",
    [(2, 13, 40, 256), (4, 13, 64, 50257), (3, 1, 9, 7), (2, 5, 3, 256), (7, 4, 4, 128256), (2, 3, 30, 2**31 + 11)],
)
def test_mask_equals_plain_python_reference(k, h, t, vocab):
    rng = random.Random(k * 1000 + h * 10 + t)
    windows = [[rng.randrange(vocab) for _ in range(t + 1)] for _ in range(5)]
    w = torch.tensor(windows, dtype=torch.long)
    got = goldfish_keep(w[:, :-1], w[:, 1:], k, h)
    assert got.shape == (5, t) and got.dtype == torch.bool
    assert got.tolist() == [_reference_keep(win, k, h) for win in windows]


def test_mask_depends_only_on_the_context():
    """The same h tokens before a target give the same decision in any sample, at any position."""
    rng = np.random.default_rng(0)
    stream = torch.from_numpy(rng.integers(0, 50, 400))
    k, h, t = 2, 6, 48
    decision: dict[tuple, bool] = {}
    for start in range(0, 400 - t - 1, 7):
        w = stream[start : start + t + 1][None]
        keep = goldfish_keep(w[:, :-1], w[:, 1:], k, h)[0]
        for j in range(h - 1, t):
            ctx = tuple(w[0, j + 1 - h : j + 1].tolist())
            assert decision.setdefault(ctx, bool(keep[j])) == bool(keep[j])
        assert keep[: h - 1].all()  # the first h tokens of a sample are never dropped
    assert len(decision) > 200


@pytest.mark.parametrize("k", [2, 3, 4, 8])
def test_dropped_fraction_is_one_over_k(k):
    """On random tokens the drop rate is 1/k within sampling error (4 binomial standard deviations)."""
    h, t = 13, 256
    g = torch.Generator().manual_seed(k)
    w = torch.randint(0, 50257, (200, t + 1), generator=g)
    keep = goldfish_keep(w[:, :-1], w[:, 1:], k, h)[:, h - 1 :]  # targets with a full context
    n = keep.numel()
    dropped = 1 - keep.float().mean().item()
    sd = math.sqrt((1 / k) * (1 - 1 / k) / n)
    assert abs(dropped - 1 / k) < 4 * sd, (dropped, 1 / k, sd)


def test_off_and_bad_values():
    w = torch.randint(0, 256, (2, 9))
    assert goldfish_keep(w[:, :-1], w[:, 1:], 0, 13).all()
    for k, h, what in [
        (1, 13, "goldfish_k=1 would drop every token"),
        (-2, 13, "goldfish_k=-2"),
        (2, 0, "goldfish_h=0"),
    ]:
        with pytest.raises(ValueError, match=what):
            goldfish_keep(w[:, :-1], w[:, 1:], k, h)
        with pytest.raises(ConfigError, match=f"train.{what}"):
            check_values(load_config("tiny", [f"train.goldfish_k={k}", f"train.goldfish_h={h}"]))
    check_values(load_config("tiny", ["train.goldfish_k=2", "train.goldfish_h=1"]))


def test_masked_loss_and_gradients_match_plain_pytorch():
    """Dropped targets: loss 0 and no gradient; the masked mean's gradients equal plain autograd's."""
    torch.manual_seed(0)
    cfg = ModelConfig(n_layer=2, n_embd=32, n_head=4, vocab_size=250, seq_len=24)
    comm = Comm(Grid(), 0, init_groups=False)
    gpt = GPT(cfg, comm, seed=3)
    plain = PlainGPT(cfg, gpt.vocab)
    plain.load_state_dict(full_state_dict(gpt, comm))
    w = torch.randint(0, 250, (3, 25))
    x, y = w[:, :-1], w[:, 1:]
    keep = goldfish_keep(x, y, 2, 4)
    assert 0 < keep.sum() < keep.numel()
    la = gpt(x, y, loss_mask=keep)
    ce = F.cross_entropy(plain(x).reshape(-1, 250), y.reshape(-1), reduction="none").view(3, 24)
    torch.testing.assert_close(la, ce * keep, rtol=1e-5, atol=1e-6)
    assert (la[~keep] == 0).all()
    (la.sum() / keep.sum()).backward()
    (ce[keep].sum() / keep.sum()).backward()
    assert_grads_match_plain(gpt, plain, cfg.n_head)


def test_trainer_step_is_the_mean_over_kept_targets_of_the_whole_step():
    """With accumulation, the step's loss and gradient norm are those of sum(kept losses) / count(kept)
    over every micro-step, computed in plain PyTorch; the dropped fraction is the batch's."""
    cfg = load_config(
        "tiny",
        [
            "train.goldfish_k=3",
            "train.goldfish_h=5",
            "train.grad_accum=2",
            "train.global_batch=4",
            "train.grad_clip=0",
            "parallel.tuner=false",
            "parallel.overlap=false",
        ],
    )
    rng = np.random.default_rng(1)
    ds = TokenDataset(rng.integers(0, 256, 20000).astype(np.uint16), cfg.model.seq_len, 0.1, cfg.train.seed)
    comm = Comm(Grid(), 0, init_groups=False)
    tr = Trainer(cfg, comm, ds, torch.device("cpu"))
    plain = PlainGPT(cfg.model, tr.model.vocab)
    plain.load_state_dict(full_state_dict(tr.model, comm))
    total, kept = torch.zeros(()), 0
    idx = tr.plan.samples(0)[1]  # the step's 4 samples, fixed before the cut into micro-batches
    for micro in range(2):
        b = ds.batch("train", idx[2 * micro : 2 * micro + 2])
        x, y = b.x, b.y
        keep = goldfish_keep(x, y, 3, 5)
        ce = F.cross_entropy(plain(x).reshape(-1, 256), y.reshape(-1), reduction="none").view_as(y)
        total, kept = total + ce[keep].sum(), kept + int(keep.sum())
    ref = total / kept
    ref.backward()
    # the model's gradient: the plain one with the key bias held at zero (all of q's and v's bias count)
    ref_norm = math.sqrt(sum(float(g.double().square().sum()) for g in plain_grads(plain, cfg.model.n_head).values()))
    s = tr.step(0)
    assert s.loss == pytest.approx(float(ref.detach()), rel=1e-5)
    assert s.grad_norm == pytest.approx(ref_norm, rel=1e-6)
    assert s.dropped == pytest.approx(1 - kept / (4 * cfg.model.seq_len))
    assert 0.2 < s.dropped < 0.4  # about 1/3
