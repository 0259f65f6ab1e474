"""Train a GPT on the 4D grid.

    python -m axo4d.train --config NAME_OR_YAML [--grid data=2,x=2,y=1,z=2]
                          [--set train.steps=100 --set train.lr=1e-3 ...] --out DIR

Launch under ``mpiexec``/``mpirun``/``srun``/``torchrun`` or ``python -m launch.local -n N --``.
Rank 0 prints a line per step and writes ``DIR/metrics.jsonl``, ``DIR/config.yaml``
and, at the end, ``DIR/loss.png``. Checkpoints go to ``DIR/checkpoints/step_N``
(``checkpoint.interval``, ``checkpoint.at_end``; see :mod:`axo4d.checkpoint`).

Resuming: ``--resume PATH`` continues from a checkpoint folder, or from the newest
complete checkpoint of a run folder; ``--resume auto`` continues from the newest
complete checkpoint in ``--out`` if there is one (else starts fresh). The run goes on
at the checkpoint's step, bit-exactly as if it had not stopped (same grid), and
``metrics.jsonl`` keeps the records of the steps before it. Without ``--resume`` a
fresh run moves an earlier run's ``DIR/checkpoints`` to ``DIR/checkpoints.prev``.

Errors: bad input is one line on stderr and exit status 2, found before ``--out`` is
touched; a failed or timed-out collective (a rank died or hangs) or a non-finite loss
is exit status 1 with the rank, axis and operation (or step and last checkpoint) named; a
collective that fails or times out also writes every live rank's last collectives to
``DIR/traces`` and names the rank that is behind (``python -m axo4d.trace DIR/traces``).
Every fault and what a user sees: docs/faults.md; exit statuses: :mod:`axo4d.exits`.

Signals (``checkpoint.signals``, default SIGUSR1 and SIGTERM, and a first Ctrl-C): every rank
finishes the same step, saves a checkpoint and exits with status 75 ("stopped cleanly, resume
me"); ``--resume auto`` continues bit-exactly. A second Ctrl-C stops at once (130). Periodic
saves run in the background (``checkpoint.async``): training waits only for the copy of the
state to host memory (:mod:`axo4d.training.lifecycle`, :mod:`axo4d.training.checkpointing.background`).

Test hook (environment, every rank): ``AXO4D_FAULT`` kills, stops or fills the disk of one rank
at a named point (:mod:`axo4d.dist.faults`).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
import time
from pathlib import Path

from axo4d.config import RunConfig, dump_config, load_config
from axo4d.config.errors import TrainError, agreed
from axo4d.dist import flight
from axo4d.exits import run_and_exit
from axo4d.facts.grid import Grid
from axo4d.facts.run import RunFacts, derive, exchange_note
from axo4d.train_args import check_run_config, grid_auto_plugin, needs_plan, parse_args
from axo4d.training.checkpointing.checkpointer import Checkpointer, step_dir_name
from axo4d.training.checkpointing.outdir import claim_output, prepare_output, probe_writable
from axo4d.training.checkpointing.resume import choose_resume, resume_changes
from axo4d.training.datasets.batches import run_length, steps_for_epochs
from axo4d.training.datasets.dataset import open_dataset, prepare_tokens
from axo4d.training.init_from import (
    check_init_source,
    check_tokenizer,
    config_with_init,
    load_init_weights,
    model_sources,
    record_source,
)
from axo4d.training.lifecycle import EXIT_RESUME, Stop, StopSignals, at_boundary
from axo4d.training.metrics_log import StepLog
from axo4d.training.perf import device_peaks
from axo4d.training.run_plan import make_plan
from axo4d.training.startup import World, start
from axo4d.training.trainer import Trainer


class Run:
    """One training run of this rank on a started world: set-up, loop, outputs."""

    def __init__(
        self,
        args: argparse.Namespace,
        world: World,
        plan=None,
        signals: StopSignals | None = None,
        facts: RunFacts | None = None,
    ) -> None:
        self.args, self.world, self.out, self.plan = args, world, Path(args.out), plan
        if facts is not None and facts.spec.grid != world.comm.grid:  # x and y exchanged at start-up:
            facts = derive(world.cfg, world.comm.grid)  # the same config, checked; its numbers on that grid
        self.facts = facts  # check_run_config's, on this world's grid
        self.cfg, self.comm, self.info, self.rank = world.cfg, world.comm, world.info, world.rank
        self.ckpt: Checkpointer | None = None
        self.resume: dict | None = None
        self.start = 0
        self.signals = signals
        self.stopped: Stop | None = None
        if signals is not None:
            signals.rank = self.rank

    # ---- set-up ------------------------------------------------------------------
    def setup(self) -> None:
        """Everything that can reject the run comes before ``--out`` is touched."""
        c, comm = self.cfg, self.comm
        self.resume = choose_resume(self.args.resume, self.out, c, comm)  # files verified
        init = self.args.init_from if self.resume is None else None
        if c.data.tokenizer != "byte":
            comm.on_rank0(lambda: check_tokenizer(c))
        if init is not None:
            comm.on_rank0(lambda: check_init_source(c, init))
        comm.on_rank0(lambda: prepare_tokens(c.data))
        self.data = comm.on_every_rank(lambda: open_dataset(c.data, c.model.seq_len, c.train.seed, c.model.vocab_size))
        if c.train.epochs:  # train.epochs decides the steps, now that the epoch's size is known
            steps = steps_for_epochs(c.train.epochs, self.data.epoch_size, c.train.global_batch)
            c = self.cfg = dataclasses.replace(c, train=dataclasses.replace(c.train, steps=steps))
        local = self.info.local_world_size
        # the run plan, once: every later part reads it (the memory check stops an unfitting run here)
        self.run_plan = make_plan(c, comm.grid, self.info.device, local, self.facts)
        self.trainer = Trainer(
            c, comm, self.data, self.info.device, init_weights=init is None, local_ranks=local, run_plan=self.run_plan
        )
        self.background = self.trainer.memory.async_checkpoints
        self.harness = None
        if c.eval.tasks:
            from axo4d.training.lm_harness import TrainingEval

            self.harness = TrainingEval(c, self.trainer.model, self.trainer.dtype)
        tr = self.trainer
        self.ckpt = Checkpointer(
            self.out, c, comm, tr.model, tr.opt, self.background, tr.data_state, self.run_plan.facts
        )
        self.load_weights(init)
        comm.on_rank0(lambda: self.ckpt.check_space_at_start(self.start))
        comm.on_rank0(self.prepare_output)
        if comm.trace is not None:
            comm.trace.dump_into(self.out / "traces")
        if init is not None:
            comm.on_rank0(lambda: record_source(self.out, init))
            if self.rank == 0:
                print(f"initialised from {init}; {getattr(self.args, 'model_sources', '')}", flush=True)
        self.flops = self.run_plan.hardware_flops
        self.peaks = device_peaks(self.info.device, self.trainer.dtype, c.train)
        self.log = StepLog(
            self.out,
            c,
            self.rank,
            self.info.world_size,
            comm.grid.spec(),
            (self.run_plan.model_flops, self.run_plan.hardware_flops),
            self.peaks,
            self.trainer.tokens_per_step,
            self.info.device,
        )
        if self.rank == 0:
            self.banner()
            if self.resume is not None:
                self.resume_note()

    def load_weights(self, init: str | None) -> None:
        """The checkpoint resumed from (its step, and notes on how the data differ), or ``--init-from``'s weights."""
        tr, self.data_notes = self.trainer, []
        if self.resume is not None:
            self.start = self.ckpt.load(Path(self.resume["path"]), self.resume["grid"])
            saved_batch = self.resume["config"].train.global_batch
            self.data_notes = tr.resume_data(self.start, self.resume.get("data"), saved_batch)
        elif init is not None:
            load_init_weights(tr.model, init, self.comm)
            tr.weights_loaded()

    def prepare_output(self) -> None:
        """Create the output folder (the first write to it: every input is checked by now)."""
        probe_writable(self.out)
        self.out_lock = claim_output(self.out)
        dump_config(self.cfg, self.out / "config.yaml")
        self.run_plan.write(self.out / "plan.yaml")
        prepare_output(self.out, None if self.resume is None else self.resume["step"])
        flight.clear(self.out / "traces")

    def resume_note(self) -> None:
        r, t, v = self.resume, self.cfg.train, self.resume["verified"]
        for w in r["warnings"]:
            print(f"warning: {w}", flush=True)
        checked = (
            f"{v['bytes'] / 2**20:,.1f} MiB checked against crc32 in {v['seconds']:.2f} s on {v['ranks']} rank(s)"
            if v["checked"]
            else "sizes checked, saved without checksums"
        )
        pos = self.trainer.plan.position(self.start)
        print(
            f"resumed from {r['path']} (saved on grid {r['grid']}; {checked}): continuing at step {self.start}, "
            f"sample {pos:,} of the data stream",
            flush=True,
        )
        if self.data_notes:
            print("note: the data differ from the checkpoint's run: " + ", ".join(self.data_notes), flush=True)
        if self.start >= t.steps:
            print(
                f"note: the checkpoint is at step {self.start} >= train.steps={t.steps}: nothing to train", flush=True
            )
        for note in resume_changes(r, t, self.run_plan.facts):
            print(note, flush=True)

    def banner(self) -> None:
        c, m, info = self.cfg, self.trainer.model, self.info
        ck = c.train.activation_checkpointing
        print(
            f"axo4d: {info.world_size} ranks ({info.launcher}, {info.backend}, {info.device.type}) "
            f"grid {self.comm.grid.spec()} order {','.join(self.comm.grid.order)}"
            + (f", expert groups of {self.comm.grid.expert} data ranks" if self.comm.grid.expert > 1 else "")
        )
        note = exchange_note(self.world.asked or self.comm.grid, self.comm.grid)
        if note:
            print(note)
        print(
            f"model {c.name}: {m.num_params() / 1e6:.2f}M params, {c.model.n_layer} layers, hidden "
            f"{c.model.n_embd}, {c.model.n_head} heads, seq {c.model.seq_len}, vocab {c.model.vocab_size} "
            f"(padded {m.vocab}), dtype {self.trainer.dtype}"
        )
        print(
            f"data: {self.data.describe()}; global batch {c.train.global_batch} x {c.model.seq_len} tokens, "
            f"grad_accum {c.train.grad_accum}; {run_length(c.train, self.data.epoch_size)}"
            + (", document mask" if c.data.document_mask else "")
        )
        print(
            f"FLOPs/step: model {m.spec.flops_formula(False)} = {self.run_plan.model_flops:.4g}, hardware "
            f"{m.spec.flops_formula(ck)} = {self.flops:.4g} (docs/design.md section 5); "
            f"{self.peaks.describe()}",
            flush=True,
        )
        print(self.trainer.memory.summary(), flush=True)
        print(self.run_plan.summary(), flush=True)
        if self.trainer.memory.note:
            print(f"note: {self.trainer.memory.note}", flush=True)

    # ---- loop --------------------------------------------------------------------------
    def loop(self, start: int = 0) -> list[dict]:
        """Steps ``start..train.steps-1``; ends early (``self.stopped``) when the ranks agree on a
        stop signal at a step boundary, after saving (:mod:`axo4d.training.lifecycle`)."""
        t = self.cfg.train
        history = []
        for i in range(start, t.steps):
            try:
                s = self.trainer.step(i)
            except TrainError as e:
                raise agreed(TrainError(f"{e}; last checkpoint: {self.settled_checkpoint() or 'none'}")) from None
            history.append(self.log.step(s))
            if i == start:
                self.after_first_step(s)
            last = i == t.steps - 1
            if (t.eval_interval and (i + 1) % t.eval_interval == 0) or last:
                self.evaluate(i)
            if self.harness is not None and self.harness.due(i, last):
                self.log.harness(i, self.harness.run())
            self.after_step(i, last)
            if not last:
                stop = at_boundary(self.comm, self.signals, self.ckpt)
                if stop is not None:
                    self.stop(i + 1, stop)
                    break
        if self.plan is not None and self.rank == 0:  # the median after warm-up beside the prediction
            print(grid_auto_plugin().measured_line(self.plan, [h["step_time_s"] for h in history]), flush=True)
        skipped = sum(bool(h["skipped"]) for h in history)
        if skipped and self.rank == 0:
            print(
                f"warning: {skipped} of {len(history)} steps were skipped (non-finite loss or gradients; "
                f'"skipped": true in metrics.jsonl)',
                flush=True,
            )
        return history

    def after_first_step(self, s) -> None:
        """Compiled, tuned, warmed up: a hung rank now stops the others quickly; the measured memory
        beside the prediction (with a plan, the step time after the loop: ``measured_line``)."""
        self.comm.set_timeout(self.cfg.parallel.timeout_s)
        if self.rank == 0:
            print(self.trainer.memory.measured(self.info.device), flush=True)

    def evaluate(self, step: int) -> None:
        val = self.trainer.evaluate()
        self.log.evaluation(step, val)
        if not math.isfinite(val):
            raise agreed(
                TrainError(
                    f"validation loss {val} at step {step}: the model diverged; not saving it; "
                    f"last checkpoint: {self.settled_checkpoint() or 'none'}"
                )
            )

    def after_step(self, step: int, last: bool) -> None:
        """Save after every ``checkpoint.interval`` completed steps (in the background with
        ``checkpoint.async``) and at the end (training waits: nothing is left to overlap)."""
        done, c = step + 1, self.cfg.checkpoint
        if (c.interval > 0 and done % c.interval == 0) or (last and c.at_end):
            background = self.background and not last
            t0 = time.perf_counter()
            path = self.ckpt.save(done, background=background)
            if self.rank == 0:
                dt = time.perf_counter() - t0
                what = f"saving in the background, training blocked {dt:.2f} s" if background else f"{dt:.2f} s"
                print(f"checkpoint {path} ({what})", flush=True)

    def stop(self, done: int, stop: Stop) -> None:
        """Every rank agreed on ``stop`` after ``done`` steps: the save in flight completes, this
        step's checkpoint is saved (unless it just was), and rank 0 says so (exit status 75)."""
        self.stopped = stop
        last = self.ckpt.wait()
        t0 = time.perf_counter()
        saved = "saved at this step already"
        if last is None or last.name != step_dir_name(done):
            last = self.ckpt.save(done)
            saved = f"saved in {time.perf_counter() - t0:.2f} s"
        if self.rank == 0:
            self.log.close()
            print(
                f"axo4d.train: stopped by {stop.name} (received by rank {stop.rank}) after step {done} of "
                f"{self.cfg.train.steps}: checkpoint {last} ({saved}); continue with --resume auto "
                f"(exit status {EXIT_RESUME}: stopped cleanly, resume me)",
                file=sys.stderr,
                flush=True,
            )

    def last_checkpoint(self) -> str | None:
        """The newest complete checkpoint of this run (saved or resumed from)."""
        return str(self.ckpt.last) if self.ckpt is not None and self.ckpt.last is not None else None

    def settled_checkpoint(self) -> str | None:
        """:meth:`last_checkpoint` once a save in flight has ended (its failure dropped: the run is
        failing for another reason already)."""
        if self.ckpt is not None:
            self.ckpt.wait(raise_error=False)
        return self.last_checkpoint()

    def finish(self) -> None:
        self.ckpt.wait()
        if self.rank == 0:
            self.log.close()
            from axo4d.training.plot import plot_loss

            png = plot_loss(self.out / "metrics.jsonl", self.out / "loss.png", title=self.cfg.name)
            print(
                f"done: metrics {self.out / 'metrics.jsonl'}, plot {png}, config {self.out / 'config.yaml'}", flush=True
            )


