"""The public entry point, as `deepspeed.initialize` is DeepSpeed's: `hetloco_ds.initialize`."""
from __future__ import annotations

import copy
import os
from typing import Any, Mapping


def initialize(args=None, model: Any = None, optimizer=None, model_parameters=None, training_data=None,
               lr_scheduler=None, distributed_port: int | None = None, mpu=None, dist_init_required: bool | None = None,
               collate_fn=None, config: Mapping | str | os.PathLike | None = None, mesh_param=None,
               config_params: Mapping | str | os.PathLike | None = None, *, seq_len: int | None = None,
               tokenizer=None, text_field: str = "text"):
    """`(engine, optimizer, training_dataloader, lr_scheduler)` of this rank, as `deepspeed.initialize`
    returns them: the engine is this rank's pipeline stage of `model`, trained as `config` says.

    Call it in every rank of a job started by any launcher (deepspeed, torchrun, accelerate,
    `hetloco-ds train --nproc`); the process group is created from the launcher's environment if
    it does not exist yet. World size = pipeline.stages x replicas (or the sum of
    hetloco.replica_stages). Before any rank builds anything, the run is checked as `hetloco-ds
    train` checks it (`config.check_run`: topology, compressed replicas, ratios; the model's shapes;
    the tokenizer and the data): a bad value is one ConfigError naming it, raised on every rank.

    DeepSpeed's keywords:
    model:  a transformers `LlamaForCausalLM` (every rank passes the same weights; each stage
            copies only its own layers), a `save_pretrained` directory, or a Hub model id
            (resolved through the local Hugging Face cache; each stage reads only its tensors).
    config: a DeepSpeed config dict or JSON path with a `hetloco` section (validated here: an
            unknown or bad key is one ConfigError naming it); or `config_params`, or
            `args.deepspeed_config`, as DeepSpeed reads them. `args` also reaches the engine.
    training_data: this rank's replica's micro-batches, as `hetloco-ds train` reads them
            (`batches.ReplicaBatches`: each replica its own shard of a seeded permutation, every
            stage of a replica the same batches), set as the engine's data iterator (so
            `train_batch()` needs no argument) and returned as `training_dataloader`. It is a
            `--data` value (a path or a dataset name) or a `datasets.Dataset` with a text column
            `text_field`, tokenised by `tokenizer` (default: the model directory's) and packed
            into seq_len blocks as the CLI does; or any other map-style dataset (a torch Dataset,
            a tokenised `datasets.Dataset`), whose samples `collate_fn` (default: torch's
            default_collate) merges into (inputs, labels), a tensor of token blocks, or a mapping
            with input_ids.
    lr_scheduler: a callable optimizer -> scheduler, called on this rank's optimizer as DeepSpeed
            calls it (it then replaces the config's `scheduler`).
    distributed_port, dist_init_required: passed to DeepSpeed's process-group set-up.
    Refused, each with one line naming it: `optimizer` (the inner optimizer is the config's
    AdamW), `model_parameters` other than all of the model's parameters, a scheduler object
    (built on an optimizer this call creates), `mpu` (DeepSpeed's pipeline refuses it too),
    `mesh_param`.

    Ours: seq_len: tokens per sample (default: hetloco.train.seq_len); tokenizer: a tokenizer,
    or a directory or Hub id of one; text_field: the text column of jsonl/parquet/datasets rows.

    The engine: `train_batch(data_iter=None)` runs one optimizer step of this replica (and, every
    H steps, the outer sync) and returns the replica's loss on every stage, as DeepSpeed's does;
    `eval_batch(data_iter, num_micro_batches)`; `save_checkpoint(dir)` / `load_checkpoint(dir)`
    with every replica's whole state (AdamW moments, error feedback, theta at the last sync,
    T_perp, counters), atomically across ranks; `save_pretrained(dir, tokenizer=None)` writes the
    synced model as a directory `transformers` loads as is (refused between outer steps, where
    the replicas differ: `replicas_synced()`, `outer_step()`).
    """
    from . import convert
    from .build import build_engine, build_module, init_distributed
    from deepspeed import comm as dist

    from .config import ConfigError, check_run

    run = _run_config(args, config, config_params)
    _refuse_unsupported(optimizer=optimizer, lr_scheduler=lr_scheduler, mpu=mpu, mesh_param=mesh_param,
                        collate_fn=collate_fn, training_data=training_data)
    hf_dir, hf_state = None, None
    if isinstance(model, (str, os.PathLike)):
        hf_dir = str(convert.resolve_hf_dir(str(model), what="model"))
        llama_config = convert.read_hf_config(hf_dir)
        convert.check_hf_dir(hf_dir, llama_config)  # shapes from headers, before any rank loads
    elif getattr(getattr(model, "config", None), "model_type", None) == "llama" and hasattr(model, "state_dict"):
        llama_config = copy.deepcopy(model.config)
        hf_state = model.state_dict()
    else:
        raise ConfigError(f"initialize: model must be a LlamaForCausalLM, a save_pretrained directory or a Hub id, "
                          f"got {type(model).__name__}")
    _check_model_parameters(model_parameters, model if hf_state is not None else None)
    seq_len = seq_len or run.hetloco.train.seq_len
    init_distributed(distributed_port, dist_init_required)
    num_replicas = check_run(run, dist.get_world_size(), llama_config.hidden_size, llama_config.num_hidden_layers,
                             tied=bool(llama_config.tie_word_embeddings))
    samples = None
    if training_data is not None:
        samples = _on_every_rank(lambda: _training_samples(training_data, tokenizer, hf_dir, llama_config, seq_len,
                                                           text_field, run, num_replicas, collate_fn))
    module = build_module(run, llama_config, hf_dir=hf_dir, hf_state=hf_state)
    engine = build_engine(run, module, seq_len=seq_len, args=args, lr_scheduler=lr_scheduler)
    engine.hf_source = hf_dir
    loader = None
    if samples is not None:
        from .batches import ReplicaBatches

        loader = ReplicaBatches(samples, engine.replica, engine.num_replicas, engine.micro_batch_size,
                                seed=run.hetloco.train.seed, collate_fn=collate_fn)
        engine.set_dataloader(loader)  # the first and last stage read it (DeepSpeed's pipeline rule)
        engine.training_dataloader = loader
    return engine, engine.optimizer, loader, engine.lr_scheduler


