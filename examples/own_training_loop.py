"""Your own training loop on hetloco_ds's public API, as you would write it with deepspeed.initialize.

Launch it like any DeepSpeed script, one process per GPU (on CPU, gloo):

    torchrun --nproc_per_node 4 examples/own_training_loop.py --model ./llama-hf --data corpus.txt \
        --config examples/heterogeneous_fleet/config.json --out runs/mine

Every rank builds the engine from the same model and config; each keeps only its pipeline stage.
The first and last stage of a replica read the same batches (seeded by the replica), the replicas
read different ones.
"""
import argparse

import torch
from transformers import AutoTokenizer

import hetloco_ds


def batches(path, tokenizer, seq_len, micro, seed):
    """(ids, labels) micro-batches of `seq_len` tokens drawn from one text file."""
    ids = tokenizer(open(path).read())["input_ids"]
    blocks = torch.tensor(ids[: len(ids) // seq_len * seq_len]).view(-1, seq_len)
    g = torch.Generator().manual_seed(seed)
    while True:
        pick = torch.randint(len(blocks), (micro,), generator=g)
        yield blocks[pick], blocks[pick]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True, help="a save_pretrained directory or Hub id")
    p.add_argument("--data", required=True, help="a text file")
    p.add_argument("--config", required=True, help="DeepSpeed JSON with a hetloco section")
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=100)
    args = p.parse_args()

    engine = hetloco_ds.initialize(model=args.model, config=args.config)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    data = batches(args.data, tokenizer, engine.seq_len, engine.micro_batch_size, seed=engine.replica)
    for step in range(1, args.steps + 1):
        loss = engine.train_batch(data)  # one local AdamW step; every H-th also syncs the replicas
        if engine.global_rank == 0:
            print(f"step {step} loss {loss.item():.4f}", flush=True)
    engine.save_checkpoint(f"{args.out}/checkpoints")  # every replica's whole state, atomically
    engine.save_pretrained(f"{args.out}/hf", tokenizer=tokenizer)  # loads with transformers as is


if __name__ == "__main__":
    main()