def run(argv: list[str] | None = None) -> int:
    args = parse_args(argv, __doc__)
    cfg = load_config(args.config, args.set, args.grid)
    if args.init_from:
        cfg = config_with_init(cfg, args.init_from, args.set, args.config)
        args.model_sources = model_sources(cfg, args.init_from, args.set, args.config)
    auto = cfg.parallel.grid.strip().lower() == "auto"  # --grid auto: chosen once the world is known
    p = cfg.parallel
    facts = [check_run_config(cfg, Grid() if auto else Grid.parse(p.grid, p.order, p.expert))]
    plans: list = []
    resolve = None
    if needs_plan(cfg):
        plan_run = grid_auto_plugin().plan_run

        def resolve(c: RunConfig, info) -> RunConfig:
            c, plan = plan_run(c, info)
            cp = c.parallel
            facts[0] = check_run_config(c, Grid.parse(cp.grid, cp.order, cp.expert))  # the chosen grid
            plans.append(plan)
            return c

    signals = StopSignals(cfg.checkpoint.signals).install()  # from here on a signal stops the run cleanly
    r = None
    try:
        r = Run(args, start(cfg, args.launcher, resolve), plans[0] if plans else None, signals, facts[0])
        r.setup()
        if r.cfg.train.steps == 0:  # evaluation only: the initial weights' validation loss, no checkpoint
            r.evaluate(r.start)
        else:
            r.loop(r.start)
        if r.stopped is not None:
            return EXIT_RESUME
        r.finish()
    except BaseException as e:
        # a second Ctrl-C: KeyboardInterrupt, or what became of it -- a library that catches it
        # (DCP's collectives pass it on as an error) or a peer that left at its own second Ctrl-C
        if not isinstance(e, KeyboardInterrupt) and signals.interrupts < 2:
            raise
        if r is None or r.rank == 0:
            last = (r.last_checkpoint() if r is not None else None) or "none"
            print(f"axo4d.train: interrupted (Ctrl-C twice): stopped at once; last checkpoint: {last}", file=sys.stderr)
        raise KeyboardInterrupt from None
    return 0


def main(argv: list[str] | None = None) -> int:
    """CLI entry: one clear error line and a documented exit status (axo4d.exits), never a hang."""
    return run_and_exit(run, argv, "axo4d.train")


if __name__ == "__main__":
    sys.exit(main())
