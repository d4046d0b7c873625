"""`hetloco-ds train`'s checks and the run directory taken: what a rank's loop is built from.

`plan_run` makes every check (config, topology, model, data, `--resume` compatibility and the
checkpoint it would load) by reading only. The launching process runs it before any rank
starts; each rank runs it again (cheap, and the same answers) to get its inputs. `own_run` then
takes the run directory: the lock, and for a new run its record (`run_config.json`, `hf_meta`),
for a resumed one the metrics rows past the checkpoint dropped. Nothing is written before both
have passed, so a bad invocation exits 2 having written nothing.
"""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
import time

import torch

from . import checkpoint, rundir, sizes
from .checkpoint import mem_available
from .config import ConfigError, RunConfig, check_run, check_topology, default_config_path, elastic_replica, parse_config
from .elastic import replica as fleet
from .elastic.replica import FleetArgs
from .model import parameter_count
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
    overwrite: bool = False
    text_field: str | None = None
    tokenizer: str | None = None
    dtype: str | None = None
    fleet: FleetArgs | None = None
    """Elastic mode: this job is one replica of a fleet; `out` is then the replica's directory."""


@dataclasses.dataclass
class RunPlan:
    """Everything checked, ready to build from."""

    args: TrainArgs
    """With `--resume`, completed from the run's record (model, data, text field)."""
    run: RunConfig
    raw_config: dict
    llama_config: object
    tokenizer: object
    corpus: object
    world: int
    replicas: int
    hf_dir: str | None
    """Weights to load while building; None when a checkpoint brings them (resume) or none (fresh model)."""
    resume: checkpoint.Pick | None
    secret: bytes | None = dataclasses.field(default=None, repr=False)
    """Elastic mode: the fleet's secret."""

    @property
    def ckpt_dir(self) -> str:
        """OUT/checkpoints. Read when the run directory is used, not when the plan is made:
        `prepare_inputs` plans a run that has no --out."""
        return os.path.join(self.args.out, rundir.CHECKPOINTS)



def default_out() -> str:
    return os.path.join("runs", time.strftime("%Y%m%d-%H%M%S"))



# ------------------------------------------------------------------------------------ checks


def _norm_path(value: str | None) -> str | None:
    """Paths compared across a resume by their absolute form; dataset names as written."""
    if value is None:
        return None
    return os.path.abspath(value) if os.path.exists(value) else value


def config_path(args: TrainArgs) -> str | None:
    """--config, or the DeepSpeed JSON given to `accelerate launch --deepspeed_config_file`."""
    via_accelerate = None
    if os.environ.get("ACCELERATE_USE_DEEPSPEED", "").lower() == "true":
        via_accelerate = os.environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE") or None
    if args.config and via_accelerate and _norm_path(args.config) != _norm_path(via_accelerate):
        raise ConfigError(f"--config {args.config} differs from accelerate's deepspeed_config_file {via_accelerate}; "
                          "give one DeepSpeed JSON")
    return args.config or via_accelerate


def read_config_file(path: str) -> dict:
    """The JSON object in `path`, for `parse_config`; a missing or malformed file is one ConfigError."""
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path}") from None
    except json.JSONDecodeError as err:
        raise ConfigError(f"{path}: not valid JSON: {err}") from None


def _resume_args(args: TrainArgs, record: dict) -> TrainArgs:
    """Fill what --resume leaves out from the run's record; refuse what differs from it."""
    from . import convert

    saved = record["args"]
    filled = {}
    for field, flag in (("model", "--model"), ("tokenizer", "--tokenizer"), ("dtype", "--dtype"),
                        ("model_config", "--model-config"), ("data", "--data"), ("text_field", "--text-field")):
        given, then = getattr(args, field), saved.get(field)
        if given is not None and field in ("model", "tokenizer"):  # a Hub id: its local snapshot, as recorded
            given = str(convert.resolve_hf_dir(given, flag))
        if given is None:
            filled[field] = then
        elif (_norm_path(given) if field in ("model", "tokenizer", "data") else given) != then:
            raise ConfigError(f"--resume: {flag} {given} is not the run's ({then if then is not None else 'none given'}; "
                              f"{os.path.join(args.out, rundir.RUN_CONFIG)})")
    return dataclasses.replace(args, **filled)


