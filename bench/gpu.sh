#!/usr/bin/env bash
# Run one bench script on a GPU machine: the one place that knows how to prepare one.
#
#   OUT=/path/to/results bash bench/gpu.sh [--gpus N] [--timeout S] SCRIPT.py [ARGS...]
#   bash bench/gpu.sh --cpu SCRIPT.py --cpu-smoke [ARGS...]     # the same path on this CPU
#
# From the repository root of a checkout on the GPU machine; $OUT is where results go (the bench
# scripts write their JSON there unless given --out). In order:
#   1. packages, once nvidia-smi lists at least N GPUs (--gpus, default 1; fewer: it stops at once):
#      if .whl/ holds wheels (DeepSpeed and whatever else the machine's image lacks, e.g.
#      torchft for gpu_elastic.py), they are installed into /tmp/site (once per machine and set of
#      wheels: /tmp/site/.installed; concurrent calls wait on /tmp/site.lock), leaving the image's own
#      packages alone, plus .whl/opt/*.whl when the image's typing_extensions is older than pydantic
#      2.13 needs; PYTHONPATH is /tmp/site and this checkout. Without .whl/, what is installed is used.
#   2. environment: DS_ACCELERATOR=cuda (DeepSpeed told, not left to guess); NVLink multicast off
#      (NCCL_NVLS_ENABLE=0 and friends); unbuffered output.
#   3. a record of the machine in $OUT/env.txt (nvidia-smi, its topology, the versions and paths of
#      what the benches import); it stops here when fewer than N GPUs are visible to torch.
#   4. the bench: python3 bench/SCRIPT.py ARGS..., bounded by --timeout seconds (default 570; its
#      whole process group is signalled), its output also in $OUT/SCRIPT.log.
# `--pytest ARGS...` in place of SCRIPT.py runs python3 -m pytest ARGS... the same way (the GPU tier:
# `bash bench/gpu.sh --pytest -m gpu tests/gpu`; its record also lands in $OUT/gpu_last_run.json).
# --cpu: no wheels, no GPU check, this checkout's package with what is installed here; $OUT defaults
# to a temporary folder. On a GPU machine (BENCH_PACK=0 turns it off; BENCH_PACK=1 turns it on with
# --cpu) $OUT's files are also packed into $OUT/bench.tgz every 15 s (BENCH_PACK_EVERY) and at the
# end (written aside, then renamed): the lending machine gives back 8 files at most, none more than
# 2 folders down, and size_sweep.py's rows land 3 down ($OUT/one_pass/micro8/105M/).
# Exit status: the bench's (124 when the timeout stopped it), or 1 when the preparation failed.
set -o pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1

CPU=0; GPUS=1; LIMIT=570
while [ $# -gt 0 ]; do
  case "$1" in
    --cpu) CPU=1; GPUS=0; shift ;;
    --gpus) GPUS=$2; shift 2 ;;
    --timeout) LIMIT=$2; shift 2 ;;
    *) break ;;
  esac
done
SCRIPT=${1:?usage: bash bench/gpu.sh [--cpu] [--gpus N] [--timeout S] SCRIPT.py|--pytest [ARGS...]}; shift
if [ "$SCRIPT" = --pytest ]; then RUN=(python3 -m pytest); SCRIPT=pytest.py
else [ -f "bench/$SCRIPT" ] || { echo "bench/gpu.sh: no bench/$SCRIPT" >&2; exit 1; }; RUN=(python3 "bench/$SCRIPT"); fi
if [ "$CPU" = 1 ]; then OUT=${OUT:-$(mktemp -d /tmp/bench_XXXXXX)}; fi
: "${OUT:?OUT must name the folder for the results}"
mkdir -p "$OUT"
export OUT PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
NAME=${SCRIPT%.py}
T0=$(date +%s)
stamp() { echo "[gpu.sh] $(( $(date +%s) - T0 )) s: $*"; }

if [ "${BENCH_PACK:-$((1 - CPU))}" = 1 ]; then
  pack() {  # each pack its own part file: one cut off at the end never writes into the last one's
    local part rc
    part=$(mktemp "$OUT/.bench.tgz.XXXXXX") || return 1
    tar czf "$part" --warning=no-file-changed -C "$OUT" --exclude bench.tgz --exclude '.bench.tgz.*' .
    rc=$?
    # 1: a file changed while it was read (the log grows); the archive is whole, that file as it was
    if [ "$rc" -le 1 ]; then chmod 644 "$part"; mv -f "$part" "$OUT/bench.tgz"; else rm -f "$part"; return 1; fi
  }
  ( while sleep "${BENCH_PACK_EVERY:-15}"; do pack; done ) & PACKER=$!
  trap 'pkill -P $PACKER 2> /dev/null; kill $PACKER 2> /dev/null; wait $PACKER 2> /dev/null
        rm -f "$OUT"/.bench.tgz.*; pack' EXIT
