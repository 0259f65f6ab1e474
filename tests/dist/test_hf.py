"""Hugging Face models (Llama tied and untied, GPT-2; Qwen2 on x=2,y=2) on grids of 2, 4 and 8 ranks
against ``transformers`` (fp32): logits and loss
within 1e-5 relative, every gradient (assembled) within 1e-5, greedy generation of 32 tokens
identical; a checkpoint saved on a grid exports to a folder whose tensors equal the source's."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")

from tests import hf_models as H  # noqa: E402
from tests.dist.harness import ROOT, run_on_ranks  # noqa: E402

TOL = 1e-5
GRIDS = {
    2: ["x=2", "y=2", "z=2", "data=2"],
    4: ["x=2,y=2", "data=2,z=2"],
    8: ["x=2,y=2,z=2", "data=2,x=2,z=2"],
}
EIGHT_MORE = {"llama_tied": ["data=2,y=2,z=2"]}  # tied Llama there only (saved, exported); the others on GRIDS[8]
PROMPTS = [[5, 17, 42, 8, 99, 3, 250], [7, 7, 120, 33, 64], [200, 1, 9]]


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    base = tmp_path_factory.mktemp("hfdist")
    tok = H.tokenizer_json()
    idx = torch.randint(0, H.VOCAB, (4, 24), generator=torch.Generator().manual_seed(3))
    for i, name in enumerate(H.NAMES):
        hf = H.build(name, base / name, tok, seed=10 + i)
        ref = H.hf_reference(hf, idx, PROMPTS, 32)
        torch.save({**ref, "idx": idx, "prompts": PROMPTS, "new_tokens": 32}, base / f"{name}.ref.pt")
    return base


def _check(results: list[dict]) -> None:
    bad = []
    for rank, res in enumerate(results):
        for case, e in res.items():
            if rank == 0:
                print(
                    f"{case:28s} logits {e['logits']:.1e} loss {e['loss']:.1e} grad {e['grad']:.1e} "
                    f"({e['grad_worst']}) generation {'DIFFERS' if e['generation_differs'] else 'identical'}"
                )
            for k in ("logits", "loss", "grad"):
                if not e[k] <= TOL:
                    bad.append(f"rank {rank} {case}: {k} rel err {e[k]:.2e} > {TOL} ({e['grad_worst']})")
            if e["generation_differs"]:
                bad.append(f"rank {rank} {case}: greedy generation differs from transformers")
    assert not bad, "\n".join(bad[:20])


@pytest.mark.dist
@pytest.mark.parametrize("world", [2, 4])
def test_hf_models_on_grids(base, world):
    """Qwen2 (a registry entry added without touching a layer: Llama with q/k/v biases) on x=2,y=2."""
    more = {"qwen2": ["x=2,y=2"]} if world == 4 else {}
    _check(run_on_ranks(world, "tests.dist.cases_hf:run", 600, str(base), GRIDS[world], {}, more))


@pytest.mark.dist
def test_hf_models_on_eight_ranks_and_export(base, tmp_path):
    save = {"llama_tied": "data=2,y=2,z=2", "gpt2": "data=2,x=2,z=2"}
    _check(run_on_ranks(8, "tests.dist.cases_hf:run", 900, str(base), GRIDS[8], save, EIGHT_MORE))
    from safetensors import safe_open

    for name in save:
        out = tmp_path / name
        r = subprocess.run(
            [
                sys.executable,
                "-m",
                "axo4d.checkpoint",
                "export-hf",
                str(base / f"run_{name}"),
                str(out),
                "--dtype",
                "float32",
            ],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert r.returncode == 0, r.stderr
        src = safe_open(str(base / name / "model.safetensors"), "pt")
        index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
        for k, f in index.items():
            a, b = src.get_tensor(k), safe_open(str(out / f), "pt").get_tensor(k)
            assert a.numpy().tobytes() == b.numpy().tobytes(), f"{name}: {k} changed in the round trip"


@pytest.mark.dist
def test_llama_checkpoint_reshards(tmp_path):
    r = run_on_ranks(8, "tests.dist.cases_hf:reshard_llama", 600, str(tmp_path))[0]
    print(
        f"llama tied: {r['tensors']} model+optimizer tensors after x=2,y=2,z=2 -> data=2,y=2,z=2; "
        f"differ: {r['tensors_differ']}; next-step loss rel diff {r['loss_rel']:.1e}"
    )
    assert r["tensors"] > 10 and not r["tensors_differ"]
    assert r["loss_rel"] <= TOL
