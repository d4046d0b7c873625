#!/usr/bin/env bash
# One call on a 4-GPU host for what issue 11 still needs on GPUs (each pair of GPUs runs its own stock
# baseline, so every ratio compares runs on the same GPUs in the same call):
#   GPUs 0,1  gpu_two --configs a_ours_r1,a_ds --repeats 3 --schedule blocking: our S = 2 as "auto" runs it on
#             NCCL, now with each weight cast once per step, vs stock DeepSpeed's pipeline; then
#             --configs b_ours_sl,b_ds_dp --repeats 3: M = 2 vs data parallelism with the same change
#             (gpu_two_m2_r3_h100.json had 0.979x before it).
#   GPUs 2,3  gpu_two --configs a_ours_r1,a_ds --repeats 3 --schedule overlapped --link-max-ctas 1: the overlapped
#             schedule with its link communicators capped at one CTA (gpu_two_s2_overlapped_h100.json: 0.88x,
#             the GEMMs slowed by the posted receives' kernels); then the same at --link-max-ctas 4.
# Everything is packed into $OUT/gpu4s.tgz every 15 s (written aside, then renamed).
#
# Device tool:  command "bash bench/run_gpu4_schedules.sh", carry [".whl"], kind "nvidia-h100-x4", timeout_s 600
# (~8 min after the machine starts). .whl: see _gpu_env.sh (DeepSpeed and its wheels; py-spy for stacks).
source "$(dirname "$0")/_gpu_env.sh" || exit 1
: "${OUT:?OUT must be set}"
O=$OUT; W=${BENCH_WORK:-/tmp/gpu4s}; mkdir -p "$W/blocking" "$W/m2" "$W/cta1" "$W/cta4"; T0=$(date +%s)
(OUT=$W/blocking; bench_install_wheels) > "$W/blocking/wheels.log" 2>&1 || { tail "$W/blocking/wheels.log"; exit 1; }
export BENCH_WHEELS_INSTALLED=1
pack() { tar czf "$O/part.tgz" -C "$W" blocking m2 cta1 cta4 2>/dev/null; mv -f "$O/part.tgz" "$O/gpu4s.tgz"; }
( while sleep 15; do pack; done ) & L=$!
pair() {  # pair GPUS DIR ARGS BUDGET_S: one gpu_two run, bounded
  CUDA_VISIBLE_DEVICES=$1 OUT=$W/$2 BENCH_GPU2_ARGS="$3 --time-budget $4 --config-timeout 75" \
    BENCH_GPU2_TIMEOUT=$(( $4 + 60 )) bash bench/run_gpu2.sh > /dev/null 2>&1
}
left() { echo $(( $1 - ($(date +%s) - T0) )); }
( pair 2,3 cta1 "--configs a_ours_r1,a_ds --repeats 3 --schedule overlapped --link-max-ctas 1" 230
  B=$(left 470); [ "$B" -gt 120 ] && pair 2,3 cta4 "--configs a_ours_r1,a_ds --repeats 3 --schedule overlapped --link-max-ctas 4" "$B" ) & P=$!
pair 0,1 blocking "--configs a_ours_r1,a_ds --repeats 3 --schedule blocking" 230
B=$(left 470); [ "$B" -gt 120 ] && pair 0,1 m2 "--configs b_ours_sl,b_ds_dp --repeats 3" "$B"
wait $P; kill $L; pack
for d in blocking m2 cta1 cta4; do
  echo "== $d"; [ -f "$W/$d/gpu_two.log" ] && grep -E "ratio of medians|^a_|^b_|error|timeout" "$W/$d/gpu_two.log" | tail -12
done
