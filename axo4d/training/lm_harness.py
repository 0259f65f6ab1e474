"""lm-evaluation-harness tasks on a model sharded over the grid (``pip install 'axo4d[eval]'``).

:class:`GridLM` is the model registered with the harness (an ``lm_eval.api.model.LM``):
``loglikelihood`` (batched, :func:`axo4d.models.scoring.score_continuations`: every rank computes
its rows of each batch), ``loglikelihood_rolling`` (the harness's disjoint rolling windows of
``seq_len`` tokens, scored the same way) and ``generate_until`` (greedy,
:func:`axo4d.models.generation.generate`, cut at the first stop string). Requests are tokenised as
the harness's Hugging Face model does (a context's trailing spaces move to the continuation; the
continuation's tokens are those of ``context + continuation`` past the context's, texts framed as the
tokenizer frames them; an empty context is the begin-of-text token, else the end-of-text one), so
both score the same tokens.

Every rank runs the harness identically (:func:`run_tasks`) rather than rank 0 driving it and
broadcasting requests: the harness is deterministic given its tasks and seeds, so each rank builds
the same requests in the same order and every forward is reached by all ranks together with no
protocol of messages to keep in step, and a model call never waits on one rank's Python; a check
at each call (one small all-gather of the requests' CRC-32) stops every rank with one error if the
ranks ever disagree. Only rank 0 logs and reports. The harness is told it runs on one rank
(``rank 0 of 1``): it must not split requests itself, the grid does. The run's random state
(``random``, numpy, torch) is saved before and restored after, so an evaluation inside training
changes nothing the training sees.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import random
import zlib
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np
import torch
from lm_eval.api.model import LM

from axo4d.config.errors import ConfigError
from axo4d.models.base import DecoderLM
from axo4d.models.generation import Sampling, generate
from axo4d.models.scoring import score_continuations
from axo4d.training.datasets.tokenizer import Tokenizer

#: the harness's default number of new tokens of ``generate_until``
MAX_GEN_TOKS = 256


@contextlib.contextmanager
def kept_random_state() -> Iterator[None]:
    """Restore Python's, numpy's and torch's (CPU and CUDA) random states on exit."""
    py, npy, cpu = random.getstate(), np.random.get_state(), torch.get_rng_state()
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    try:
        yield
    finally:
        random.setstate(py)
        np.random.set_state(npy)
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)


