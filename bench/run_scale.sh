#!/usr/bin/env bash
# bench/scale.py on the GPU machine: PARTS (default "profile") into $OUT/scale.json, with the logs,
# and the chrome traces of replica 0's two stages (ours and stock) packed into $OUT/traces.tgz.
#   PARTS=profile,speed BUDGET=560 bash bench/run_scale.sh        (device: carry .whl, nvidia-h100-x4)
source "$(dirname "$0")/_gpu_env.sh" || exit 1
bench_begin scale /tmp/bench_smoke_scale
BUDGET=${BUDGET:-560}
if [ "$SMOKE" = 1 ]; then bench_smoke_path; ARGS="--cpu-smoke"; else bench_install_wheels 90 60 || exit 1; bench_nvidia_smi topo; ARGS=""; fi
bench_env_check 0 60 || exit 1
left=$(( BUDGET - ($(date +%s) - BENCH_START) - 25 ))
stamp "scale.py --parts ${PARTS:-profile} (timeout ${left} s)"
timeout -k 10 "$left" python3 bench/scale.py $ARGS --parts "${PARTS:-profile}" --out "$OUT" ${SCALE_ARGS:-} 2>&1 | bench_quiet
rc=$?
traces=$(cd /tmp/hetloco_scale 2>/dev/null && find . -name 'rank[02].trace.json.gz' -size -5M | head -8)
[ -n "$traces" ] && tar czf "$OUT/traces.tgz" -C /tmp/hetloco_scale $traces
(cd /tmp/hetloco_scale 2>/dev/null && tar czf "$OUT/logs.tgz" *.log $(ls -d */metrics.jsonl 2>/dev/null))
bench_end "$rc"
