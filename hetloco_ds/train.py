"""`hetloco-ds train`, one rank's part: validate, build, loop, checkpoint, export.

Everything that can be wrong with the user's input is checked before the output directory
is created, so a bad invocation exits non-zero having written nothing.
"""
from __future__ import annotations

import dataclasses
import json
import os
import sys
import time

import torch

from .config import ConfigError, RunConfig, check_topology, load_config
from .presets import model_config_for


@dataclasses.dataclass
class TrainArgs:
    config: str | None = None
    model: str | None = None
    model_config: str | None = None
    data: str | None = None
    out: str | None = None
    steps: int = 200
    resume: bool = False
    text_field: str = "text"
    tokenizer: str | None = None
    dtype: str | None = None


def default_out() -> str:
    return os.path.join("runs", time.strftime("%Y%m%d-%H%M%S"))


def prepare_inputs(args: TrainArgs, world_size: int):
    """Config, tokenizer, model config and corpus: everything checked before any rank starts.

    Hub ids in `args.model` / `args.tokenizer` are replaced in place by their local snapshot
    directories (every later reader of args needs a directory). The model config's `dtype` is
    the export dtype: `--dtype`, else the source checkpoint's, else none (weights as stored).
    """
    from . import convert, data

    run = load_config(args.config)
    check_topology(world_size, run.stages, run.source)
    seq_len = run.hetloco.train.seq_len
    dtype = convert.parse_dtype(args.dtype)
    if args.tokenizer is not None:
        given = args.tokenizer
        args.tokenizer = str(convert.resolve_hf_dir(given, "--tokenizer", convert.HUB_TOKENIZER_FILES))
        if not convert.tokenizer_files(args.tokenizer):
            raise ConfigError(f"--tokenizer {given}: no tokenizer files ({', '.join(convert.TOKENIZER_FILES[:4])}, ...)")
    if args.model is not None:
        given = args.model
        args.model = str(convert.resolve_hf_dir(given, "--model"))
        llama_config = convert.read_hf_config(args.model)
        convert.check_hf_dir(args.model, llama_config)  # shapes from headers, before any rank loads
        provenance = {"source_model": given}
        if not os.path.isdir(os.path.expanduser(given)):  # a Hub id: its snapshot folder is named by the commit
            provenance["source_revision"] = os.path.basename(args.model)
        setattr(llama_config, convert.PROVENANCE_KEY, provenance)
        llama_config.dtype = dtype or convert.weights_dtype(args.model) or llama_config.dtype
        if args.tokenizer is None:
            if not convert.tokenizer_files(args.model):
                raise ConfigError(f"--model {given} has no tokenizer files ({', '.join(convert.TOKENIZER_FILES[:4])}, "
                                  "...); pass --tokenizer DIR_OR_HUB_ID")
            args.tokenizer = args.model
        tokenizer = _load_tokenizer(args.tokenizer)
        if args.model_config is not None:
            wanted = model_config_for(args.model_config, llama_config.vocab_size)
            for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                        "intermediate_size", "vocab_size"):
                if getattr(wanted, key) != getattr(llama_config, key):
                    raise ConfigError(
                        f"--model {given} has {key} = {getattr(llama_config, key)} but --model-config "
                        f"{args.model_config} asks for {getattr(wanted, key)}"
                    )
    else:
        if args.tokenizer is not None:
            tokenizer = _load_tokenizer(args.tokenizer)
        else:
            tokenizer = data.default_tokenizer(vocab_size=run.hetloco.train.vocab_size)
        llama_config = model_config_for(args.model_config or "tiny", len(tokenizer))
        llama_config.dtype = dtype
    check_topology(world_size, run.stages, run.source, llama_config.num_hidden_layers)
    if len(tokenizer) > llama_config.vocab_size:
        raise ConfigError(f"tokenizer has {len(tokenizer)} tokens but the model's vocab_size is {llama_config.vocab_size}")
    corpus = data.load_corpus(args.data, tokenizer, seq_len, text_field=args.text_field)
    return run, llama_config, tokenizer, corpus


