"""The run configuration's schema: frozen dataclasses, one docstring per field (the string literal
under it), ``Literal`` types for choices."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

CONFIG_DIR = Path(__file__).parents[1] / "configs"
#: words ``parallel.cache_weights`` takes besides a number of blocks
CACHE_WEIGHTS_WORDS = ("off", "false", "none", "", "all", "on", "true", "auto")
#: signals ``checkpoint.signals`` may name (those a process can catch and that schedulers send)
STOP_SIGNALS = ("SIGUSR1", "SIGUSR2", "SIGTERM", "SIGHUP", "SIGINT", "SIGQUIT", "SIGXCPU")
#: the largest integer a config value may be (steps, sizes and seeds become int64 tensors)
INT_MAX = 2**63 - 1
#: the largest float32: settings the optimizer and the layers multiply float32 tensors by stay below it
FLOAT32_MAX = 3.4028234663852886e38


@dataclass(frozen=True)
class ModelConfig:
    arch: str = "gpt"
    """A registered architecture (the entries of axo4d.facts.archs, e.g. 'gpt': GPT-2 style, 'llama': Llama
    3.x); an unknown one is one error naming the registered ones."""
    n_layer: int = 2
    """Number of transformer blocks."""
    n_embd: int = 64
    """Hidden size ``h``; must divide by G_x and G_y."""
    n_head: int = 4
    """Attention heads; must divide by G_y and divide ``n_embd``."""
    vocab_size: int = 256
    """Tokenizer vocabulary; padded up to ``vocab_multiple * G_y`` for the LM head."""
    seq_len: int = 64
    """Sequence length (context) in tokens."""
    ffn_mult: int = 4
    """MLP hidden size is ``ffn_mult * n_embd``."""
    bias: bool = True
    """Biases in linear layers and LayerNorms."""
    vocab_multiple: int = 64
    """The padded vocabulary is a multiple of this times G_y (padding is masked)."""
    ln_eps: float = 1e-5
    """Norm epsilon (LayerNorm; RMSNorm for 'llama')."""
    init_std: float = 0.02
    """Std of the normal init of weights (residual projections scaled by 1/sqrt(2*n_layer))."""
    n_kv_head: int = 0
    """Key/value heads of grouped-query attention ('llama'; 0 = n_head); must divide n_head and by G_y."""
    head_dim: int = 0
    """Size of one attention head (0 = n_embd / n_head)."""
    ffn_hidden: int = 0
    """MLP hidden size (0 = ffn_mult * n_embd); for 'llama' the width of gate and up each; for an
    MoE architecture the width of one expert's gate and up each."""
    tie_embeddings: bool = False
    """'llama': the token embedding is the LM head's weight (looked up vocabulary-parallel)."""
    rope_theta: float = 10000.0
    """RoPE base ('llama')."""
    rope_scaling: Literal["", "llama3"] = ""
    """RoPE frequency scaling: '' (none) or 'llama3' (Llama 3.1's, with the rope_* fields below)."""
    rope_factor: float = 8.0
    """'llama3' scaling: factor applied to low frequencies."""
    rope_low_freq_factor: float = 1.0
    """'llama3' scaling: low_freq_factor."""
    rope_high_freq_factor: float = 4.0
    """'llama3' scaling: high_freq_factor."""
    rope_original_max_positions: int = 8192
    """'llama3' scaling: original_max_position_embeddings of pre-training."""
    n_experts: int = 0
    """Mixture of experts ('qwen3_moe', 'mixtral', 'qwen2_moe'): expert MLPs of each block's MoE
    layer (docs/design.md section 16); 0 for the dense architectures."""
    experts_per_token: int = 2
    """MoE: the top-k experts each token is sent to (1 <= k <= n_experts)."""
    norm_topk_prob: bool = True
    """MoE: renormalise the chosen experts' softmax scores to sum to 1 (Mixtral always does;
    Qwen3-MoE as its config.json says)."""
    router_aux_loss_coef: float = 0.001
    """MoE: weight of the router's load-balancing loss (transformers' load_balancing_loss_func) in
    the training loss when ``output_router_logits`` is true; 0 = not added (still logged as aux_loss)."""
    output_router_logits: bool = False
    """MoE: add ``router_aux_loss_coef`` x the load-balancing loss to the training loss, as
    ``transformers`` does when its config's field of this name is true (false there by default, and
    in the published Qwen3-MoE and Mixtral folders). Read from and written back to ``config.json``;
    the loss is computed and logged as ``aux_loss`` either way (docs/design.md section 16). The
    named MoE configs, which train from scratch, set it true."""
    shared_expert_ffn: int = 0
    """MoE with a shared expert ('qwen2_moe', which needs it > 0): width of the dense SwiGLU expert
    every token passes through beside its routed ones, its output scaled by a sigmoid gate
    (Qwen2-MoE's shared_expert_intermediate_size; divisible by G_x*G_y); 0 for the others."""