fi

if [ "$CPU" = 1 ]; then
  export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH}
else
  export DS_ACCELERATOR=cuda PYTHONPATH=.
  # The machine's GPUs before any wheel: one with too few stops at once (the check after the
  # install also counts CUDA_VISIBLE_DEVICES, which nvidia-smi does not).
  FOUND=$(timeout 20 nvidia-smi -L 2> /dev/null | grep -c '^GPU ')
  if [ "${FOUND:-0}" -lt "$GPUS" ]; then echo "need $GPUS GPUs, found ${FOUND:-0}"; stamp "environment check failed"; exit 1; fi
  if compgen -G ".whl/*.whl" > /dev/null; then
    # Once per machine and set of wheels: several gpu.sh started together (one bench per GPU) take
    # turns on the lock, and the later ones find the stamp.
    WANT=$(ls -l .whl/*.whl .whl/opt/*.whl 2> /dev/null | awk '{print $5, $NF}' | md5sum | cut -d' ' -f1)
    mkdir -p /tmp/site
    exec 9> /tmp/site.lock
    flock -w 300 9 || { stamp "waited 300 s for another gpu.sh's install"; exit 1; }
    if [ "$(cat /tmp/site/.installed 2> /dev/null)" != "$WANT" ]; then
      stamp "installing .whl/ into /tmp/site"
      rm -f /tmp/site/.installed
      timeout -k 5 120 python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || { stamp "wheel install failed"; exit 1; }
      if ! PYTHONPATH=/tmp/site python3 -c "import sys, importlib.metadata as m
sys.exit(tuple(int(x) for x in m.version('typing_extensions').split('.')[:3]) < (4, 14, 1))" \
          && compgen -G ".whl/opt/*.whl" > /dev/null; then
        stamp "typing_extensions too old for pydantic: installing .whl/opt/"
        timeout -k 5 60 python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
          --target /tmp/site .whl/opt/*.whl || { stamp ".whl/opt install failed"; exit 1; }
      fi
      echo "$WANT" > /tmp/site/.installed
    fi
    exec 9>&-
    export PYTHONPATH=/tmp/site:.
  fi
  { timeout 20 nvidia-smi; timeout 20 nvidia-smi topo -m; } > "$OUT/env.txt" 2>&1
fi

BENCH_NEED_GPUS=$GPUS timeout -k 5 60 python3 - >> "$OUT/env.txt" 2>&1 <<'EOF'
import importlib.metadata as md, importlib.util, os, sys
print("python", sys.version.split()[0], sys.executable)
for name in ("torch", "transformers", "deepspeed", "pydantic", "typing_extensions", "torchft"):
    try:  # versions and paths without importing them (deepspeed alone takes seconds)
        print(f"{name:18} {md.version(name):12} {importlib.util.find_spec(name).origin}")
    except Exception as err:  # noqa: BLE001 - recorded; the bench that needs it fails on its own
        print(f"{name:18} missing: {err!r}")
import torch
n = torch.cuda.device_count() if torch.cuda.is_available() else 0
print("cuda", torch.version.cuda, "devices", n, [torch.cuda.get_device_name(i) for i in range(n)])
print({k: os.environ.get(k) for k in ("NCCL_NVLS_ENABLE", "DS_ACCELERATOR", "PYTHONPATH")})
need = int(os.environ["BENCH_NEED_GPUS"])
if n < need:
    sys.exit(f"need {need} GPUs, found {n}")
EOF
rc=$?
[ "$rc" = 0 ] || { tail -1 "$OUT/env.txt"; stamp "environment check failed"; exit 1; }

stamp "${RUN[*]} $* (timeout ${LIMIT} s)"
# DeepSpeed's per-optimizer memory prints and layer listings are dropped from the log.
timeout -k 10 "$LIMIT" "${RUN[@]}" "$@" 2>&1 \
  | { grep --line-buffered -v -E '^(CPU Virtual Memory|MA [0-9.]+ GB|\s+[0-9]+: [A-Za-z]+$)' || true; } | tee "$OUT/$NAME.log"
rc=${PIPESTATUS[0]}
stamp "${RUN[*]} exit $rc; results in $OUT"
exit "$rc"
