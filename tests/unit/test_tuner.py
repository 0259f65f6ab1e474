"""The BLAS layout tuner: variants compute the same GEMM, decisions are cached and reused."""

import json

import pytest
import torch

from axo4d.config import ModelConfig
from axo4d.dist.comm import Comm
from axo4d.facts.grid import Grid
from axo4d.models.gpt import GPT
from axo4d.nn.blas_tuner import VARIANTS, GemmTuner, gemm_key, run_variant
from axo4d.nn.context import LayerContext
from axo4d.nn.schedule import Schedule

TOL = 1e-6  # variants are other BLAS calls: equal up to fp32 rounding, not necessarily bitwise


@pytest.fixture
def one_thread():
    """MKL with 2 threads may round differently from run to run (it decides per call how many
    threads to use; 1 and 2 threads give different sums), so exactness checks use one thread."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _gemms(m=48, k=40, n=24):
    g = torch.Generator().manual_seed(0)
    x, w, dy = (torch.randn(*s, generator=g) for s in ((m, k), (n, k), (m, n)))
    return {"fwd": (x, w.t()), "dx": (dy, w), "dw": (dy.t(), x)}


def _rel(a, b):
    return float((a - b).abs().max() / b.abs().max())


@pytest.mark.parametrize("kind", ["fwd", "dx", "dw"])
@pytest.mark.parametrize("bias", [False, True])
def test_variants_compute_the_same_product(kind, bias):
    a, b = _gemms()[kind]
    c = torch.randn(b.shape[1]) if bias else None
    ref = a.double() @ b.double() + (c.double() if bias else 0)
    for v in range(len(VARIANTS)):
        out = run_variant(v, a, b, c)
        assert out.is_contiguous() and out.shape == ref.shape
        assert _rel(out.double(), ref) <= TOL, VARIANTS[v]


def test_candidates_skip_variants_that_change_nothing():
    t = GemmTuner(None, "/nonexistent/never-written.json")
    gem = _gemms()
    assert t.candidates(*gem["fwd"]) == [0, 1, 2, 3]
    assert t.candidates(*gem["dx"]) == [0, 2, 3]  # both contiguous: 'copy' is a no-op
    x = gem["fwd"][0]
    assert t.candidates(x.t(), x) == [0, 1, 2, 3]


def test_cache_written_and_reused_without_timing(tmp_path):
    path = tmp_path / "tuner.json"
    t1 = GemmTuner(None, path, reps=1, verbose=False)
    for kind, (a, b) in _gemms().items():
        torch.testing.assert_close(t1.matmul(kind, a, b, tag="lin"), a @ b, rtol=TOL, atol=TOL)
    assert t1.timed == 3 and t1.loaded == 0
    t1.matmul("fwd", *_gemms()["fwd"])  # known key: not timed again
    assert t1.timed == 3
    t1.save()
    entries = json.loads(path.read_text())["entries"]
    assert len(entries) == 3 and all(e["variant"] in VARIANTS for e in entries.values())
    t2 = GemmTuner(None, path, reps=1, verbose=False)
    assert t2.loaded == 3
    for kind, (a, b) in _gemms().items():
        t2.matmul(kind, a, b, tag="lin")
    assert t2.timed == 0, "decisions from the cache file were timed again"
    assert {r["gemm"] for r in t2.rows()} == {"fwd", "dx", "dw"}
    assert "lin" in t2.table_text()


def test_key_names_shape_layout_dtype_device():
    a, b = _gemms()["fwd"]
    k = gemm_key("fwd", a, b, None)
    assert k.startswith("fwd|48x40@40x24|nt|float32|cpu:")
    assert gemm_key("fwd", a.double(), b.double(), None) != k


def test_gpt_with_tuner_matches_without(tmp_path, one_thread):
    cfg = ModelConfig(n_layer=2, n_embd=32, n_head=4, vocab_size=64, seq_len=16)
    comm = Comm(Grid(), 0, init_groups=False)
    idx = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(1))
    out = {}
    for label, tuner in (("off", None), ("on", GemmTuner(comm, tmp_path / "t.json", reps=1, verbose=False))):
        gpt = GPT(cfg, LayerContext(comm, Schedule(comm), tuner), seed=3)
        loss = gpt(idx, idx.roll(1, 1)).mean()
        loss.backward()
        out[label] = (float(loss.detach()), {n: p.grad.clone() for n, p in gpt.named_parameters()})
    assert abs(out["on"][0] - out["off"][0]) <= TOL * abs(out["off"][0])
    for n, g in out["off"][1].items():
        assert _rel(out["on"][1][n], g) <= TOL, n
