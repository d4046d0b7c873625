#!/usr/bin/env bash
# One batched call on a 2-GPU machine: the stage link (S = 2: ours uncompressed / ratio 8 / ratio 64 vs
# stock DeepSpeed) and the replica link (M = 2: SparseLoCo H = 50 vs stock DeepSpeed data parallel).
#
# Device tool:  command "bash bench/run_gpu2.sh", carry [".whl"], kind "nvidia-h100-x2", timeout_s 540.
# Expected ~3-4 min after the machine starts (6 configurations x ~25-35 s, each in 2 fresh processes);
# worst case ~7.5 min: gpu_two.py starts no configuration after 300 s, stops one after 120 s, and is
# itself stopped at 420 s (timeout signals its process group: the workers too).
# Writes into $OUT (5 files): nvidia-smi.txt, env.txt, gpu_two.json, gpu_two.log, run_gpu2.log.
#
# BENCH_SMOKE=1 bash bench/run_gpu2.sh   the same sequence on this CPU (gloo, tiny, seq 64), no wheel
# install (checks the script itself; OUT defaults to /tmp/bench_smoke_out2).
set -o pipefail
cd "$(dirname "$0")/.." || exit 1
SMOKE=${BENCH_SMOKE:-0}
if [ "$SMOKE" = 1 ]; then OUT=${OUT:-/tmp/bench_smoke_out2}; fi
: "${OUT:?OUT must be set}"
mkdir -p "$OUT"
exec > >(tee -a "$OUT/run_gpu2.log") 2>&1
start=$(date +%s)
stamp() { echo "[run_gpu2] $(( $(date +%s) - start )) s: $*"; }

# NVLink multicast stays off (KINDS.md); DeepSpeed told its accelerator, not left to guess.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
# gpu_two.py sets RANK / WORLD_SIZE / MASTER_PORT for each of its 2 worker processes itself.
unset RANK WORLD_SIZE LOCAL_RANK LOCAL_WORLD_SIZE MASTER_PORT

if [ "$SMOKE" = 1 ]; then
  export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH}
  ARGS="--cpu-smoke"; TIMEOUT=900
else
  export DS_ACCELERATOR=cuda
  stamp "installing wheels"
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  # pydantic 2.13 needs typing_extensions >= 4.14.1; carry ours only if the image's is older.
  if ! python3 -c "import sys, importlib.metadata as m; v = tuple(int(x) for x in m.version('typing_extensions').split('.')[:3]); sys.exit(v < (4, 14, 1))"; then
    stamp "image typing_extensions too old: installing .whl/opt"
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/opt/*.whl || exit 1
  fi
  export PYTHONPATH=/tmp/site:.
  nvidia-smi 2>&1 | tee "$OUT/nvidia-smi.txt"
  nvidia-smi topo -m 2>&1 | tee -a "$OUT/nvidia-smi.txt"
  ARGS="${BENCH_GPU2_ARGS:-}"; TIMEOUT=420
fi

stamp "environment"
python3 - <<'EOF' 2>&1 | tee "$OUT/env.txt"
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
if os.environ.get("DS_ACCELERATOR") == "cuda" and n < 2:
    sys.exit("need 2 GPUs")
EOF
[ "${PIPESTATUS[0]}" = 0 ] || { stamp "environment check failed"; exit 1; }

stamp "gpu_two.py (timeout ${TIMEOUT} s)"
# DeepSpeed's per-optimizer memory prints and the layer listings are dropped from the log.
timeout -k 15 "$TIMEOUT" python3 bench/gpu_two.py $ARGS --out "$OUT/gpu_two.json" 2>&1 \
  | grep --line-buffered -v -E '^(CPU Virtual Memory|MA [0-9.]+ GB|\s+[0-9]+: [A-Za-z]+$)' | tee "$OUT/gpu_two.log"
rc=$?
stamp "gpu_two.py rc=$rc"
ls -la "$OUT"
stamp "done"
[ "$rc" = 0 ]
