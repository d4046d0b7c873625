"""The paper's Tables 1, 2, 4 and 5a in shape, at small scale, with the simulator on one GPU.

M = 8 replicas x S = 4 virtual stages, H = 50, a LLaMA of ~20M parameters on the embedded
corpus (the Python standard library, BPE 8192, carried as a pre-tokenised tensor file so
the GPU machine needs no `datasets`), the same token budget for every row. Each finished
row is appended to the JSON at once, so a call that runs out of time keeps what it did.

    python bench/paper_tables.py --data .benchdata/stdlib_bpe8192_seq256.pt --seeds 0 \
        --steps 300 --out $OUT/paper_tables_seed0.json
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from hetloco_ds.config import parse_config  # noqa: E402
from hetloco_ds.data import Corpus  # noqa: E402
from hetloco_ds.presets import model_config_for  # noqa: E402
from hetloco_ds.simulate import degradation_table, parse_variants, simulate_variant  # noqa: E402

# Rows in priority order: Table 1/2 (uniform vs het at three ratios), Table 4 (AdamW H=1),
# Table 5a (embedding adaptation off).
DEFAULT_ROWS = ("sparseloco,pp:8,het:8,pp:24,het:24,pp:96,het:96,adamw,adamw-pp:8,adamw-het:8,"
                "pp:8:noadapt,het:8:noadapt")


def run_config(steps: int, micro: int, lr: float, seq_len: int, bf16: bool) -> dict:
    return {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "bf16": {"enabled": bf16},
        "optimizer": {"type": "AdamW", "params": {"lr": lr, "betas": [0.9, 0.95], "weight_decay": 0.1}},
        "scheduler": {"type": "WarmupCosineLR",
                      "params": {"total_num_steps": steps, "warmup_num_steps": max(1, steps // 10),
                                 "warmup_min_ratio": 0.0, "cos_min_ratio": 0.1}},
        "hetloco": {"sparseloco": {"inner_steps": 50, "outer_lr": 1.0, "error_decay": 0.95, "topk": 32},
                    "train": {"seq_len": seq_len, "eval_batches": 16, "seed": 0}},
    }


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True, help="torch file with int32 'train'/'val' blocks [N, seq]")
    p.add_argument("--model", default="20M")
    p.add_argument("--replicas", type=int, default=8)
    p.add_argument("--stages", type=int, default=4)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--micro", type=int, default=8)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--rows", default=DEFAULT_ROWS)
    p.add_argument("--seeds", default="0,1")
    p.add_argument("--budget-s", type=float, default=540, help="start no new row after this many seconds")
    p.add_argument("--out", required=True)
    p.add_argument("--device", default="cuda")
    args = p.parse_args()

    blob = torch.load(args.data)
    corpus = Corpus(train=blob["train"], val=blob["val"], description=blob["description"], cache_path=args.data)
    seq_len = corpus.train.shape[1]
    run = parse_config(run_config(args.steps, args.micro, args.lr, seq_len, bf16=args.device == "cuda"))
    llama = model_config_for(args.model, blob["vocab_size"])
    variants = parse_variants(args.rows.split(","), args.replicas, [int(s) for s in args.seeds.split(",")])
    device = torch.device(args.device)
    card = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    results, start = [], time.perf_counter()
    for v in variants:
        if time.perf_counter() - start > args.budget_s:
            print(f"budget reached; skipping {v.name}", flush=True)
            continue
        r = simulate_variant(run, v, llama, corpus, args.replicas, args.stages, args.steps, device, progress=False)
        r.pop("replica_losses")
        results.append(r)
        print(f"{v.name:<24} val {r['val_loss']:.4f} train {r['final_train_loss']:.4f} ({r['seconds']:.0f}s)", flush=True)
        rows = degradation_table(results)
        doc = {
            "card": card, "torch": torch.__version__, "command": " ".join(sys.argv),
            "model": args.model, "model_config": llama.to_dict(), "replicas": args.replicas, "stages": args.stages,
            "steps": args.steps, "inner_steps": 50, "micro_batch": args.micro, "seq_len": seq_len, "lr": args.lr,
            "tokens_per_row": args.steps * args.micro * seq_len * args.replicas, "data": corpus.description,
            "rows": rows,
        }
        tmp = args.out + ".tmp"
        with open(tmp, "w") as f:
            json.dump(doc, f, indent=1, default=str)
        os.replace(tmp, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
