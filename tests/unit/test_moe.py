"""Mixture-of-experts models on one process, against ``transformers`` itself.

Tiny random ``Qwen3MoeForCausalLM`` (per-head q/k norms; renormalised top-k and not),
``MixtralForCausalLM`` and ``Qwen2MoeForCausalLM`` (q/k/v biases, a gated shared expert) are
saved to folders and loaded by axo4d (experts as ``train.expert_gemm``'s default builds them:
grouped GEMMs where torch runs them; the loop against them in
:func:`test_grouped_expert_gemm_equals_the_loop`): logits, the load-balancing loss,
the training loss (cross-entropy + ``router_aux_loss_coef`` x load-balancing loss, as
``transformers`` computes it with ``output_router_logits`` true in config.json; cross-entropy
alone, the aux loss still logged, with it false) and every parameter's gradient within
1e-5 relative (fp32), greedy generation identical; export -> ``from_pretrained`` gives the same
logits and byte-identical tensors; a router that sends most tokens to one expert drops none; bad
MoE configs (expert parallelism's included) are one line. Multi-rank grids: tests/dist/test_moe.py.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from axo4d.config import ModelConfig, RunConfig, TrainConfig  # noqa: E402
from axo4d.config.errors import CheckpointError, ConfigError, GridError  # noqa: E402
from axo4d.facts.archs import model_spec  # noqa: E402
from axo4d.facts.grid import Grid  # noqa: E402
from axo4d.facts.run import derive  # noqa: E402
from axo4d.models.moe import apply_expert_gemm  # noqa: E402
from axo4d.nn import grouped_gemm as G  # noqa: E402
from tests import moe_models as M  # noqa: E402
from tests.unit.test_hf import PROMPTS, _export, _idx, _load  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
TOL = 1e-5


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    base = tmp_path_factory.mktemp("moe")
    return {name: (base / name, M.build_moe(name, base / name, seed=i)) for i, name in enumerate(M.MOE_NAMES)}


@pytest.mark.parametrize("name", M.MOE_NAMES)
def test_matches_transformers_on_one_rank(folders, name):
    folder, hf = folders[name]
    idx = _idx()
    ref = M.moe_reference(hf, idx, PROMPTS, 24)
    assert ref["aux"] > 0
    model, comm = _load(folder)
    grouped = apply_expert_gemm(model, TrainConfig().expert_gemm)  # the default, as training builds it
    assert grouped == (model.cfg.n_layer if G.grouped_mm_supported("cpu", torch.float32) else 0)
    assert model.cfg.arch == name.split("_no")[0] and model.cfg.norm_topk_prob == (
        hf.config.model_type == "mixtral" or hf.config.norm_topk_prob
    )
    assert model.cfg.output_router_logits == hf.config.output_router_logits == (not name.endswith("_noaux"))
    if name.endswith("_noaux"):  # transformers' loss without the aux loss: far from the one with it
        assert hf.config.router_aux_loss_coef * ref["aux"] > 1e3 * TOL * ref["loss"], ref
    errs = M.moe_errors(model, comm, folder, ref, idx, PROMPTS, 24)
    print(name, errs)
    for k in ("logits", "aux", "loss", "grad"):
        assert errs[k] <= TOL, (k, errs)
    assert errs["generation_differs"] == 0.0, errs


@pytest.mark.parametrize("name", ("qwen3_moe", "mixtral", "qwen2_moe"))
def test_export_loads_in_transformers(folders, name, tmp_path):
    from safetensors import safe_open

    from tests.unit.test_hf import _import_and_save

    folder, hf = folders[name]
    _import_and_save(folder, tmp_path / "run")
    r = _export(tmp_path / "run", tmp_path / "out", "--dtype", "float32")
    assert r.returncode == 0, r.stderr
    out = tmp_path / "out"
    src = safe_open(str(folder / "model.safetensors"), "pt")
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    assert set(index) == set(src.keys())
    for k, f in index.items():
        assert torch.equal(src.get_tensor(k), safe_open(str(out / f), "pt").get_tensor(k)), k
    again = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(again) is type(hf)
    assert again.config.output_router_logits is hf.config.output_router_logits is True  # written back
    idx = _idx()
    with torch.no_grad():
        assert torch.equal(again(idx).logits, hf(idx).logits)


def test_unbalanced_router_drops_nothing(folders):
    """A router that sends nearly every token to expert 0: each token's output is still its top-k
    experts' (the plain reference computes every token), and the counts show the imbalance."""
    from axo4d.models.moe import PlainMoeDecoder
    from axo4d.training.trainer import moe_stats
    from tests.helpers import full_state_dict

    model, comm = _load(folders["mixtral"][0])
    idx = _idx()
    for block in model.blocks:  # layer by layer: expert 0's row makes its logit large for these tokens
        seen = []
        hook = block.mlp.register_forward_pre_hook(lambda m, a: seen.append(a[0].detach().reshape(-1, a[0].shape[-1])))
        with torch.no_grad():
            model(idx[:, :-1])
            w = torch.linalg.lstsq(seen[0], torch.ones(seen[0].shape[0], 1)).solution[:, 0]  # h . w ~ 1
            block.mlp.router.weight[0] = 20.0 * w
        hook.remove()
    plain = PlainMoeDecoder(model.cfg, model.spec.vocab)
    plain.load_state_dict(full_state_dict(model, comm))
    model.train()
    losses = model(idx[:, :-1], idx[:, 1:])
    aux = model.router_loss().detach()
    ref = plain(idx[:, :-1], idx[:, 1:])
    assert torch.allclose(losses, ref, rtol=1e-5, atol=1e-6)
    assert abs(float(aux) - float(plain.router_loss().detach())) <= 1e-5 * float(aux)
    rec = moe_stats(model, aux)
    tokens = idx[:, :-1].numel()
    assert rec["moe_tokens_per_expert_mean"] == tokens * 2 / 4  # k = 2 of E = 4: every token routed twice
    assert rec["moe_tokens_per_expert_max"] >= 0.9 * tokens, rec  # expert 0: nearly every token
    assert rec["aux_loss"] > 2.0 * 1.4, rec  # balanced routing gives k = 2


