"""The one summary table of ``bench/gpu_check.sh``, from the JSON files its parts wrote.

    python -m bench.gpu_summary DIR

Reads ``DIR/speed_*.json`` (``bench.single_gpu --json``; the files of one model merged),
``DIR/sanity.json``
(``bench.loss_sanity --json``), ``DIR/gpu_tests.jsonl`` (``tests/gpu`` with
``AXO4D_GPU_TEST_REPORT``), ``DIR/status.txt`` (``part exit-status seconds`` per line),
``DIR/tuner.log``, ``DIR/peers.json`` (``bench.peers --json``: the ranks share the one GPU,
so its verdict is the losses' agreement, not a speed) and ``DIR/fp8.json``
(``bench.fp8_speed --json``); prints one table of checks
against the issue's targets, each with its figure.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

TARGET_TFLOPS = 600.0  # issue 13: axo4d on one H200, DESIGN.md section 5's formula
TRAINER_WITHIN = 0.03
MEMORY_WITHIN = 0.05


def _load(p: Path):
    try:
        return json.loads(p.read_text())
    except (OSError, ValueError):
        return None


def _speed_rows(name: str, r: dict, gpu: bool) -> list[tuple[str, str, str]]:
    c = r["contenders"]
    rows = []
    for k, v in c.items():
        eff = (f"MFU {100 * v['mfu']:.1f}%" if v.get("mfu") is not None else "MFU n/a") + (
            f", {100 * v['gemm_ceiling_frac']:.1f}% of GEMM ceiling" if v.get("gemm_ceiling_frac") is not None else ""
        )
        mem = f", {v['peak_gib']:.1f} GiB" if v.get("peak_gib") is not None else ""
        rows.append((f"{name}: {k}", f"{v['tflops']:.4g} TFLOP/s ({eff}{mem})", ""))
    base = "plain compiled" if "plain compiled" in c else "plain eager"
    best = max((k for k in c if k.startswith("axo4d")), key=lambda k: c[k]["tflops"], default=None)
    if best and base in c:
        ratio = c[best]["tflops"] / c[base]["tflops"]
        rows.append(
            (
                f"{name}: best axo4d / {base}",
                f"{ratio:.3f} ({best})",
                ("PASS" if ratio >= 1.0 else "FAIL") if gpu else "",
            )
        )
        if gpu and name.startswith("gpt"):
            tf = c[best]["tflops"]
            rows.append(
                (
                    f"{name}: best axo4d >= {TARGET_TFLOPS:.0f} TFLOP/s",
                    f"{tf:.1f}",
                    "PASS" if tf >= TARGET_TFLOPS else "FAIL",
                )
            )
    for kind in ("compiled", "eager"):
        a, p = c.get(f"axo4d {kind}"), c.get(f"plain {kind}")
        if a and p and a.get("peak_gib") and p.get("peak_gib"):
            ratio = a["peak_gib"] / p["peak_gib"]
            rows.append(
                (
                    f"{name}: peak memory axo4d/plain {kind}",
                    f"{a['peak_gib']:.1f} / {p['peak_gib']:.1f} GiB = {ratio:.3f}",
                    ("PASS" if ratio <= 1 + MEMORY_WITHIN else "FAIL") if kind == "compiled" else "",
                )
            )
    return rows


def _speed_runs(out: Path) -> list[dict]:
    """``DIR/speed_*.json``, one run per model config: files of one config (the eager and the
    compiled parts) merged, their contenders together, so each config's ratios and targets are
    taken over all of its contenders once."""
    runs: dict[str, dict] = {}
    for p in sorted(out.glob("speed_*.json")):
        r = _load(p)
        if not r:
            continue
        if r["config"] in runs:
            runs[r["config"]]["contenders"].update(r["contenders"])
        else:
            runs[r["config"]] = dict(r, contenders=dict(r["contenders"]))
    return list(runs.values())


def _status(out: Path) -> dict[str, tuple[int, float]]:
    """``status.txt``: each part's exit status and seconds."""
    status = {}
    for line in (out / "status.txt").read_text().splitlines() if (out / "status.txt").exists() else []:
        part, rc, secs = line.split()
        status[part] = (int(rc), float(secs))
    return status