def _model_and_tokenizer(args: TrainArgs, run: RunConfig):
    """(LlamaConfig, tokenizer, args) of a new run. Hub ids in --model / --tokenizer become their
    local snapshot directories in the returned args (every later reader needs a directory). The
    model config's `dtype` is the export dtype: --dtype, else the source checkpoint's, else none."""
    from . import convert, corpus, hf_export

    dtype = convert.parse_dtype(args.dtype)
    if args.tokenizer is not None:
        given = args.tokenizer
        args = dataclasses.replace(args, tokenizer=str(convert.resolve_hf_dir(given, "--tokenizer",
                                                                              convert.HUB_TOKENIZER_FILES)))
        if not convert.tokenizer_files(args.tokenizer):
            raise ConfigError(f"--tokenizer {given}: no tokenizer files ({', '.join(convert.TOKENIZER_FILES[:4])}, ...)")
    if args.model is not None:
        given = args.model
        args = dataclasses.replace(args, model=str(convert.resolve_hf_dir(given, "--model")))
        llama_config = convert.read_hf_config(args.model)
        convert.check_hf_dir(args.model, llama_config)  # shapes from headers, before any rank loads
        provenance = {"source_model": given}
        if not os.path.isdir(os.path.expanduser(given)):  # a Hub id: its snapshot folder is named by the commit
            provenance["source_revision"] = os.path.basename(args.model)
        setattr(llama_config, hf_export.PROVENANCE_KEY, provenance)
        llama_config.dtype = dtype or convert.weights_dtype(args.model) or llama_config.dtype
        if args.tokenizer is None:
            if not convert.tokenizer_files(args.model):
                raise ConfigError(f"--model {given} has no tokenizer files ({', '.join(convert.TOKENIZER_FILES[:4])}, "
                                  "...); pass --tokenizer DIR_OR_HUB_ID")
            args = dataclasses.replace(args, tokenizer=args.model)
        tokenizer = corpus.load_tokenizer(args.tokenizer)
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
            tokenizer = corpus.load_tokenizer(args.tokenizer)
        else:
            tokenizer = corpus.default_tokenizer(vocab_size=run.hetloco.train.vocab_size)
        llama_config = model_config_for(args.model_config or "tiny", len(tokenizer))
        llama_config.dtype = dtype
    return llama_config, tokenizer, args


