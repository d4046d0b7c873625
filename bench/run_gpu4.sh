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
set -o pipefail
cd "$(dirname "$0")/.." || exit 1
SMOKE=${BENCH_SMOKE:-0}
if [ "$SMOKE" = 1 ]; then OUT=${OUT:-/tmp/bench_smoke_out4}; fi
: "${OUT:?OUT must be set}"
mkdir -p "$OUT"
exec > >(tee -a "$OUT/run_gpu4.log") 2>&1
start=$(date +%s)
stamp() { echo "[run_gpu4] $(( $(date +%s) - start )) s: $*"; }

# NVLink multicast stays off (KINDS.md); DeepSpeed told its accelerator, not left to guess.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
# gpu_four.py sets RANK / WORLD_SIZE / MASTER_PORT for each of its 4 worker processes itself.
unset RANK WORLD_SIZE LOCAL_RANK LOCAL_WORLD_SIZE MASTER_PORT

if [ "$SMOKE" = 1 ]; then
  export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH}
  ARGS="--cpu-smoke"; DEADLINE=${BENCH_GPU4_DEADLINE:-2700}; NEED=0
else
  export DS_ACCELERATOR=cuda
  DEADLINE=${BENCH_GPU4_DEADLINE:-255}; NEED=4
  stamp "installing wheels"
  timeout -k 5 60 python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || { stamp "wheel install failed"; exit 1; }
  # pydantic 2.13 needs typing_extensions >= 4.14.1; carry ours only if the image's is older.
  if ! python3 -c "import sys, importlib.metadata as m; v = tuple(int(x) for x in m.version('typing_extensions').split('.')[:3]); sys.exit(v < (4, 14, 1))"; then
    stamp "image typing_extensions too old: installing .whl/opt"
    timeout -k 5 30 python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/site .whl/opt/*.whl || exit 1
  fi
  export PYTHONPATH=/tmp/site:.
  timeout 20 nvidia-smi 2>&1 | tee "$OUT/nvidia-smi.txt"
  timeout 20 nvidia-smi topo -m 2>&1 | tee -a "$OUT/nvidia-smi.txt"
  ARGS="${BENCH_GPU4_ARGS:-}"
fi
export GPU4_NEED=$NEED

stamp "environment"
timeout -k 5 45 python3 - <<'EOF' 2>&1 | tee "$OUT/env.txt"
import importlib, os, sys
print("python", sys.version.split()[0], sys.executable)
for name in ("torch", "transformers", "deepspeed", "pydantic", "pydantic_core", "hjson", "typing_extensions"):
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
need = int(os.environ.get("GPU4_NEED", "0"))
if n < need:
    sys.exit(f"need {need} GPUs, found {n}")
EOF
[ "${PIPESTATUS[0]}" = 0 ] || { stamp "environment check failed"; exit 1; }

# What is left of DEADLINE: `timeout` gets it less 12 s (its kill grace 8 s + the ls below);
# gpu_four.py plans to end 10 s before its own timeout.
left=$(( DEADLINE - ($(date +%s) - start) - 12 ))
[ "$left" -gt 60 ] || { stamp "only ${left} s left; not starting gpu_four.py"; exit 1; }
stamp "gpu_four.py (timeout ${left} s)"
# DeepSpeed's per-optimizer memory prints and the layer listings are dropped from the log.
timeout -k 8 "$left" python3 bench/gpu_four.py $ARGS --deadline $(( left - 10 )) --out "$OUT/gpu_four.json" 2>&1 \
  | grep --line-buffered -v -E '^(CPU Virtual Memory|MA [0-9.]+ GB|\s+[0-9]+: [A-Za-z]+$)' | tee "$OUT/gpu_four.log"
rc=$?
stamp "gpu_four.py rc=$rc"
ls -la "$OUT"
stamp "done"
[ "$rc" = 0 ]