def _skewed_router(model, idx: torch.Tensor) -> None:
    """In every layer expert 0's router row along the layer's inputs (most tokens to it) and expert
    3's against them (no token to it), layer by layer as :func:`test_unbalanced_router_drops_nothing`."""
    for block in model.blocks:
        seen = []
        hook = block.mlp.register_forward_pre_hook(lambda m, a: seen.append(a[0].detach().reshape(-1, a[0].shape[-1])))
        with torch.no_grad():
            model(idx)
            w = torch.linalg.lstsq(seen[0], torch.ones(seen[0].shape[0], 1)).solution[:, 0]  # h . w ~ 1
            block.mlp.router.weight[0] = 8.0 * w
            block.mlp.router.weight[3] = -20.0 * w
        hook.remove()


def _logits_loss_grads(model, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict, torch.Tensor]:
    model.eval()
    with torch.no_grad():
        logits = model(idx[:, :-1])
    model.train()
    model.zero_grad(set_to_none=True)
    losses = model(idx[:, :-1], idx[:, 1:])
    loss = losses.mean() + model.router_loss_weight() * model.router_loss()
    loss.backward()
    counts = torch.stack(model.router_stats.counts)  # (layers, E)
    return logits, loss.detach(), {n: p.grad for n, p in model.named_parameters()}, counts


def test_grouped_expert_gemm_equals_the_loop(folders):
    """The experts as one grouped GEMM (``train.expert_gemm``, :func:`apply_expert_gemm`: weights
    stacked at forward) against the per-expert loop on one process, fp32: logits, loss with the aux
    loss and every gradient within 1e-6 relative, with a router sending most tokens to expert 0 and
    none to expert 3 (an empty group); names unchanged; 'loop' replaces nothing, 'auto' falls back
    to the loop for a dtype torch's grouped GEMM refuses (float64)."""
    from axo4d.nn.experts import ExpertSet, GroupedExperts

    idx = _idx()
    loop, _ = _load(folders["mixtral"][0])
    _skewed_router(loop, idx[:, :-1])
    grouped, _ = _load(folders["mixtral"][0])
    grouped.load_state_dict(loop.state_dict())
    assert apply_expert_gemm(loop, "loop") == 0 and type(loop.blocks[0].mlp.experts) is ExpertSet
    assert apply_expert_gemm(grouped, "grouped") == grouped.cfg.n_layer
    assert isinstance(grouped.blocks[0].mlp.experts, GroupedExperts)
    assert grouped.state_dict().keys() == loop.state_dict().keys()
    calls = []
    grouped.blocks[0].mlp.experts.register_forward_hook(lambda m, a, out: calls.append(m.grouped(a[0])))
    a, b = _logits_loss_grads(grouped, idx), _logits_loss_grads(loop, idx)
    assert calls and all(calls) == G.grouped_mm_supported("cpu", torch.float32), calls
    counts, tokens = b[3], idx[:, :-1].numel()
    assert torch.equal(a[3], counts) and (counts[:, 3] == 0).all() and (counts[:, 0] >= 0.75 * tokens).all(), counts
    assert (a[2]["blocks.0.mlp.experts.3.down.weight"] == 0).all()  # the empty group: a zero gradient
    for what, x, y in (("logits", a[0], b[0]), ("loss", a[1], b[1])):
        assert (x - y).abs().max() <= 1e-6 * y.abs().max(), what
    for n, g in b[2].items():
        assert (a[2][n] - g).abs().max() <= 1e-6 * g.abs().max(), n
    auto = GroupedExperts(loop.blocks[0].mlp.experts, "auto")
    assert not auto.grouped(torch.zeros(2, loop.cfg.n_embd, dtype=torch.float64))


