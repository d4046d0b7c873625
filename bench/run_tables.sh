#!/usr/bin/env bash
# One GPU call of the paper-table rows (bench/paper_tables.py: batched simulator, 20M, M = 8 x S = 4,
# H = 50, 32 x 2 x 256 tokens per replica step, 5000 steps = 100 outer syncs) over every visible GPU,
# PROCS_PER_GPU worker processes on each (1: one batched row fills a GPU).
# Device tool, carry [".whl", ".benchdata/code_bpe8192_seq256.pt"], timeout_s 600:
#   lr sweep:  LR_SWEEP=3e-4,6e-4,1e-3,2e-3 STEPS=1000 TAG=sweep bash bench/run_tables.sh
#   the rows:  LR_FROM=bench/results/paper_tables_sweep/paper_tables_summary.json TAG=h100x8 bash bench/run_tables.sh
#   next call: the same plus SKIP_DONE=bench/results/paper_tables_h100x8 (rows already committed there)
# Each worker rewrites $OUT/paper_tables_${TAG}_g<gpu>p<proc>.json after every row, starts no row it cannot
# finish within BUDGET seconds (default 540, counted from this script's start: a DEVICE_CORPUS build, 200 s on
# an H100 host, comes out of it), and saves a row the budget stops into STATE_DIR (default
# runs/paper_tables_state, kept by the device while it stays warm) for the next call to resume; a finished row
# is marked there too, so a chained call skips it without SKIP_DONE naming the earlier call's JSON.
# Optional: ROWS (priority order, default paper_tables.DEFAULT_ROWS), SEEDS (0,1), MODEL (20M), DEVICE (cuda),
# COMPILE (1: torch.compile the forward), S_PER_STEP (bench/sim_throughput.py's step seconds, for the
# first row's budget judgement), AGGREGATION / OUTER_LR (every SparseLoCo row), DATA
# (.benchdata/code_bpe8192_seq256.pt, made by bench/make_code_corpus.py; about 29 passes in a 5000-step row), or
# DEVICE_CORPUS=1 (carry .benchdata/tokenizer: bench/make_device_corpus.py builds a larger one on the machine,
# CORPUS_ROOTS picks its source folders). The summary goes to $OUT/summary.
# PACK (default 1 on cuda, 0 on cpu): everything is written under /tmp/tables_$TAG instead and packed into
# the one file $OUT/tables_$TAG.tgz every 15 s and at the end (written aside, then renamed): the device tool
# returns at most 8 files a call, and 4 GPUs' JSONs beside the card and summary already make 7 (8 GPUs: 11).
source "$(dirname "$0")/_gpu_env.sh" || exit 1   # pipefail, link settings, wheels (shared with run_gpu*.sh)
cd "$(dirname "$0")/.." || exit 1
T0=$(date +%s)  # BUDGET counts from here: the wheels and a corpus built on the machine spend it too
: "${OUT:?OUT must be set}" "${TAG:?TAG must be set}"
if [ "${PACK:-$([ "${DEVICE:-cuda}" = cuda ] && echo 1 || echo 0)}" = 1 ]; then
  PACKED=$OUT/tables_$TAG.tgz; OUT=/tmp/tables_$TAG
  rm -rf "$OUT"; mkdir -p "$OUT"  # a machine may keep /tmp between calls: only this call's files are packed
  pack() { tar czf "$PACKED.part" -C "$OUT" . && mv -f "$PACKED.part" "$PACKED"; }
  ( while sleep 15; do pack; done ) & PACKER=$!
  trap 'kill $PACKER 2> /dev/null; pack' EXIT
fi
BENCH_TAG=run_tables
export MASTER_ADDR=127.0.0.1 MASTER_PORT=29512 RANK=0 WORLD_SIZE=1 LOCAL_RANK=0 LOCAL_WORLD_SIZE=1
if [ "${DEVICE:-cuda}" = cuda ]; then
  bench_install_wheels || exit 1
  nvidia-smi --query-gpu=name,memory.total,clocks.sm --format=csv | tee "$OUT/card_$TAG.txt"
else
  bench_smoke_path
fi
nproc | tee -a "$OUT/card_$TAG.txt"
if [ "${DEVICE_CORPUS:-0}" = 1 ]; then
  # The paper-regime corpus from the machine's own sources (bench/make_device_corpus.py; carry
  # .benchdata/tokenizer instead of the corpus), built once and kept under runs/ while the machine is warm.
  DATA=${DATA:-runs/device_corpus_seq256.pt}
  [ -f "$DATA" ] || python3 bench/make_device_corpus.py --tokenizer .benchdata/tokenizer --out "$DATA" \
    ${CORPUS_ROOTS:+--roots $CORPUS_ROOTS} 2>&1 | tail -5 || exit 1
fi
LEFT=$(( ${BUDGET:-540} - ($(date +%s) - T0) ))
[ "$LEFT" -gt 60 ] || { echo "[run_tables] only ${LEFT} s of BUDGET left after the set-up; no row started"; exit 1; }
args=(--data "${DATA:-.benchdata/code_bpe8192_seq256.pt}" --model "${MODEL:-20M}" --seeds "${SEEDS:-0,1}"
      --steps "${STEPS:-5000}" --device "${DEVICE:-cuda}" --procs-per-gpu "${PROCS_PER_GPU:-1}"
      --budget-s "$LEFT" --state-dir "${STATE_DIR:-runs/paper_tables_state}" --tag "$TAG" --out "$OUT")
[ -n "${ROWS:-}" ] && args+=(--rows "$ROWS")
[ -n "${LR_SWEEP:-}" ] && args+=(--lr-sweep "$LR_SWEEP")
[ -n "${LR_FROM:-}" ] && args+=(--lr-from "$LR_FROM")
[ -n "${SKIP_DONE:-}" ] && args+=(--skip-done "$SKIP_DONE")
[ -n "${S_PER_STEP:-}" ] && args+=(--s-per-step "$S_PER_STEP")
[ -n "${AGGREGATION:-}" ] && args+=(--aggregation "$AGGREGATION")
[ -n "${OUTER_LR:-}" ] && args+=(--outer-lr "$OUTER_LR")
[ "${COMPILE:-0}" = 1 ] && args+=(--compile)
[ -n "${EXTRA_ARGS:-}" ] && read -r -a extra <<< "$EXTRA_ARGS" && args+=("${extra[@]}")
python3 bench/paper_tables.py "${args[@]}" 2>&1 | grep --line-buffered -v -E "WARNING|performance drop|scaled_dot_product_attention\("
rc=$?
python3 bench/summarize_tables.py "$OUT" --out-dir "$OUT/summary" 2>&1 | tail -30
exit $rc
