"""FP8 on one rank: the layer equals torchao's ``Float8Linear`` bit for bit (both recipes, fp32 and
bf16), the casts equal torchao's, the layer rule, the bytes an FP8 layer moves, the scale counts,
and the bad settings (one line, exit 2). Multi-rank parity: tests/dist/test_fp8.py."""

from __future__ import annotations

import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

import axo4d.nn.fp8 as F8
import axo4d.nn.fp8_plan as F8P
from axo4d.config import load_config
from axo4d.dist.comm import Comm
from axo4d.facts.archs import model_spec
from axo4d.facts.fp8_rule import fp8_layer_names, pays, shape_problems, with_fp8
from axo4d.facts.grid import Grid
from axo4d.facts.spec import ALL_GATHER, ALL_REDUCE, Dtypes
from axo4d.nn.context import LayerContext
from axo4d.nn.schedule import Schedule
from perfmodel.costs import bookkeeping_colls
from tests.dist.cases_fp8 import torchao_linears
from tests.helpers import from_linear

ROOT = Path(__file__).resolve().parents[2]


def _torchao():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import torchao.float8.float8_utils as U

    return U


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("transposed", [False, True])
def test_one_rank_layer_equals_torchao_bit_for_bit(recipe, dtype, transposed):
    torch.manual_seed(0)
    ref = nn.Linear(64, 48)
    nn.init.normal_(ref.bias)
    ao = torchao_linears([ref], recipe)[0]
    comm = Comm(Grid(), 0, init_groups=False)
    lin = from_linear(ref, LayerContext(comm, Schedule(comm), None, F8P.plan(recipe)), transposed=transposed)
    x, r = torch.randn(32, 64).to(dtype), torch.randn(32, 48)
    xa, xb = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    (ao(xa).float() * r).sum().backward()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
        yb = lin(xb)
    (yb.float() * r).sum().backward()
    assert yb.dtype == dtype and lin.fp8.name == recipe and not lin.plain()
    assert torch.equal(yb.detach(), ao(x).detach())
    assert torch.equal(xb.grad, xa.grad)
    assert torch.equal(lin.weight.grad.view(48, 64), ao.weight.grad)
    assert torch.equal(lin.bias.grad, ao.bias.grad)
    assert lin.weight.grad.dtype == torch.float32  # masters and their gradients stay fp32


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_casts_equal_torchao(recipe):
    U = _torchao()
    torch.manual_seed(1)
    t = torch.randn(48, 80) * torch.logspace(-3, 2, 80)  # columns of very different ranges
    for c in {f for f in vars(F8.RECIPES[recipe]).values() if isinstance(f, F8.Cast)}:
        dim = {"tensor": None, "row": -1, "col": 0}[c.per]
        gran = U.ScalingGranularity.TENSORWISE if dim is None else U.ScalingGranularity.AXISWISE
        s = U.tensor_to_scale(t, c.dtype, scaling_granularity=gran, axiswise_dim=dim, round_scales_to_power_of_2=c.pow2)
        want = U.to_fp8_saturated(t.float() * s, c.dtype)
        got = F8.cast(t, c)
        assert torch.equal(got.scale.reshape(s.shape), s), c
        assert torch.equal(got.data.view(torch.uint8), want.view(torch.uint8)), c


def test_scaled_mm_wants_multiples_of_16_and_takes_any_layout():
    a = F8.cast(torch.randn(32, 48), F8.RECIPES["tensorwise"].x)
    b = F8.cast(torch.randn(48, 24), F8.RECIPES["tensorwise"].x)
    with pytest.raises(ValueError, match="N=24 not a multiple of 16"):
        F8.scaled_mm(a, b, torch.float32, False)
    b = F8.cast(torch.randn(32, 48), F8.RECIPES["tensorwise"].x)
    y = F8.scaled_mm(a, b.t(), torch.float32, True)  # column-major right operand, no copy
    y2 = F8.scaled_mm(a, F8.Fp8Tensor(b.data.t().contiguous(), b.scale), torch.float32, True)  # copied
    ref = (a.data.float() / a.scale) @ (b.data.float() / b.scale).t()
    assert torch.equal(y, y2) and torch.allclose(y, ref, rtol=1e-5, atol=1e-4)