@dataclass(frozen=True)
class SourceConfig:
    path: str = ""
    """A source as ``data.source`` takes it (a text source, a prepared folder, a token file or a
    Megatron dataset prefix)."""
    weight: float = 1.0
    """Its share of each epoch, relative to the other sources' weights (>= 0, summing to > 0)."""


@dataclass(frozen=True)
class DataConfig:
    source: str = "stdlib"
    """'stdlib' (the Python standard library's .py sources, no download), a directory of text
    and/or .jsonl files, a text file, a .jsonl file (one document per line, its text in
    ``text_field``), a Hugging Face datasets folder (save_to_disk) or an .arrow/.parquet file (one
    document per row), a prepared folder (python -m axo4d.data prepare), a Megatron indexed dataset
    (its prefix PREFIX, or PREFIX.bin/PREFIX.idx, or a folder of just that pair; one document per
    entry of its document index, no separator added), or a token file (.bin/.u16/.u32/.npy, one
    document). Text sources are tokenised once into the cache."""
    tokenizer: str = "byte"
    """'byte' (vocabulary 256) or the path to a HuggingFace tokenizer.json (or its folder).
    With a tokenizer that has an end-of-text token, documents are separated by it."""
    text_field: str = "text"
    """The field holding a document's text in .jsonl sources."""
    token_dtype: Literal["auto", "uint16", "uint32"] = "auto"
    """dtype of a token file: 'uint16', 'uint32' or 'auto' (from the suffix/vocabulary)."""
    val_fraction: float = 0.05
    """Fraction of the documents held out for validation (a fixed pseudo-random set, the same for
    every seed and grid); a source of too few documents for that (one text or token file) holds out
    the tail of its token stream instead."""
    max_tokens: int = 0
    """Use at most this many tokens of the corpus (0 = all)."""
    cache_dir: str = ""
    """Where tokenised corpora are cached ('' = $AXO4D_CACHE or ~/.cache/axo4d)."""
    sources: tuple[SourceConfig, ...] = ()
    """A mixture instead of ``source``: ``[{path: A, weight: 3}, {path: B, weight: 1}]``; each epoch
    takes every source's share of the samples by weight, shuffled together, deterministically
    (docs/design.md section 11)."""
    val_source: str = ""
    """Validation from this whole source instead of held-out documents ('' = val_fraction)."""
    document_mask: bool = False
    """Attention stays inside each document of a packed sequence (block-diagonal causal mask,
    positions restarting per document), as Llama 3 trains."""
    log_samples: bool = False
    """Write the indices of every step's samples into metrics.jsonl ("samples")."""


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 20
    """Optimizer steps (0: evaluation only -- the validation loss of the initial weights, from
    ``--resume`` or ``--init-from``, logged as one ``val_loss`` record; no checkpoint is written)."""
    global_batch: int = 8
    """Samples per optimizer step, over all ranks and accumulation steps."""
    grad_accum: int = 1
    """Micro-steps per optimizer step; global_batch/grad_accum must divide by data*z."""
    lr: float = 1e-3
    """Peak learning rate."""
    min_lr: float = 1e-4
    """Learning rate at the end of the cosine decay."""
    warmup_steps: int = 2
    """Linear warm-up steps."""
    decay_steps: int = 0
    """Steps of cosine decay after warm-up (0 = until the last step)."""
    weight_decay: float = 0.1
    """AdamW decoupled weight decay (not applied to norms, biases)."""
    beta1: float = 0.9
    """AdamW beta1."""
    beta2: float = 0.95
    """AdamW beta2."""
    eps: float = 1e-8
    """AdamW epsilon."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this (0 = off)."""
    seed: int = 1234
    """Seed of initialisation, data order and everything random."""
    dtype: Literal["auto", "fp32", "bf16"] = "auto"
    """'auto' (bf16 autocast on GPU, fp32 on CPU), 'fp32' or 'bf16'."""
    activation_checkpointing: bool = False
    """Recompute each block's activations in backward."""
    eval_interval: int = 10
    """Validation every this many steps (0 = only at the end)."""
    eval_batches: int = 2
    """Validation batches of global_batch held-out samples per evaluation (fixed samples, the same
    on every grid; all of them when there are fewer, or with 0)."""
    log_interval: int = 1
    """Print a line every this many steps."""
    compile: bool = False
    """torch.compile each block, and the head with its loss (axo4d.models.apply_compile)."""
    peak_tflops: float = 0.0
    """Peak TFLOP/s per device that MFU is against (0 = the vendor's dense bf16 peak of a known GPU,
    axo4d.training.perf; none on a CPU). The fraction of the measured GEMM ceiling is reported beside it."""
    tensorboard: bool = False
    """Also write TensorBoard event files into the output folder (needs the tensorboard package)."""
    nonfinite: Literal["stop", "skip"] = "stop"
    """On a non-finite loss: 'stop' (exit with an error) or 'skip' (skip the step)."""
    nonfinite_max_consecutive: int = 5
    """With nonfinite='skip': stop with an error when this many steps in a row were skipped (0 = no limit)."""
    nonfinite_max_total: int = 20
    """With nonfinite='skip': stop with an error when this many steps of the run were skipped
    (counted since the start or the resume; 0 = no limit)."""
    offload: Literal["none", "optimizer", "auto"] = "none"
    """Optimizer state in host memory: 'none', 'optimizer' (fp32 master weights and Adam moments
    in (pinned) host memory, AdamW on the CPU per gradient bucket, the weights on the device in
    the compute dtype) or 'auto' (on the device as far as the memory model fits, the rest offloaded)."""
    memory_budget_gb: float = 0.0
    """Device memory per rank in GiB (0 = the GPU's total memory; on CPU: no check). A run the
    memory model predicts not to fit stops before allocating; offload 'auto' fills it."""
    host_memory_gb: float = 0.0
    """Host memory per rank for offloaded state in GiB (0 = the node's available memory shared
    by the ranks on the node)."""
    goldfish_k: int = 0
    """Goldfish loss (docs/design.md section 8): drop target token i from the loss when a hash of
    the goldfish_h tokens before it is 0 mod k, about 1/k of the targets, the same on every grid and
    rerun (0 = off; k >= 2). Dropped targets count in neither the loss sum nor the token count;
    validation loss stays the full loss."""
    goldfish_h: int = 13
    """Goldfish context width h >= 1: the tokens hashed to decide whether the next one is dropped
    (the first h tokens of a sample are never dropped)."""
    epochs: float = 0.0
    """Train this many epochs of the data instead of ``steps`` (0 = ``steps`` decides): steps =
    ceil(epochs * samples per epoch / global_batch), the last step's slots past the end left empty."""
    fp8: Literal["off", "tensorwise", "rowwise"] = "off"
    """FP8 training (docs/fp8.md): the forward, dX and dW GEMMs of the linear layers that
    train.fp8_layers picks run as scaled FP8 GEMMs with dynamic scales, torchao's recipe of this
    name ('tensorwise': e4m3, output gradients e5m2, one scale per tensor; 'rowwise': e4m3, one scale
    per row/column), outputs in the compute dtype, weight blocks gathered over z in FP8; masters,
    optimizer, gradient reductions and checkpoints stay fp32. 'off': none."""
    fp8_layers: Literal["auto", "blocks", "all"] = "auto"
    """With train.fp8: 'auto' (the block layers whose local GEMM shape pays in FP8, torchao's
    thresholds; the LM head stays in the compute dtype), 'blocks' (every block layer) or 'all'
    (the block layers and the LM head)."""
    expert_gemm: Literal["auto", "grouped", "loop"] = "auto"
    """Mixture of experts: how a rank's experts multiply their routed rows where their layers are
    whole on it (x, y and z of one rank, no FP8): 'grouped' (one grouped GEMM per projection for
    all of them, torch._grouped_mm, on weights stacked at each forward), 'loop' (one expert after
    the other) or 'auto' (grouped where this torch runs it for the compute dtype and device). Where
    x, y or z split the expert layers they always loop (each layer's own collectives). How the step
    computes, not what: parameters, checkpoints and exports are the same (docs/design.md section 16)."""


