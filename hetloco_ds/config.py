"""The `hetloco` section of a DeepSpeed JSON, typed and validated once, at the edge.

A run's configuration is one DeepSpeed JSON file. DeepSpeed reads its own keys; ours live
under `"hetloco"`. `load_config` splits the two, validates ours with pydantic
(`extra="forbid"`, strict types: an unknown key, or a value of the wrong type, is one error naming
the key, the value and the file), checks the DeepSpeed settings we depend on, and hands typed
objects inward.
"""
from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

# ConfigError, OptimizerSettings and check_scheduler are re-exported: modules and tests take every
# name of the configuration from here.
from .ds_config import (ConfigError, OptimizerSettings, check_deepspeed_section, check_scheduler,  # noqa: F401
                        format_pydantic, optimizer_settings, resolve_scheduler)
from .sizes import CHUNKINGS, MAX_CHUNK, OPTIMIZER_STATES, QUANT_BITS, VALUE_BYTES
from .sparseloco.aggregate import AGGREGATIONS, REGISTRIES
from .sparseloco.presets import PRESETS as OUTER_PRESETS

OUTER_STATE_DEVICE = "cpu"
"""Where the outer state waits by default (`sparseloco.outer_state_device`): on the host it keeps
8 B/parameter off the device, at 1B and 8B what puts a GPU's peak at or below stock DeepSpeed's;
in speed it measured ahead at 1B and within run-to-run noise at 178M and at the 8B shape
(bench/README.md, "outer state on the host")."""


_RULES = {registry.key: registry for registry in REGISTRIES}
"""The `sparseloco` keys whose choices are a registry's names (sparseloco/aggregate.py)."""


class _Section(BaseModel):
    # strict: a value of the wrong type is an error naming it ("inner_steps": "5" was once read as 5,
    # "enabled": 1 as true); an int is still a float. What JSON cannot say strictly (a dict's integer
    # keys) and unions that would report each member are read by the fields' own validators.
    model_config = ConfigDict(extra="forbid", validate_assignment=True, strict=True)