def test_scale_counts_flag_nonfinite_and_saturated_scales():
    st = F8.Fp8Stats()
    c = F8.Cast(F8.E4M3, "row")
    t = torch.randn(4, 32)
    t[1, 3] = float("inf")
    t[2] = 0.0
    F8.cast(t, c, stats=st)
    F8.cast(torch.randn(4, 32), F8.Cast(F8.E5M2), stats=st)
    assert st.take() == {"fp8_scales": 5, "fp8_nonfinite_scales": 1, "fp8_saturated_scales": 1}
    assert st.take()["fp8_scales"] == 0


def test_layer_rule_is_torchaos_thresholds_on_the_local_shape():
    cfg = load_config("gpt-1.3b").model  # hidden 2048: qkv 2048x6144, proj 2048x2048, up 2048x8192, down 8192x2048
    one = model_spec(cfg, Grid())
    assert fp8_layer_names(one, "tensorwise") == ("attn.qkv", "attn.proj", "mlp.up", "mlp.down")
    assert fp8_layer_names(one, "rowwise") == ("attn.qkv", "mlp.up")  # N <= 2048 stays bf16
    assert fp8_layer_names(one, "tensorwise", "all")[-1] == "lm_head"
    assert "lm_head" not in fp8_layer_names(one, "tensorwise", "blocks")
    split = model_spec(cfg, Grid.parse("x=4,y=4"))  # local shapes a quarter each way
    # proj 512x512 and down 2048x512 (K <= 4096, N <= 1024) stay bf16
    assert fp8_layer_names(split, "tensorwise") == ("attn.qkv", "mlp.up")
    assert fp8_layer_names(split, "rowwise") == ()
    assert fp8_layer_names(one, "off") == ()
    assert not pays("tensorwise", 4096, 1024) and pays("tensorwise", 4097, 1024)


def test_fp8_layers_gather_one_byte_and_agree_scales_in_small_all_reduces():
    cfg = load_config("tiny").model
    g = Grid.parse("data=2,x=2,y=2,z=2")
    spec = model_spec(cfg, g)
    fp8 = with_fp8(spec, "tensorwise", "blocks")
    rows, dt = 128, Dtypes.for_compute("bf16")
    for a, b in zip(spec.linears(), fp8.linears()):
        # the weight block's gathers over z move FP8 (the activations' gathers over x/y stay in bf16)
        ga = [c for c in a.collectives(g, rows, dt, False, True) if c.kind == ALL_GATHER and c.axes == ("z",)]
        gb = [c for c in b.collectives(g, rows, dt, False, True) if c.kind == ALL_GATHER and c.axes == ("z",)]
        assert [c.nbytes for c in gb] == [c.nbytes / 2 for c in ga] and b.fp8 == "tensorwise"
        plain = a.collectives(g, rows, dt, False, True)
        amax = [c for c in b.collectives(g, rows, dt, False, True) if c.kind == ALL_REDUCE and c not in plain]
        assert [(c.axes, c.nbytes) for c in amax] == [(a.axes()[:1], 4), (a.axes()[1:], 4)]  # X over in, dY over out
    assert fp8.head_linear().fp8 == "" and with_fp8(spec, "tensorwise", "all").head_linear().fp8 == "tensorwise"
    # the weights' scales: one all-reduce a step over (x, y, z), one value per FP8 layer (rowwise: N + K)
    (w,) = [c for c in bookkeeping_colls(fp8, dt) if c.layer == "fp8_weight_scales"]
    assert w.axes == ("x", "y", "z") and w.nbytes == 4 * cfg.n_layer * 4
    row = with_fp8(spec, "rowwise", "all")
    (w,) = [c for c in bookkeeping_colls(row, dt) if c.layer == "fp8_weight_scales"]
    assert w.nbytes == 4 * (cfg.n_layer * sum(x.n + x.k for x in row.linears()) + row.head_linear().n + cfg.n_embd)


def test_shape_problems_name_the_setting_and_what_would_work():
    cfg = load_config("tiny", ["model.n_embd=72"]).model
    spec = model_spec(cfg, Grid())
    bad = shape_problems(spec, "tensorwise", "blocks", 256)
    assert bad and "train.fp8=tensorwise" in bad[0] and "K 72" in bad[0] and "train.fp8=off" in bad[0]
    assert shape_problems(spec, "tensorwise", "auto", 256) == []  # auto: every layer this small stays bf16
    assert "rows per rank" in shape_problems(model_spec(load_config("tiny").model, Grid()), "rowwise", "all", 40)[0]


