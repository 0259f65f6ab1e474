"""The data pipeline's promises on one process: epochs without replacement, a step's samples that no
memory setting changes, every document token once per epoch, resumes at the exact next sample,
mixtures by weight, document masks equal to per-document attention, and bad data as one line.
(On grids, and grad_accum 1, 2, 4 giving the same losses: tests/dist/test_data.py.)"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from axo4d.config import DataConfig, load_config
from axo4d.config.errors import DataError
from axo4d.dist.comm import Comm
from axo4d.facts.grid import Grid
from axo4d.models import build_model
from axo4d.nn.attention import document_mask, document_positions
from axo4d.training.datasets.batches import StepPlan, run_length, steps_for_epochs
from axo4d.training.datasets.dataset import TokenDataset, open_dataset
from axo4d.training.datasets.order import EpochOrder, MixtureOrder, permute, shares
from axo4d.training.datasets.prepared import check_vocab
from axo4d.training.trainer import Trainer
from tests.data_fixtures import unique_jsonl, unique_tokenizer

ONE = Comm(Grid(), 0, init_groups=False)


# ---- the order of samples ----------------------------------------------------------------------
@pytest.mark.parametrize("n", [1, 2, 3, 7, 64, 1000, 4097, 100_003])
def test_permute_is_a_bijection(n):
    p = permute(np.arange(n), n, 12345)
    assert np.array_equal(np.sort(p), np.arange(n))
    if n >= 1000:  # and looks shuffled: few fixed points, another key another order
        assert (p == np.arange(n)).sum() < 10 and not np.array_equal(p, permute(np.arange(n), n, 12346))


def test_epochs_without_replacement_reshuffled():
    order = EpochOrder(100, seed=3)
    epoch, idx = order.at(np.arange(300))
    assert epoch.tolist() == [0] * 100 + [1] * 100 + [2] * 100
    for e in range(3):
        assert sorted(idx[epoch == e]) == list(range(100))  # every sample once per epoch
    assert not np.array_equal(idx[:100], idx[100:200])
    assert np.array_equal(EpochOrder(100, seed=3).at(np.arange(150, 160))[1], idx[150:160])  # pure
    assert not np.array_equal(EpochOrder(100, seed=4).at(np.arange(100))[1], idx[:100])


def test_mixture_by_weight_deterministic():
    assert shares([3, 1], 10) == [8, 2] and sum(shares([1, 1, 1], 10)) == 10 and shares([0, 2], 5) == [0, 5]
    mix = MixtureOrder([10, 30], [3, 1], seed=7)
    assert mix.epoch_size == 40 and mix.counts == [30, 10]
    _, ids = mix.at(np.arange(80))
    src0, src1 = ids[ids < 10], ids[ids >= 10] - 10
    assert len(src0) == 60 and np.bincount(src0).tolist() == [6] * 10  # upsampled: 3 times per epoch
    assert len(src1) == 20 and len(set(src1.tolist())) == 20  # 1/3 of its samples per epoch, none twice
    assert np.array_equal(MixtureOrder([10, 30], [3, 1], seed=7).at(np.arange(80))[1], ids)


# ---- a step's samples ---------------------------------------------------------------------------
def _ds(n: int = 20_000, seq_len: int = 16, seed: int = 7) -> TokenDataset:
    return TokenDataset((np.arange(n) % 251).astype(np.uint16), seq_len, val_fraction=0.1, seed=seed)


def test_step_samples_do_not_depend_on_accumulation_or_shards():
    ds = _ds()
    ref = StepPlan(ds, 16, 1).samples(4)[1]
    full = ds.batch("train", ref).x
    for accum in (1, 2, 4, 8):
        for shards in (1, 2):
            if 16 // accum % shards:
                continue
            rows = [
                StepPlan(ds, 16, accum, s, shards).read(ref, m).x for m in range(accum) for s in range(shards)
            ]  # micro-batch by micro-batch, shard by shard
            torch.testing.assert_close(torch.cat(rows), full)
            assert np.array_equal(StepPlan(ds, 16, accum, 0, shards).samples(4)[1], ref)


def test_resume_continues_at_the_next_sample_even_with_another_global_batch():
    ds = _ds()
    a = StepPlan(ds, 8, 1)
    stream = np.concatenate([a.samples(s)[1] for s in range(10)])
    b = StepPlan(ds, 8, 2)
    b.resume_at(7, a.position(7))
    assert np.array_equal(np.concatenate([b.samples(s)[1] for s in (7, 8, 9)]), stream[56:80])
    c = StepPlan(ds, 4, 1)  # half the batch after the resume: the same stream, smaller steps
    c.resume_at(7, a.position(7))
    assert np.array_equal(np.concatenate([c.samples(s)[1] for s in range(7, 13)]), stream[56:80])
    with pytest.raises(DataError, match="before the step 7"):
        c.samples(6)


# ---- documents and epochs ---------------------------------------------------------------------------
def _jsonl_dataset(tmp_path, seq_len=32, n_docs=1000, **kw):
    pytest.importorskip("tokenizers")
    words = unique_jsonl(tmp_path / "docs.jsonl", n_docs)
    tok = unique_tokenizer(tmp_path / "tokenizer.json", words + [["held", "out"]])
    (tmp_path / "val.jsonl").write_text('{"text": "held out"}\n' * 4)
    cfg = DataConfig(
        source=str(tmp_path / "docs.jsonl"),
        tokenizer=str(tok),
        val_source=str(tmp_path / "val.jsonl"),
        cache_dir=str(tmp_path / "cache"),
        **kw,
    )
    return cfg, words, open_dataset(cfg, seq_len, seed=5, vocab_size=2 + sum(map(len, words)) + 2)


def test_one_epoch_trains_every_document_token_once(tmp_path):
    """Over one epoch (train.epochs=1) of a 1,000-document JSONL, on the shards of data=2 x z=2 and
    grad_accum 2, every document token is a target exactly once (ids are unique per token)."""
    _, words, ds = _jsonl_dataset(tmp_path)
    n_tokens = sum(map(len, words))
    steps = steps_for_epochs(1, ds.epoch_size, 8)
    assert steps == math.ceil(ds.epoch_size / 8) and ds.train.n_documents == 1000
    seen = []
    for shard in range(4):
        plan = StepPlan(ds, 8, 2, shard, 4, epochs=1)
        for step in range(steps):
            idx = plan.samples(step)[1]
            for m in range(2):
                b = plan.read(idx, m)
                y = b.y if b.mask is None else b.y[b.mask]
                seen.append(y.flatten().numpy())
    seen = np.concatenate(seen)
    counts = np.bincount(seen, minlength=2 + n_tokens)
    assert counts[1] == 1000  # the end-of-text token after every document
    assert (counts[2 : 2 + n_tokens] == 1).all(), np.flatnonzero(counts[2 : 2 + n_tokens] != 1)[:10]
    assert counts[0] == 0 and len(seen) == n_tokens + 1000
    assert plan.progress(steps - 1) == {"samples_seen": ds.epoch_size, "epoch": 0, "epoch_fraction": 1.0}


def test_held_out_documents_are_never_trained(tmp_path):
    pytest.importorskip("tokenizers")
    words = unique_jsonl(tmp_path / "docs.jsonl", 200)
    tok = unique_tokenizer(tmp_path / "tokenizer.json", words)
    cfg = DataConfig(source=str(tmp_path / "docs.jsonl"), tokenizer=str(tok), cache_dir=str(tmp_path / "c"))
    ds = open_dataset(cfg, 16, seed=1)
    assert ds.split == "10 held-out documents" and ds.train.n_documents == 190
    train = set(ds.batch("train", np.arange(ds.train.n_samples)).x.flatten().tolist())
    val = set(ds.batch("val", np.arange(ds.val.n_samples)).x.flatten().tolist())
    assert train & val <= {0, 1}  # shared: only padding and the end-of-text token
    again = open_dataset(cfg, 16, seed=99)  # another seed: the same held-out documents
    assert np.array_equal(again.val.ids, ds.val.ids)


def test_document_mask_equals_per_document_attention(tmp_path):
    """A packed sequence under the document mask gives every document the logits it gets alone
    (GPT: learned positions restart per document; Llama: RoPE, grouped-query attention)."""
    torch.manual_seed(0)
    lengths = [5, 9, 1, 12, 5]  # documents of a 32-token sequence
    docs = torch.tensor(sum(([i] * n for i, n in enumerate(lengths)), []))[None]  # (1, 32)
    assert document_positions(docs)[0, :6].tolist() == [0, 1, 2, 3, 4, 0]
    assert document_mask(docs).shape == (1, 1, 32, 32) and not document_mask(docs)[0, 0, 5, 4]
    for config in ("tiny", "llama-tiny"):
        cfg = load_config(config, ["model.seq_len=32"]).model
        model = build_model(cfg, ONE, seed=3).eval()
        x = torch.randint(0, cfg.vocab_size, (2, 32))
        with torch.no_grad():
            packed = model(x, documents=docs.expand(2, -1))  # (2, 32, V)
            start = 0
            for n in lengths:
                alone = model(x[:, start : start + n])  # (2, n, V)
                torch.testing.assert_close(packed[:, start : start + n], alone, rtol=1e-5, atol=1e-5)
                start += n
            assert not torch.allclose(model(x)[:, 5:14], packed[:, 5:14], atol=1e-3)  # the mask matters


def test_trainer_with_document_mask_and_padding(tmp_path):
    """A run of 1.5 epochs with the document mask: the last step's empty slots are masked, the loss
    is the mean over the real targets, metrics' epoch and fraction follow the stream."""
    cfg, _, ds = _jsonl_dataset(tmp_path, seq_len=32, n_docs=60, document_mask=True)
    run = load_config(
        "tiny",
        ["train.epochs=1.5", "train.global_batch=8", "parallel.tuner=false", "model.vocab_size=1500"],
    )
    steps = steps_for_epochs(1.5, ds.epoch_size, 8)
    tr = Trainer(run, ONE, ds, torch.device("cpu"))
    stats = [tr.step(i) for i in range(steps)]
    assert all(math.isfinite(s.loss) for s in stats) and stats[-1].samples_seen == int(1.5 * ds.epoch_size)
    assert stats[-1].epoch == 1 and stats[-1].epoch_fraction == pytest.approx(0.5, abs=1 / ds.epoch_size)
    assert tr.real < 8 * 32 or int(1.5 * ds.epoch_size) % 8 == 0
    assert math.isfinite(tr.evaluate())


