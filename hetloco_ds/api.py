"""The public entry point, as `deepspeed.initialize` is DeepSpeed's: `hetloco_ds.initialize`."""
from __future__ import annotations

import copy
import os
from typing import Any, Mapping


def initialize(model: Any, config: Mapping | str | os.PathLike, *, seq_len: int | None = None):
    """This rank's HetlocoEngine: its pipeline stage of `model`, trained as `config` says.

    Call it in every rank of a job started by any launcher (deepspeed, torchrun, accelerate,
    `hetloco-ds train --nproc`); the process group is created from the launcher's environment if
    it does not exist yet. World size = pipeline.stages x replicas.

    model:  a transformers `LlamaForCausalLM` (every rank passes the same weights; each stage
            copies only its own layers), a `save_pretrained` directory, or a Hub model id
            (resolved through the local Hugging Face cache; each stage reads only its tensors).
    config: a DeepSpeed config dict or JSON path with a `hetloco` section (validated here: an
            unknown or bad key is one ConfigError naming it).
    seq_len: tokens per sample (default: hetloco.train.seq_len).

    The engine: `train_batch(data_iter)` runs one optimizer step of this replica (and, every H
    steps, the outer sync) and returns the replica's loss on every stage, as DeepSpeed's does;
    `eval_batch(data_iter, num_micro_batches)`; `save_checkpoint(dir)` / `load_checkpoint(dir)`
    with every replica's whole state (AdamW moments, error feedback, theta at the last sync,
    T_perp, counters), atomically across ranks; `save_pretrained(dir, tokenizer=None)` writes a
    directory `transformers` loads as is.
    """
    from . import convert
    from .config import ConfigError, load_config, parse_config
    from .initialize import build_engine, build_module, init_distributed

    if isinstance(config, Mapping):
        run = parse_config(dict(config), source="<config dict>")
    elif isinstance(config, (str, os.PathLike)):
        run = load_config(config)
    else:
        raise ConfigError(f"config must be a dict or a JSON path, got {type(config).__name__}")
    init_distributed()
    hf_dir, hf_state = None, None
    if isinstance(model, (str, os.PathLike)):
        hf_dir = str(convert.resolve_hf_dir(str(model), what="model"))
        llama_config = convert.read_hf_config(hf_dir)
    elif getattr(getattr(model, "config", None), "model_type", None) == "llama" and hasattr(model, "state_dict"):
        llama_config = copy.deepcopy(model.config)
        hf_state = model.state_dict()
    else:
        raise ConfigError(f"model must be a LlamaForCausalLM, a save_pretrained directory or a Hub id, "
                          f"got {type(model).__name__}")
    module = build_module(run, llama_config, hf_dir=hf_dir, hf_state=hf_state)
    engine = build_engine(run, module, seq_len=seq_len or run.hetloco.train.seq_len)
    engine.hf_source = hf_dir
    return engine