def test_device_problem_names_the_gpu(monkeypatch):
    assert F8P.device_problem(torch.device("cpu")) == ""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: "NVIDIA A100-SXM4-40GB")
    monkeypatch.setattr(torch.version, "hip", None)
    why = F8P.device_problem(torch.device("cuda"))
    assert "A100" in why and "8.0" in why and "8.9" in why


def _train(tmp_path: Path, *sets: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "axo4d.train", "--config", "tiny", "--out", str(tmp_path / "run")]
    cmd += [x for s in ("train.steps=2", "train.eval_interval=0", *sets) for x in ("--set", s)]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)


@pytest.mark.parametrize(
    "sets, expect",
    [
        (["train.fp8=e4m3"], ["train.fp8='e4m3'", "valid: off, tensorwise, rowwise"]),
        (["train.fp8=tensorwise", "train.fp8_layers=blocks", "model.n_embd=72"], ["layer attn.qkv", "K 72", "of 16"]),
        (["train.fp8=rowwise", "train.fp8_layers=all", "model.seq_len=33"], ["rows per rank", "multiple of 16"]),
    ],
)
def test_bad_fp8_settings_are_one_line_and_exit_2(tmp_path, sets, expect):
    p = _train(tmp_path, *sets)
    assert p.returncode == 2, p.stderr[-2000:]
    lines = [ln for ln in p.stderr.splitlines() if "Error" in ln or "error" in ln]
    assert len(lines) == 1 and all(e in lines[0] for e in expect), p.stderr[-2000:]
    assert "Traceback" not in p.stderr and not (tmp_path / "run" / "metrics.jsonl").exists()


def test_fp8_training_logs_scale_counts_and_checkpoints_fp32(tmp_path):
    p = _train(tmp_path, "train.fp8=tensorwise", "train.fp8_layers=all")
    assert p.returncode == 0, p.stderr[-3000:]
    assert "FP8 GEMMs in attn.proj, attn.qkv, lm_head, mlp.down, mlp.up" in p.stdout
    import json

    recs = [json.loads(ln) for ln in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in recs if "loss" in r]
    # 9 layers (2 blocks of 4 and the head), each: X, the weight block, dY (G_z = 1: the block is reused)
    assert [r["fp8_scales"] for r in steps] == [27, 27] and all(r["fp8_nonfinite_scales"] == 0 for r in steps)
    # issue 33 item 9 (this run's log, no process of its own): printed steps count completed steps, as
    # the checkpoints do -- main printed "step 0/2", "step 1/2" and saved step_000002
    printed = [ln.split("|")[0].strip() for ln in p.stdout.splitlines() if ln.startswith("step ")]
    assert printed == ["step     1/2", "step     2/2", "step     2"], printed  # the last: the validation loss
    assert [c.name for c in (tmp_path / "run" / "checkpoints").glob("step_*")] == ["step_000002"]
    assert "; 2 steps (0.0" in p.stdout and " steps = " not in p.stdout, p.stdout
    from safetensors.torch import load_file

    exp = tmp_path / "w.safetensors"
    ck = sorted((tmp_path / "run" / "checkpoints").glob("step_*"))[-1]
    q = subprocess.run(
        [sys.executable, "-m", "axo4d.checkpoint", "export", str(ck), str(exp)], cwd=ROOT, capture_output=True
    )
    assert q.returncode == 0, q.stderr
    assert {t.dtype for t in load_file(exp).values()} == {torch.float32}


