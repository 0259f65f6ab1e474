#!/usr/bin/env bash
# One prepared GPU check (issue 13): speed and peak memory against plain PyTorch (gpt-1.3b and
# llama3.2-1b on one GPU), the loss sanity run (gpt-1.3b from scratch, 20 steps, bf16, axo4d's
# trainer against plain PyTorch), the multi-rank tests of tests/gpu (2 and 4 ranks sharing the GPU
# over gloo) and the GEMM tuner; then ONE summary table (python -m bench.gpu_summary).
#
#   bench/gpu_check.sh [--out DIR]           # a GPU machine: what fits in 600 s (all parts: ~20 min)
#   bench/gpu_check.sh --cpu [--out DIR]     # the same parts at reduced size on the CPU (checks the script)
#   GPU_CHECK_PARTS=speed_gpt,sanity bench/gpu_check.sh    # only these parts
#
# Parts, in this order, each under its own time limit, cut to what is left of the overall budget
# GPU_CHECK_BUDGET_S (default 600 s; --cpu: 3600 s; a part with nothing left is skipped; both show
# in the table as exit 124):
#   speed_gpt       bench.single_gpu, gpt-1.3b, the eager contenders (plain, transformers, axo4d)
#   sanity          bench.loss_sanity: gpt-1.3b from scratch, 20 steps, bf16, trainer vs plain
#   gpu_tests       tests/gpu: multi-rank parity, overlap, resharding, sharded optimizer / offload
#   peers           bench.peers on local ranks sharing the GPU over gloo (issue 31 item 9): the
#                   losses' agreement, no speed verdict; x2 last, the probe of docs/gpu.md's crash
#   tuner           bench.tuner on gpt-1.3b's GEMMs
#   fp8             bench.fp8_speed: gpt-1.3b and llama3.2-1b, bf16 vs FP8 tensorwise compiled,
#                   step-time ratio at equal loss over 50 steps; target >= 1.25x
#   speed_compiled  bench.single_gpu, gpt-1.3b, plain compiled vs axo4d compiled
#   speed_llama     bench.single_gpu, llama3.2-1b, compiled
# The parts together take longer than one 10-minute device call: a session picks with
# GPU_CHECK_PARTS (docs/gpu.md says which ran last). Each part's output goes to DIR/<part>.log
# (default DIR: runs/gpu_check); the table reads the JSON files they write.
set -u
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
[ -x .venv/bin/python ] && PY=.venv/bin/python
MODE=gpu
OUT=runs/gpu_check
while [ $# -gt 0 ]; do
  case "$1" in
    --cpu) MODE=cpu ;;
    --out) OUT=$2; shift ;;
    *) echo "usage: bench/gpu_check.sh [--cpu] [--out DIR]" >&2; exit 2 ;;
  esac
  shift
done
PARTS=${GPU_CHECK_PARTS:-speed_gpt,sanity,gpu_tests,peers,tuner,fp8,speed_compiled,speed_llama}
DEFAULT_BUDGET=600
[ "$MODE" = cpu ] && DEFAULT_BUDGET=3600      # 2 CPU cores: the reduced parts take minutes each
BUDGET=${GPU_CHECK_BUDGET_S:-$DEFAULT_BUDGET}
mkdir -p "$OUT"
rm -f "$OUT"/*.json "$OUT"/*.jsonl "$OUT"/*.log "$OUT/status.txt"
START=$SECONDS

if [ "$MODE" = gpu ] && ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "bench/gpu_check.sh: no CUDA device here; run with --cpu for the reduced CPU version" >&2
  exit 2
fi

part() {   # part NAME LIMIT_S COMMAND...: run COMMAND into DIR/NAME.log unless skipped
  local name=$1 limit=$2; shift 2
  case ",$PARTS," in *",$name,"*) ;; *) return ;; esac
  local used=$((SECONDS - START))
  if [ "$used" -ge "$BUDGET" ]; then
    echo "$name 124 0" >> "$OUT/status.txt"
    echo "skipped $name: ${used}s used of the ${BUDGET}s budget" >> "$OUT/skipped.log"
    return
  fi
  [ "$limit" -gt $((BUDGET - used)) ] && limit=$((BUDGET - used))   # never past the overall budget
  local t0=$SECONDS
  timeout -k 5 "$limit" "$@" > "$OUT/$name.log" 2>&1
  echo "$name $? $((SECONDS - t0))" >> "$OUT/status.txt"
}

if [ "$MODE" = gpu ]; then   # limits: the durations measured on one H200 (docs/gpu.md) with room
  part speed_gpt 110 "$PY" -m bench.single_gpu --steps 5 --warmup 2 --no-compile --json "$OUT/speed_gpt-1.3b.json"
  part sanity 130 "$PY" -m bench.loss_sanity --steps 20 --json "$OUT/sanity.json"
  part gpu_tests 150 env AXO4D_GPU_TEST_REPORT="$OUT/gpu_tests.jsonl" "$PY" -m pytest -q -x tests/gpu -p no:cacheprovider
  part peers 80 "$PY" -m bench.peers --local --pairs z2,data2,x2 --steps 4 --rounds 2 --warmup 2 --json "$OUT/peers.json"
  part tuner 50 "$PY" -m bench.tuner --config gpt-1.3b --passes 3
  part fp8 260 "$PY" -m bench.fp8_speed --steps 50 --warmup 5 --json "$OUT/fp8.json"
  part speed_compiled 240 "$PY" -m bench.single_gpu --steps 5 --warmup 2 --only "plain compiled,axo4d compiled" \
    --json "$OUT/speed_compiled_gpt-1.3b.json"
  part speed_llama 150 "$PY" -m bench.single_gpu --config llama3.2-1b --batch 4 --steps 5 --warmup 2 \
    --only "plain compiled,axo4d compiled" --json "$OUT/speed_llama3.2-1b.json"
else
  export CUDA_VISIBLE_DEVICES=""
  part speed_gpt 300 "$PY" -m bench.single_gpu --reduced --steps 3 --warmup 1 --no-compile --json "$OUT/speed_gpt.json"
  part sanity 300 "$PY" -m bench.loss_sanity --reduced --steps 3 --set model.seq_len=32 --json "$OUT/sanity.json"
  part gpu_tests 1200 env AXO4D_GPU_TESTS_ON_CPU=1 AXO4D_GPU_TEST_REPORT="$OUT/gpu_tests.jsonl" \
    "$PY" -m pytest -q -x tests/gpu -p no:cacheprovider
  part peers 600 "$PY" -m bench.peers --local --pairs x2,data2 --n-embd 64 --n-layer 1 --seq 32 --batch 4 --steps 1 \
    --rounds 1 --json "$OUT/peers.json"
  part speed_llama 300 "$PY" -m bench.single_gpu --reduced --config llama-tiny --steps 3 --warmup 1 --no-compile \
    --json "$OUT/speed_llama-tiny.json"
  part tuner 300 "$PY" -m bench.tuner --passes 2
  part fp8 600 "$PY" -m bench.fp8_speed --reduced --no-compile --steps 3 --warmup 1 --json "$OUT/fp8.json"
fi

echo "bench/gpu_check.sh ($MODE): $((SECONDS - START)) s; logs in $OUT"
"$PY" -m bench.gpu_summary "$OUT"
