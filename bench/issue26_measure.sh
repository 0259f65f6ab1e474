#!/usr/bin/env bash
# Every measured figure of issue 26, in sequence, for a quiet machine (nothing else running):
#   1. the overlap table: bench.overlap on z=2, data=2, x=2, y=2 (2 ranks) and data=2,z=2 (4 ranks) on
#      the virtual cluster at 1 Gbit/s, default settings, with the ideal ratios, sharded vs unsharded
#      on data=2, and the performance model's predictions (docs/overlap.md);
#   2. the preregistered validation H1-H4 (docs/perfmodel_validation_plan.md) and its report
#      (docs/perfmodel_validation.md section 6).
#
#   sudo bash bench/issue26_measure.sh [OUT]          # about 60 minutes (table ~15-20, validation ~35-45)
#   sudo bash bench/issue26_measure.sh --smoke [OUT]  # tiny sizes, the plumbing only (~10 min; figures mean nothing)
#
# Refuses to start when the 1-minute load average is 2.5 or more (FORCE=1 to override); every step
# records the load before and during its runs. Exit status: 0 when every bound was met, 1 when one was
# not (the figures are written either way), 2 on an error.
set -u
cd "$(dirname "$0")/.."
SMOKE=""
if [ "${1:-}" = "--smoke" ]; then SMOKE="--smoke"; shift; fi
OUT="${1:-runs/issue26}"
PY="${PYTHON:-.venv/bin/python}"
mkdir -p "$OUT"
export OMP_NUM_THREADS=1
load=$(cut -d' ' -f1 /proc/loadavg)
echo "issue26_measure: $(date -u +%FT%TZ) load average $(cut -d' ' -f1-3 /proc/loadavg)" | tee "$OUT/log.txt"
if [ -z "${FORCE:-}" ] && awk "BEGIN {exit !($load >= 2.5)}"; then
    echo "issue26_measure: load average $load >= 2.5: other jobs are running; measure on a quiet machine (FORCE=1 overrides)" >&2
    exit 2
fi
DOCS=(--doc docs/overlap.md)
VDOC=(--doc docs/perfmodel_validation.md)
if [ -n "$SMOKE" ]; then DOCS=(); VDOC=(); fi
status=0
"$PY" -m launch.vcluster --cleanup
t0=$(date +%s)
"$PY" -m bench.overlap_table --out "$OUT/overlap" $SMOKE "${DOCS[@]}" 2>&1 | tee -a "$OUT/log.txt"
rc=${PIPESTATUS[0]}; [ "$rc" -eq 2 ] && exit 2; [ "$rc" -ne 0 ] && status=1
t1=$(date +%s)
echo "issue26_measure: overlap table $((t1 - t0)) s, exit $rc" | tee -a "$OUT/log.txt"
WAIT=(); [ -n "${FORCE:-}" ] && WAIT=(--force --wait 0)
"$PY" -m bench.validation_plan measure --out "$OUT/validation" $SMOKE "${WAIT[@]}" 2>&1 | tee -a "$OUT/log.txt"
rc=${PIPESTATUS[0]}; [ "$rc" -eq 2 ] && exit 2
"$PY" -m bench.validation_plan report --out "$OUT/validation" "${VDOC[@]}" 2>&1 | tee -a "$OUT/log.txt"
rc=${PIPESTATUS[0]}; [ "$rc" -eq 2 ] && exit 2; [ "$rc" -ne 0 ] && status=1
t2=$(date +%s)
echo "issue26_measure: validation $((t2 - t1)) s; total $((t2 - t0)) s; load average $(cut -d' ' -f1-3 /proc/loadavg); exit $status" | tee -a "$OUT/log.txt"
exit $status
