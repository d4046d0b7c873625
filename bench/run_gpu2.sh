#!/usr/bin/env bash
# One batched call on a 2-GPU machine: the stage link (S = 2: our overlapped schedule, uncompressed, vs stock
# DeepSpeed's pipeline) and the replica link (M = 2: SparseLoCo H = 50, inner steps vs stock DeepSpeed data
# parallel), each pair 3 times interleaved (medians; the last repeat of each also profiled: kernel and host-op
# summaries in the JSON, to see where M = 2 loses to DeepSpeed's data parallelism), then ratio 8 once.
#
# Device tool:  command "bash bench/run_gpu2.sh", carry [".whl"], kind "nvidia-h100-x2", timeout_s 600.
# Expected ~6-7 min after the machine starts (13 configurations x ~25-35 s, each in 2 fresh processes);
# worst case ~9.5 min: gpu_two.py starts no configuration after 450 s, stops one after 120 s, and is
# itself stopped at 540 s (timeout signals its process group: the workers too).
# Writes into $OUT (5 files): nvidia-smi.txt, env.txt, gpu_two.json, gpu_two.log, run_gpu2.log.
#
# BENCH_SMOKE=1 bash bench/run_gpu2.sh   the same sequence on this CPU (gloo, tiny, seq 64, 1 repeat), no
# wheel install (checks the script itself; OUT defaults to /tmp/bench_smoke_out2; ~4-5 min on 2 cores).
#
# BENCH_GPU2_ARGS: extra gpu_two.py flags (device and smoke mode), e.g. "--repeats 1", "--schedule blocking",
# "--no-profile", or "--compiled-rows" (+3 rows of ours under hetloco.train.compile; ~2 min more on the GPUs:
# use "--repeats 1 --compiled-rows"). BENCH_GPU2_TIMEOUT: gpu_two.py's outer limit in seconds (default 540 on
# the device, 1500 in smoke mode).
source "$(dirname "$0")/_gpu_env.sh" || exit 1   # pipefail, link settings, wheels, env check
bench_begin run_gpu2 /tmp/bench_smoke_out2
# gpu_two.py sets RANK / WORLD_SIZE / MASTER_PORT for each of its 2 worker processes itself.
unset RANK WORLD_SIZE LOCAL_RANK LOCAL_WORLD_SIZE MASTER_PORT

if [ "$SMOKE" = 1 ]; then
  bench_smoke_path
  ARGS="--cpu-smoke ${BENCH_GPU2_ARGS:-}"; TIMEOUT=${BENCH_GPU2_TIMEOUT:-1500}; NEED=0
else
  bench_install_wheels || exit 1
  bench_nvidia_smi topo
  ARGS="--time-budget 450 ${BENCH_GPU2_ARGS:-}"; TIMEOUT=${BENCH_GPU2_TIMEOUT:-540}; NEED=2
fi

stamp "environment"
bench_env_check "$NEED" || exit 1

stamp "gpu_two.py (timeout ${TIMEOUT} s)"
timeout -k 15 "$TIMEOUT" python3 bench/gpu_two.py $ARGS --out "$OUT/gpu_two.json" 2>&1 | bench_quiet | tee "$OUT/gpu_two.log"
rc=$?
stamp "gpu_two.py rc=$rc"
bench_end "$rc"
