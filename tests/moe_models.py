"""Tiny random Hugging Face mixture-of-experts models (Qwen3-MoE, Mixtral, Qwen2-MoE with its
shared expert) saved to folders, and
the comparison of an axo4d model on any grid with them: logits, loss with the load-balancing
loss, every gradient (mapped to the checkpoint's per-expert names), greedy generation.

``transformers`` >= 5 holds each layer's experts fused (``experts.gate_up_proj`` (E, 2F, C),
``experts.down_proj`` (E, C, F)) but saves them per expert; :func:`hf_grads` maps the gradients
of the fused tensors to the saved names, which the axo4d layout reads.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from tests.hf_models import QWEN2, VOCAB, _rel, tokenizer_json

BASE = {k: v for k, v in QWEN2.items() if k not in ("intermediate_size",)}
QWEN3_MOE = dict(
    BASE,
    head_dim=16,
    intermediate_size=96,
    moe_intermediate_size=32,
    num_experts=4,
    num_experts_per_tok=2,
    norm_topk_prob=True,
    router_aux_loss_coef=0.1,
)
MIXTRAL = dict(BASE, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2, router_aux_loss_coef=0.1)
QWEN2_MOE = dict(  # top-k not renormalised (the family's default); q/k/v biases; a shared expert
    BASE,
    intermediate_size=96,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=48,
    num_experts=4,
    num_experts_per_tok=2,
    norm_topk_prob=False,
    router_aux_loss_coef=0.1,
)
#: '_noaux': ``output_router_logits`` false in config.json (the training loss without the aux loss);
#: the others true (``router_aux_loss_coef`` x the load-balancing loss added, as ``transformers``)
MOE_NAMES = ("qwen3_moe", "qwen3_moe_nonorm", "mixtral", "qwen2_moe", "mixtral_noaux")


def build_moe(name: str, folder: Path, seed: int = 0):
    """Save the tiny MoE model ``name`` (one of :data:`MOE_NAMES`) into ``folder``; returns it (eval)."""
    import transformers

    torch.manual_seed(seed)
    aux = {"output_router_logits": not name.endswith("_noaux")}
    if name.startswith("qwen3_moe"):
        cfg = transformers.Qwen3MoeConfig(**dict(QWEN3_MOE, norm_topk_prob=name == "qwen3_moe", **aux))
        model = transformers.Qwen3MoeForCausalLM(cfg)
    elif name == "qwen2_moe":
        model = transformers.Qwen2MoeForCausalLM(transformers.Qwen2MoeConfig(**QWEN2_MOE, **aux))
    else:
        model = transformers.MixtralForCausalLM(transformers.MixtralConfig(**MIXTRAL, **aux))
    with torch.no_grad():  # norms away from 1, biases from 0, routers and shared gates from uniform
        for n, p in model.named_parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn_like(p))
            if n.endswith("gate.weight"):
                p.normal_(0, 0.5)
    model.eval().save_pretrained(folder)
    (folder / "tokenizer.json").write_text(tokenizer_json())
    return model


def hf_grads(model) -> dict[str, torch.Tensor]:
    """Gradients by the names the model saves (experts per expert; Mixtral's w1/w3/w2)."""
    mixtral = model.config.model_type == "mixtral"
    out = {}
    for n, p in model.named_parameters():
        if p.grad is None:
            continue
        g = p.grad.detach()
        m = re.match(r"(model\.layers\.\d+\.)mlp\.(.*)", n)
        if not m:
            out[n] = g.clone()
            continue
        pre, rest = m.group(1) + ("block_sparse_moe." if mixtral else "mlp."), m.group(2)
        gate, up, down = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
        if rest == "experts.gate_up_proj":
            f = g.shape[1] // 2
            for e in range(g.shape[0]):
                out[pre + f"experts.{e}.{gate}.weight"] = g[e, :f].clone()
                out[pre + f"experts.{e}.{up}.weight"] = g[e, f:].clone()
        elif rest == "experts.down_proj":
            for e in range(g.shape[0]):
                out[pre + f"experts.{e}.{down}.weight"] = g[e].clone()
        else:
            out[pre + rest] = g.clone()
    return out


def moe_reference(model, idx: torch.Tensor, prompts: list[list[int]], new_tokens: int) -> dict:
    """Logits, loss (cross-entropy, + coef * load-balancing loss when the config's
    ``output_router_logits`` is true), the load-balancing loss, gradients by saved name and greedy
    continuations of ``model``."""
    model.zero_grad(set_to_none=True)
    out = model(idx, labels=idx)  # output_router_logits as the config says
    out.loss.backward()
    aux = out.aux_loss
    if aux is None:  # not in the loss: the load-balancing loss alone, for the logged value
        assert not model.config.output_router_logits
        with torch.no_grad():
            aux = model(idx, labels=idx, output_router_logits=True).aux_loss
    gen = [
        model.generate(
            torch.tensor([p]), max_new_tokens=new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0
        )[0, len(p) :].tolist()
        for p in prompts
    ]
    return {
        "logits": out.logits.detach(),
        "loss": float(out.loss.detach()),
        "aux": float(aux.detach()),
        "grads": hf_grads(model),
        "gen": gen,
    }


def moe_errors(model, comm, folder: Path, ref: dict, idx: torch.Tensor, prompts, new_tokens: int) -> dict:
    """Max relative errors of an axo4d MoE model (any grid, weights from ``folder``) against
    :func:`moe_reference`: the loss is the training loss of :class:`~axo4d.training.trainer.Trainer`
    (mean cross-entropy over the T-1 targets of every sample, the last position masked, plus
    :meth:`~axo4d.models.moe.MoeDecoder.router_loss_weight` times the load-balancing loss over all T
    tokens: ``router_aux_loss_coef`` when ``output_router_logits``, as ``transformers``, else 0)."""
    from axo4d.models.generation import Sampling, generate
    from axo4d.training.hf.weights import SafetensorsFolder, weight_layout
    from tests.helpers import full_tensors, gather_blocks, shard_rows

    v = model.spec.vocab_size
    rows = shard_rows(idx, comm)  # (B/(data*z), T)
    model.eval()
    with torch.no_grad():
        lg = model(rows)  # (b, T, V/y)
    full = gather_blocks(lg.reshape(-1, lg.shape[-1]), comm, ("z", "data"), ("x", "y"))
    full = full.view(idx.shape[0], idx.shape[1], -1)
    errs = {"logits": _rel(full[..., :v], ref["logits"])}
    model.train()
    targets = torch.roll(rows, -1, 1)  # (b, T): the last position's target is masked out
    mask = torch.ones_like(rows, dtype=torch.bool)
    mask[:, -1] = False
    losses = model(rows, targets, loss_mask=mask)  # (b, T)
    n = idx.shape[0] * (idx.shape[1] - 1)
    aux = model.router_loss()
    weight = model.router_loss_weight()  # the trainer's rule
    (losses.sum() / n + weight * aux).backward()
    model.finish_gradients()
    total = comm.all_reduce(torch.stack([losses.detach().sum() / n, aux.detach()]).double(), ("z", "data"))
    errs["aux"] = abs(float(total[1]) - ref["aux"]) / abs(ref["aux"])
    loss = float(total[0]) + weight * float(total[1])
    errs["loss"] = abs(loss - ref["loss"]) / abs(ref["loss"])
    layout = weight_layout(model.cfg, SafetensorsFolder(folder))
    grads: dict[str, torch.Tensor] = {}
    for name, g in full_tensors(model, comm, lambda p: p.grad, logical=True).items():
        for hf_name, pieces in layout[name].split(g).items():
            for base, part in pieces:
                cur = grads.setdefault(hf_name, torch.zeros_like(ref["grads"][hf_name]))
                cur[base : base + part.shape[0]] += part
    missing = sorted(set(ref["grads"]) - set(grads))
    assert not missing, f"no axo4d gradient for {missing}"
    errs["grad"] = max(_rel(grads[k], ref["grads"][k]) for k in ref["grads"])
    errs["grad_worst"] = max(ref["grads"], key=lambda k: _rel(grads[k], ref["grads"][k]))
    gen = generate(model, prompts, new_tokens, Sampling())
    errs["generation_differs"] = 0.0 if gen == ref["gen"] else 1.0
    return errs


__all__ = ["MOE_NAMES", "VOCAB", "build_moe", "hf_grads", "moe_reference", "moe_errors"]
