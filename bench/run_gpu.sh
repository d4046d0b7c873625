#!/usr/bin/env bash
# One batched GPU call: throughput of the three systems, then the outer step's cost.
#
# Device tool:  command "bash bench/run_gpu.sh", carry [".whl"], timeout_s 570.
# Worst case ~8 min (hard per-script timeouts 320 s + 130 s), expected ~5 min after the machine starts.
# Writes into $OUT (at most 7 files): nvidia-smi.txt, env.txt, gpu_throughput.{json,log},
# outer_step.{json,log}, run_gpu.log.
#
# BENCH_SMOKE=1 bash bench/run_gpu.sh   runs the same sequence on this CPU with tiny shapes and
# no wheel install (checks the script itself; OUT defaults to /tmp/bench_smoke_out).
set -o pipefail
cd "$(dirname "$0")/.." || exit 1
SMOKE=${BENCH_SMOKE:-0}
if [ "$SMOKE" = 1 ]; then OUT=${OUT:-/tmp/bench_smoke_out}; fi
: "${OUT:?OUT must be set}"
mkdir -p "$OUT"
exec > >(tee -a "$OUT/run_gpu.log") 2>&1
start=$(date +%s)
stamp() { echo "[run_gpu] $(( $(date +%s) - start )) s: $*"; }

# NVLink multicast stays off (KINDS.md); DeepSpeed told its accelerator, not left to guess.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
export MASTER_ADDR=127.0.0.1 MASTER_PORT=29511 RANK=0 WORLD_SIZE=1 LOCAL_RANK=0 LOCAL_WORLD_SIZE=1

if [ "$SMOKE" = 1 ]; then
  export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH}
  TP_ARGS="--cpu-smoke"; OS_ARGS="--cpu-smoke"; TP_TIMEOUT=600; OS_TIMEOUT=300
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
  TP_ARGS="${BENCH_TP_ARGS:---time-budget 190}"; OS_ARGS=""; TP_TIMEOUT=320; OS_TIMEOUT=130
fi

stamp "environment"
python3 - <<'EOF' 2>&1 | tee "$OUT/env.txt"
import importlib, sys
print("python", sys.version.split()[0], sys.executable)
for name in ("torch", "transformers", "deepspeed", "pydantic", "pydantic_core", "hjson", "typing_extensions", "triton"):
    try:
        mod = importlib.import_module(name)
        print(f"{name:18} {getattr(mod, '__version__', '?'):12} {getattr(mod, '__file__', '')}")
    except Exception as err:  # noqa: BLE001
        print(f"{name:18} MISSING: {err}")
import torch
print("cuda available", torch.cuda.is_available(), torch.version.cuda,
      torch.cuda.get_device_name(0) if torch.cuda.is_available() else "")
EOF
[ "${PIPESTATUS[0]}" = 0 ] || { stamp "environment check failed"; exit 1; }

stamp "gpu_throughput.py (timeout ${TP_TIMEOUT} s)"
timeout -k 10 "$TP_TIMEOUT" python3 bench/gpu_throughput.py $TP_ARGS --out "$OUT/gpu_throughput.json" 2>&1 \
  | grep --line-buffered -v -E '^(CPU Virtual Memory|MA [0-9.]+ GB)' | tee "$OUT/gpu_throughput.log"
rc1=$?
stamp "gpu_throughput.py rc=$rc1"

stamp "outer_step.py (timeout ${OS_TIMEOUT} s)"
timeout -k 10 "$OS_TIMEOUT" python3 bench/outer_step.py $OS_ARGS --throughput-json "$OUT/gpu_throughput.json" \
  --out "$OUT/outer_step.json" 2>&1 | tee "$OUT/outer_step.log"
rc2=$?
stamp "outer_step.py rc=$rc2"

if [ "$SMOKE" != 1 ] && [ -f .benchdata/stdlib_bpe8192_seq256.pt ]; then
  stamp "simulator calibration for the paper tables (timeout 180 s)"
  timeout -k 5 180 python3 bench/paper_tables.py --data .benchdata/stdlib_bpe8192_seq256.pt --calibrate --procs 1,6 \
    --steps 20 --tag gpu --out "$OUT" 2>&1 | grep -v WARNING
  stamp "calibration rc=$?"
fi

ls -la "$OUT"
stamp "done (throughput rc=$rc1, outer rc=$rc2)"
[ "$rc1" = 0 ] && [ "$rc2" = 0 ]