def _run_config(args, config, config_params):
    """The RunConfig from `config`, `config_params` or `args.deepspeed_config`, as DeepSpeed picks."""
    from .config import ConfigError, load_config, parse_config

    if config is None:
        config = config_params
    from_args = getattr(args, "deepspeed_config", None) or getattr(args, "deepscale_config", None)
    if from_args is not None:
        if config is not None:
            raise ConfigError("initialize: got a config both in args.deepspeed_config and as config=; pass one")
        config = from_args
    if isinstance(config, Mapping):
        return parse_config(dict(config), source="<config dict>")
    if isinstance(config, (str, os.PathLike)):
        return load_config(config)
    raise ConfigError(f"initialize: config must be a dict or a JSON path, got {type(config).__name__}")


def _refuse_unsupported(*, optimizer, lr_scheduler, mpu, mesh_param, collate_fn, training_data) -> None:
    from .config import ConfigError

    if optimizer is not None:
        raise ConfigError("initialize: optimizer= is not supported: each replica's inner optimizer is AdamW over its "
                          "own stage, set by the config's optimizer section")
    if lr_scheduler is not None and (not callable(lr_scheduler) or hasattr(lr_scheduler, "step")):
        raise ConfigError(f"initialize: lr_scheduler= must be a callable optimizer -> scheduler (the optimizer is "
                          f"built here, per stage), got a {type(lr_scheduler).__name__} object")
    if mpu is not None:
        raise ConfigError("initialize: mpu= is not supported: the pipeline's topology comes from pipeline.stages "
                          "(DeepSpeed refuses an mpu with pipeline parallelism too)")
    if mesh_param is not None:
        raise ConfigError("initialize: mesh_param= (sequence parallelism) is not supported")
    if collate_fn is not None and training_data is None:
        raise ConfigError("initialize: collate_fn= merges samples of training_data=, and none was given")


def _check_model_parameters(model_parameters, model) -> None:
    """DeepSpeed optimises `model_parameters`; here every stage trains all of its parameters, so
    only all of the model's are accepted (what `model.parameters()` gives)."""
    from .config import ConfigError

    if model_parameters is None:
        return
    if model is None:
        raise ConfigError("initialize: model_parameters= names tensors of an in-memory model, but model= is a path")
    given = list(model_parameters)
    if any(isinstance(g, dict) for g in given):
        raise ConfigError("initialize: model_parameters= as parameter groups is not supported: one AdamW from the "
                          "config's optimizer section trains every parameter")
    ids, every = {id(p) for p in given}, {id(p) for p in model.parameters()}
    if ids != every:
        raise ConfigError(f"initialize: model_parameters= holds {len(ids & every)} of the model's {len(every)} "
                          f"parameters and {len(ids - every)} others; every stage trains all of its parameters")


