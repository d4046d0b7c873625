"""`hetloco-ds simulate`: M replicas x S virtual stages in one process on one device.

Argument parsing, the inputs checked before any row starts, and results.json (written whole or
not at all); the rows themselves are `rows.simulate_variant`'s.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

from .. import sizes
from ..config import ConfigError, load_config
from .rows import degradation_table, format_table, parse_variants, simulate_variant


def _check_depths(run, args, num_layers: int) -> None:
    """`hetloco.replica_stages` (each replica's depth) against --replicas, --stages, the model and the simulator."""
    depths = run.hetloco.replica_stages
    if depths is None:
        return
    where = f"{run.source}: hetloco.replica_stages = {depths}"
    if len(depths) != args.replicas:
        raise ConfigError(f"{where} names {len(depths)} replicas; --replicas is {args.replicas}")
    if args.stages is not None:
        raise ConfigError(f"{where} gives each replica its depth; leave out --stages")
    for S in depths:
        sizes.stage_parts(num_layers, S)
    if len(set(depths)) > 1 and not args.per_replica:
        raise ConfigError(f"{where} mixes depths, which the batched simulator cannot vmap over; add --per-replica")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="hetloco-ds simulate", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", help="DeepSpeed JSON with a hetloco section (default: configs/cpu_tiny.json)")
    p.add_argument("--model-config", default="tiny", help="preset or JSON of LlamaConfig fields")
    p.add_argument("--data", help="as for train (default: the Python stdlib)")
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--stages", type=int, help="virtual stages (default: the config's pipeline.stages)")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--variants", default="sparseloco,pp:8,het:8",
                   help="comma-separated rows HEAD[:RATIO][:FLAG...]: sparseloco, pp:R, het:R, adamw, adamw-pp:R, "
                        "adamw-het:R, diloco; flags noadapt, wproj, stepproj, tsdecay, lr=X, or any sparseloco "
                        "field as KEY=VALUE")
    p.add_argument("--seeds", default="0")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", help="directory for results.json and metrics.jsonl")
    p.add_argument("--per-replica", action="store_true",
                   help="one module set per replica (the reference) instead of the replica-batched simulator")
    p.add_argument("--compile", action="store_true", help="torch.compile the batched simulator's stage functions")
    args = p.parse_args(argv)
    try:
        run = load_config(args.config)
        stages = args.stages or run.stages
        if args.replicas < 1 or args.steps < 1:
            raise ConfigError(f"--replicas {args.replicas} and --steps {args.steps} must be >= 1")
        seeds = [int(s) for s in args.seeds.split(",")]
        variants = parse_variants(args.variants.split(","), args.replicas, seeds)
        from ..corpus import default_tokenizer, load_corpus
        from ..presets import model_config_for

        tokenizer = default_tokenizer(vocab_size=run.hetloco.train.vocab_size)
        llama_config = model_config_for(args.model_config, len(tokenizer))
        sizes.stage_parts(llama_config.num_hidden_layers, stages)
        _check_depths(run, args, llama_config.num_hidden_layers)
        for v in variants:
            if v.ratio > 1:
                sizes.subspace_dim(llama_config.hidden_size, v.ratio)
        corpus = load_corpus(args.data, tokenizer, run.hetloco.train.seq_len)
    except (ConfigError, ValueError, FileNotFoundError) as err:
        print(f"hetloco-ds simulate: error: {err}", file=sys.stderr)
        return 2
    metrics = None
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        metrics = os.path.join(args.out, "metrics.jsonl")
    device = torch.device(args.device)
    results = [simulate_variant(run, v, llama_config, corpus, args.replicas, stages, args.steps, device, metrics,
                                batched=not args.per_replica, compile=args.compile)
               for v in variants]
    rows = degradation_table(results)
    print(format_table(rows))
    if args.out:
        tmp = os.path.join(args.out, "results.json.tmp")
        with open(tmp, "w") as f:
            json.dump({"config": run.source, "model": llama_config.to_dict(), "device": str(device),
                       "device_name": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                       "rows": rows}, f, indent=1, default=str)
        os.replace(tmp, os.path.join(args.out, "results.json"))
    return 0
