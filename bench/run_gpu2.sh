#!/usr/bin/env bash
# One batched call on a 2-GPU machine: the stage link (S = 2: ours uncompressed / ratio 8 / ratio 64 vs
# stock DeepSpeed) and the replica link (M = 2: SparseLoCo H = 50 vs stock DeepSpeed data parallel).
#
# Device tool:  command "bash bench/run_gpu2.sh", carry [".whl"], kind "nvidia-h100-x2", timeout_s 540.
# Expected ~3-4 min after the machine starts (6 configurations x ~25-35 s, each in 2 fresh processes);
# worst case ~7.5 min: gpu_two.py starts no configuration after 300 s, stops one after 120 s, and is
# itself stopped at 420 s (timeout signals its process group: the workers too).
# Writes into $OUT (5 files): nvidia-smi.txt, env.txt, gpu_two.json, gpu_two.log, run_gpu2.log.
#
# BENCH_SMOKE=1 bash bench/run_gpu2.sh   the same sequence on this CPU (gloo, tiny, seq 64), no wheel
# install (checks the script itself; OUT defaults to /tmp/bench_smoke_out2).
#
# BENCH_GPU2_ARGS: extra gpu_two.py flags (device and smoke mode), e.g. "--compiled-rows" (+3 rows of ours
# under hetloco.train.compile: a_ours_r1_compiled, a_ours_r8_compiled, b_ours_sl_compiled; ~2 min more
# on the GPUs, so give it BENCH_GPU2_TIMEOUT=480 and the device tool timeout_s 600). BENCH_GPU2_TIMEOUT:
# gpu_two.py's outer limit in seconds (default 420 on the device, 900 in smoke mode).
source "$(dirname "$0")/_gpu_env.sh" || exit 1   # pipefail, link settings, wheels, env check
bench_begin run_gpu2 /tmp/bench_smoke_out2
# gpu_two.py sets RANK / WORLD_SIZE / MASTER_PORT for each of its 2 worker processes itself.
unset RANK WORLD_SIZE LOCAL_RANK LOCAL_WORLD_SIZE MASTER_PORT

if [ "$SMOKE" = 1 ]; then
  bench_smoke_path
  ARGS="--cpu-smoke ${BENCH_GPU2_ARGS:-}"; TIMEOUT=${BENCH_GPU2_TIMEOUT:-900}; NEED=0
else
  bench_install_wheels || exit 1
  bench_nvidia_smi topo
  ARGS="${BENCH_GPU2_ARGS:-}"; TIMEOUT=${BENCH_GPU2_TIMEOUT:-420}; NEED=2
fi

stamp "environment"
bench_env_check "$NEED" || exit 1

stamp "gpu_two.py (timeout ${TIMEOUT} s)"
timeout -k 15 "$TIMEOUT" python3 bench/gpu_two.py $ARGS --out "$OUT/gpu_two.json" 2>&1 | bench_quiet | tee "$OUT/gpu_two.log"
rc=$?
stamp "gpu_two.py rc=$rc"
bench_end "$rc"
