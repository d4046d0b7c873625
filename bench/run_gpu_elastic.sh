#!/usr/bin/env bash
# Two GPUs, two elastic replicas (S = 1 each) through a torchft lighthouse: replica 1 killed mid-run and
# restarted (bench/gpu_elastic.py): the survivor's tokens/s alone, the outer step with 2 vs 1 members, the
# fault's cost and the recovery time, in $OUT/gpu_elastic.json (naming the card).
#
# Device tool:  command "bash bench/run_gpu_elastic.sh", carry [".whl"], kind "nvidia-h100-x2", timeout_s 420.
# .whl must also hold torchft and what it imports (the device image has none of them): in the repo root,
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
#     torchft==0.2.0 opentelemetry-api==1.45.2 opentelemetry-sdk==1.45.2 opentelemetry-semantic-conventions==0.66b2 \
#     opentelemetry-proto==1.45.2 opentelemetry-exporter-otlp-proto-common==1.45.2 \
#     opentelemetry-exporter-otlp-proto-http==1.45.2 opentelemetry-exporter-otlp-common==0.66b2 \
#     opentelemetry-exporter-http-transport==0.66b2 protobuf==7.36.2 psutil==7.2.2
# (about 3.4 MB). Expected ~3 min after the machine starts: the stdlib tokenizer and token cache (~30 s),
# both replicas' start (~30 s), 4 outer steps together, the kill, 4 alone, the restart (~30 s) and its heal,
# 3 together; gpu_elastic.py gives any phase at most 150 s and is itself stopped at 330 s.
# Writes into $OUT: nvidia-smi.txt, env.txt, gpu_elastic.json, gpu_elastic.log, run_gpu_elastic.log.
#
# BENCH_SMOKE=1 bash bench/run_gpu_elastic.sh   the same on this CPU (gloo, tiny, seq 64), ~1-2 min
# (OUT defaults to /tmp/bench_smoke_elastic).
source "$(dirname "$0")/_gpu_env.sh" || exit 1   # pipefail, link settings, wheels, env check
bench_begin run_gpu_elastic /tmp/bench_smoke_elastic
# gpu_elastic.py starts each replica as rank 0 of a world of 1 itself.
unset RANK WORLD_SIZE LOCAL_RANK LOCAL_WORLD_SIZE MASTER_PORT

if [ "$SMOKE" = 1 ]; then
  bench_smoke_path
  ARGS="--cpu-smoke"; TIMEOUT=${BENCH_ELASTIC_TIMEOUT:-600}; NEED=0
else
  bench_install_wheels || exit 1
  bench_nvidia_smi topo
  ARGS=""; TIMEOUT=${BENCH_ELASTIC_TIMEOUT:-330}; NEED=2
fi

stamp "environment"
bench_env_check "$NEED" || exit 1
python3 -c "import torchft; print('torchft', torchft.__file__)" 2>&1 | tee -a "$OUT/env.txt"
[ "${PIPESTATUS[0]}" = 0 ] || { stamp "torchft does not import: put it and its wheels in .whl (see above)"; exit 1; }

stamp "gpu_elastic.py (timeout ${TIMEOUT} s)"
timeout -k 15 "$TIMEOUT" python3 bench/gpu_elastic.py $ARGS --out "$OUT/gpu_elastic.json" 2>&1 | bench_quiet | tee "$OUT/gpu_elastic.log"
rc=$?
stamp "gpu_elastic.py rc=$rc"
bench_end "$rc"
