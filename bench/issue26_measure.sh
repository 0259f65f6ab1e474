#!/usr/bin/env bash
# Every measured figure of issue 26, in sequence, for a quiet machine (nothing else running):
#   1. the overlap table: bench.overlap on z=2, data=2, x=2, y=2 (2 ranks) and data=2,z=2 (4 ranks) on
#      the virtual cluster at 1 Gbit/s, default settings, with the ideal ratios, sharded vs unsharded
#      on data=2, and the performance model's predictions (docs/overlap.md);
#   2. the preregistered validation H1-H4 (docs/perfmodel_validation_plan.md) and its report
#      (docs/perfmodel_validation.md section 6).
#
#   sudo bash bench/issue26_measure.sh [OUT]                       # everything: about 25-35 minutes (the
#                                # table 7-10, the validation 15-25: estimated, not yet timed quiet)
#   sudo bash bench/issue26_measure.sh --budget 25 [OUT]           # a 25-minute window: the table, then
#                                # the held-out configurations that fit, in order (those left are named)
#   sudo bash bench/issue26_measure.sh --budget 25 --resume [OUT]  # a later window: what is not yet in OUT
#   sudo bash bench/issue26_measure.sh --smoke [OUT]               # tiny sizes: the plumbing only (figures
#                                                                  # mean nothing; docs untouched)
#
# --budget MIN: the table always runs in full (about 7-10 minutes); a held-out configuration starts
# only when it is expected to end within MIN minutes of the start, less 2 for the report (expected:
# bench.validation_plan.EXPECTED_S, scaled by how long the first ones took). Which configurations
# run is decided by durations only; the report says 'incomplete' until every one is in OUT.
# --resume: skip the table when OUT/overlap/table.json exists, and configurations already measured.
#
# Refuses to start when the 1-minute load average is 2.5 or more (FORCE=1 to override); every step
# records the load before and during its runs. Exit status: 0 when every bound was met, 1 when one was
# not or the validation is incomplete (the figures are written either way), 2 on an error.
set -u
cd "$(dirname "$0")/.."
SMOKE="" BUDGET=0 RESUME=""
while [ $# -gt 0 ]; do
    case "$1" in
        --smoke) SMOKE="--smoke"; shift ;;
        --budget) BUDGET="${2:?--budget needs minutes}"; shift 2 ;;
        --resume) RESUME="--resume"; shift ;;
        -*) echo "issue26_measure: unknown option $1; valid: --smoke, --budget MIN, --resume, OUT" >&2; exit 2 ;;
        *) break ;;
    esac
done
case "$BUDGET" in
    '' | *[!0-9.]* | *.*.*) echo "issue26_measure: --budget $BUDGET; valid: minutes, such as 25" >&2; exit 2 ;;
esac
OUT="${1:-runs/issue26}"
PY="${PYTHON:-.venv/bin/python}"
mkdir -p "$OUT"
export OMP_NUM_THREADS=1
load=$(cut -d' ' -f1 /proc/loadavg)
echo "issue26_measure: $(date -u +%FT%TZ) load average $(cut -d' ' -f1-3 /proc/loadavg); budget ${BUDGET} min" \
    | tee -a "$OUT/log.txt"
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
if [ -n "$RESUME" ] && [ -f "$OUT/overlap/table.json" ]; then
    echo "issue26_measure: overlap table already in $OUT/overlap (--resume)" | tee -a "$OUT/log.txt"
else
    "$PY" -m bench.overlap_table --out "$OUT/overlap" $SMOKE "${DOCS[@]}" 2>&1 | tee -a "$OUT/log.txt"
    rc=${PIPESTATUS[0]}; [ "$rc" -eq 2 ] && exit 2; [ "$rc" -ne 0 ] && status=1
    echo "issue26_measure: overlap table $(($(date +%s) - t0)) s, exit $rc" | tee -a "$OUT/log.txt"
fi
t1=$(date +%s)
VARGS=(--out "$OUT/validation")
[ -n "$SMOKE" ] && VARGS+=(--smoke)
[ -n "$RESUME" ] && VARGS+=(--resume)
if [ "$BUDGET" != 0 ]; then  # what is left of the window, less 2 minutes for the report
    VARGS+=(--budget "$(awk "BEGIN {print $BUDGET * 60 - 120 - ($t1 - $t0)}")")
fi
[ -n "${FORCE:-}" ] && VARGS+=(--force --wait 0)
"$PY" -m bench.validation_plan measure "${VARGS[@]}" 2>&1 | tee -a "$OUT/log.txt"
rc=${PIPESTATUS[0]}; [ "$rc" -eq 2 ] && exit 2
"$PY" -m bench.validation_plan report --out "$OUT/validation" "${VDOC[@]}" 2>&1 | tee -a "$OUT/log.txt"
rc=${PIPESTATUS[0]}; [ "$rc" -eq 2 ] && exit 2; [ "$rc" -ne 0 ] && status=1
t2=$(date +%s)
echo "issue26_measure: validation $((t2 - t1)) s; total $((t2 - t0)) s; load average $(cut -d' ' -f1-3 /proc/loadavg); exit $status" | tee -a "$OUT/log.txt"
exit $status
