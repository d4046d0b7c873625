#!/usr/bin/env bash
# One call on a 4-GPU host for what issues 11 and 12 still need on GPUs, two benches side by side:
#   GPUs 0,1  bench/run_gpu2.sh --configs a_ours_r1,a_ds --repeats 3: our S = 2 pipeline with the overlapped
#             schedule named explicitly ("auto" is blocking on NCCL: gpu_two_s2_overlapped_h100.json) vs stock
#             DeepSpeed's pipeline, interleaved, medians;
#   GPUs 2,3  bench/run_gpu_elastic.sh (2 elastic replicas, one killed and restarted), then, if time is left,
#             bench/run_gpu2.sh --configs b_ours_sl,b_ds_dp --repeats 3 (M = 2 vs data parallelism, profiled).
# Everything is packed into $OUT/gpu4.tgz every 15 s (written aside, then renamed), so a call cut at its
# limit still brings back what finished (the device returns at most 8 files).
#
# Device tool:  command "bash bench/run_gpu4_links_elastic.sh", carry [".whl"], kind "nvidia-h100-x4",
# timeout_s 600 (~7 min after the machine starts). .whl: see run_gpu_elastic.sh's header (torchft and its
# wheels) and _gpu_env.sh (DeepSpeed and its wheels).
source "$(dirname "$0")/_gpu_env.sh" || exit 1
: "${OUT:?OUT must be set}"
O=$OUT; W=${BENCH_WORK:-/tmp/gpu4}; mkdir -p "$W/two" "$W/el" "$W/m2"; T0=$(date +%s)
(OUT=$W/two; bench_install_wheels) > "$W/two/wheels.log" 2>&1 || { tail "$W/two/wheels.log"; exit 1; }
export BENCH_WHEELS_INSTALLED=1
pack() { tar czf "$O/part.tgz" -C "$W" two el m2 $(cd "$W" && ls -d eager 2>/dev/null); mv -f "$O/part.tgz" "$O/gpu4.tgz"; }
( while sleep 15; do pack; done ) & L=$!
( CUDA_VISIBLE_DEVICES=2,3 OUT=$W/el BENCH_ELASTIC_TIMEOUT=240 bash bench/run_gpu_elastic.sh > /dev/null 2>&1
  E=$(( $(date +%s) - T0 ))
  if [ "$E" -lt 300 ]; then
    CUDA_VISIBLE_DEVICES=2,3 OUT=$W/m2 BENCH_GPU2_ARGS="--configs b_ours_sl,b_ds_dp --repeats 3 --time-budget $((420 - E))" \
      BENCH_GPU2_TIMEOUT=$((500 - E)) bash bench/run_gpu2.sh > /dev/null 2>&1
  fi ) & P=$!
CUDA_VISIBLE_DEVICES=0,1 OUT=$W/two BENCH_GPU2_ARGS="--configs a_ours_r1,a_ds --repeats 3 --schedule overlapped --time-budget 330 --config-timeout 75" \
  BENCH_GPU2_TIMEOUT=400 bash bench/run_gpu2.sh > /dev/null 2>&1
# A hang again (its stacks are in two/gpu_two.log): once more with every CUDA kernel loaded at start, which
# tells whether lazy module loading (a context-wide synchronisation) is what deadlocks the posted receives.
E=$(( $(date +%s) - T0 ))
if grep -q '"error": "timeout' "$W/two/gpu_two.json" 2>/dev/null && [ "$E" -lt 450 ]; then
  mkdir -p "$W/eager"
  CUDA_MODULE_LOADING=EAGER CUDA_VISIBLE_DEVICES=0,1 OUT=$W/eager BENCH_GPU2_ARGS="--configs a_ours_r1 --repeats 1 --schedule overlapped --time-budget $((520 - E)) --config-timeout 75 --no-profile" \
    BENCH_GPU2_TIMEOUT=$((540 - E)) bash bench/run_gpu2.sh > /dev/null 2>&1
fi
wait $P; kill $L; pack
for f in "$W/two/gpu_two.log" "$W/eager/gpu_two.log" "$W/el/gpu_elastic.log" "$W/m2/gpu_two.log"; do
  echo "== $f"; [ -f "$f" ] && grep -v "^\s*$" "$f" | tail -25
done