def test_training_builds_the_expert_gemm_it_is_told():
    """``train.expert_gemm`` reaches the model training builds (:func:`build_model_on`): 'loop' keeps
    the per-expert loop, 'grouped' groups every layer, 'auto' groups where this torch runs fp32."""
    from axo4d.config import load_config
    from axo4d.dist.comm import Comm
    from axo4d.nn.experts import ExpertSet, GroupedExperts
    from axo4d.training.startup import build_model_on

    auto = GroupedExperts if G.grouped_mm_supported("cpu", torch.float32) else ExpertSet
    for kernel, cls in (("loop", ExpertSet), ("grouped", GroupedExperts), ("auto", auto)):
        cfg = load_config("moe-tiny", [f"train.expert_gemm={kernel}", "parallel.tuner=false"])
        model = build_model_on(cfg, Comm(Grid(), 0, init_groups=False), torch.device("cpu"), seed=0)
        assert [type(b.mlp.experts) for b in model.blocks] == [cls] * cfg.model.n_layer, kernel


@pytest.mark.parametrize("kernel", ["grouped", "loop"])
def test_compiled_moe_equals_eager(kernel):
    """``train.compile`` on an MoE model (Qwen3-MoE: per-head q/k norms, routing): the experts run
    outside the compiled graphs (their row counts are known only at run time; torch's grouped GEMM
    has no traceable fp32 form), the q/k norms' weights are taken before attention's views of its
    QKV output, and the routers' counts have a static shape. Three steps (different routings)
    equal eager in loss and every gradient, and no frame compiles again step after step."""
    from torch._dynamo.utils import counters

    from axo4d.config import load_config
    from axo4d.dist.comm import Comm
    from axo4d.models import apply_compile
    from axo4d.nn.experts import expert_counts
    from axo4d.training.startup import build_model_on

    chosen = torch.tensor([[3, 0], [3, 7], [0, 3]])
    assert torch.equal(expert_counts(chosen, 8), torch.bincount(chosen.reshape(-1), minlength=8))
    cfg = load_config("moe-tiny", [f"train.expert_gemm={kernel}", "parallel.tuner=false"])

    def build():
        return build_model_on(cfg, Comm(Grid(), 0, init_groups=False), torch.device("cpu"), seed=0)

    eager, comp = build(), apply_compile(build(), backend="aot_eager")
    g = torch.Generator().manual_seed(0)
    torch._dynamo.reset()
    counters.clear()
    graphs = []
    for _ in range(3):
        x, y = (torch.randint(0, cfg.model.vocab_size, (2, cfg.model.seq_len), generator=g) for _ in "xy")
        out = []
        for model in (eager, comp):
            model.zero_grad(set_to_none=True)
            loss = model(x, y).mean() + model.router_loss()
            loss.backward()
            out.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
        (le, ge), (lc, gc) = out
        torch.testing.assert_close(lc, le, rtol=1e-6, atol=0)
        for n, grad in ge.items():
            torch.testing.assert_close(gc[n], grad, rtol=1e-5, atol=1e-6, msg=n)
        graphs.append(counters["stats"]["unique_graphs"])
    assert graphs[0] > 0 and graphs[-1] == graphs[0], graphs  # compiled once (before: 23, 26, 28 graphs)
    torch._dynamo.reset()