@dataclass(frozen=True)
class ParallelConfig:
    grid: str = "data=1"
    """Grid spec 'data=..,x=..,y=..,z=..' (missing axes are 1); the product is the world size."""
    order: str = "x,y,z,data"
    """Rank layout, fastest axis first."""
    backend: Literal["auto", "nccl", "gloo", "mpi"] = "auto"
    """'auto' (nccl with CUDA, else gloo), 'nccl', 'gloo' or 'mpi'."""
    timeout_s: float = 30.0
    """Collective timeout in seconds once training runs (from the second step on): a rank that
    hangs makes the others stop after this long, naming the rank, axis and operation."""
    init_timeout_s: float = 600.0
    """Collective timeout in seconds at start-up (process group, data preparation on rank 0,
    resume, the first step with its compilation and tuning) and during checkpoint saves."""
    overlap: bool = True
    """Overlap non-blocking collectives with compute."""
    tuner: bool = True
    """Time GEMM layout variants per layer and keep the fastest (axo4d.nn.blas_tuner; agreed over all ranks)."""
    tuner_cache: str = ""
    """JSON file of tuner decisions ('' = <cache_dir>/blas_tuner.json)."""
    dp_bucket_mb: str = "auto"
    """Size of the data-parallel gradient buckets (all-reduced, or reduce-scattered with the sharded
    optimizer, as soon as their gradients are final): 'auto' (from the model and grid: about four
    buckets a block, at least 1 MiB per rank of the group, at most 25 MiB; the rule:
    axo4d.facts.schedule_rules, docs/design.md section 3) or a size in MiB for every group."""
    shard_optimizer: Literal["auto", "true", "false"] = "auto"
    """Sharded optimizer (ZeRO-1): gradients reduce-scattered over each bucket's axes (data, and z
    for replicated parameters) instead of all-reduced, AdamW state of 1/G of every piece per rank,
    new weights all-gathered: 'auto' (on when G_data > 1), 'true' or 'false'."""
    cache_weights: str = "off"
    """Keep each gathered z weight block from forward for backward (and recompute), so those
    all-gathers disappear, at one block of memory per cached layer: 'off', 'all', a number N
    (the last N blocks and the LM head), or 'auto' (as many as the memory model fits; chosen by
    python -m axo4d.train)."""
    machine: str = ""
    """perfmodel machine (bundled name such as 'perlmutter', or a machine YAML) for --grid auto,
    cache_weights=auto and the predicted step time; '' = a short profile of this job's own
    groups taken at start-up (only when one of those needs it)."""
    trace_collectives: int = 512
    """Collectives each rank keeps in its trace (a ring buffer: group, operation, sequence number,
    bytes, times; axo4d.dist.flight), written to OUT/traces/rank_K.json when a collective fails or
    times out and compared to name the rank that is behind (0 = off)."""
    expert: int = 1
    """Expert parallelism for mixture-of-experts models: G_ep, the ranks of an expert group --
    G_ep consecutive ranks of the data axis (so it must divide G_data; also n_experts) -- each
    holding n_experts/G_ep of the experts, tokens sent to their experts' rank by an all-to-all
    over the group and back; the G_data/G_ep ranks at the same position of every group hold copies
    of the same experts and sum their gradients (docs/design.md section 16). 1 = every batch rank
    holds every expert."""
    z_split: Literal["batch", "sequence", "auto"] = "batch"
    """What z splits: 'batch' (whole samples over data*z), 'sequence' (every sample's sequence:
    z rank i holds chunks i and 2z-1-i of 2z equal chunks; attention all-gathers K and V over z;
    the micro-batch need only divide by G_data, seq_len by 2*G_z) or 'auto' (sequence when the
    micro-batch cannot fill G_data*G_z, else batch). Long contexts: docs/design.md section 14."""