def _sanity_rows(out: Path, s: dict, gpu: bool) -> list[tuple[str, str, str]]:
    """The loss-sanity rows: losses, the largest difference, grad norms, the trainer against the benchmark."""
    rows: list[tuple[str, str, str]] = []
    la = " ".join(f"{x[0]:.2f}" for x in s["axo4d"][:6])
    lp = " ".join(f"{x[0]:.2f}" for x in s["plain"][:6])
    rows.append((f"loss sanity {s['config']} {s['dtype']}: axo4d losses", f"{la} ... {s['axo4d'][-1][0]:.3f}", ""))
    rows.append((f"loss sanity {s['config']}: plain losses", f"{lp} ... {s['plain'][-1][0]:.3f}", ""))
    tol = 2e-2 if "bfloat16" in s["dtype"] else 1e-4
    rows.append(
        (
            "loss sanity: max rel diff axo4d vs plain",
            f"{s['max_rel']:.2e} (limit {tol:g})",
            "PASS" if s["max_rel"] <= tol else "FAIL",
        )
    )
    gmax = max(x[1] for x in s["axo4d"])
    rows.append(("loss sanity: max grad norm axo4d / plain", f"{gmax:.2f} / {max(x[1] for x in s['plain']):.2f}", ""))
    # the benchmark's best axo4d figure of the same model and shape (the same FLOPs per step)
    best = max(
        (
            v["tflops"]
            for p in out.glob("speed_*.json")
            if (r := _load(p)) and r.get("flops_per_step") == s.get("flops_per_step")
            for k, v in r["contenders"].items()
            if k.startswith("axo4d")
        ),
        default=0.0,
    )
    fig = (
        f"{s['trainer_tflops']:.4g} TFLOP/s, {s['trainer_tflops'] / best:.3f}"
        if best
        else f"{s['trainer_tflops']:.4g} TFLOP/s (no benchmark run of the same shape)"
    )
    rows.append(
        (
            f"trainer step (compile={s['compile']}) / best bench axo4d",
            fig,
            ("PASS" if s["trainer_tflops"] / best >= 1 - TRAINER_WITHIN else "FAIL") if best and gpu else "",
        )
    )
    return rows


def _test_rows(out: Path) -> list[tuple[str, str, str]]:
    """The rows of ``gpu_tests.jsonl``: parity, overlap, resharding and offload per rank count."""
    rows: list[tuple[str, str, str]] = []
    tests = (
        [json.loads(line) for line in (out / "gpu_tests.jsonl").read_text().splitlines()]
        if (out / "gpu_tests.jsonl").exists()
        else []
    )
    for r in tests:
        if r.get("test") == "offload":  # tests/gpu/test_offload.py: rows per (dtype, mode)
            for dt in ("fp32", "bf16"):
                rs = [x for x in r["rows"] if x["dtype"] == dt]
                if rs:
                    worst = max(x["max_rel_loss"] for x in rs)
                    rows.append(
                        (
                            f"{r['ranks']} ranks {dt} sharded optimizer / offload vs unsharded",
                            f"max rel loss {worst:.2e} ({', '.join(x['mode'] for x in rs)})",
                            "",
                        )
                    )
            continue
        for dt in ("fp32", "bf16"):
            worst = max((p["max_rel_loss"] for p in r["parity"] if p["dtype"] == dt), default=float("nan"))
            grids = ", ".join(p["grid"] for p in r["parity"] if p["dtype"] == dt)
            rows.append((f"{r['ranks']} ranks {r['backend']} {dt} parity ({grids})", f"max rel loss {worst:.2e}", ""))
        rows.append(
            (f"{r['ranks']} ranks overlap on/off identical", str(all(p["identical"] for p in r["overlap"])), "")
        )
        sh = r["reshard"]
        rows.append(
            (f"{r['ranks']} ranks checkpoint {sh['from']} -> {sh['to']}", f"max rel loss {sh['max_rel_loss']:.2e}", "")
        )
    return rows