def plan_run(args: TrainArgs, world: int, owned: bool = False, config: tuple[dict, str] | None = None,
             secret: bytes | None = None) -> RunPlan:
    """Every check, reading only; raises ConfigError (or another ValueError) with one line.

    `owned`: our launcher already took the run directory, so it is not judged as someone else's.
    `config`: (raw config, its path) in place of reading --config (`--elastic` plans the fleet's
    config before writing it). `secret`: the fleet secret, when not read from --secret-file / env."""
    from . import batches, hf_export
    from .corpus import load_corpus

    if world < 1:
        raise ConfigError(f"--nproc {world} must be >= 1")
    if args.resume and args.overwrite:
        raise ConfigError("--resume continues the run in --out and --overwrite replaces it; pass one")
    out = args.out
    record = None
    if args.resume:
        record = rundir.read_record(out)
        args = _resume_args(args, record)
    elif not owned and not args.overwrite:
        rundir.check_unused(out)
    args = dataclasses.replace(args, text_field=args.text_field or "text")

    path = config_path(args)
    if config is not None:
        raw, source = config
    elif path is None and record is not None:
        raw, source = record["config"], os.path.join(out, rundir.RUN_CONFIG)
    else:
        source = path or default_config_path()
        raw = read_config_file(source)
    run = parse_config(raw, source)
    if record is not None:
        fleet.check_resumed(args.fleet, record, out)
        then = parse_config(record["config"], os.path.join(out, rundir.RUN_CONFIG))
        diffs = rundir.config_differences(run, then)
        if diffs:
            more = f" (and {len(diffs) - 1} more)" if len(diffs) > 1 else ""
            raise ConfigError(f"--resume: {source} differs from the run's config: {diffs[0]}{more}")
        if record["world_size"] != world:
            raise ConfigError(f"--resume: the run has {record['world_size']} ranks ({record['replicas']} replicas x "
                              f"pipeline.stages = {record['stages']}); this launch has {world}")
    if args.fleet is not None:  # one replica of the fleet: its own depth when the config names every replica's
        run = elastic_replica(run, args.fleet.replica)
    check_topology(world, run.stages, run.source, replica_stages=run.hetloco.replica_stages)

    seq_len = run.hetloco.train.seq_len
    hf_dir = None
    if record is not None:
        # The run's own metadata rebuilds the model; the checkpoint brings the weights.
        meta = hf_export.load_hf_meta(os.path.join(out, rundir.CHECKPOINTS))
        llama_config, tokenizer = meta.config, meta.tokenizer
        if tokenizer is None:
            raise ConfigError(f"--resume: {meta.path} holds no tokenizer")
    else:
        llama_config, tokenizer, args = _model_and_tokenizer(args, run)
        hf_dir = args.model
    M = check_run(run, world, llama_config.hidden_size, llama_config.num_hidden_layers, elastic=args.fleet is not None,
                  tied=bool(llama_config.tie_word_embeddings), replica=args.fleet.replica if args.fleet else None)
    _check_host_memory(run, llama_config, world, M)
    try:
        checkpoint.check_torch()
    except checkpoint.TorchMismatch as err:  # one line from the launcher, as bad input is
        raise ConfigError(str(err)) from None
    positions = getattr(llama_config, "max_position_embeddings", None)
    if positions is not None and seq_len > positions:
        model = (meta.path if record is not None else f"--model {args.model}" if args.model
                 else f"--model-config {args.model_config or 'tiny'}")
        raise ConfigError(f"{run.source}: hetloco.train.seq_len = {seq_len} exceeds the model's max_position_embeddings "
                          f"= {positions} ({model})")
    if args.fleet is not None:
        fleet.check_replica(args.fleet, run)
        secret = secret or fleet.read_secret(args.fleet)
        fleet.check_lighthouse(args.fleet)
    if len(tokenizer) > llama_config.vocab_size:
        raise ConfigError(f"tokenizer has {len(tokenizer)} tokens but the model's vocab_size is {llama_config.vocab_size}")
    corpus = load_corpus(args.data, tokenizer, seq_len, text_field=args.text_field)
    try:  # the replicas' data streams, built as the ranks will build them
        batches.ReplicaBatches(corpus.train, M - 1, M, run.micro_batch)
    except ValueError as err:
        raise ConfigError(f"--data {args.data or '(default: the Python stdlib)'}: {err}") from None

    resume = None
    if record is not None:
        try:
            resume = checkpoint.pick(os.path.join(out, rundir.CHECKPOINTS), world)
            checkpoint.check_readable(os.path.join(out, rundir.CHECKPOINTS), resume.tag)
        except checkpoint.CheckpointError as err:
            raise ConfigError(f"--resume: {err}") from None
    return RunPlan(args, run, raw, llama_config, tokenizer, corpus, world, M, hf_dir, resume, secret)


