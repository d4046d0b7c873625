#!/usr/bin/env bash
# Fine-tune a Hugging Face LLaMA checkpoint on your text and export it back to Hugging Face format.
#
#   MODEL=./llama-hf DATA=./texts/ bash examples/finetune_and_export.sh
#
# MODEL: a save_pretrained directory or Hub id; DATA: text/jsonl/parquet files or a folder, or a
# dataset name; CONFIG: a DeepSpeed JSON with a hetloco section (default: the CPU one); NPROC: ranks
# on this machine (default 4: 2 stages x 2 replicas); STEPS; OUT.
set -euo pipefail
: "${MODEL:?MODEL must name an HF directory or Hub id}" "${DATA:?DATA must name your text}"
OUT=${OUT:-runs/finetune}
hetloco-ds train --model "$MODEL" --data "$DATA" ${CONFIG:+--config "$CONFIG"} --nproc "${NPROC:-4}" \
    --steps "${STEPS:-200}" --out "$OUT"
# The run already exported its last checkpoint to $OUT/hf; any other checkpoint exports like this,
# keeping the source's dtype, tokenizer, generation config and model card:
hetloco-ds export "$OUT/checkpoints" "$OUT/hf-latest"
python -c "from transformers import AutoModelForCausalLM; AutoModelForCausalLM.from_pretrained('$OUT/hf-latest'); print('loads:', '$OUT/hf-latest')"