class GridLM(LM):
    """An axo4d model on its grid as an lm-evaluation-harness model (module docstring)."""

    def __init__(self, model: DecoderLM, tokenizer: Tokenizer, batch_size: int = 16, dtype: torch.dtype | None = None):
        super().__init__()
        self.model, self.tok, self.batch_size, self.dtype = model, tokenizer, max(1, batch_size), dtype
        self.max_length = model.spec.seq_len

    @property
    def prefix_token_id(self) -> int:
        """The context of a request without one: begin-of-text, else end-of-text."""
        for t in (self.tok.bos_id, self.tok.eos_id):
            if t is not None:
                return t
        raise ConfigError("the tokenizer has neither a begin- nor an end-of-text token: requests need a context")

    def tok_encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """``text``'s tokens as the tokenizer frames them (a Llama tokenizer adds its begin-of-text
        token), unless the text starts with the prefix token's text already."""
        if add_special_tokens and text.startswith(self.tok.decode([self.prefix_token_id])):
            add_special_tokens = False
        return self.tok.encode(text, add_special_tokens=add_special_tokens)

    def _encode_pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        if not context:  # the prefix token is the context (unless the continuation starts with it)
            cont = self.tok_encode(continuation, add_special_tokens=False)
            return ([self.prefix_token_id], cont) if cont[:1] != [self.prefix_token_id] else (cont[:1], cont[1:])
        n = len(context) - len(context.rstrip())
        if n:
            context, continuation = context[:-n], context[-n:] + continuation
        whole, ctx = self.tok_encode(context + continuation), self.tok_encode(context)
        return ctx, whole[len(ctx) :]

    def _same_everywhere(self, what: str, payload: Sequence) -> None:
        """Every rank must hold the same requests (one all-gather of a CRC-32)."""
        crc = zlib.crc32(repr(payload).encode())
        crcs = self.model.comm.all_gather_object(crc)
        if len(set(crcs)) > 1:
            raise ConfigError(f"{what}: the ranks built different requests (CRC-32 {crcs}); the harness must agree")

    def _autocast(self):
        dev = next(self.model.parameters()).device
        if self.dtype is None or self.dtype == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(dev.type, dtype=self.dtype)

    def _score(self, pairs: list[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
        self._same_everywhere("loglikelihood", pairs)
        with self._autocast():
            return score_continuations(self.model, pairs, self.batch_size)

    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        return self._score([self._encode_pair(*r.args) for r in requests])

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

        pairs, owner = [], []
        for i, r in enumerate(requests):
            windows = get_rolling_token_windows(
                token_list=self.tok_encode(r.args[0]),
                prefix_token=self.prefix_token_id,
                max_seq_len=self.max_length,
                context_len=1,
            )
            for w in map(make_disjoint_window, windows):
                pairs.append(w)
                owner.append(i)
        totals = [0.0] * len(requests)
        for i, (lp, _) in zip(owner, self._score(pairs)):
            totals[i] += lp
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Greedy continuations, batched by their generation settings, cut at the first stop string."""
        groups: dict[str, list[int]] = {}
        for i, r in enumerate(requests):
            groups.setdefault(repr(sorted(r.args[1].items(), key=lambda kv: kv[0])), []).append(i)
        out = [""] * len(requests)
        eos = self.tok.eos_id
        for ids in groups.values():
            kw = dict(requests[ids[0]].args[1])
            until = kw.get("until") or []
            until = [until] if isinstance(until, str) else list(until)
            if eos is not None:
                until.append(self.tok.decode([eos]))
            new = int(kw.get("max_gen_toks", MAX_GEN_TOKS))
            keep = max(1, self.max_length - new)
            prompts = [self.tok_encode(requests[i].args[0])[-keep:] or [self.prefix_token_id] for i in ids]
            self._same_everywhere("generate_until", prompts)
            for b in range(0, len(ids), self.batch_size):
                with self._autocast():
                    outs = generate(self.model, prompts[b : b + self.batch_size], new, Sampling(), eos_id=eos)
                for i, toks in zip(ids[b : b + self.batch_size], outs):
                    text = self.tok.decode(toks)
                    for stop in until:
                        if stop:
                            text = text.split(stop)[0]
                    out[i] = text
        return out


@functools.lru_cache(maxsize=4)
def task_manager(include_path: str | None, tasks: tuple[str, ...] = ()):
    """The harness's task index, with the YAML tasks under ``include_path`` (a folder or file); only
    those when they hold every task of ``tasks`` (indexing the harness's own thousands of task files
    takes seconds). Cached: the ranks, the check and the run share one."""
    from lm_eval.tasks import TaskManager

    if include_path and not Path(include_path).exists():
        raise ConfigError(f"--include-path {include_path!r} does not exist (a folder of task YAML files)")
    if include_path:
        tm = TaskManager(include_path=include_path, include_defaults=False)
        if tasks and all(t in tm.all_tasks for t in tasks):
            return tm
    return TaskManager(include_path=include_path or None)


def check_tasks(tasks: Sequence[str], include_path: str | None) -> None:
    """Each task (or group, or tag) is one the harness knows: one line naming the unknown ones."""
    tm = task_manager(include_path, tuple(tasks))
    unknown = [t for t in tasks if t not in tm.all_tasks]
    if not tasks:
        raise ConfigError("no task given: --tasks t1,t2 names lm-evaluation-harness tasks")
    if unknown:
        where = f" or under {include_path}" if include_path else " (add your own YAML tasks with --include-path DIR)"
        raise ConfigError(
            f"unknown lm-evaluation-harness task(s) {', '.join(unknown)}: not among the harness's "
            f"{len(tm.all_tasks)} tasks{where}"
        )


def run_tasks(
    lm: GridLM,
    tasks: Sequence[str],
    include_path: str | None = None,
    limit: int | None = None,
    num_fewshot: int | None = None,
    log_samples: bool = False,
) -> dict:
    """The harness's results of ``tasks`` (``simple_evaluate``'s dictionary); collective: every rank
    calls it alike, the random state is kept (module docstring)."""
    from lm_eval import simple_evaluate

    rank = lm.model.comm.rank
    level = logging.getLogger("lm-eval").level
    if rank != 0:
        logging.getLogger("lm-eval").setLevel(logging.ERROR)
    try:
        with kept_random_state(), torch.no_grad():
            return simple_evaluate(
                model=lm,
                tasks=list(tasks),
                num_fewshot=num_fewshot,
                limit=limit,
                task_manager=task_manager(include_path, tuple(tasks)),
                log_samples=log_samples,
                bootstrap_iters=0,
            )
    finally:
        logging.getLogger("lm-eval").setLevel(level)


def scores(results: dict) -> dict[str, float]:
    """``{"task/metric": value}`` of a results dictionary (the metrics only: no standard errors, no
    ``sample_len``)."""
    out = {}
    for task, metrics in results.get("results", {}).items():
        for key, v in metrics.items():
            if isinstance(v, (int, float)) and not isinstance(v, bool) and "_stderr" not in key and key != "sample_len":
                out[f"{task}/{key.split(',')[0]}"] = float(v)
    return out


def check_eval_config(cfg) -> None:
    """``eval.*`` of a training run: known tasks, sensible numbers, a grid whose z splits the batch."""
    e = cfg.eval
    if e.interval < 0 or e.limit < 0 or e.batch_size < 1:
        raise ConfigError(
            f"eval.interval={e.interval} and eval.limit={e.limit} must be >= 0, eval.batch_size={e.batch_size} >= 1"
        )
    if cfg.parallel.z_split != "batch":
        raise ConfigError(
            f"eval.tasks with parallel.z_split={cfg.parallel.z_split}: the harness's requests are scored with z "
            "splitting the batch; set parallel.z_split=batch or evaluate checkpoints with python -m axo4d.eval"
        )
    check_tasks(e.tasks, e.include_path or None)


class TrainingEval:
    """``eval.tasks`` every ``eval.interval`` steps of a training run, on the trainer's model."""

    def __init__(self, cfg, model: DecoderLM, dtype: torch.dtype | None) -> None:
        from axo4d.training.datasets.tokenizer import load_tokenizer

        self.cfg = cfg.eval
        self.lm = GridLM(model, load_tokenizer(cfg.data.tokenizer), self.cfg.batch_size, dtype)

    def due(self, step: int, last: bool) -> bool:
        return last or (self.cfg.interval > 0 and (step + 1) % self.cfg.interval == 0)

    def run(self) -> dict[str, float]:
        """The scores ``{"task/metric": value}`` (the same on every rank); changes no state of the run."""
        e = self.cfg
        return scores(run_tasks(self.lm, e.tasks, e.include_path or None, e.limit or None))