def test_resume_may_change_the_aux_loss_settings(tmp_path):
    """A checkpoint resumes under another ``output_router_logits`` or ``router_aux_loss_coef`` (the
    weights mean the same), not under another expert count."""
    from axo4d.config import load_config
    from axo4d.training.checkpointing.folder import check_model_config

    saved = load_config("moe-tiny", [])
    for change in ("model.output_router_logits=false", "model.router_aux_loss_coef=0.5"):
        check_model_config(saved, load_config("moe-tiny", [change]), tmp_path)
    with pytest.raises(CheckpointError, match="model.n_experts=8 .this run: 4."):
        check_model_config(saved, load_config("moe-tiny", ["model.n_experts=4"]), tmp_path)


def test_bad_moe_configs():
    """Experts and top-k are checked with the model's shape, one reason each; a bad one on the
    command line is one line, exit 2, --out untouched; unsupported config.json fields name the field."""
    base = ModelConfig(arch="qwen3_moe", n_embd=64, n_head=4, n_kv_head=2, ffn_hidden=32, n_experts=4)
    cases = [
        (dict(experts_per_token=5), "experts_per_token=5 must be between 1 and n_experts=4"),
        (dict(experts_per_token=0), "experts_per_token=0 must be between 1 and n_experts=4"),
        (dict(n_experts=0), "n_experts=0 must be >= 1"),
    ]
    for kw, msg in cases:
        reasons = model_spec(ModelConfig(**{**base.__dict__, **kw}), Grid()).divisibility_reasons()
        assert any(msg in r for r in reasons), (msg, reasons)
    reasons = model_spec(ModelConfig(**{**base.__dict__, "ffn_hidden": 30}), Grid(y=4)).divisibility_reasons()
    assert any("ffn_hidden=30 (one expert's width) not divisible by G_y=4" in r for r in reasons), reasons
    reasons = model_spec(
        ModelConfig(**{**base.__dict__, "n_experts": 6}), Grid(data=4, expert=4)
    ).divisibility_reasons()
    assert any("n_experts=6 not divisible by parallel.expert=4" in r for r in reasons), reasons
    with pytest.raises(GridError, match=r"parallel.expert=3 must divide G_data=4 .*valid: 1, 2, 4"):
        Grid.parse("data=4,x=2", expert=3)
    dense = RunConfig(model=ModelConfig(arch="llama", n_embd=64, n_head=4, n_kv_head=2, ffn_hidden=32))
    with pytest.raises(ConfigError, match="parallel.expert=2 needs a mixture-of-experts model; model.arch='llama'"):
        derive(dense, Grid(data=2, expert=2))
    from axo4d.facts.archs.qwen3_moe_family import qwen3_moe_from_hf

    raw = dict(M.QWEN3_MOE, hidden_act="silu")
    for key, value in (("mlp_only_layers", [1]), ("decoder_sparse_step", 2), ("router_jitter_noise", 0.1)):
        with pytest.raises(CheckpointError, match=f"unsupported {key}="):
            qwen3_moe_from_hf({**raw, key: value}, Path("/x"))


def test_qwen2_moe_fields_it_does_not_implement():
    """Qwen2-MoE's config.json fields axo4d does not implement are one error naming the field; a
    shared expert's width is checked with the grid; the other families refuse one."""
    from axo4d.facts.archs.qwen2_moe_family import qwen2_moe_from_hf

    raw = dict(M.QWEN2_MOE, hidden_act="silu")
    assert qwen2_moe_from_hf(raw, Path("/x"))["shared_expert_ffn"] == 48
    bad = (
        ("mlp_only_layers", [1]),
        ("decoder_sparse_step", 2),
        ("use_sliding_window", True),
        ("layer_types", ["sliding_attention", "full_attention"]),
        ("qkv_bias", False),
        ("shared_expert_intermediate_size", 0),
        ("router_jitter_noise", 0.1),
    )
    for key, value in bad:
        with pytest.raises(CheckpointError, match=f"unsupported {key}="):
            qwen2_moe_from_hf({**raw, key: value}, Path("/x"))
    base = dict(arch="qwen2_moe", n_embd=64, n_head=4, n_kv_head=2, ffn_hidden=32, n_experts=4)
    reasons = model_spec(ModelConfig(**base, shared_expert_ffn=30), Grid(x=2, y=2)).divisibility_reasons()
    assert any("shared_expert_ffn=30 not divisible by G_x*G_y=4" in r for r in reasons), reasons
    reasons = model_spec(ModelConfig(**base), Grid()).divisibility_reasons()
    assert any("shared_expert_ffn=0 must be >= 1" in r for r in reasons), reasons
    reasons = model_spec(ModelConfig(**dict(base, arch="mixtral"), shared_expert_ffn=8), Grid()).divisibility_reasons()
    assert any("model.arch='mixtral' has no shared expert" in r for r in reasons), reasons


