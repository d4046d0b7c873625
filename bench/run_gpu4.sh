#!/usr/bin/env bash
# One call on a 4-GPU machine: M = 2 replicas x S = 2 stages. Ours heterogeneous (replica 1's stage link
# compressed at ratio 8, replica 0 uncompressed; SparseLoCo H = 50, one outer step crossed, parameter
# hashes per stage) vs stock DeepSpeed PipelineEngine PP x DP (bench/gpu_four.py has the details).
#
# Device tool:  command "bash bench/run_gpu4.sh", carry [".whl"], kind "nvidia-h100-x4", timeout_s 270.
# Expected ~1.5-2 min after the machine starts (2 configurations x ~30-45 s, each in 4 fresh processes,
# plus wheel install and checks). Hard limits: everything ends by DEADLINE (255 s) after this script
# starts: pip 60 s, environment check 45 s, gpu_four.py the rest (it starts no configuration with under
# 40 s left and stops one at its share; timeout signals its process group, the workers too).
# Writes into $OUT (5 files): nvidia-smi.txt, env.txt, gpu_four.json, gpu_four.log, run_gpu4.log.
#
# BENCH_SMOKE=1 bash bench/run_gpu4.sh   the same sequence on this CPU (gloo, 4 ranks, tiny, seq 64, H = 3),
# no wheel install (checks the script itself; OUT defaults to /tmp/bench_smoke_out4).
source "$(dirname "$0")/_gpu_env.sh" || exit 1   # pipefail, link settings, wheels, env check
bench_begin run_gpu4 /tmp/bench_smoke_out4
# gpu_four.py sets RANK / WORLD_SIZE / MASTER_PORT for each of its 4 worker processes itself.
unset RANK WORLD_SIZE LOCAL_RANK LOCAL_WORLD_SIZE MASTER_PORT

if [ "$SMOKE" = 1 ]; then
  bench_smoke_path
  ARGS="--cpu-smoke"; DEADLINE=${BENCH_GPU4_DEADLINE:-2700}; NEED=0
else
  DEADLINE=${BENCH_GPU4_DEADLINE:-255}; NEED=4
  bench_install_wheels 60 30 || exit 1
  bench_nvidia_smi topo
  ARGS="${BENCH_GPU4_ARGS:-}"
fi

stamp "environment"
bench_env_check "$NEED" 45 || exit 1

# What is left of DEADLINE: `timeout` gets it less 12 s (its kill grace 8 s + the ls below);
# gpu_four.py plans to end 10 s before its own timeout.
left=$(( DEADLINE - ($(date +%s) - BENCH_START) - 12 ))
[ "$left" -gt 60 ] || { stamp "only ${left} s left; not starting gpu_four.py"; exit 1; }
stamp "gpu_four.py (timeout ${left} s)"
timeout -k 8 "$left" python3 bench/gpu_four.py $ARGS --deadline $(( left - 10 )) --out "$OUT/gpu_four.json" 2>&1 \
  | bench_quiet | tee "$OUT/gpu_four.log"
rc=$?
stamp "gpu_four.py rc=$rc"
bench_end "$rc"
