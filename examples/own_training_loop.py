"""Your own training loop on hetloco_ds's public API, as you would write it with deepspeed.initialize.

Launch it like any DeepSpeed script, one process per GPU (on CPU, gloo):

    torchrun --nproc_per_node 4 examples/own_training_loop.py --model ./llama-hf --data corpus.txt \
        --config examples/heterogeneous_fleet/rehearsal.json --out runs/mine

Every rank builds the engine from the same model and config; each keeps only its pipeline stage
(rehearsal.json: 2 stages x 2 replicas, replica 1 compressed). `training_data` goes through the
same pipeline as `hetloco-ds train --data` (a text file, a folder, a dataset name, or a
datasets.Dataset): the first and last stage of a replica read the same batches, the replicas
read different shards.
"""
import argparse

from transformers import AutoTokenizer

import hetloco_ds


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True, help="a save_pretrained directory or Hub id")
    p.add_argument("--data", required=True, help="what `hetloco-ds train --data` takes: text files, a folder, a dataset")
    p.add_argument("--config", required=True, help="DeepSpeed JSON with a hetloco section")
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=100)
    args = p.parse_args()

    engine, optimizer, loader, scheduler = hetloco_ds.initialize(model=args.model, config=args.config,
                                                                 training_data=args.data)
    for step in range(1, args.steps + 1):
        loss = engine.train_batch()  # one local AdamW step on this replica's shard; every H-th also syncs the replicas
        if engine.global_rank == 0:
            print(f"step {step} loss {loss.item():.4f} lr {engine.get_lr()[0]:.3g}", flush=True)
    engine.save_checkpoint(f"{args.out}/checkpoints")  # every replica's whole state, atomically
    if not engine.replicas_synced():  # steps is not a multiple of H: the replicas differ until they sync
        engine.outer_step()
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    engine.save_pretrained(f"{args.out}/hf", tokenizer=tokenizer)  # loads with transformers as is


if __name__ == "__main__":
    main()
