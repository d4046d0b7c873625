#!/usr/bin/env bash
# One device call for what issue 11 still needs on GPUs, on a 2- or a 4-GPU host. Every ratio compares
# runs on the same two GPUs in the same call (each gpu_two run has its own stock baseline, 3 repeats).
# Since "auto" became the copy engines on GPUs of one host, every lane names its schedule and transport
# (the results committed before then ran "auto" as blocking on NCCL; see bench/README.md):
#   cta1      gpu_two --configs a_ours_r1,a_ds --schedule overlapped --link-transport process_group --link-max-ctas 1:
#             the overlapped S = 2 over NCCL with its link communicators capped at one CTA
#             (gpu_two_s2_overlapped_h100.json: 0.88x uncapped, the GEMMs slowed by the posted receives' kernels)
#   m2        gpu_two --configs b_ours_sl,b_ds_dp: M = 2 vs data parallelism, the weights cast once per
#             step (gpu_two_m2_r3_h100.json had 0.979x before)
#   blocking  gpu_two --configs a_ours_r1,a_ds --schedule blocking (DeepSpeed's 1F1B over NCCL)
#   m2bind    m2 with each rank (ours and stock alike) pinned to its own half of the lane's cores (gpu_two
#             --bind-cores): gpu_two_m2_castonce_h100.json had one replica 4-5% slower than the other in two
#             of three repeats, a different one each time, with equal device time; contention for the
#             shared cores is the suspect this run tests
#   cta4      as cta1 at --link-max-ctas 4
#   blockbind, cta1bind  blocking and cta1 with every rank pinned (--bind-cores): in the profiled step of
#             cta1 every host op ran 15-25% longer than in blocking's (aten::mm 39.8 vs 31.3 ms, the same
#             840 calls), so the overlapped schedule may lose on the host, not the device
#   autobind  the product's defaults (schedule and transport "auto") with every rank pinned: on GPUs of
#             one host, the overlapped schedule over the copy engines (each rank's part says what ran)
#   cta1carve cta1bind with hetloco.pipeline.gemm_sm_carveout "auto" for ours (gpu_two --sm-carveout auto: cuBLASLt,
#             SMs carved out = 1 CTA x 2 resident link kernels at S = 2):
#             pinned, cta1 was still 0.927x (blocking 1.015x) and in the profiled steps ours' GEMM device time
#             grew with the NCCL kernels beside it (rank 1: 438.6 vs 103.5 ms); the suspect is wave
#             quantisation: a persistent GEMM launches one CTA per SM, and with a link CTA resident on one SM
#             its grid runs in two waves (pytorch issue 143988). Each rank has at most 2 link CTAs resident (a
#             send and a receive, one CTA per communicator), so the GEMMs are sized to the SMs minus 2
#   autolt    blockbind with cuBLASLt for ours (--blas cublaslt): what cuBLASLt alone does to the blocking
#             schedule, so cta1carve's change is not mistaken for the carveout's
#   ce1bind   the overlapped S = 2 with hetloco.pipeline.link_transport "copy_engine" (gpu_two --link-transport
#             copy_engine), every rank pinned: messages copied by the copy engines into the peer's slots (CUDA IPC),
#             signalled by stream memory operations, so no link kernel is resident beside the GEMMs (resident_link's
#             "ce" condition measures that alone); compare with blockbind / cta1bind in the same call
#   bitsblk, bitsce, bitsblk2  the bits, not the time: gpu_two --configs a_ours_r1,a_ours_r8 --deterministic
#             (torch's deterministic algorithms, math attention, a fixed cuBLAS workspace; every step's loss and each rank's
#             parameter hash), 1 + 3 steps, under the blocking schedule over NCCL, then the overlapped one
#             over the copy engines, then blocking again (whether the machine repeats its own bits at all).
#             The end of the call prints whether they match (bits.txt); LANES="0,1:bitsblk,bitsce,bitsblk2"
# RESIDENT=1 first runs bench/resident_link.py on GPUs 0,1 (about a minute, before the lanes): a stage's
#   GEMMs alone and beside 1-2 held link receives, under cuBLAS and cuBLASLt, with and without the
#   carveout; the mechanism without a pipeline. Its JSON lands in resident/.
# 4 GPUs: GPUs 0,1 run blocking, m2bind then m2 while GPUs 2,3 run cta1 then cta4. 2 GPUs: one lane in the
# order blocking, cta1, m2bind, m2, cta4; a run starts only with at least 150 s of BUDGET (default 470 s) left.
# LANES="0,1:autobind,cta1bind 2,3:m2bind,m2" (or one lane "0,1:m2bind,m2,cta1bind") replaces both orders;
# with two lanes each has its own half of the lower cores (a change from the earlier 4-GPU runs, which
# shared them).
# PREBUILD_CORPUS=1 (carry .benchdata/tokenizer too): bench/make_device_corpus.py builds the paper-table
# corpus (runs/device_corpus_seq256.pt, what run_tables.sh DEVICE_CORPUS=1 reads) meanwhile, pinned to the
# upper half of the CPU cores while the benches are pinned to the lower half, so the next tables call on
# the same warm machine skips its 200 s build.
# Everything is packed into $OUT/gpus.tgz every 15 s (written aside, then renamed).
#
# Device tool:  command "bash bench/run_gpu_schedules.sh", carry [".whl"], kind "nvidia-h100-x2" or
# "nvidia-h100-x4", timeout_s 600. .whl: see _gpu_env.sh (DeepSpeed and its wheels; py-spy for stacks).
source "$(dirname "$0")/_gpu_env.sh" || exit 1
cd "$(dirname "$0")/.." || exit 1
: "${OUT:?OUT must be set}"
O=$OUT; W=${BENCH_WORK:-/tmp/gpus}; RUNS="resident blocking cta1 m2bind m2 cta4 blockbind autobind cta1bind cta1carve autolt ce1bind bitsblk bitsce bitsblk2"; T0=$(date +%s)
rm -rf "$W"  # a machine may keep /tmp between loans: no earlier run's JSON may be packed as this one's
for d in $RUNS; do mkdir -p "$W/$d"; done
(OUT=$W/m2; bench_install_wheels) > "$W/wheels.log" 2>&1 || { tail "$W/wheels.log"; exit 1; }
export BENCH_WHEELS_INSTALLED=1
NGPU=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
NCPU=$(nproc); LOW=(); HIGH=()
if command -v taskset > /dev/null && [ "$NCPU" -ge 4 ]; then
  LOW=(taskset -c 0-$(( NCPU / 2 - 1 ))); HIGH=(taskset -c $(( NCPU / 2 ))-$(( NCPU - 1 )))
