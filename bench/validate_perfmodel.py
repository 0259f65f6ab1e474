"""Validate the performance model's grid ranking on a virtual cluster, beside an alpha-beta baseline.

    sudo python -m bench.validate_perfmodel [--out runs/validate] [--doc docs/perfmodel_validation.md]
    sudo python -m bench.validate_perfmodel --nodes 2 --ranks-per-node 2 --orders traffic --set model.n_embd=192 ...
    python -m bench.validate_perfmodel --from-json runs/validate/results.json --machine runs/validate/machine.yaml

On :mod:`launch.vcluster` (``--nodes`` namespaces x ``--ranks-per-node`` ranks, the inter-node
veth shaped to 1 Gbit/s): ``perfmodel profile`` writes a machine YAML (links, the model's local
GEMM shapes, attention, streaming, overlap and concurrency figures); then a small GPT
(:data:`MODEL_SETS` plus ``--set``) trains on every grid of the world the model divides on (with
``--orders traffic`` each grid also in its busiest-axis-first order), interleaved
(:mod:`bench.perfmodel_sweep`). The measured step time of a configuration is the median of its
steps after the warm-up. The model predicts the same configurations with the profiled machine;
the report gives per-configuration predicted vs measured, the Spearman rank correlation, whether
the measured fastest is in the predicted top 2, and the same for the **baseline**: the bare
alpha-beta sum of every collective, no compute (``comm_total_s``). ``results.json`` records the
sha256 of every ``perfmodel`` source and of the machine file used (what was frozen).
``--from-json`` re-scores stored measurements (no cluster). The prediction and scores:
:mod:`bench.validate_predict`; the measurement: :mod:`bench.validate_measure`; here the report
and the command line.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path
from typing import Any

from bench.validate_measure import measure_all
from bench.validate_predict import (
    GPUS_PER_NODE,
    MODEL_SETS,
    frozen_record,
    predict,
    score,
)


def report_text(res: dict[str, Any], sc: dict[str, Any], machine: str) -> str:
    """Markdown: settings, what was frozen, the per-configuration table and the verdict."""
    from perfmodel.machine import load_machine

    m = load_machine(machine)
    lines = _settings_lines(res, m, machine) + _table_lines(sc) + _verdict_lines(res, sc, m)
    return "\n".join(lines)


def _settings_lines(res: dict[str, Any], m: Any, machine: str) -> list[str]:
    """The report's settings: command, host, virtual cluster, model, machine file, what was frozen."""
    g_, c_, conc = m.slowdowns()
    load = (
        f"; 1-min load average {res['load_start']} at the start, {res['load_end']} at the end"
        + (f", during the sweep {res['load_measure']}" if "load_measure" in res else " (the host is shared)")
        if "load_start" in res
        else ""
    )
    nodes, rpn = res.get("nodes", 2), res.get("ranks_per_node", 4)
    lines = [
        f"- command: `{res['command']}`",
        f"- date: {res['date']}",
        f"- host: {res['host']}{load}",
        f"- virtual cluster: {nodes} nodes (network namespaces) x {rpn} ranks; inter-node veth: "
        f"{res.get('link', '?')}; rank orders: {res.get('orders', 'default')}",
        f"- model: `{' '.join(MODEL_SETS)}` (plus `{' '.join(res.get('extra_sets', [])) or '-'}`), " + _how(res),
        f"- machine file: `{machine}`: GEMM table {len(m.gemm_table)} shapes (curve {m.gemm_tflops * 1e3:.1f} "
        f"GFLOP/s, half-speed dimension {m.gemm_half_dim:g}), attention {m.attention_tflops or 0:.4g} TFLOP/s, "
        f"latency {m.latency_us:.0f} us, inter-node {m.inter_gbps * 8:.2f} Gbit/s per group, "
        f"{m.op_overhead_us:.1f} us per operator, {m.memory_gbps or 0:.2f} GB/s elementwise, slowdowns: "
        f"compute x{g_:g}, collectives x{c_:g}, concurrent x{conc['intra']:g} / x{conc['inter']:g}",
    ]
    if res.get("frozen"):
        lines.append(
            "- frozen before measuring (sha256, first 16 hex): "
            + ", ".join(f"`{k}` {v}" for k, v in res["frozen"].items())
        )
    return lines


