#!/usr/bin/env bash
# A heterogeneous fleet, sized by the cost model, rehearsed on one machine, then launched.
#
#   bash examples/heterogeneous_fleet/run.sh
#
# (STEPS, OUT, DATA: what --data takes, default the Python stdlib; LINKS=1 to shape the links.)
# 1. fleet.json describes three sites: 8 A100s in a datacenter, 8 RTX 4090s in a lab on 1 Gbit/s,
#    4 RTX 3090s at home on 100 Mbit/s. `plan --fleet --stages 2` puts every replica in 2 stages
#    (without --stages each group gets its own depth, the datacenter's 80 GB GPUs one replica each:
#    README, "Mixed topologies") and picks which groups run full replicas and which compress their
#    stage links, and at which ratio: for the 1B model M = 10 replicas (ranks stage x 10 + replica:
#    the datacenter hosts replicas 0-3, the lab 4-7, home 8-9), full tensors in the datacenter and
#    ratio 4 on the lab's and home's stage links, which config.json encodes.
# 2. rehearsal.json is the same mix at toy scale on this machine: 2 stages x 2 replicas, replica 1
#    compressed at ratio 4 (with LINKS=1, as root, its stage links shaped to 100 Mbit/s by netlab).
# 3. The real launch: every node runs the deepspeed launcher on the same hostfile (see ../multinode).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
hetloco-ds plan --fleet "$here/fleet.json" --model 1B --target 0.9 --n-mb 64 --stages 2
links=()
[ "${LINKS:-0}" = 1 ] && links=(--link stage=100mbit --link replica=1G)
hetloco-ds train --config "$here/rehearsal.json" --model-config tiny --nproc 4 --steps "${STEPS:-8}" \
    ${DATA:+--data "$DATA"} --out "${OUT:-runs/fleet-rehearsal}" "${links[@]}"
cat <<MSG
On the fleet (hostfile: one line per node, "host slots=GPUS", in rank order):
  deepspeed --hostfile hostfile --module hetloco_ds.cli train --config $here/config.json \\
      --model-config 1B --data YOUR_DATA --out runs/fleet
MSG