fi
echo "gpus $NGPU, cpus $NCPU, benches on ${LOW[*]:-all cores}" | tee "$W/setup.txt"
if [ "${PREBUILD_CORPUS:-0}" = 1 ] && [ ! -f runs/device_corpus_seq256.pt ]; then
  ( PYTHONPATH=/tmp/site:. RAYON_NUM_THREADS=$(( NCPU / 2 )) "${HIGH[@]}" python3 bench/make_device_corpus.py \
      --tokenizer .benchdata/tokenizer --out runs/device_corpus_seq256.pt > "$W/corpus.log" 2>&1 ) & C=$!
fi
pack() { tar czf "$O/part.tgz" -C "$W" setup.txt wheels.log $RUNS $( [ -f "$W/corpus.log" ] && echo corpus.log ) 2>/dev/null
         mv -f "$O/part.tgz" "$O/gpus.tgz"; }
( while sleep 15; do pack; done ) & L=$!
PG="--link-transport process_group"
S2="--configs a_ours_r1,a_ds --repeats 3"  # our S = 2 against stock's
BITS="--configs a_ours_r1,a_ours_r8 --ratios 8 --repeats 1 --warmup 1 --steps 3 --deterministic --no-profile --bind-cores"
declare -A ARGS=(
  [cta1]="$S2 --schedule overlapped $PG --link-max-ctas 1"
  [m2]="--configs b_ours_sl,b_ds_dp --repeats 3"
  [m2bind]="--configs b_ours_sl,b_ds_dp --repeats 3 --bind-cores"
  [blocking]="$S2 --schedule blocking"
  [cta4]="$S2 --schedule overlapped $PG --link-max-ctas 4"
  [blockbind]="$S2 --schedule blocking --bind-cores"
  [autobind]="$S2 --schedule auto --link-transport auto --bind-cores"
  [cta1bind]="$S2 --schedule overlapped $PG --link-max-ctas 1 --bind-cores"
  [cta1carve]="$S2 --schedule overlapped $PG --link-max-ctas 1 --bind-cores --sm-carveout auto"
  [autolt]="$S2 --schedule blocking --bind-cores --blas cublaslt"
  [ce1bind]="$S2 --schedule overlapped --link-transport copy_engine --bind-cores"
  [bitsblk]="$BITS --schedule blocking $PG"
  [bitsce]="$BITS --schedule overlapped --link-transport copy_engine"
  [bitsblk2]="$BITS --schedule blocking $PG")
