# Shared preamble of the GPU bench scripts: sourced (not run) by bench/run_gpu.sh, run_gpu2.sh and
# run_gpu4.sh and run_tables.sh. One copy of the link settings, the wheel install and
# the environment check, so a fix to them (a new pin, a new env switch) reaches every device call.
#
#   source "$(dirname "$0")/_gpu_env.sh"
#   bench_begin run_gpu2 /tmp/bench_smoke_out2     # repo root, SMOKE, OUT, $OUT/run_gpu2.log, stamp
#   if [ "$SMOKE" = 1 ]; then bench_smoke_path; else bench_install_wheels || exit 1; bench_nvidia_smi topo; fi
#   stamp "environment"; bench_env_check 2 || exit 1
#   ... | bench_quiet | tee "$OUT/x.log"; bench_end "$rc"   # DeepSpeed noise dropped; ls $OUT, final status
#
# Sourcing it sets pipefail and exports the link settings below; everything else is a function.
set -o pipefail

# NVLink multicast stays off (KINDS.md); logs are live (unbuffered), tokenizers never fork-warn.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false

BENCH_TAG=${BENCH_TAG:-bench}
BENCH_START=${BENCH_START:-$(date +%s)}

# "[tag] <seconds since bench_begin> s: message", so a log shows where a device call's time went.
stamp() { echo "[$BENCH_TAG] $(( $(date +%s) - BENCH_START )) s: $*"; }

# bench_begin TAG SMOKE_OUT: cd to the repo root; SMOKE from BENCH_SMOKE (1 = this CPU, tiny shapes, no
# wheels); OUT required on the device (SMOKE_OUT by default in smoke mode); everything from here on also
# goes to $OUT/TAG.log; the stamp clock starts.
bench_begin() {
  BENCH_TAG=$1
  cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1
  SMOKE=${BENCH_SMOKE:-0}
  if [ "$SMOKE" = 1 ]; then OUT=${OUT:-$2}; fi
  : "${OUT:?OUT must be set}"
  mkdir -p "$OUT"
  exec > >(tee -a "$OUT/$BENCH_TAG.log") 2>&1
  BENCH_START=$(date +%s)
}

# Smoke mode: the package from this checkout, with whatever is installed here.
bench_smoke_path() {
  export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH}
}

# bench_install_wheels [WHEELS_S [OPT_S]]: device mode. The carried .whl/*.whl into /tmp/site (the image's
# own packages stay untouched), plus .whl/opt/*.whl only when the image's typing_extensions is older
# than pydantic 2.13 needs (4.14.1); each pip bounded by WHEELS_S / OPT_S seconds when given. Sets
# PYTHONPATH=/tmp/site:. and DS_ACCELERATOR=cuda (DeepSpeed told its accelerator, not left to guess).
bench_install_wheels() {
  # BENCH_WHEELS_INSTALLED=1: an earlier step of the same device call installed them (two benches side
  # by side must not both pip-install into /tmp/site while the other's processes import from it).
  if [ "${BENCH_WHEELS_INSTALLED:-0}" = 1 ]; then export DS_ACCELERATOR=cuda PYTHONPATH=/tmp/site:.; return 0; fi
  local t1=() t2=()
  [ -n "${1:-}" ] && t1=(timeout -k 5 "$1")
  [ -n "${2:-}" ] && t2=(timeout -k 5 "$2")
  export DS_ACCELERATOR=cuda
  stamp "installing wheels"
  "${t1[@]}" python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || { stamp "wheel install failed"; return 1; }
  if ! python3 -c "import sys, importlib.metadata as m; v = tuple(int(x) for x in m.version('typing_extensions').split('.')[:3]); sys.exit(v < (4, 14, 1))"; then
    stamp "image typing_extensions too old: installing .whl/opt"
    "${t2[@]}" python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/site .whl/opt/*.whl || { stamp ".whl/opt install failed"; return 1; }
  fi
  export PYTHONPATH=/tmp/site:.
}

# bench_nvidia_smi [topo]: the cards (and with "topo" how they are linked) into $OUT/nvidia-smi.txt.
bench_nvidia_smi() {
  timeout 20 nvidia-smi 2>&1 | tee "$OUT/nvidia-smi.txt"
  if [ "${1:-}" = topo ]; then timeout 20 nvidia-smi topo -m 2>&1 | tee -a "$OUT/nvidia-smi.txt"; fi
  return 0
}

# bench_env_check [NEED_GPUS [SECONDS]]: versions and paths of what the benches import, the cards, NCCL
# and the link settings, into $OUT/env.txt; fails (before any bench starts) when a package does not
# import as torch, or fewer than NEED_GPUS cards are visible. Bounded by SECONDS when given.
bench_env_check() {
  local t=()
  [ -n "${2:-}" ] && t=(timeout -k 5 "$2")
  BENCH_NEED_GPUS=${1:-0} "${t[@]}" python3 - <<'EOF' 2>&1 | tee "$OUT/env.txt"
import importlib, os, sys
print("python", sys.version.split()[0], sys.executable)
for name in ("torch", "transformers", "deepspeed", "pydantic", "pydantic_core", "hjson", "typing_extensions", "triton"):
    try:
        mod = importlib.import_module(name)
        print(f"{name:18} {getattr(mod, '__version__', '?'):12} {getattr(mod, '__file__', '')}")
    except Exception as err:  # noqa: BLE001
        print(f"{name:18} MISSING: {err}")
import torch
n = torch.cuda.device_count() if torch.cuda.is_available() else 0
print("cuda available", torch.cuda.is_available(), torch.version.cuda, "devices", n,
      [torch.cuda.get_device_name(i) for i in range(n)])
if n:
    print("nccl", torch.cuda.nccl.version())
for k in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS", "DS_ACCELERATOR"):
    print(k, os.environ.get(k))
need = int(os.environ.get("BENCH_NEED_GPUS", "0"))
if n < need:
    sys.exit(f"need {need} GPUs, found {n}")
EOF
  [ "${PIPESTATUS[0]}" = 0 ] || { stamp "environment check failed"; return 1; }
}

# stdin to stdout less DeepSpeed's per-optimizer memory prints and its layer listings (log noise).
bench_quiet() {
  grep --line-buffered -v -E '^(CPU Virtual Memory|MA [0-9.]+ GB|\s+[0-9]+: [A-Za-z]+$)'
}

# bench_end RC [NOTE]: what $OUT now holds, the closing stamp; returns 0 only when RC is 0.
bench_end() {
  ls -la "$OUT"
  stamp "done${2:+ ($2)}"
  [ "$1" = 0 ]
}