def _check_host_memory(run: RunConfig, llama_config, world: int, replicas: int) -> None:
    """Refuse, before any rank starts, a run whose ranks on this host would hold more host memory
    (`sizes.host_state_bytes`: checkpoint copies, the outer state on the host, the CPU's training
    state) than the host has available: otherwise the kernel kills a rank mid-run."""
    available = mem_available()
    if available is None:
        return
    params = parameter_count(llama_config)
    here = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    sl = run.hetloco.sparseloco
    on_gpu = torch.cuda.is_available()
    outer_on_host = on_gpu and sl.enabled and sl.outer_state_device == "cpu"
    # "auto" stages a save only where the host holds the copy (checkpoint.pick_staging): no copy counted
    copies = run.hetloco.train.checkpoint_staging == "host"
    need = sizes.host_state_bytes(params * replicas * here // world, on_gpu, outer_on_host, run.bf16, sl.enabled,
                                  sl.outer_momentum > 0, run.hetloco.train.optimizer_state, checkpoint_copy=copies)
    if need > available:
        held = ", ".join(["checkpoint copies"] * copies + ["the outer state"] * outer_on_host
                         + ["the training state"] * (not on_gpu))
        hint = ('; hetloco.sparseloco.outer_state_device "gpu" keeps the outer state (8 B a parameter) on the GPUs'
                if outer_on_host else "")
        hint += '; hetloco.train.checkpoint_staging "none" saves without a host copy' if copies else ""
        raise ConfigError(f"{run.source}: the {here} rank(s) on this host need about {need / 1e9:.1f} GB of host "
                          f"memory ({params / 1e9:.2f}B parameters, {replicas} replica(s): {held}) and "
                          f"{available / 1e9:.1f} GB is available{hint}")


def prepare_inputs(args: TrainArgs, world_size: int):
    """(run, llama_config, tokenizer, corpus) of a new run, through `plan_run`'s checks, for
    callers that want only the inputs (no run directory is judged). Hub ids in `args.model` /
    `args.tokenizer` are replaced in place by their local snapshot directories."""
    plan = plan_run(args, world_size, owned=True)
    args.model, args.tokenizer = plan.args.model, plan.args.tokenizer
    return plan.run, plan.llama_config, plan.tokenizer, plan.corpus


def own_run(plan: RunPlan) -> rundir.RunLock:
    """Take the run directory (call once per job, after `plan_run`): the lock, then either the
    record of a new run or, on resume, the metrics rows past the checkpoint dropped."""
    from . import hf_export
    from .metrics import keep_rows_up_to

    out = plan.args.out
    os.makedirs(out, exist_ok=True)
    lock = rundir.RunLock(out)
    try:
        _recheck_under_lock(plan)
        if plan.args.overwrite:
            rundir.clear_previous_run(out)
        shutil.rmtree(rundir.state_dir(out, "heartbeat"), ignore_errors=True)  # of jobs before this one
        if plan.resume is not None:
            keep_rows_up_to(os.path.join(out, rundir.METRICS), plan.resume.step)
        else:
            a = plan.args
            hf_export.save_hf_meta(plan.ckpt_dir, plan.llama_config, plan.tokenizer, model_dir=a.model,
                                   tokenizer_dir=a.tokenizer)
            rundir.write_record(out, {
                "config": plan.raw_config, "config_file": plan.run.source,
                "args": {"model": _norm_path(a.model), "tokenizer": _norm_path(a.tokenizer), "dtype": a.dtype,
                         "model_config": a.model_config, "data": _norm_path(a.data), "text_field": a.text_field},
                "world_size": plan.world, "stages": plan.run.stages, "replicas": plan.replicas,
                "model": plan.llama_config.to_dict(), "data_description": plan.corpus.description,
                "ds": plan.run.ds, "hetloco": plan.run.hetloco.model_dump(),
                "fleet": None if a.fleet is None else {"replica": a.fleet.replica, "max_replicas": plan.replicas},
            })
    except BaseException:
        lock.release()
        raise
    return lock


def _recheck_under_lock(plan: RunPlan) -> None:
    """`plan_run`'s reading of --out, again now that the lock is held: another run may have taken
    the directory, trained in it and let go between that reading and the lock."""
    out = plan.args.out
    if plan.resume is None:
        if not plan.args.overwrite:
            rundir.check_unused(out, under_lock=True)
        return
    try:
        now = checkpoint.pick(plan.ckpt_dir, plan.world)
    except checkpoint.CheckpointError as err:
        raise ConfigError(f"--resume: {err}") from None
    if now.tag != plan.resume.tag:
        raise ConfigError(f"--resume: another run wrote {out} while this launch was checking it (its newest complete "
                          f"checkpoint is now {now.tag}, not {plan.resume.tag}); launch again to resume from there")


__all__ = ["TrainArgs", "RunPlan", "default_out", "config_path", "read_config_file", "plan_run",
           "prepare_inputs", "own_run", "mem_available"]