left() { echo $(( ${BUDGET:-470} - ($(date +%s) - T0) )); }
lane() {  # lane GPUS RUN...: each run bounded by what is left of BUDGET, none started with < 150 s
  local g=$1 b; shift
  for r in "$@"; do
    b=$(left); [ "$b" -ge 150 ] || { echo "$r: not started, ${b} s left" >> "$W/$r/skipped.txt"; continue; }
    CUDA_VISIBLE_DEVICES=$g OUT=$W/$r BENCH_GPU2_ARGS="${ARGS[$r]} --time-budget $(( b - 20 )) --config-timeout 75" \
      BENCH_GPU2_TIMEOUT=$(( b + 40 )) "${PIN[@]}" bash bench/run_gpu2.sh > /dev/null 2>&1
  done
}
PIN=("${LOW[@]}")
if [ "${RESIDENT:-0}" = 1 ]; then
  CUDA_VISIBLE_DEVICES=0,1 PYTHONPATH=/tmp/site:. DS_ACCELERATOR=cuda "${LOW[@]}" timeout -k 10 150 \
    python3 bench/resident_link.py --out "$W/resident/resident_link.json" > "$W/resident/resident_link.log" 2>&1
fi
if [ -z "${LANES:-}" ]; then
  if [ "$NGPU" -ge 4 ]; then LANES="0,1:blocking,m2bind,m2 2,3:cta1,cta4"; else LANES="0,1:blocking,cta1,m2bind,m2,cta4"; fi
fi
# Lane i of n gets the i-th n-th of the lower cores: --bind-cores splits what its driver may use, so
# lanes sharing one set would pin their ranks onto the same cores.
set -- $LANES; n=$#; per=$(( NCPU / 2 / n )); i=0; PIDS=()
for spec in $LANES; do
  runs=${spec#*:}
  [ ${#LOW[@]} -gt 0 ] && PIN=(taskset -c $(( i * per ))-$(( (i + 1) * per - 1 )))
  lane "${spec%%:*}" ${runs//,/ } & PIDS+=($!); i=$(( i + 1 ))
done
wait "${PIDS[@]}"
[ -n "${C:-}" ] && { wait "$C"; tail -3 "$W/corpus.log"; }
if [ -f "$W/bitsblk/gpu_two.json" ]; then
  python3 - "$W" > "$W/bitsblk/bits.txt" 2>&1 <<'PY'
import json, os, sys
w = sys.argv[1]
rows = {}
for run in ("bitsblk", "bitsce", "bitsblk2"):
    path = os.path.join(w, run, "gpu_two.json")
    if os.path.exists(path):
        for r in json.load(open(path))["results"]:
            rows[run, r["config"]] = (r.get("losses"), r.get("param_sha256"), [x.get("link_transport") for x in r.get("ranks", [])])
for config in sorted({c for _, c in rows}):
    base = rows.get(("bitsblk", config))
    for run in ("bitsce", "bitsblk2"):
        got = rows.get((run, config))
        if base and got:
            print(f"{config} {run} vs bitsblk: losses {'equal' if got[0] == base[0] else 'DIFFER'}, "
                  f"parameters {'equal' if got[1] == base[1] else 'DIFFER'} ({got[2]}); losses {got[0]} vs {base[0]}")
PY
fi
kill $L; pack
for d in $RUNS; do
  echo "== $d"; cat "$W/$d/skipped.txt" 2>/dev/null
  [ -f "$W/$d/gpu_two.log" ] && grep -E "ratio of medians|^a_|^b_|error|timeout" "$W/$d/gpu_two.log" | tail -12
  [ -f "$W/$d/resident_link.log" ] && tail -20 "$W/$d/resident_link.log"
  [ -f "$W/$d/bits.txt" ] && cat "$W/$d/bits.txt"
done
# Each run's outcome is printed above and packed; without this the status was the last test of
# the print loop (1 whenever the last run had no resident log), which read as a failed call.
exit 0