def _tuner_rows(out: Path) -> list[tuple[str, str, str]]:
    """The rows of ``tuner.log``: GEMMs tuned, how many not a@b, the forward+backward line."""
    rows: list[tuple[str, str, str]] = []
    log = out / "tuner.log"
    if log.exists():
        chosen = [
            ln.split() for ln in log.read_text().splitlines() if ln.strip().startswith(("attn", "mlp", "lm_head"))
        ]
        non_default = sum(
            1 for c in chosen if len(c) > 2 and "a@b" != c[-2] and c[-2] in ("a@b:copy", "(bT@aT)T", "(bT@aT)T:copy")
        )
        last = [ln for ln in log.read_text().splitlines() if "speed-up" in ln.lower() or "ratio" in ln.lower()]
        rows.append(("tuner", f"{len(chosen)} GEMMs, {non_default} not a@b", ""))
        if last:
            rows.append(("tuner: forward+backward", last[-1].strip()[:140], ""))
    return rows


def table(out: Path) -> list[tuple[str, str, str]]:
    rows: list[tuple[str, str, str]] = []
    status = _status(out)
    gpu = False
    for r in _speed_runs(out):
        gpu = gpu or r.get("vendor_peak", 0) > 0 or any(v.get("peak_gib") for v in r["contenders"].values())
        rows += _speed_rows(r["config"], r, gpu)
    s = _load(out / "sanity.json")
    if s:
        rows += _sanity_rows(out, s, gpu)
    rows += _test_rows(out)
    if "gpu_tests" in status:
        rows.append(
            ("tests/gpu (pytest)", f"exit {status['gpu_tests'][0]}", "PASS" if status["gpu_tests"][0] == 0 else "FAIL")
        )
    rows += _peers_rows(out)
    rows += _fp8_rows(out)
    rows += _tuner_rows(out)
    for part, (rc, secs) in status.items():
        rows.append((f"part {part}", f"exit {rc}, {secs:.0f} s", "" if rc == 0 else "FAIL"))
    return rows


def _peers_rows(out: Path) -> list[tuple[str, str, str]]:
    """``DIR/peers.json`` (``bench.peers --json``): each pair's median steps and ratio. Ranks that
    share one GPU over gloo give no speed verdict; the verdict is whether the first-step losses agree
    (both sides did the same work on the GPU)."""
    r = _load(out / "peers.json")
    rows: list[tuple[str, str, str]] = []
    for p in (r or {}).get("pairs", []):
        med, fl = p["median_s"], p["first_loss"]
        fig = (
            f"axo4d {med['axo4d'] * 1e3:.1f} ms, peer {med['peer'] * 1e3:.1f} ms, ratio {p['ratio']:.3f}; "
            f"first-step loss {fl['axo4d']:.6f} / {fl['peer']:.6f}"
        )
        name = f"peers {p['pair']} ({p['grid']}) vs {p['peer'].split(' (')[0]}"
        rows.append((name, fig, "PASS" if p["losses_agree"] else "FAIL"))
    return rows


def _fp8_rows(out: Path) -> list[tuple[str, str, str]]:
    """``DIR/fp8.json`` (``bench.fp8_speed --json``): per model, FP8 vs bf16 step time and loss
    (issue 23: >= 1.25x at equal loss; a verdict only from a GPU)."""
    r = _load(out / "fp8.json")
    rows: list[tuple[str, str, str]] = []
    for m in (r or {}).get("models", []):
        c = m["contenders"]
        for name, v in c.items():
            if name == "bf16":
                continue
            fig = (
                f"step-time ratio {v['speedup']:.3f} ({c['bf16']['tflops']:.4g} -> {v['tflops']:.4g} TFLOP/s), "
                f"loss {100 * v['loss_rel']:+.2f}%"
            )
            ok = v["speedup"] >= 1.25 and abs(v["loss_rel"]) <= 0.02
            gpu = r.get("device", "cpu") != "cpu"
            rows.append(
                (f"{m['arch']} h={m['hidden']}: {name} vs bf16", fig, ("PASS" if ok else "FAIL") if gpu else "")
            )
    return rows


def main(argv: list[str] | None = None) -> int:
    out = Path((argv or sys.argv[1:])[0])
    rows = table(out)
    w0 = max(len(r[0]) for r in rows) if rows else 10
    w1 = max(len(r[1]) for r in rows) if rows else 10
    print(f"{'check':{w0}s} | {'figure':{w1}s} | verdict")
    print(f"{'-' * w0}-+-{'-' * w1}-+--------")
    for a, b, c in rows:
        print(f"{a:{w0}s} | {b:{w1}s} | {c}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
