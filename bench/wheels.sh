#!/usr/bin/env bash
# The wheels a GPU machine without internet needs beside its image's torch and transformers, into
# .whl/ (ignored by git; name it in the device tool's `carry`): DeepSpeed (built here, it ships as
# an sdist), pydantic for its config, torchft and what it imports (elastic mode and its tests), torchao
# (hetloco.train.optimizer_state "bf16" and "8bit"), Liger's kernels (bench/loss_chunk.py compares its fused
# linear + cross-entropy with ours; the image's triton runs them).
# bench/gpu.sh installs them into /tmp/site there. For CPython 3.12 on x86-64 (the machines' image).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
mkdir -p .whl
GET=(python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp
     --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl)
"${GET[@]}" pydantic==2.13.4 pydantic_core==2.46.4 annotated-types==0.8.0 typing-inspection==0.4.5 hjson==3.1.0 \
  torchft==0.2.0 opentelemetry-api==1.45.2 opentelemetry-sdk==1.45.2 opentelemetry-semantic-conventions==0.66b2 \
  opentelemetry-exporter-otlp-proto-http==1.45.2 opentelemetry-exporter-otlp-proto-common==1.45.2 \
  opentelemetry-proto==1.45.2 opentelemetry-exporter-http-transport==0.66b2 opentelemetry-exporter-otlp-common==0.66b2 \
  googleapis-common-protos==1.76.0 protobuf==7.36.2 torchao==0.18.0 liger-kernel==0.8.5
[ -n "$(ls .whl/deepspeed-0.19.8-*.whl 2> /dev/null)" ] || python3 -m pip wheel -q --no-deps deepspeed==0.19.8 -w .whl
ls .whl