def test_every_optimizer_recomputes_the_weight_scales_after_each_update(tmp_path):
    """Issue 33 item 1 on one process: the plain optimizer and host offload (which writes the
    weights through ``.data``, as the sharded optimizer does) recompute the FP8 weight scales after
    every update -- the same scale count every step -- and agree bit for bit; the offloaded run
    resumed from its step-2 checkpoint continues bit for bit. Sharded: tests/dist/test_fp8.py."""
    from axo4d.nn.fp8_plan import plan_of
    from axo4d.training.checkpointing.checkpointer import Checkpointer
    from axo4d.training.datasets.dataset import open_dataset, prepare_tokens
    from axo4d.training.trainer import Trainer

    torch.set_num_threads(1)
    base = ["train.fp8=tensorwise", "train.fp8_layers=all", "train.steps=4", "train.eval_interval=0"]
    base += ["parallel.tuner=false"]
    cfg = load_config("tiny", base)
    prepare_tokens(cfg.data)
    ds = open_dataset(cfg.data, cfg.model.seq_len, cfg.train.seed, cfg.model.vocab_size)
    comm = Comm(Grid(), 0, init_groups=False)
    runs = {}
    for mode in ("none", "optimizer"):
        tr = Trainer(load_config("tiny", base + [f"train.offload={mode}"]), comm, ds, torch.device("cpu"))
        ck = Checkpointer(tmp_path / mode, tr.cfg, comm, tr.model, tr.opt)
        steps = [tr.step(i) for i in range(2)]
        ck_path = ck.save(2)
        steps += [tr.step(i) for i in range(2, 4)]
        tr.settle()
        weights = [p.detach().float().clone() for p in tr.model.parameters()]
        runs[mode] = ([s.fp8["fp8_scales"] for s in steps], [s.loss for s in steps], weights, ck_path)
        assert plan_of(tr.model).weight_scales.updates == 4
    (sc0, l0, w0, _), (sc1, l1, w1, path) = runs["none"], runs["optimizer"]
    assert sc0 == sc1 == [27] * 4, (sc0, sc1)  # 9 layers: X, the weight, dY each step
    assert l1 == l0 and all(torch.equal(a, b) for a, b in zip(w0, w1)), (l0, l1)
    tr = Trainer(load_config("tiny", base + ["train.offload=optimizer"]), comm, ds, torch.device("cpu"))
    start = Checkpointer(tmp_path / "resumed", tr.cfg, comm, tr.model, tr.opt).load(path, "")
    assert start == 2 and plan_of(tr.model).weight_scales.updates == 2
    assert [tr.step(i).loss for i in (2, 3)] == l1[2:]


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_fp8_expert_pads_its_routed_rows_and_equals_torchao(recipe):
    """An FP8 expert of moe-tiny given 43 routed rows (not a multiple of 16, which FP8 GEMMs need)
    pads them with zero rows: its outputs and every gradient equal torchao's ``Float8Linear`` pair
    (gate|up, down) on the rows padded alike, bit for bit; zero rows change no scale."""
    from axo4d.models import build_model
    from axo4d.nn.fp8_plan import plan as fp8_plan

    cfg = load_config("moe-tiny", [], None)
    comm = Comm(Grid(), 0, init_groups=False)
    names = fp8_layer_names(model_spec(cfg.model, Grid()), recipe, "all")
    model = build_model(cfg.model, LayerContext(comm, Schedule(comm), None, fp8_plan(recipe, names)))
    ex = model.blocks[0].mlp.experts["3"]
    assert ex.gate_up.fp8.name == recipe and ex.down.fp8.name == recipe
    c, f2 = cfg.model.n_embd, 2 * cfg.model.ffn_hidden
    refs = [nn.Linear(c, f2, bias=False), nn.Linear(f2 // 2, c, bias=False)]
    with torch.no_grad():
        refs[0].weight.copy_(ex.gate_up.weight.view(f2, c))
        refs[1].weight.copy_(ex.down.weight.view(c, f2 // 2))
    ao = torchao_linears(refs, recipe)
    torch.manual_seed(1)
    x, r = torch.randn(43, c), torch.randn(43, c)
    xa, xb = nn.functional.pad(x, (0, 0, 0, 5)).requires_grad_(True), x.clone().requires_grad_(True)
    gu = ao[0](xa).unflatten(-1, (-1, 2))
    ya = ao[1](nn.functional.silu(gu[..., 0]) * gu[..., 1])[:43]
    (ya * r).sum().backward()
    yb = ex(xb)
    (yb * r).sum().backward()
    assert torch.equal(yb.detach(), ya.detach())
    assert torch.equal(xb.grad, xa.grad[:43]) and not xa.grad[43:].any()
    assert torch.equal(ex.gate_up.weight.grad.view(f2, c), ao[0].weight.grad)
    assert torch.equal(ex.down.weight.grad.view(c, f2 // 2), ao[1].weight.grad)
