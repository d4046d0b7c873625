#!/usr/bin/env bash
# One GPU call of the paper-table rows (bench/paper_tables.py), optionally after the throughput
# bench. Device tool: command "ROWS=... SEEDS=... TAG=... bash bench/run_tables.sh",
# carry [".whl", ".benchdata"]. Rows are appended to $OUT/paper_tables_$TAG.json as they finish.
set -o pipefail
cd "$(dirname "$0")/.." || exit 1
: "${OUT:?OUT must be set}" "${ROWS:?ROWS must be set}" "${TAG:?TAG must be set}"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 DS_ACCELERATOR=cuda
export MASTER_ADDR=127.0.0.1 MASTER_PORT=29512 RANK=0 WORLD_SIZE=1 LOCAL_RANK=0 LOCAL_WORLD_SIZE=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:.
nvidia-smi --query-gpu=name,memory.total,clocks.sm --format=csv | tee "$OUT/card_$TAG.txt"
if [ "${THROUGHPUT:-0}" = 1 ]; then
  timeout -k 10 300 python3 bench/gpu_throughput.py --time-budget 120 --systems ours,ds,hf --extra "" --profile-shapes 178M --out "$OUT/gpu_throughput.json" 2>&1 \
    | grep --line-buffered -v -E '^(CPU Virtual Memory|MA [0-9.]+ GB)|WARNING' | tail -30
fi
python3 bench/paper_tables.py --data .benchdata/stdlib_bpe8192_seq256.pt --rows "$ROWS" --seeds "${SEEDS:-0}" \
  --steps "${STEPS:-150}" --budget-s "${BUDGET:-420}" --out "$OUT/paper_tables_$TAG.json" 2>&1 | grep -v WARNING
