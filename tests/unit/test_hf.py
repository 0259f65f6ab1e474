"""Hugging Face checkpoints in and out, on one process, against ``transformers`` itself.

Tiny random ``LlamaForCausalLM`` (GQA, llama3 RoPE scaling; tied and untied), ``GPT2LMHeadModel``
and ``Qwen2ForCausalLM`` (Llama with q/k/v biases) are saved to folders and loaded by axo4d: logits and loss within 1e-5
relative (fp32), every parameter's gradient within 1e-5 of transformers', greedy generation of 32
tokens identical to ``generate(do_sample=False)``; export -> ``from_pretrained`` gives the same
logits; import -> export gives byte-identical tensors. Multi-rank grids: tests/dist/test_hf.py.
"""

from __future__ import annotations

import json
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from axo4d.dist.comm import Comm  # noqa: E402
from axo4d.facts.archs.layout import Part, RowMap  # noqa: E402
from axo4d.facts.grid import Grid  # noqa: E402
from axo4d.models import build_model  # noqa: E402
from axo4d.nn.context import as_context  # noqa: E402
from axo4d.training.hf.hf_config import read_hf_config  # noqa: E402
from axo4d.training.hf.weights import load_hf_weights  # noqa: E402
from tests import hf_models as H  # noqa: E402
from tests.forked_cli import run_many  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
TOL = 1e-5


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    base = tmp_path_factory.mktemp("hf")
    tok = H.tokenizer_json()
    out = {}
    for i, name in enumerate(H.NAMES):
        out[name] = (base / name, H.build(name, base / name, tok, seed=i))
    return out


def _idx(b: int = 4, t: int = 24) -> torch.Tensor:
    return torch.randint(0, H.VOCAB, (b, t), generator=torch.Generator().manual_seed(7))


PROMPTS = [[5, 17, 42, 8, 99, 3, 250], [7, 7, 120, 33, 64]]


def _load(folder: Path):
    cfg, _ = read_hf_config(folder)
    comm = Comm(Grid(), 0, init_groups=False)
    model = build_model(cfg, as_context(comm), seed=None)
    load_hf_weights(model, folder, comm.grid, 0)
    return model, comm


def test_row_maps_cover_every_range():
    """segments() against a brute-force row list, for random maps and ranges."""
    rnd = random.Random(0)
    for _ in range(2000):
        parts = tuple(Part(f"s{i}", rnd.randint(1, 4), rnd.choice([0, 100])) for i in range(rnd.randint(1, 3)))
        rm = RowMap(parts, rnd.randint(1, 7))
        ref = [(p.name, p.base + g * p.rows + j) for g in range(rm.groups) for p in parts for j in range(p.rows)]
        r0 = rnd.randrange(len(ref))
        r1 = rnd.randint(r0 + 1, len(ref))
        got = [None] * (r1 - r0)
        for name, src, dst in rm.segments(r0, r1):
            for d, s in zip(range(dst.start, dst.stop, dst.step or 1), range(src.start, src.stop)):
                assert got[d] is None
                got[d] = (name, s)
        assert got == ref[r0:r1], (rm, r0, r1)
        t = torch.arange(len(ref) * 2.0).view(len(ref), 2)
        back = {}
        for name, pieces in rm.split(t).items():
            for base, rows in pieces:
                for j in range(rows.shape[0]):
                    back[(name, base + j)] = rows[j]
        for i, key in enumerate(ref):
            assert torch.equal(back[key], t[i])


@pytest.mark.parametrize("name", H.NAMES)
def test_matches_transformers_on_one_rank(folders, name):
    folder, hf = folders[name]
    idx = _idx()
    ref = H.hf_reference(hf, idx, PROMPTS, 32)
    model, comm = _load(folder)
    errs = H.axo4d_errors(model, comm, folder, ref, idx, PROMPTS, 32)
    print(name, errs)
    for k in ("logits", "loss", "grad"):
        assert errs[k] <= TOL, (k, errs)
    assert errs["generation_differs"] == 0.0, errs


def _export(ckpt_run: Path, out: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "axo4d.checkpoint", "export-hf", str(ckpt_run), str(out), *extra],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )


def _import_and_save(folder: Path, run: Path) -> None:
    """``--init-from`` then save a checkpoint without training: a 0-step run."""
    from axo4d.config import load_config
    from axo4d.training.checkpointing.checkpointer import Checkpointer
    from axo4d.training.init_from import config_with_init, record_source

    cfg = config_with_init(load_config("tiny"), folder, [])
    model, comm = _load(folder)
    Checkpointer(run, cfg, comm, model, None).save(0)
    record_source(run, folder)