def _load_tokenizer(directory: str):
    """AutoTokenizer of a local directory; any failure is one ConfigError naming it."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(directory)
    except Exception as err:  # transformers raises ValueError, OSError, ImportError, ... for a bad directory
        detail = " ".join(str(err).split())
        raise ConfigError(f"cannot load a tokenizer from {directory}: {type(err).__name__}: {detail}") from None


def validation_batches(blocks: torch.Tensor, micro: int):
    """The held-out blocks in order, `micro` at a time, cycling: the same batches at every validation."""
    n = blocks.shape[0]
    start = 0
    while True:
        idx = torch.arange(start, start + micro) % n
        ids = blocks[idx].long()
        yield ids, ids.clone()
        start = (start + micro) % n


def run_rank(args: TrainArgs) -> int:
    """Body of one rank (launched by deepspeed, torchrun or our --nproc)."""
    from deepspeed import comm as dist

    from . import checkpoint, convert, data
    from .initialize import build_engine, build_module, init_distributed
    from .metrics import MetricsWriter, Progress, RunFacts

    world = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    os.environ.setdefault("LOCAL_RANK", "0")
    init_distributed()
    rank = dist.get_rank()
    # Local rank 0 builds tokenizer and token caches first; the others then read them.
    if local_rank != 0:
        dist.barrier()
    run, llama_config, tokenizer, corpus = prepare_inputs(args, world)
    if local_rank == 0:
        dist.barrier()
    out = args.out
    ckpt_dir = os.path.join(out, "checkpoints")
    torch.manual_seed(run.hetloco.train.seed)
    module = build_module(run, llama_config, hf_dir=args.model)
    engine = build_engine(run, module, seq_len=run.hetloco.train.seq_len)
    M, S = engine.num_replicas, engine.num_stages
    if rank == 0:
        os.makedirs(out, exist_ok=True)
        convert.save_hf_meta(ckpt_dir, llama_config, tokenizer, model_dir=args.model, tokenizer_dir=args.tokenizer)
        with open(os.path.join(out, "run_config.json"), "w") as f:
            json.dump({"ds": run.ds, "hetloco": run.hetloco.model_dump(), "stages": S, "replicas": M,
                       "model": llama_config.to_dict(), "data": corpus.description}, f, indent=2, default=str)
    dist.barrier()

    position = 0
    if args.resume and checkpoint.latest_tag(ckpt_dir) is not None:
        position = checkpoint.load(engine, ckpt_dir)
    micro = engine.micro_batch_size
    batches = data.ReplicaBatches(corpus.train, engine.replica, M, micro, seed=run.hetloco.train.seed, position=position)
    needs_data = engine.is_first_stage() or engine.is_last_stage()

    H = run.hetloco.sparseloco.inner_steps if run.hetloco.sparseloco.enabled else 1
    writes = engine.is_last_stage()
    facts = RunFacts.from_engine(engine)
    writer = MetricsWriter(os.path.join(out, "metrics.jsonl") if writes else None, facts)
    progress = Progress(total=args.steps, initial=engine.local_steps, enabled=(rank == 0), monitor=engine.monitor,
                        facts=facts)
    eval_every = run.hetloco.train.eval_interval
    next_eval = (engine.local_steps // eval_every + 1) * eval_every if eval_every else None
    ckpt_every = run.hetloco.train.checkpoint_interval * H

    validated_at = None

    def validate(step: int) -> None:
        nonlocal validated_at
        validated_at = step
        # The synced model is the same on every replica, so replica 0 alone evaluates it.
        if engine.replica != 0:
            return
        loss = engine.evaluate(validation_batches(corpus.val, micro) if needs_data else None,
                               run.hetloco.train.eval_batches)
        if engine.is_last_stage():
            writer.write({"kind": "validation", "step": step, "replica": 0, "loss": loss, "time": time.time()})
        loss_t = torch.tensor([loss or 0.0], dtype=torch.float64, device=engine.device)
        if S > 1:
            dist.broadcast(loss_t, src=engine.grid.stage_to_global(S - 1), group=engine.pipe_group)
        progress.validation(step, float(loss_t))

    try:
        while engine.local_steps < args.steps:
            # The last step always ends with an outer sync, so the export and the final
            # validation see the synced model even when steps is not a multiple of H.
            last = engine.local_steps + 1 == args.steps
            rec = engine.train_batch(batches if needs_data else None, force_outer=last)
            at_boundary = rec.outer is not None or not engine.algorithm.sparseloco
            writer.step(rec)
            progress.update(rec)
            if next_eval is not None and at_boundary and rec.step >= next_eval:
                validate(rec.step)
                next_eval = (rec.step // eval_every + 1) * eval_every
            if ckpt_every and at_boundary and rec.step % ckpt_every == 0 and rec.step < args.steps:
                checkpoint.save(engine, ckpt_dir, rec.step, batches.position)
        if validated_at != engine.local_steps:  # also at --steps 0
            validate(engine.local_steps)
        checkpoint.save(engine, ckpt_dir, engine.local_steps, batches.position)
    finally:
        progress.close()
        writer.close()
    dist.barrier()
    if rank == 0:
        convert.export(ckpt_dir, os.path.join(out, "hf"), overwrite=True)
        print(f"[hetloco] exported Hugging Face model to {os.path.join(out, 'hf')}", flush=True)
    dist.barrier()
    return 0


def main_rank(args: TrainArgs) -> int:
    try:
        return run_rank(args)
    except (ConfigError, ValueError, FileNotFoundError) as err:
        print(f"hetloco-ds train: error: {err}", file=sys.stderr, flush=True)
        return 2
