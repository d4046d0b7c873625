#!/usr/bin/env bash
# Several nodes through the deepspeed launcher and a hostfile. With ssh between the nodes, run
# this on the first node only; without ssh, run it on every node with NODE_RANK=0,1,...:
#
#   HOSTFILE=examples/multinode/hostfile MASTER_ADDR=node-a CONFIG=configs/gpu_512m.json \
#       bash examples/multinode/run.sh --model-config 512M --data my_corpus/ --out runs/512m
#
# (Our `--nproc` is for one machine; torchrun and `accelerate launch` work the same way.)
set -euo pipefail
: "${HOSTFILE:?HOSTFILE must name a hostfile}" "${CONFIG:?CONFIG must name a DeepSpeed JSON}"
ssh_args=()
[ -n "${NODE_RANK:-}" ] && ssh_args=(--no_ssh --node_rank "$NODE_RANK")
deepspeed --hostfile "$HOSTFILE" "${ssh_args[@]}" --master_addr "${MASTER_ADDR:-127.0.0.1}" \
    --master_port "${MASTER_PORT:-29500}" --module hetloco_ds.cli train --config "$CONFIG" "$@"
