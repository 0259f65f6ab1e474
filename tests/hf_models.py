"""Tiny randomly initialised Hugging Face models, saved to folders (the oracle of the HF tests).

Nothing is downloaded: ``LlamaForCausalLM`` (grouped-query attention, Llama 3.1 ``llama3`` RoPE
scaling, tied and untied embeddings) and ``GPT2LMHeadModel`` built from configs, and a small BPE
``tokenizer.json`` trained on a few standard-library files.
"""

from __future__ import annotations

import json
import sysconfig
from pathlib import Path

import torch

VOCAB = 300
LLAMA = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    rms_norm_eps=1e-5,
    rope_parameters={
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16,
    },
    bos_token_id=0,
    eos_token_id=1,
)
GPT2 = dict(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=64, bos_token_id=1, eos_token_id=1)
#: Qwen2: the Llama shape with biases on q, k and v, default RoPE (theta 1e6), untied
QWEN2 = {
    **{k: v for k, v in LLAMA.items() if k != "rope_parameters"},
    "rope_parameters": {"rope_type": "default", "rope_theta": 1e6},
}
NAMES = ("llama", "llama_tied", "gpt2", "qwen2")
#: the models of the multi-rank grids of tests/dist/test_hf.py (Qwen2 runs on x=2,y=2 there)
GRID_NAMES = ("llama", "llama_tied", "gpt2")


def tokenizer_json(vocab: int = 296) -> str:
    """A byte-level BPE tokenizer (``vocab`` tokens, ids 0/1 begin/end of text)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tr = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=["<|begin_of_text|>", "<|end_of_text|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[:10]
    tok.train([str(f) for f in files], tr)
    return tok.to_str()


def build(name: str, folder: Path, tokenizer: str | None = None, seed: int = 0):
    """Save the tiny model ``name`` (one of :data:`NAMES`) into ``folder``; returns it (eval)."""
    import transformers

    torch.manual_seed(seed)
    if name.startswith("llama"):
        model = transformers.LlamaForCausalLM(
            transformers.LlamaConfig(**LLAMA, tie_word_embeddings=name == "llama_tied")
        )
    elif name == "qwen2":
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**QWEN2, tie_word_embeddings=False))
    else:
        model = transformers.GPT2LMHeadModel(transformers.GPT2Config(**GPT2))
    with torch.no_grad():  # norms and biases away from their init, so errors show
        for n, p in model.named_parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn_like(p))
    model.eval().save_pretrained(folder)
    (folder / "tokenizer.json").write_text(tokenizer or tokenizer_json())
    (folder / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>"})
    )
    return model


def hf_reference(model, idx: torch.Tensor, prompts: list[list[int]], new_tokens: int) -> dict:
    """Logits, loss, gradients (by HF name) and greedy continuations of ``model``."""
    model.zero_grad(set_to_none=True)
    out = model(idx, labels=idx)
    out.loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    gen = [
        model.generate(
            torch.tensor([p]), max_new_tokens=new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0
        )[0, len(p) :].tolist()
        for p in prompts
    ]
    return {"logits": out.logits.detach(), "loss": float(out.loss.detach()), "grads": grads, "gen": gen}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def axo4d_errors(
    model, comm, folder: Path, ref: dict, idx: torch.Tensor, prompts: list[list[int]], new_tokens: int
) -> dict:
    """Max relative errors of an axo4d model (on any grid, weights loaded from ``folder``) against
    the Hugging Face reference: logits, loss, every gradient (assembled, mapped back to HF names),
    and whether greedy generation is identical (1.0 when not)."""
    from axo4d.facts.placement import placement_of
    from axo4d.models.generation import Sampling, generate
    from axo4d.training.hf.weights import SafetensorsFolder, weight_layout
    from tests.helpers import gather_blocks, gather_full_tensor, shard_rows

    v = model.spec.vocab_size
    rows = shard_rows(idx, comm)  # (B/(data*z), T)
    model.eval()
    with torch.no_grad():
        lg = model(rows)  # (b, T, V/(x*y))
    full = gather_blocks(lg.reshape(-1, lg.shape[-1]), comm, ("z", "data"), ("x", "y"))
    full = full.view(idx.shape[0], idx.shape[1], -1)
    errs = {"logits": _rel(full[..., :v], ref["logits"])}
    model.train()
    losses = model(rows[:, :-1], rows[:, 1:])  # (b, T-1)
    n = idx.shape[0] * (idx.shape[1] - 1)
    (losses.sum() / n).backward()
    model.finish_gradients()
    all_losses = gather_blocks(losses.detach(), comm, ("z", "data"), None)
    errs["loss"] = abs(float(all_losses.sum()) / n - ref["loss"]) / abs(ref["loss"])
    layout = weight_layout(model.cfg, SafetensorsFolder(folder))
    grads: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters():
        g = gather_full_tensor(p.grad, p, comm)[: placement_of(p).logical_shape[0]]
        rm = layout[name]
        for hf_name, pieces in rm.split(g).items():
            for base, part in pieces:
                part = part.t() if rm.transposed else part
                cur = grads.setdefault(hf_name, torch.zeros_like(ref["grads"][hf_name]))
                if rm.transposed:
                    cur[:, base : base + part.shape[1]] += part
                else:
                    cur[base : base + part.shape[0]] += part
    missing = sorted(set(ref["grads"]) - set(grads))
    assert not missing, f"no axo4d gradient for {missing}"
    errs["grad"] = max(_rel(grads[k], ref["grads"][k]) for k in ref["grads"])
    errs["grad_worst"] = max(ref["grads"], key=lambda k: _rel(grads[k], ref["grads"][k]))
    gen = generate(model, prompts, new_tokens, Sampling())
    errs["generation_differs"] = 0.0 if gen == ref["gen"] else 1.0
    return errs