@dataclass(frozen=True)
class CheckpointConfig:
    interval: int = 0
    """Save every this many steps (0 = only at the end)."""
    keep: int = 2
    """Keep the newest this many complete checkpoints."""
    at_end: bool = True
    """Save when training ends."""
    async_: Literal["auto", "true", "false"] = "auto"
    """(YAML key ``async``) Asynchronous saves: the state is copied to host memory at the step
    boundary, then written, checksummed and marked COMPLETE in the background while training goes
    on, one save in flight at a time: 'true', 'false' (training waits for each save) or 'auto'
    (on, unless the memory model finds no room for the host copy)."""
    signals: str = "SIGUSR1,SIGTERM,SIGHUP"
    """Signals on which every rank finishes its step, saves a checkpoint and exits with status 75
    ("stopped cleanly, resume me"; axo4d.exits), e.g. 'SIGUSR1,SIGTERM,SIGHUP' (Slurm's --signal and
    its end-of-job SIGTERM; SIGHUP: the SSH session or terminal that started the run went away);
    '' = none (the signal's default action). SIGINT (Ctrl-C) does the same at
    the first press and stops at once at the second."""


@dataclass(frozen=True)
class EvalConfig:
    tasks: tuple[str, ...] = ()
    """lm-evaluation-harness tasks to score during training (``pip install 'axo4d[eval]'``), e.g.
    ``[hellaswag, arc_easy]``; scores go to metrics.jsonl (``{"step": s, "eval": {"task/metric": v}}``)
    and TensorBoard (``eval/task/metric``). () = none."""
    interval: int = 0
    """Score ``tasks`` every this many steps, and after the last step (0 = only after the last step)."""
    include_path: str = ""
    """A folder (or file) of your own task YAML files besides the harness's ('' = none)."""
    limit: int = 0
    """At most this many examples of each task (0 = all of them)."""
    batch_size: int = 16
    """Requests scored a forward, over the grid."""


@dataclass(frozen=True)
class RunConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    """Model shape."""
    data: DataConfig = field(default_factory=DataConfig)
    """Dataset and tokenizer."""
    train: TrainConfig = field(default_factory=TrainConfig)
    """Optimisation."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """Grid and communication."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Checkpointing."""
    eval: EvalConfig = field(default_factory=EvalConfig)
    """lm-evaluation-harness tasks during training."""
    name: str = "custom"
    """Name of the config."""
