"""Make a small randomly initialised Hugging Face model folder (Llama, GPT-2, Qwen3-MoE or
Qwen2-MoE; and a fine-tuning JSONL file), to
try ``--init-from``, ``export-hf`` and ``axo4d.generate`` without downloading anything.

    python examples/make_hf_model.py --arch llama --out hf/tiny-llama --data data/stdlib.jsonl

The folder holds ``config.json``, ``model.safetensors`` (written by ``transformers``'
``save_pretrained``, as a published checkpoint is) and a byte-level BPE ``tokenizer.json``
trained on a few standard-library files. The JSONL file has one document per line in a ``text``
field (standard-library modules). With a real checkpoint (e.g. a Llama 3.2 1B folder) none of
this is needed: pass its folder to ``--init-from``.
"""

from __future__ import annotations

import argparse
import json
import sys
import sysconfig
from pathlib import Path

SHAPES = {  # hidden, layers, heads, kv heads, MLP width
    "llama": dict(
        hidden_size=128, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4, intermediate_size=344
    ),
    "gpt2": dict(n_embd=128, n_layer=4, n_head=4),
    "qwen3_moe": dict(  # 8 experts of width 128, each token to its top 2
        hidden_size=128,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=16,
        intermediate_size=344,
        moe_intermediate_size=128,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        router_aux_loss_coef=0.01,
    ),
    "qwen2_moe": dict(  # 8 experts of width 128, each token to its top 2, and a shared expert of width 256
        hidden_size=128,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        intermediate_size=344,
        moe_intermediate_size=128,
        shared_expert_intermediate_size=256,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=False,
        router_aux_loss_coef=0.001,
    ),
}


def tokenizer(vocab: int, files: list[Path]):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train(
        [str(f) for f in files],
        trainers.BpeTrainer(
            vocab_size=vocab,
            special_tokens=["<|begin_of_text|>", "<|end_of_text|>"],
            show_progress=False,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        ),
    )
    return tok


def make_model(arch: str, vocab: int):
    """A randomly initialised ``transformers`` model of ``arch`` (shapes: :data:`SHAPES`)."""
    import transformers

    if arch == "gpt2":
        cfg = transformers.GPT2Config(vocab_size=vocab, n_positions=512, bos_token_id=1, eos_token_id=1, **SHAPES[arch])
        return transformers.GPT2LMHeadModel(cfg)
    common = dict(vocab_size=vocab, max_position_embeddings=2048, rms_norm_eps=1e-6, bos_token_id=0, eos_token_id=1)
    if arch == "qwen3_moe":
        cfg = transformers.Qwen3MoeConfig(
            rope_parameters={"rope_type": "default", "rope_theta": 1e6}, **common, **SHAPES[arch]
        )
        return transformers.Qwen3MoeForCausalLM(cfg)
    if arch == "qwen2_moe":
        cfg = transformers.Qwen2MoeConfig(
            rope_parameters={"rope_type": "default", "rope_theta": 1e6}, **common, **SHAPES[arch]
        )
        return transformers.Qwen2MoeForCausalLM(cfg)
    rope = {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 512,
    }
    common["rms_norm_eps"] = 1e-5
    cfg = transformers.LlamaConfig(rope_parameters=rope, tie_word_embeddings=True, **common, **SHAPES[arch])
    return transformers.LlamaForCausalLM(cfg)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", choices=sorted(SHAPES), default="llama")
    ap.add_argument("--out", required=True, help="model folder to create")
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument("--data", default=None, help="also write a JSONL fine-tuning file here")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    import torch

    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    tok = tokenizer(a.vocab, files[:40])
    torch.manual_seed(a.seed)
    model = make_model(a.arch, a.vocab)
    out = Path(a.out)
    model.save_pretrained(out)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>"})
    )
    print(
        f"wrote {out}: {a.arch}, {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters, "
        f"vocabulary {a.vocab}"
    )
    if a.data:
        path = Path(a.data)
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "w") as f:
            for p in files[:200]:
                f.write(json.dumps({"text": p.read_text(errors="replace")}) + "\n")
        print(f"wrote {path}: 200 documents")
    return 0


if __name__ == "__main__":
    sys.exit(main())