def _table_lines(sc: dict[str, Any]) -> list[str]:
    """The per-configuration table and the bootstrap intervals of the rank correlations."""
    lines: list[str] = []
    lines += [
        "",
        "| configuration | measured s/step | predicted s/step | pred/meas | measured rank | predicted rank "
        "| baseline rank | pred. compute s | pred. exposed comm s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in sc["rows"]:
        lines.append(
            f"| {r['grid']} | {r['measured_s']:.3f} | {r['predicted_s']:.3f} | "
            f"{r['predicted_s'] / r['measured_s']:.2f} | {r['meas_rank']:g} | {r['pred_rank']:g} | "
            f"{r['base_rank']:g} | {r['compute_s']:.3f} | {r['exposed_comm_s']:.3f} |"
        )
    ci = sc.get("bootstrap") or {}
    if ci:
        f = lambda k: f"{ci[k][0]:.3f} [{ci[k][1]:.3f}, {ci[k][2]:.3f}]"  # noqa: E731
        lines += [
            "",
            f"Spearman rho with 95% bootstrap intervals: model {f('model')}, baseline {f('baseline')}, "
            f"model - baseline {f('delta')}.",
        ]
    return lines


def _verdict_lines(res: dict[str, Any], sc: dict[str, Any], m: Any) -> list[str]:
    """The verdict: rank correlations, the fastest configuration, ratios, failed runs."""
    lines: list[str] = []
    failed = [s for s, r in res["runs"].items() if r.get("rc") != 0]
    wrong = [ok for _, ok in sc["misordered"]]
    close = [ok for ratio, ok in sc["misordered"] if ratio < 1 + m.uncertainty]
    lines += [
        "",
        f"**Spearman rank correlation: model {sc['spearman']:.3f}, alpha-beta baseline "
        f"{sc['baseline_spearman']:.3f}** (target >= 0.9) over {len(sc['rows'])} configurations.",
        f"**Measured fastest: {sc['measured_best']}; model's top 2: {', '.join(sc['predicted_top2'])} -> "
        f"{'in the top 2' if sc['best_in_top2'] else 'NOT in the top 2'}; baseline's top 2: "
        f"{', '.join(sc['baseline_top2'])} -> {'in' if sc['baseline_best_in_top2'] else 'NOT in'}.**",
        f"Predicted/measured: geometric mean {math.exp(sc['log_ratio_mean']):.2f}, log-ratio sd "
        f"{sc['log_ratio_sd']:.2f}. Pairs ordered as measured: {sum(wrong)}/{len(wrong)}; among pairs the "
        f"model puts within its uncertainty ({100 * m.uncertainty:.0f}%): {sum(close)}/{len(close)}.",
    ]
    if failed:
        lines.append(f"Runs that failed (excluded): {', '.join(failed)}.")
    if res.get("changed_since"):
        lines.append(f"Re-scored with model sources changed since the measurement: {', '.join(res['changed_since'])}.")
    return lines


def _how(res: dict[str, Any]) -> str:
    if res.get("mode") == "interleaved":
        return (
            f"interleaved sweep (`bench.perfmodel_sweep`): {res['rounds']} rounds x {res['steps']} steps per "
            f"grid, the first {res['warmup']} of every visit left out, median of the rest "
            f"({res.get('measure_wall_s', 0):.0f} s for all grids)"
        )
    return (
        f"one `python -m axo4d.train` run per grid, {res['steps']} steps, median of the steps after "
        f"{res['warmup']} warm-up steps"
    )


BEGIN, END = "<!-- results:begin -->", "<!-- results:end -->"


def write_doc(path: Path, text: str, tag: str = "results") -> None:
    """Replace the generated block ``<!-- tag:begin -->`` .. ``<!-- tag:end -->`` of ``path``
    (appended, the file created with a heading if missing)."""
    begin, end = f"<!-- {tag}:begin -->", f"<!-- {tag}:end -->"
    block = f"{begin}\n{text}\n{end}"
    old = path.read_text() if path.exists() else "# Performance model validation\n\n"
    if begin in old and end in old:
        new = old[: old.index(begin)] + block + old[old.index(end) + len(end) :]
    else:
        new = old.rstrip("\n") + "\n\n" + block + "\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(new)


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m bench.validate_perfmodel",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument(
        "--mode",
        choices=("interleaved", "train"),
        default="interleaved",
        help="interleaved: one launch, every grid in rounds (bench.perfmodel_sweep; default); "
        "train: one `python -m axo4d.train` per grid",
    )
    ap.add_argument("--rounds", type=int, default=5, help="interleaved: rounds over all grids (default 5)")
    ap.add_argument(
        "--steps",
        type=int,
        default=None,
        help="steps per grid and round (interleaved, default 4) or per run (train, default 10)",
    )
    ap.add_argument(
        "--warmup",
        type=int,
        default=None,
        help="steps left out of the median: of every visit (interleaved, default 1) or of the run (train, default 3)",
    )
    ap.add_argument("--out", default="runs/validate", help="folder of runs, machine.yaml, results.json")
    ap.add_argument("--machine", default=None, help="use this machine YAML instead of profiling")
    ap.add_argument("--from-json", default=None, help="re-score stored results.json (no cluster needed)")
    ap.add_argument("--doc", default=None, help="write the result table into this markdown file")
    ap.add_argument("--rate", default="1gbit")
    ap.add_argument("--delay", default="0.2ms")
    ap.add_argument("--timeout", type=float, default=1200, help="seconds per launch (default 1200)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="extra config override")
    ap.add_argument("--nodes", type=int, default=2, help="virtual nodes (default 2)")
    ap.add_argument("--ranks-per-node", type=int, default=GPUS_PER_NODE, help="ranks per node (default 4)")
    ap.add_argument("--oversubscribe", action="store_true", help="allow more than two ranks per core")
    ap.add_argument(
        "--orders",
        choices=("default", "traffic"),
        default="default",
        help="traffic: also each grid in its busiest-axis-first rank order",
    )
    return ap


def main(argv: list[str] | None = None) -> int:
    """Exit 0 when the targets are met (Spearman >= 0.9, best in top 2), 1 if not, 2 on errors."""
    argv = sys.argv[1:] if argv is None else list(argv)
    opts = _parser().parse_args(argv)
    opts.argv = argv
    inter = opts.mode == "interleaved"
    opts.steps = opts.steps if opts.steps is not None else (4 if inter else 10)
    opts.warmup = opts.warmup if opts.warmup is not None else (1 if inter else 3)
    cores = os.cpu_count() or 1
    if not opts.from_json and opts.nodes * opts.ranks_per_node > 2 * cores and not opts.oversubscribe:
        print(
            f"bench.validate_perfmodel: error: {opts.nodes} nodes x {opts.ranks_per_node} ranks on {cores} cores: more "
            f"than two ranks per core measures the scheduler, not the model; use at most {2 * cores} ranks "
            f"(or --oversubscribe)",
            file=sys.stderr,
        )
        return 2
    try:
        if opts.from_json:
            res = json.loads(Path(opts.from_json).read_text())
        else:
            out = Path(opts.out)
            out.mkdir(parents=True, exist_ok=True)
            res = measure_all(opts, out)
        machine = opts.machine or res["machine_file"]
        measured = {s: r["median_s"] for s, r in res["runs"].items() if r.get("rc") == 0}
        steps = {s: r["times"] for s, r in res["runs"].items() if r.get("rc") == 0 and r.get("times")}
        world = res.get("nodes", 2) * res.get("ranks_per_node", GPUS_PER_NODE)
        if opts.from_json:
            now = frozen_record(None, res.get("extra_sets"), world, res.get("ranks_per_node", GPUS_PER_NODE))
            res["changed_since"] = sorted(k for k, v in res.get("frozen", {}).items() if k in now and now[k] != v)
        sc = score(
            measured,
            predict(machine, res.get("extra_sets"), world, res.get("ranks_per_node", GPUS_PER_NODE), list(measured)),
            steps,
        )
    except (OSError, ValueError, RuntimeError) as e:
        print(f"bench.validate_perfmodel: error: {e}", file=sys.stderr)
        return 2
    text = report_text(res, sc, machine)
    print(text)
    if opts.doc:
        doc = Path(opts.doc)
        if not opts.from_json:  # keep the profiled machine next to the table it produced
            keep = doc.with_name(doc.stem + "_machine.yaml")
            keep.write_text(Path(machine).read_text())
            text = text.replace(f"`{machine}`", f"`{keep.name}` (copied from `{machine}`)")
        write_doc(doc, text)
    return 0 if sc["spearman"] >= 0.9 and sc["best_in_top2"] else 1


if __name__ == "__main__":
    sys.exit(main())
