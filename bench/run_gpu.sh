#!/usr/bin/env bash
# One batched GPU call: throughput of the three systems, then the outer step's cost.
#
# Device tool:  command "bash bench/run_gpu.sh", carry [".whl"], timeout_s 570.
# Worst case ~8 min (hard per-script timeouts 320 s + 130 s), expected ~5 min after the machine starts.
# Writes into $OUT (at most 7 files): nvidia-smi.txt, env.txt, gpu_throughput.{json,log},
# outer_step.{json,log}, run_gpu.log.
#
# BENCH_SMOKE=1 bash bench/run_gpu.sh   runs the same sequence on this CPU with tiny shapes and
# no wheel install (checks the script itself; OUT defaults to /tmp/bench_smoke_out).
source "$(dirname "$0")/_gpu_env.sh" || exit 1   # pipefail, link settings, wheels, env check
bench_begin run_gpu /tmp/bench_smoke_out
export MASTER_ADDR=127.0.0.1 MASTER_PORT=29511 RANK=0 WORLD_SIZE=1 LOCAL_RANK=0 LOCAL_WORLD_SIZE=1

if [ "$SMOKE" = 1 ]; then
  bench_smoke_path
  TP_ARGS="--cpu-smoke"; OS_ARGS="--cpu-smoke"; TP_TIMEOUT=600; OS_TIMEOUT=300
else
  bench_install_wheels || exit 1
  bench_nvidia_smi
  TP_ARGS="${BENCH_TP_ARGS:---time-budget 190}"; OS_ARGS=""; TP_TIMEOUT=320; OS_TIMEOUT=130
fi

stamp "environment"
bench_env_check || exit 1

stamp "gpu_throughput.py (timeout ${TP_TIMEOUT} s)"
timeout -k 10 "$TP_TIMEOUT" python3 bench/gpu_throughput.py $TP_ARGS --out "$OUT/gpu_throughput.json" 2>&1 \
  | grep --line-buffered -v -E '^(CPU Virtual Memory|MA [0-9.]+ GB)' | tee "$OUT/gpu_throughput.log"
rc1=$?
stamp "gpu_throughput.py rc=$rc1"

stamp "outer_step.py (timeout ${OS_TIMEOUT} s)"
timeout -k 10 "$OS_TIMEOUT" python3 bench/outer_step.py $OS_ARGS --throughput-json "$OUT/gpu_throughput.json" \
  --out "$OUT/outer_step.json" 2>&1 | tee "$OUT/outer_step.log"
rc2=$?
stamp "outer_step.py rc=$rc2"

if [ "$SMOKE" != 1 ] && [ -f .benchdata/stdlib_bpe8192_seq256.pt ]; then
  stamp "simulator calibration for the paper tables (timeout 180 s)"
  timeout -k 5 180 python3 bench/paper_tables.py --data .benchdata/stdlib_bpe8192_seq256.pt --calibrate --procs 1,6 \
    --steps 20 --tag gpu --out "$OUT" 2>&1 | grep -v WARNING
  stamp "calibration rc=$?"
fi

bench_end "$(( rc1 != 0 || rc2 != 0 ))" "throughput rc=$rc1, outer rc=$rc2"