def test_run_length_says_epochs_and_steps_without_contradiction():
    """Issue 33 item 9: the banner read '1.5 epochs = 35 steps = 1.52 epochs'; now the epochs, the
    samples they hold, the steps and the last step's empty slots."""
    t = load_config("tiny", ["train.epochs=1.5", "train.global_batch=8", "train.steps=35"]).train
    assert steps_for_epochs(1.5, 183, 8) == 35
    line = run_length(t, 183)
    assert line == (
        "train.epochs=1.5: 274 samples (183 an epoch) in 35 steps, the last step's 6 slot(s) past the end left empty"
    )
    assert run_length(load_config("tiny", ["train.steps=20"]).train, 183) == "20 steps (0.874 epochs of 183 samples)"


# ---- bad data ------------------------------------------------------------------------------------------
def test_token_id_errors_name_the_fix():
    with pytest.raises(DataError, match=r"token id -3 in 'x.npy' is negative: token ids are 0..255"):
        check_vocab(np.array([5, -3, 7]), 256, "x.npy")
    with pytest.raises(DataError, match=r"token id 300 .* set model.vocab_size >= 301"):
        check_vocab(np.array([5, 300]), 256, "x.npy")
    try:
        check_vocab(np.array([5, -3, 7]), 256, "x.npy")
    except DataError as e:
        assert "vocab_size >=" not in str(e)  # raising the vocabulary cannot fix a negative id


def test_mixture_dataset(tmp_path):
    a, b = tmp_path / "a.u16", tmp_path / "b.u16"
    (np.arange(3000) % 200).astype(np.uint16).tofile(a)
    (np.arange(9000) % 200 + 50).astype(np.uint16).tofile(b)
    cfg = load_config(
        "tiny", [f"data.sources=[{{path: {a}, weight: 1}}, {{path: {b}, weight: 1}}]", "data.val_fraction=0.1"]
    ).data
    ds = open_dataset(cfg, 16, seed=2, vocab_size=256)
    na = ds.train.parts[0].n_samples
    _, ids = ds.order.at(np.arange(ds.epoch_size))
    assert abs((ids < na).sum() - ds.epoch_size / 2) <= 1  # half of every epoch from each source
    assert ds.name.startswith("mixture of") and ds.val.n_samples == sum(p.n_samples for p in ds.val.parts)
