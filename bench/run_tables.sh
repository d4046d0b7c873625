#!/usr/bin/env bash
# One GPU call of the paper-table rows (bench/paper_tables.py) over every visible GPU, PROCS_PER_GPU
# worker processes on each. Device tool, carry [".whl", ".benchdata/code_bpe8192_seq256.pt"]:
#   calibrate: CALIBRATE=1 PROCS=1,4,8,12 STEPS=20 TAG=cal bash bench/run_tables.sh
#   full run:  STEPS=1500 SEEDS=0,1 PROCS_PER_GPU=6 TAG=h200x2 bash bench/run_tables.sh
# Each worker rewrites $OUT/paper_tables_${TAG}_g<gpu>p<proc>.json after every row it finishes and
# starts no row that would end after BUDGET seconds (judged by its previous row). Optional: ROWS
# (default: all 12), MODEL (20M), DEVICE (cuda), DATA (.benchdata/code_bpe8192_seq256.pt, made by
# bench/make_code_corpus.py; carry it instead of the whole .benchdata to stay under 64 MiB). The summary of this run goes to $OUT/summary.
source "$(dirname "$0")/_gpu_env.sh" || exit 1   # pipefail, link settings, wheels (shared with run_gpu*.sh)
cd "$(dirname "$0")/.." || exit 1
: "${OUT:?OUT must be set}" "${TAG:?TAG must be set}"
BENCH_TAG=run_tables
export MASTER_ADDR=127.0.0.1 MASTER_PORT=29512 RANK=0 WORLD_SIZE=1 LOCAL_RANK=0 LOCAL_WORLD_SIZE=1
if [ "${DEVICE:-cuda}" = cuda ]; then
  bench_install_wheels || exit 1
  nvidia-smi --query-gpu=name,memory.total,clocks.sm --format=csv | tee "$OUT/card_$TAG.txt"
else
  bench_smoke_path
fi
nproc | tee -a "$OUT/card_$TAG.txt"
args=(--data "${DATA:-.benchdata/code_bpe8192_seq256.pt}" --model "${MODEL:-20M}" --seeds "${SEEDS:-0,1}" --steps "${STEPS:-300}"
      --device "${DEVICE:-cuda}" --procs-per-gpu "${PROCS_PER_GPU:-6}" --budget-s "${BUDGET:-540}" --tag "$TAG" --out "$OUT")
[ -n "${ROWS:-}" ] && args+=(--rows "$ROWS")
if [ "${CALIBRATE:-0}" = 1 ]; then
  python3 bench/paper_tables.py "${args[@]}" --calibrate --procs "${PROCS:-1,4,8}" 2>&1 | grep --line-buffered -v WARNING
  exit $?
fi
python3 bench/paper_tables.py "${args[@]}" 2>&1 | grep --line-buffered -v WARNING
rc=$?
python3 bench/summarize_tables.py "$OUT" --out-dir "$OUT/summary" 2>&1 | tail -20
exit $rc