@pytest.mark.parametrize("name", H.NAMES)
def test_import_export_round_trip(folders, name, tmp_path):
    from safetensors import safe_open

    folder, hf = folders[name]
    _import_and_save(folder, tmp_path / "run")
    r = _export(tmp_path / "run", tmp_path / "out", "--dtype", "float32")
    assert r.returncode == 0, r.stderr
    out = tmp_path / "out"
    assert {"config.json", "model.safetensors.index.json", "tokenizer.json"} <= {p.name for p in out.iterdir()}
    # byte-identical tensors
    src = safe_open(str(folder / "model.safetensors"), "pt")
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    assert set(index) == set(src.keys()) - {k for k in src.keys() if k.endswith(".attn.bias")}
    for k, f in index.items():
        a = src.get_tensor(k)
        b = safe_open(str(out / f), "pt").get_tensor(k)
        assert a.dtype == b.dtype and a.shape == b.shape and a.numpy().tobytes() == b.numpy().tobytes(), k
    # from_pretrained of the export gives the same logits as the source
    again = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    idx = _idx()
    with torch.no_grad():
        assert torch.equal(again(idx).logits, hf(idx).logits)


def test_export_bf16_shards_and_refuses_nonempty(folders, tmp_path):
    folder, hf = folders["llama"]
    _import_and_save(folder, tmp_path / "run")
    r = _export(tmp_path / "run", tmp_path / "out", "--shard-gb", "0.00005", "--dtype", "bfloat16")  # ~50 kB shards
    assert r.returncode == 0, r.stderr
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32).eval()
    idx = _idx()
    with torch.no_grad():  # bf16 weights: the logits agree to bf16 rounding
        a, b = again(idx).logits, hf(idx).logits
    assert float((a - b).abs().max() / b.abs().max()) < 2e-2
    assert json.loads((tmp_path / "out" / "config.json").read_text())["dtype"] == "bfloat16"
    r = _export(tmp_path / "run", tmp_path / "out")
    assert r.returncode == 2 and "not empty" in r.stderr


# ---- bad input ------------------------------------------------------------------------------------
def _copy(folders, name: str, dest: Path) -> Path:
    shutil.copytree(folders[name][0], dest)
    return dest


def _train(*args: str, out: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "axo4d.train", "--config", "tiny", "--out", str(out), "--set", "train.steps=1", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )


def _edit_config(folder: Path, **kw) -> None:
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(kw)
    (folder / "config.json").write_text(json.dumps(cfg))


def test_bad_hf_folders_fail_before_out(folders, tmp_path):
    from safetensors.torch import load_file, save_file

    cases = []
    no_cfg = _copy(folders, "llama", tmp_path / "no_cfg")
    (no_cfg / "config.json").unlink()
    cases.append((no_cfg, [], "has no config.json"))
    arch = _copy(folders, "llama", tmp_path / "arch")
    _edit_config(arch, architectures=["MistralForCausalLM"])
    cases.append((arch, [], "unsupported architectures"))
    rope = _copy(folders, "llama", tmp_path / "rope")
    _edit_config(rope, rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0})
    cases.append((rope, [], "rope_scaling type='yarn'"))
    act = _copy(folders, "llama", tmp_path / "act")
    _edit_config(act, hidden_act="gelu")
    cases.append((act, [], "hidden_act='gelu'"))
    missing = _copy(folders, "llama", tmp_path / "missing")
    sd = load_file(str(missing / "model.safetensors"))
    del sd["model.layers.1.mlp.up_proj.weight"]
    save_file(sd, str(missing / "model.safetensors"))
    cases.append((missing, [], "'model.layers.1.mlp.up_proj.weight' (shape (96, 64)) is missing"))
    shape = _copy(folders, "llama", tmp_path / "shape")
    sd = load_file(str(shape / "model.safetensors"))
    sd["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(16, 64)
    save_file(sd, str(shape / "model.safetensors"))
    cases.append((shape, [], "has shape (16, 64), this model needs (32, 64)"))
    cases.append((folders["llama"][0], ["--grid", "y=4"], "n_kv_head=2 not divisible by G_y=4"))
    tok = _copy(folders, "llama", tmp_path / "tok")
    (tok / "tokenizer.json").write_text(H.tokenizer_json(400))
    cases.append((tok, [], "has 400 tokens but the model's vocabulary is 300"))
    window = _copy(folders, "qwen2", tmp_path / "window")
    _edit_config(window, use_sliding_window=True)
    cases.append((window, [], "unsupported use_sliding_window=True; axo4d supports false (full attention)"))
    base = ["axo4d.train", "--config", "tiny", "--set", "train.steps=1"]
    runs = run_many(  # each a real command line, forked from one process that imported it once
        [
            [*base, "--out", str(tmp_path / f"out{i}"), "--init-from", str(f), *extra]
            for i, (f, extra, _) in enumerate(cases)
        ],
        tmp_path / "forked",
    )
    for i, ((folder, extra, msg), r) in enumerate(zip(cases, runs)):
        out = tmp_path / f"out{i}"
        lines = [ln for ln in r["stderr"].splitlines() if ln.strip()]
        assert r["rc"] == 2, (msg, r["stderr"][-2000:])
        assert len(lines) == 1 and msg in lines[0], (msg, r["stderr"][-2000:])
        assert not out.exists(), f"{msg}: --out was touched"