def _on_every_rank(fn):
    """fn() on local rank 0, then on the other ranks (it may fill a cache they then read). A
    failure on any rank is raised on every rank, as the lowest failing rank's one line, so no
    rank is left waiting for the others in a collective."""
    from deepspeed import comm as dist

    from .config import ConfigError

    def attempt():
        try:
            return fn(), None
        except (ValueError, FileNotFoundError) as err:  # ConfigError and DataError are ValueErrors
            return None, str(err)

    local = int(os.environ.get("LOCAL_RANK", 0))
    if local != 0:
        dist.barrier()
    result, error = attempt()
    if local == 0:
        dist.barrier()
    errors: list = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    first = next((e for e in errors if e is not None), None)
    if first is not None:
        raise ConfigError(first)
    return result


def _training_samples(training_data, tokenizer, hf_dir, llama_config, seq_len, text_field, run, num_replicas,
                      collate_fn):
    """What `ReplicaBatches` draws from for `training_data`: packed token blocks (a `--data` value,
    a text dataset) or the map-style dataset itself; checked as the CLI checks `--data`, and its
    first micro-batch against the engine's shape."""
    from . import batches, corpus
    from .config import ConfigError

    samples = training_data
    if isinstance(training_data, (str, os.PathLike)) or _text_dataset(training_data, text_field):
        tok = _tokenizer(tokenizer, hf_dir, training_data)
        if len(tok) > llama_config.vocab_size:
            raise ConfigError(f"initialize: the tokenizer has {len(tok)} tokens but the model's vocab_size is "
                              f"{llama_config.vocab_size}")
        samples = corpus.load_corpus(training_data, tok, seq_len, text_field=text_field,
                                     progress=int(os.environ.get("RANK", 0)) == 0).train
    elif _is_hf_dataset(training_data):
        samples = training_data.with_format("torch")
    elif not (hasattr(training_data, "__len__") and hasattr(training_data, "__getitem__")):
        raise ConfigError(f"initialize: training_data= must be a --data value, a datasets.Dataset or a map-style "
                          f"dataset (len and [i]) to shard among replicas, got {type(training_data).__name__}")
    micro = run.micro_batch
    try:  # the replicas' streams, built as the ranks will build them (as plan_run checks --data)
        inputs, labels = batches.ReplicaBatches(samples, num_replicas - 1, num_replicas, micro, collate_fn=collate_fn).batch(0)
    except ValueError as err:
        raise ConfigError(f"initialize: training_data: {err}") from None
    for name, t in (("inputs", inputs), ("labels", labels)):
        if tuple(getattr(t, "shape", ())) != (micro, seq_len):
            raise ConfigError(f"initialize: training_data: a micro-batch's {name} have shape "
                              f"{tuple(getattr(t, 'shape', ()))}; the engine takes (train_micro_batch_size_per_gpu, "
                              f"seq_len) = ({micro}, {seq_len})")
    return samples


def _is_hf_dataset(x) -> bool:
    return type(x).__module__.split(".")[0] == "datasets" and hasattr(x, "column_names")


def _text_dataset(x, text_field: str) -> bool:
    return _is_hf_dataset(x) and text_field in x.column_names and "input_ids" not in x.column_names


def _tokenizer(tokenizer, hf_dir, training_data):
    """`tokenizer` (an object, or a directory or Hub id), else the model directory's."""
    from . import convert
    from .config import ConfigError
    from .corpus import load_tokenizer

    if tokenizer is not None and not isinstance(tokenizer, (str, os.PathLike)):
        return tokenizer
    if tokenizer is None:
        if hf_dir is None or not convert.tokenizer_files(hf_dir):
            where = "the model is in memory" if hf_dir is None else f"{hf_dir} has no tokenizer files"
            raise ConfigError(f"initialize: training_data={_short(training_data)} is text to tokenise and {where}; "
                              "pass tokenizer=")
        return load_tokenizer(hf_dir)
    return load_tokenizer(str(convert.resolve_hf_dir(str(tokenizer), "tokenizer", convert.HUB_TOKENIZER_FILES)))


def _short(x) -> str:
    return repr(os.fspath(x)) if isinstance(x, (str, os.PathLike)) else f"<{type(x).__name__}>"
