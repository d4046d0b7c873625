#!/usr/bin/env bash
# The one-pass size sweep (issue 32) on a 4-GPU machine, as one device call of two lanes that keep
# every GPU busy where `size_sweep.py run --model 20M,60M,105M` would idle three GPUs at each size's
# last row:
#   lane A, GPUs 0,1: 105M's first seven rows, two GPUs a row; then 105M's second seed, then 20M's
#   lane B, GPUs 2,3: 20M and 60M, one GPU a row; 105M's two 1/96 rows, two GPUs a row; then 60M's
#                     second seed
# (20M's second seed follows 105M's so that the last rows, 105M's and 60M's seed 1, run side by side.)
# Each `size_sweep.py run` skips the rows finished under runs/one_pass_keep (this call's, earlier
# calls' on the same machine, and those committed under bench/results/size_sweep/one_pass) and
# resumes the ones a budget stopped, so the same command, called again while the machine is warm,
# goes on where the last one stopped. A call that gets a fresh machine has only the carried tree's
# rows: copy each call's finished JSONs under bench/results/size_sweep/one_pass before the next.
#
#   OUT=$OUT bash bench/one_pass_lanes.sh SECONDS TAG
#
# SECONDS: when every lane stops (from now, the device call's limit less a margin); TAG: a name for
# this call's JSONs, new each call (a repeated tag would overwrite an earlier call's rows).
# Everything under runs/one_pass_keep is packed into $OUT/res.tgz at the end.
set -o pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1
SECONDS_LEFT=${1:?usage: OUT=... bash bench/one_pass_lanes.sh SECONDS TAG}; TAG=${2:?a tag for this call}
: "${OUT:?OUT must name the folder for the packed results}"
KEEP=runs/one_pass_keep; DATA=runs/size_sweep_corpus_seq256.pt
ENDED='val [0-9]|saved at'  # paper_tables' line for a row that finished or was saved
DEADLINE=$(( $(date +%s) + SECONDS_LEFT ))
mkdir -p "$KEEP/logs" "$KEEP/one_pass" "$OUT"
# Rows in the carried tree (committed, or copied in after an earlier call) count as done here too.
[ -d bench/results/size_sweep/one_pass ] && cp -rn bench/results/size_sweep/one_pass/. "$KEEP/one_pass/"
ROWS=$(python3 -c "import sys; sys.path.insert(0, 'bench'); import size_sweep as s; print(' '.join(s.first_seed_rows('105M')))")
read -r -a R <<< "$ROWS"
A_ROWS=$(IFS=,; echo "${R[*]:0:7}"); B_ROWS=$(IFS=,; echo "${R[*]:7}")

sweep() {  # sweep GPUS NAME ARGS...: one size_sweep run within what is left of the call
  local gpus=$1 name=$2; shift 2
  local left=$(( DEADLINE - $(date +%s) ))
  [ "$left" -gt 90 ] || { echo "[$name] not started: ${left} s left"; return 0; }
  CUDA_VISIBLE_DEVICES=$gpus OUT=$KEEP/logs/$TAG$name bash bench/gpu.sh --gpus 2 --timeout $(( left + 20 )) \
    size_sweep.py run --one-pass --budget-s "$left" --out "$KEEP" --results "$KEEP/one_pass" --tag "$TAG$name" "$@" \
    > "$KEEP/logs/$TAG$name.txt" 2>&1
  echo "[$name] exit $? after $(( $(date +%s) - DEADLINE + SECONDS_LEFT )) s: $(grep -E "$ENDED" "$KEEP/logs/$TAG$name.txt" | wc -l) rows ended or saved"
}

lane_b() {
  sweep 2,3 b --model 20M,60M                               # builds the corpus when this machine has none
  sweep 2,3 c --model 105M --gpus-per-row 2 --rows "$B_ROWS"
  sweep 2,3 f --model 60M --seeds 1
}
lane_a() {
  for _ in $(seq 300); do [ -f "$DATA" ] && break; sleep 1; done  # lane B's corpus (written aside, then renamed)
  [ -f "$DATA" ] || { echo "[a] no corpus after 300 s"; return 1; }
  sweep 0,1 a --model 105M --gpus-per-row 2 --rows "$A_ROWS"
  sweep 0,1 e --model 105M --gpus-per-row 2 --seeds 1
  sweep 0,1 d --model 20M --seeds 1
}
lane_b & B=$!
lane_a & A=$!
wait $A $B
grep -hE "$ENDED" "$KEEP"/logs/"$TAG"*.txt
tar czf "$OUT/res.tgz" -C "$KEEP" .