class SparseLoCoConfig(_Section):
    preset: Literal["templar", "diloco", "paper"] | None = None
    """Fill the fields below from a named rule set (sparseloco/presets.py) when the section is read;
    fields given next to it win. templar: the SparseLoCo authors' code; diloco: dense, Nesterov outer SGD;
    paper: eq. (2) as written (divide by M, no clip)."""
    enabled: bool = True
    """False runs plain data parallelism: a gradient all-reduce every step (the AdamW DDP baseline)."""
    inner_steps: int = Field(50, ge=1)
    """H: optimizer steps each replica takes between outer syncs."""
    outer_lr: float = Field(1.0, gt=0)
    """Outer SGD learning rate; multiplies the aggregated pseudo-gradient once."""
    error_decay: float = Field(0.95, ge=0, le=1)
    """beta in e = beta * e + delta."""
    chunk_size: int = Field(MAX_CHUNK, ge=1, le=MAX_CHUNK)
    """Largest chunk in elements; 2-D tensors are tiled sqrt(chunk_size) square. <= 4096 so indices fit 12 bits."""
    topk: int = Field(32, ge=1)
    """Values kept per chunk of `chunk_size` elements (scaled for smaller chunks, at least 1)."""
    quant_bits: Literal[QUANT_BITS] | None = None
    """Quantise the selected values to this many bits with a per-tensor lookup table; null sends float32."""
    aggregation: str = "selected_count"
    """selected_count (default, the SparseLoCo authors' rule): divide each coordinate's sum by the replicas that
    selected it. mean: by the replicas that contributed (paper eq. 2). dense: whole pseudo-gradients, no top-k,
    no error feedback (DiLoCo control); or a rule registered in sparseloco/aggregate.py. README, "Aggregation", has
    the measurement behind the default."""
    chunking: Literal[CHUNKINGS] = "tiles"
    """tiles: non-2-D tensors in chunks of <= chunk_size. per_dim (templar): every dimension <= sqrt(chunk_size)."""
    topk_rule: str = "scaled"
    """scaled: k = topk * chunk_len / chunk_size, >= 1. fixed (templar): k = topk in every chunk, even, >= 2; or a
    rule registered in sparseloco/aggregate.py."""
    quant_rounding: Literal["floor", "nearest"] = "floor"
    """Quantisation bin of a value: floor (ours) or round to nearest (templar)."""
    quant_std: Literal["population", "sample"] = "population"
    """Std behind the quantisation bin width: population (ours) or sample, n - 1 (templar)."""
    norm_clip: str = "median"
    """median (default, templar): scale each replica's decoded tensor down to the replicas' median norm before
    aggregating (a no-op among honest replicas; bounds what one outlier moves); none: no clip; or a rule
    registered in sparseloco/aggregate.py."""
    screen: str = "none"
    """Leave a replica's whole payload out of the outer step when it disagrees with the others (reported as
    excluded, with its replica id). none: every finite payload counts; agreement: its norm against the median
    norm and its cosine with the others' sum (sparseloco/aggregate.py; README, "Robust outer sync")."""
    value_dtype: Literal[tuple(VALUE_BYTES)] = "float32"
    """Wire type of the values an unquantised payload sends: float32, or bfloat16 (half the value bytes)."""
    outer_momentum: float = Field(0.0, ge=0, lt=1)
    """Nesterov momentum of the outer SGD; 0 is the paper's plain SGD (DiLoCo: 0.9 with outer_lr 0.7)."""
    outer_state_device: Literal["gpu", "cpu"] = OUTER_STATE_DEVICE
    """Where theta at the last sync and the error-feedback buffers (and the outer momentum) live between outer
    steps. gpu: on the stage's device. cpu: in host memory (pinned on a GPU machine), 8 B/parameter (12 with
    outer momentum) off the device, brought over in slices during the outer step on a side stream that
    overlaps its compute; the same bits train, the outer step pays the copies it cannot hide."""
    tied_embeddings: Literal["outer_step", "every_step"] = "outer_step"
    """A tied model split over stages (tie_word_embeddings, S > 1). outer_step: the embedding and the head copy
    train separately between outer steps and are made equal again at each one from their sparse aggregates;
    every_step: their gradients are all-reduced every step (a dense vocab x d tensor on the first-last stage link)."""

    @model_validator(mode="before")
    @classmethod
    def _apply_preset(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("preset") in OUTER_PRESETS:
            return {**OUTER_PRESETS[data["preset"]], **data}
        return data

    @field_validator("aggregation", "norm_clip", "screen", "topk_rule")
    @classmethod
    def _registered(cls, v: str, info) -> str:
        # The registries hold the choices, so a rule registered at run time is a name the config accepts.
        return _RULES[info.field_name].check(v)

    @model_validator(mode="after")
    def _dense_sends_values(self) -> "SparseLoCoConfig":
        if AGGREGATIONS[self.aggregation].dense and self.quant_bits is not None:
            raise ValueError(f"aggregation {self.aggregation!r} sends whole tensors unquantised; "
                             f"quant_bits must be null, got {self.quant_bits}")
        return self

    @model_validator(mode="after")
    def _topk_fits_chunk(self) -> "SparseLoCoConfig":
        # The codec would clamp k to the chunk length: a silently denser payload than asked for.
        if self.topk > self.chunk_size:
            raise ValueError(f"topk = {self.topk} exceeds chunk_size = {self.chunk_size} (values kept per chunk)")
        return self


class SubspaceConfig(_Section):
    ratio: int = Field(1, ge=1)
    """d / k for compressed replicas; 1 means no compression."""
    compressed_replicas: list[int] | Literal["all", "none"] = "none"
    """Which replicas send subspace-projected tensors over their stage boundaries."""
    codec: str = Field("subspace", min_length=1)
    """The stage-boundary codec of the compressed replicas: a name registered in `boundary.CODECS` (checked
    when the stage's algorithm is built); subspace is the paper's, the others use identity."""
    replica_ratios: dict[int, int] = Field(default_factory=dict)
    """Per-replica override of `ratio` for compressed replicas, e.g. {"1": 64}."""
    seed: int = 1234
    """Seed of the Gaussian matrix whose QR gives U; every rank builds the same U from it."""
    embedding_adaptation: bool = True
    """Paper eqs. 3-4 after every outer sync (Table 5a ablation when false)."""
    project_residual_weights: bool = False
    """Project o_proj/down_proj outputs onto Col(U) after each inner step (Table 5b ablation)."""
    project_embedding_every_step: bool = False
    """Ablation, default false (the paper projects T_S only at outer syncs): a compressed replica's after each inner step too."""
    embedding_weight_decay: Literal["table", "t_s"] = "table"
    """What inner AdamW's weight decay shrinks: table (default, the authors' code), TE = T_S + T_perp; t_s, T_S alone."""

    @field_validator("compressed_replicas", mode="before")
    @classmethod
    def _ids_or_all_or_none(cls, v: Any) -> Any:
        if v in ("all", "none") or (isinstance(v, list) and all(type(m) is int for m in v)):
            return v
        raise ValueError(f'compressed_replicas = {v!r} must be a list of replica ids (whole numbers), "all" or "none"')

    @field_validator("replica_ratios", mode="before")
    @classmethod
    def _replica_ids_from_json_keys(cls, v: Any) -> Any:
        # A JSON object's keys are strings: {"1": 64} names replica 1.
        if not isinstance(v, dict):
            return v
        ids = {}
        for key, ratio in v.items():
            if isinstance(key, str) and key.isascii() and key.isdigit():
                key = int(key)
            elif type(key) is not int:
                raise ValueError(f"replica_ratios = {v!r}: key {key!r} is not a replica id (a whole number >= 0)")
            ids[key] = ratio
        return ids

    @field_validator("replica_ratios")
    @classmethod
    def _ratios_positive(cls, v: dict[int, int]) -> dict[int, int]:
        for replica, ratio in v.items():
            if ratio < 1:
                raise ValueError(f"replica_ratios[{replica}] = {ratio} must be >= 1")
        return v

    def compressed(self, replica: int, num_replicas: int) -> bool:
        if self.compressed_replicas == "all":
            return True
        if self.compressed_replicas == "none":
            return False
        return replica in self.compressed_replicas

    def ratio_for(self, replica: int, num_replicas: int) -> int:
        """d/k on this replica's boundaries; 1 for uncompressed replicas."""
        if not self.compressed(replica, num_replicas):
            return 1
        return self.replica_ratios.get(replica, self.ratio)

    @property
    def any_compressed(self) -> bool:
        return self.compressed_replicas != "none" and (self.compressed_replicas == "all" or bool(self.compressed_replicas))


class TrainConfig(_Section):
    seq_len: int = Field(256, ge=2)
    """Tokens per sample (context length)."""
    eval_interval: int = Field(50, ge=0)
    """Optimizer steps between validation-loss evaluations (0: only at the end)."""
    eval_batches: int = Field(4, ge=1)
    """Micro-batches of held-out data per validation."""
    checkpoint_interval: int = Field(0, ge=0)
    """Save every this many outer steps (0: only at the end). Checkpoints are taken at outer-step boundaries."""
    checkpoint_every_s: float = Field(1800.0, ge=0)
    """Also save once this many seconds have passed since the last save (rank 0's clock decides, every
    rank saves at the first outer boundary all can reach), so a power cut or a SIGKILL loses at most
    about this much training; 0 turns it off. Half an hour: training waits only for each save's copy to
    host memory (the write runs in the background), while a kill without warning costs at most that."""
    preempt_grace_s: float = Field(20.0, gt=0)
    """After SIGTERM or SIGINT (to a launcher or a rank), seconds the ranks have to agree on a step,
    save it and commit; past it they exit without committing. Schedulers follow SIGTERM with SIGKILL
    after a grace of their own: Slurm's KillWait and Kubernetes' terminationGracePeriodSeconds default
    to 30 s, spot instances give 30 s to 2 minutes. 20 s fits inside the shortest of those with room
    for the signal to travel through launchers and for the processes to exit; raise it where the
    scheduler's grace is longer and a save takes more."""
    seed: int = 0
    """Seed for model initialisation and data order."""
    vocab_size: int = Field(8192, ge=256)
    """Vocabulary of the BPE tokenizer trained on the embedded default corpus."""
    compile: bool = False
    """torch.compile each decoder layer and the loss (the first steps are slower while it compiles)."""
    deterministic: bool = False
    """Deterministic kernels (torch.use_deterministic_algorithms): a GPU run and its --resume repeat bit for bit.
    Off by default, where flash attention's backward adds in atomics, so two GPU runs part in the last bits
    after a few steps (bench/README.md, "Deterministic runs", has its cost)."""
    checkpoint_staging: Literal["auto", "host", "none"] = "auto"
    """How a save reaches the disk. "host": each rank copies its state into host buffers kept between
    saves (pinned on a GPU), training waits for that copy only, and a background thread writes it.
    "none": no copy; the save writes the live tensors, one at a time through host memory, and
    training waits for the whole write: for a host that cannot hold a second copy of the state
    (an 8B replica with its outer state on the host needs ~64 GB more for it). "auto": "host" where
    this host's available memory holds every local rank's copy at the first save, else "none"
    (that rank says so in one line); the launch's host-memory check then counts no copy."""
    keep_checkpoints: int = Field(2, ge=0)
    """Complete checkpoints kept in OUT/checkpoints (older ones are deleted after a newer one is committed); 0 keeps all."""
    watchdog_timeout: float = Field(180.0, ge=0)
    """Seconds a rank may go without a heartbeat (twice that without progress, or 20x the slowest step
    if longer) before the job is ended with a line naming it; 0 turns the watchdog off."""
    max_nonfinite_outer_steps: int = Field(3, ge=0)
    """Stop (exit 3, keeping the last good checkpoint) after this many consecutive outer steps at which
    every replica's update was non-finite; 0 never stops."""
    optimizer_state: Literal[OPTIMIZER_STATES] = "fp32"
    """How the inner AdamW keeps its moments (`optim.build_optimizer`; bytes per parameter in
    `sizes.optimizer_state_bytes_per_param`): "fp32" torch's AdamW, 8 B/param; "bf16" both moments in
    bf16, 4; "8bit" torchao's AdamW8bit, block-quantised, about 2; "cpu_offload" moments, and AdamW's
    step, on the host, 0 on the device (on a CPU-only run the copies are host to host and the numbers
    fp32's). "bf16" and "8bit" need torchao (`pip install torchao==0.18.0`)."""
    loss_chunk_tokens: int = Field(0, ge=0)
    """The last stage's loss without its [tokens, vocab] logits: the LM head's matmul and the
    cross-entropy a chunk of this many tokens at a time, each chunk's logits made again in the
    backward (`model.chunked_lm_loss`); the head's forward matmul runs twice. For large
    vocabularies at long sequences (Llama-3's 128256 at 8192 tokens: 14.7 GB of logits and their
    fp32 gradients a micro-batch, `sizes.logit_bytes`). 0: the whole micro-batch's logits at once."""
    profile_step: int = Field(0, ge=0)
    """Record this optimizer step with torch.profiler on every rank: OUT/profile/rank<r>.json (device
    busy and idle time, kernel time by class, the pipeline instructions as a timeline, host waits,
    allocator retries) and rank<r>.trace.json.gz (a chrome trace); 0 profiles nothing."""


class ElasticSection(_Section):
    """Elastic mode (`--lighthouse` / `--elastic`): every replica its own job, meeting at the outer
    sync through torchft (README, "Elastic replicas"). Ignored by the static mode."""

    max_replicas: int | None = Field(None, ge=1)
    """N, the fleet's size: replica ids are 0..N-1, and replica m trains on data shard m of N (the
    static run's replica m when N = M). `--elastic` fills it with --nproc / pipeline.stages when null."""
    timeout: float = Field(30.0, gt=0)
    """Seconds each collective of an outer-sync attempt, each store wait and a state transfer may take;
    a peer that dies inside the exchange costs the others at most about this (then one retry)."""
    quorum_timeout: float = Field(300.0, gt=0)
    """Seconds a replica waits at an outer boundary for the lighthouse's quorum before that attempt fails."""
    join_timeout: float = Field(60.0, gt=0)
    """Lighthouse started by `--elastic`: seconds the replicas at a boundary wait for a live replica that has
    not reached it (a hung or much slower one) before going on without it (`hetloco-ds lighthouse --join-timeout`)."""
    heartbeat_timeout: float = Field(5.0, gt=0)
    """Lighthouse started by `--elastic`: seconds without a heartbeat after which a replica counts as dead
    (`hetloco-ds lighthouse --heartbeat-timeout`)."""
    max_attempts: int = Field(20, ge=1)
    """Failed exchange attempts in a row (each with a new quorum) before an outer step gives up with an error."""


class PipelineConfig(_Section):
    schedule: Literal["auto", "overlapped", "blocking"] = "auto"
    """overlapped: stage-link transfers run beside the compute (receives posted ahead, sends in the
    background, 3(S-1-s)+1 micro-batches in flight on stage s). blocking: DeepSpeed's 1F1B, every
    transfer stalls the stage. auto: overlapped, except on GPUs whose every stage link stays inside
    a host when the copy-engine transport cannot start there (see link_transport): a receive that
    NCCL posts ahead is a kernel resident beside the compute and slows it, and on NVLink there is no
    transfer time worth that (pipe.order.links_plan). Same losses and parameters bit for bit; only
    timing differs."""
    link_max_ctas: int | None = Field(1, ge=1)
    """NCCL: CTAs (thread blocks, one SM each) a stage-link communicator of the overlapped schedule may
    run; null: NCCL's own choice. A receive posted ahead keeps its CTAs resident until its message
    comes, taking SMs from the stage's GEMMs, and one CTA already moves far more than an internet link
    carries (bench/results/gpu_two_s2_overlapped_cta1_h100.json against gpu_two_s2_overlapped_h100.json).
    Not used by gloo or the blocking schedule."""
    gemm_sm_carveout: int | Literal["auto"] = 0
    """NCCL, overlapped schedule: SMs the stage's matmuls leave to its resident link kernels (torch's SM
    carveout, with cuBLASLt as the process's matmul library, which is where the carveout applies). A
    persistent GEMM launches one CTA per SM; with an SM held by a posted receive its grid runs in two
    waves. "auto": link_max_ctas x the link kernels the stage can hold at once
    (pipe.order.resident_link_kernels); 0: off. Set for the whole process when the engine starts; other
    GEMM kernels round differently, as under train.compile. Not used by gloo or the blocking schedule."""

    link_transport: Literal["auto", "process_group", "copy_engine"] = "auto"
    """What moves the overlapped schedule's stage-link messages. process_group: a two-rank process
    group per direction (NCCL on GPUs, gloo on the CPU). copy_engine: CUDA, both ranks of every
    stage link on one host: the GPUs' copy engines move each message into a slot of the peer's
    memory (CUDA IPC) and the driver's stream memory operations signal it, so a receive posted
    ahead holds no SM (pipe.copy_engine); the schedule is then overlapped. auto: copy_engine where it
    applies (GPUs, every stage link inside a host, the overlapped schedule) and every rank can set
    it up, else process_group. The same bytes arrive either way, so the same bits train."""

    @field_validator("gemm_sm_carveout", mode="before")
    @classmethod
    def _carveout_is_a_count(cls, v: Any) -> Any:
        if v == "auto" or (isinstance(v, int) and not isinstance(v, bool) and v >= 0):
            return v
        raise ValueError(f"gemm_sm_carveout = {v!r} must be a number of SMs >= 0 or \"auto\"")

    @model_validator(mode="after")
    def _copy_engine_moves_the_overlapped_schedule(self) -> "PipelineConfig":
        if self.link_transport == "copy_engine" and self.schedule == "blocking":
            raise ValueError('link_transport = "copy_engine" moves the overlapped schedule\'s messages, but '
                             'schedule = "blocking"; set schedule to "overlapped" or "auto"')
        return self

    @model_validator(mode="after")
    def _auto_carveout_needs_a_cap(self) -> "PipelineConfig":
        if self.gemm_sm_carveout == "auto" and self.link_max_ctas is None:
            raise ValueError('gemm_sm_carveout = "auto" counts link_max_ctas CTAs per link kernel, but '
                             "link_max_ctas is null (NCCL's own count); give gemm_sm_carveout a number")
        return self


class HetlocoConfig(_Section):
    replica_stages: list[int] | None = None
    """Pipeline depth of each replica, one entry per replica (e.g. [1, 2]: replica 0 whole on one
    rank, replica 1 in two stages); None: every replica has pipeline.stages, which is ignored when
    this is set. Static mode: the world is their sum. Elastic mode: the fleet's replicas, replica m a
    job of replica_stages[m] ranks (hetloco.elastic.max_replicas is then its length)."""
    sparseloco: SparseLoCoConfig = Field(default_factory=SparseLoCoConfig)
    subspace: SubspaceConfig = Field(default_factory=SubspaceConfig)
    pipeline: PipelineConfig = Field(default_factory=PipelineConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    elastic: ElasticSection = Field(default_factory=ElasticSection)

    @field_validator("replica_stages")
    @classmethod
    def _stages_positive(cls, v: list[int] | None) -> list[int] | None:
        if v is not None:
            if not v:
                raise ValueError("replica_stages = [] names no replica; leave it out for pipeline.stages everywhere")
            for m, s in enumerate(v):
                if s < 1:
                    raise ValueError(f"replica_stages[{m}] = {s} must be >= 1")
        return v


@dataclass(frozen=True)
class RunConfig:
    """What the rest of the package receives: the DeepSpeed settings hetloco_ds implements per
    replica, typed, plus DeepSpeed's own dict (ours removed) for what DeepSpeed still runs."""

    ds: dict[str, Any]
    hetloco: HetlocoConfig
    source: str
    stages: int
    """pipeline.stages; with hetloco.replica_stages, the deepest replica's (an elastic replica's own,
    `elastic_replica`)."""
    activation_checkpoint_interval: int = 0
    """pipeline.activation_checkpoint_interval, as DeepSpeed's PipelineModule takes it: each stage's
    layers in runs of this many, a run of decoder layers alone keeping only its input for the
    backward and running its forward again there; 0: off."""
    bf16: bool = False
    """bf16.enabled: autocast over fp32 master weights per replica; bf16 crosses stage links."""
    clip: float = 1.0
    """gradient_clipping, over the replica's own stages."""
    micro_batch: int = 1
    """train_micro_batch_size_per_gpu."""
    grad_accum: int = 1
    """gradient_accumulation_steps: micro-batches per optimizer step."""
    optimizer: OptimizerSettings = OptimizerSettings()
    scheduler: dict | None = None
    """DeepSpeed's `scheduler` section with "auto" values resolved, or None."""
    fleet_stages: tuple[int, ...] | None = None
    """An elastic replica of a fleet of mixed depths (`elastic_replica`): every replica's depth, the
    fleet's hetloco.replica_stages (which this job's own config then leaves unset: it is one pipeline
    of `stages` ranks). None otherwise."""

    def engine_ds_config(self) -> dict[str, Any]:
        """DeepSpeed's dict for its engine, with the settings we implement per replica taken out
        of its hands (bf16, clipping, the optimizer: we pass a torch AdamW)."""
        ds = json.loads(json.dumps(self.ds))
        for key in ("optimizer", "train_batch_size"):
            ds.pop(key, None)
        ds["bf16"] = {"enabled": False}
        ds["gradient_clipping"] = 0.0
        # The module applies pipeline.activation_checkpoint_interval itself (`build_module`); DeepSpeed's
        # engine would otherwise set it again and, with use_reentrant false, its own checkpoint function.
        ds["pipeline"] = {k: v for k, v in ds.get("pipeline", {}).items() if k != "use_reentrant"}
        ds["pipeline"]["activation_checkpoint_interval"] = 0
        ds.setdefault("steps_per_print", 10**9)
        ds["train_micro_batch_size_per_gpu"] = self.micro_batch
        ds["gradient_accumulation_steps"] = self.grad_accum
        if self.scheduler is not None:
            ds["scheduler"] = json.loads(json.dumps(self.scheduler))
        return ds


def parse_config(raw: dict[str, Any], source: str = "<dict>") -> RunConfig:
    """Validate a DeepSpeed JSON dict with a `hetloco` section."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: top level must be a JSON object")
    ds = json.loads(json.dumps(raw))  # deep copy; we edit DeepSpeed's part below
    section = ds.pop("hetloco", {}) or {}
    if not isinstance(section, dict):
        raise ConfigError(f"{source}: hetloco must be a JSON object, got {section!r}")
    try:
        hetloco = HetlocoConfig.model_validate(section)
    except ValidationError as err:
        raise ConfigError(format_pydantic(err, source)) from None

    pipeline = ds.setdefault("pipeline", {})
    stages = pipeline.get("stages", 1)
    if stages == "auto":
        stages = 1
    if type(stages) is not int or stages < 1:
        raise ConfigError(f"{source}: pipeline.stages must be a positive integer, got {stages!r}")
    if hetloco.replica_stages is not None:
        stages = max(hetloco.replica_stages)  # the deepest replica's (each replica has its own)
    pipeline["stages"] = stages
    interval = pipeline.get("activation_checkpoint_interval", 0)
    if type(interval) is not int or interval < 0:
        raise ConfigError(f"{source}: pipeline.activation_checkpoint_interval must be a whole number >= 0 "
                          f"(0: off), got {interval!r}")
    if pipeline.get("use_reentrant") not in (None, False):
        raise ConfigError(f"{source}: pipeline.use_reentrant = {pipeline['use_reentrant']!r}: decoder layers are "
                          "recomputed with torch's non-reentrant checkpoint (the one that works under train.compile); "
                          "leave it out or set it to false")

    zero = ds.get("zero_optimization", {}) or {}
    if int(zero.get("stage", 0)) != 0:
        raise ConfigError(
            f"{source}: zero_optimization.stage = {zero.get('stage')} shards state across replicas, "
            "which defeats independent local steps; use stage 0"
        )
    bf16 = (ds.get("bf16") or {}).get("enabled", False)
    if not isinstance(bf16, bool) and bf16 != "auto":  # bool("false") is True
        raise ConfigError(f"{source}: bf16.enabled = {bf16!r} must be true, false or \"auto\"")
    if ds.get("fp16", {}).get("enabled"):
        raise ConfigError(f"{source}: fp16.enabled is not supported; use bf16 (autocast with fp32 master weights per replica)")
    for key in ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps"):
        value = ds.get(key, 1)
        if value == "auto":
            value = 1
        elif type(value) is not int or value < 1:  # bool is an int, and true would be a batch of 1
            raise ConfigError(f"{source}: {key} must be a positive integer, got {value!r}")
        ds[key] = value
    if ds.get("train_batch_size") == "auto":
        ds.pop("train_batch_size")
    clip = ds.get("gradient_clipping", 1.0)
    if type(clip) not in (int, float) or clip < 0:
        raise ConfigError(f"{source}: gradient_clipping must be a non-negative number, got {clip!r}")
    check_deepspeed_section(ds, source)
    optimizer = optimizer_settings(ds.get("optimizer"), source)
    return RunConfig(ds=ds, hetloco=hetloco, source=source, stages=stages, activation_checkpoint_interval=interval,
                     bf16=bool(bf16), clip=float(clip),
                     micro_batch=ds.get("train_micro_batch_size_per_gpu", 1),
                     grad_accum=ds.get("gradient_accumulation_steps", 1), optimizer=optimizer,
                     scheduler=check_scheduler(resolve_scheduler(ds.get("scheduler"), optimizer), source))


def load_config(path: str | os.PathLike | None) -> RunConfig:
    """Read and validate a DeepSpeed JSON file (None: the packaged default CPU config)."""
    if path is None:
        path = default_config_path()
    path = os.fspath(path)
    try:
        with open(path) as f:
            raw = json.load(f)
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path}") from None
    except json.JSONDecodeError as err:
        raise ConfigError(f"{path}: not valid JSON: {err}") from None
    return parse_config(raw, source=path)


def default_config_path() -> str:
    """`configs/cpu_tiny.json`, shipped inside the package (hetloco_ds/configs)."""
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs", "cpu_tiny.json")


def check_topology(world_size: int, stages: int, source: str, num_layers: int | None = None,
                   replica_stages: list[int] | None = None) -> int:
    """Replicas M = world / S (with `replica_stages`: one per entry, the world their sum), or one
    error showing the numbers."""
    if replica_stages is not None:
        if sum(replica_stages) != world_size:
            raise ConfigError(f"{source}: world size {world_size} does not match hetloco.replica_stages = "
                              f"{replica_stages}, which needs {sum(replica_stages)} ranks (one per stage of every replica)")
        deep = [m for m, s in enumerate(replica_stages) if num_layers is not None and s > num_layers]
        if deep:
            raise ConfigError(f"{source}: hetloco.replica_stages[{deep[0]}] = {replica_stages[deep[0]]} exceeds the "
                              f"model's {num_layers} decoder layers")
        return len(replica_stages)
    if stages > world_size or world_size % stages != 0:
        raise ConfigError(
            f"{source}: world size {world_size} is not divisible by pipeline.stages = {stages}; "
            f"replicas M = world / stages must be a whole number"
        )
    if num_layers is not None and stages > num_layers:
        raise ConfigError(f"{source}: pipeline.stages = {stages} exceeds the model's {num_layers} decoder layers")
    return world_size // stages


def elastic_replica(run: RunConfig, replica: int) -> RunConfig:
    """Replica `replica`'s own run in an elastic fleet whose config names every replica's depth
    (hetloco.replica_stages): one pipeline of replica_stages[replica] ranks, the fleet's depths in
    `fleet_stages` (None when they are one depth: plain pipeline.stages then), and
    hetloco.elastic.max_replicas = their number. Without replica_stages: `run` itself."""
    depths = run.hetloco.replica_stages
    if depths is None:
        return run
    el = run.hetloco.elastic
    if el.max_replicas is not None and el.max_replicas != len(depths):
        raise ConfigError(f"{run.source}: hetloco.elastic.max_replicas = {el.max_replicas} but hetloco.replica_stages "
                          f"= {depths} names {len(depths)} replicas, one per replica of the fleet (leave max_replicas "
                          "out)")
    if not 0 <= replica < len(depths):
        raise ConfigError(f"--replica-id {replica} is not in 0..{len(depths) - 1} (hetloco.replica_stages = {depths} "
                          f"in {run.source})")
    stages = depths[replica]
    ds = json.loads(json.dumps(run.ds))
    ds.setdefault("pipeline", {})["stages"] = stages
    hetloco = run.hetloco.model_copy(update={
        "replica_stages": None, "elastic": el.model_copy(update={"max_replicas": len(depths)})})
    return dataclasses.replace(run, ds=ds, hetloco=hetloco, stages=stages,
                               fleet_stages=tuple(depths) if len(set(depths)) > 1 else None)


def check_run(run: RunConfig, world_size: int, hidden_size: int, num_layers: int, elastic: bool = False,
              tied: bool = False, replica: int | None = None) -> int:
    """Every check that needs the world size or the model: run once where the job is launched.

    Returns the number of replicas M; `elastic`: the job is one replica of a fleet of
    hetloco.elastic.max_replicas, whose size is returned, `replica` its id. `tied`: the model ties its
    embedding and head."""
    mixed = run.hetloco.replica_stages
    if mixed is not None and elastic:
        raise ValueError("check_run(elastic=True) takes the replica's own run (config.elastic_replica)")
    M = check_topology(world_size, run.stages, run.source, num_layers, mixed)
    made = (f"hetloco.replica_stages = {mixed} makes" if mixed is not None
            else f"{world_size} ranks / pipeline.stages = {run.stages} make")
    if run.fleet_stages is not None:  # an elastic replica of a fleet of mixed depths
        mixed = list(run.fleet_stages)
        deep = [m for m, s in enumerate(mixed) if s > num_layers]
        if deep:
            raise ConfigError(f"{run.source}: hetloco.replica_stages[{deep[0]}] = {mixed[deep[0]]} exceeds the "
                              f"model's {num_layers} decoder layers")
    if mixed is not None and len(set(mixed)) > 1:
        sl = run.hetloco.sparseloco
        if not sl.enabled:
            raise ConfigError(f"{run.source}: hetloco.replica_stages = {mixed} mixes depths, which needs the outer sync "
                              "(hetloco.sparseloco.enabled = false all-reduces gradients between equal stages)")
        if tied and sl.tied_embeddings != "outer_step":
            raise ConfigError(f"{run.source}: hetloco.sparseloco.tied_embeddings = \"{sl.tied_embeddings}\" with mixed "
                              f"hetloco.replica_stages = {mixed}: a tied model's copies must train apart "
                              "(\"outer_step\") on every replica alike")
    if elastic:
        if M != 1:
            depth = (f"pipeline.stages = {run.stages} ranks" if run.fleet_stages is None else
                     f"{run.stages} ranks (replica {replica} of hetloco.replica_stages = {list(run.fleet_stages)})")
            raise ConfigError(f"an elastic replica is one pipeline of {depth}; this job has {world_size} "
                              f"(--nproc {run.stages}, or one replica per launch)")
        M = run.hetloco.elastic.max_replicas
        if M is None:
            raise ConfigError(f"{run.source}: hetloco.elastic.max_replicas is not set: the fleet's size N fixes "
                              "the replica ids 0..N-1 and their data shards")
        made = f"hetloco.elastic.max_replicas = {M} makes"
    if run.hetloco.pipeline.link_transport == "copy_engine" and run.stages > 1:
        import torch

        if not torch.cuda.is_available():  # where the ranks start, they pick their device the same way
            raise ConfigError(f'{run.source}: hetloco.pipeline.link_transport = "copy_engine" moves messages between '
                              "GPUs, and this machine has none")
    sub = run.hetloco.subspace
    where = f"{run.source}: hetloco.subspace"
    if isinstance(sub.compressed_replicas, list):
        missing = [m for m in sub.compressed_replicas if not 0 <= m < M]
        if missing:
            raise ConfigError(f"{where}.compressed_replicas = {sub.compressed_replicas} names replica {missing[0]}, "
                              f"but {made} replicas 0..{M - 1}")
    missing = [m for m in sub.replica_ratios if not 0 <= m < M]
    if missing:
        raise ConfigError(f"{where}.replica_ratios = {sub.replica_ratios} names replica {missing[0]}, "
                          f"but {made} replicas 0..{M - 1}")
    for m in range(M):
        ratio = sub.ratio_for(m, M)
        if hidden_size % ratio != 0:
            key = f"replica_ratios[{m}]" if m in sub.replica_ratios else "ratio"
            raise ConfigError(f"{where}.{key} = {ratio} does not divide the model's hidden_size = {hidden_size} "
                              f"(replica {m} is compressed)")
    return M