def test_exported_config_without_a_source_names_the_experts():
    """A run not started from a Hugging Face folder exports a config.json whose own fields give the
    expert count (Qwen's ``num_experts``, Mixtral's ``num_local_experts``), not the defaults."""
    from axo4d.facts.archs import get_arch

    for arch, cls in (("qwen3_moe", "Qwen3MoeConfig"), ("mixtral", "MixtralConfig"), ("qwen2_moe", "Qwen2MoeConfig")):
        shared = 16 if arch == "qwen2_moe" else 0
        cfg = ModelConfig(arch=arch, n_embd=64, n_head=4, ffn_hidden=32, n_experts=6, shared_expert_ffn=shared)
        hf = getattr(transformers, cls)(**get_arch(arch).to_hf(cfg, {}, "float32", False))
        assert (hf.num_local_experts if arch == "mixtral" else hf.num_experts) == 6, arch
        assert arch != "qwen2_moe" or hf.shared_expert_intermediate_size == 16
        for aux in (False, True):  # output_router_logits written as the run's model config says
            out = get_arch(arch).to_hf(dataclasses.replace(cfg, output_router_logits=aux), {}, "float32", False)
            assert out["output_router_logits"] is aux, arch


def test_unsupported_qwen2_moe_field_on_the_command_line(folders, tmp_path):
    """``--init-from`` a Qwen2-MoE folder with a field axo4d does not implement: one line naming
    it, exit 2, --out untouched (each a real command line, forked from one process)."""
    import shutil

    from tests.forked_cli import run_many

    cases = (("decoder_sparse_step", 2), ("mlp_only_layers", [0]))
    for i, (key, value) in enumerate(cases):
        dest = shutil.copytree(folders["qwen2_moe"][0], tmp_path / f"in{i}")
        raw = json.loads((dest / "config.json").read_text())
        (dest / "config.json").write_text(json.dumps({**raw, key: value}))
    base = ["axo4d.train", "--config", "tiny", "--set", "train.steps=1"]
    cmds = [[*base, "--out", str(tmp_path / f"out{i}"), "--init-from", str(tmp_path / f"in{i}")] for i in range(2)]
    for i, ((key, value), r) in enumerate(zip(cases, run_many(cmds, tmp_path / "forked"))):
        lines = [ln for ln in r["stderr"].splitlines() if ln.strip()]
        assert r["rc"] == 2, r["stderr"][-2000:]
        assert len(lines) == 1 and f"unsupported {key}={value!r}" in lines[0], r["stderr"]
        assert not (tmp_path / f"out{i}").exists()


@pytest.mark.parametrize(
    ("setting", "line"),
    [
        ("model.experts_per_token=9", "experts_per_token=9 must be between 1 and n_experts=8"),
        ("parallel.expert=2", "parallel.expert=2 must divide G_data=1"),
    ],
)
def test_bad_moe_config_on_the_command_line(tmp_path, setting, line):
    out = tmp_path / "out"
    r = subprocess.run(
        [sys.executable, "-m", "axo4d.train", "--config", "moe-tiny", "--out", str(out), "--set", setting],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode == 2, r.stderr[-2000:]
    assert len(lines) == 1 and line in lines[0], r.stderr
    assert not out.exists()


@pytest.mark.parametrize(
    ("name", "total", "active"), [("qwen3-30b-a3b", 30.53e9, 3.34e9), ("mixtral-8x7b", 46.70e9, 12.88e9)]
)
def test_named_configs_have_the_published_sizes(name, total, active):
    """Parameters of the published shapes (Qwen3-30B-A3B: 30.5B, 3.3B active; Mixtral-8x7B:
    46.7B, 12.9B active): all of them, and those a token multiplies with (experts times k/E,
    the FLOP formula's N_matmul) plus the embedding."""
    from axo4d.config import load_config

    m = load_config(name).model
    spec = model_spec(m, Grid())
    assert abs(spec.param_count() - total) <= 0.005e9, spec.param_count()
    assert abs(sum(spec.matmul_params()) + m.vocab_size * m.n_embd - active) <= 0.005e9, spec.matmul_params()
    assert not spec.divisibility_reasons()
