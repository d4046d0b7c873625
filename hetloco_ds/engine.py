"""HetlocoEngine: DeepSpeed's PipelineEngine with SparseLoCo in place of its optimizer step.

The engine is glue: DeepSpeed runs the pipeline schedule; the method is the stage's
`StageAlgorithm`; the engine implements the hooks of the DeepSpeed adapter (`patches`), where
it differs from the stock engine in this, and nothing else:
- no data-parallel gradient all-reduce and no data-parallel loss all-reduce: each replica
  takes H local AdamW steps on its own data;
- gradient clipping over the replica's own stages (the norm is reduced over the pipe group);
- bf16 as autocast over fp32 parameters held per replica (DeepSpeed's BF16_Optimizer shards
  master weights across replicas and all-gathers them every step);
- every H steps, the outer step of each stage inside that stage's data-parallel group;
- its own sends and receives on the stage links, so every byte is counted, by kind, in this
  engine's ByteMeter;
- by default its own schedule (`pipe.schedule.OverlappedTrainSchedule`): stage-link transfers
  run beside the compute instead of blocking it (`hetloco.pipeline.schedule`).
"""
from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass, field

import torch
from deepspeed import comm as dist

from . import casts, optim, sizes
from .algorithm import StageAlgorithm
from .config import RunConfig
from .meter import ByteMeter, nbytes, peak_memory_bytes
from .model import head_dim
from .patches import PipelineEngineAdapter
from .pipe import order, schedule as pipe_schedule
from .pipe.links import StageLinks, gemm_sm_carveout, open_links
from .transport import member_ids
from .transport.static import GroupTransport, PipeStageLink, block_groups

# DeepSpeed's PipelineEngine.__init__ puts these on the wire before our counters exist: a
# 4-byte loss scalar to the next stage (a p2p "warm-up") and a [2] int64 parameter count
# all-reduced over the model-parallel group. They are counted as control once the meter exists.
_DS_INIT_P2P_BYTES = 4
_DS_INIT_PARAM_COUNT_BYTES = 16


@dataclass
class StepRecord:
    """What one optimizer step of one replica produced (all of its stages summed)."""

    step: int
    replica: int
    loss: float
    tokens: int
    seconds: float
    bytes: dict
    outer: dict | None = None
    extra: dict = field(default_factory=dict)


class HetlocoEngine(PipelineEngineAdapter):
    INSTRUCTIONS = {
        pipe_schedule.PostRecvActivation: "post_recv_activations",
        pipe_schedule.WaitRecvActivation: "exec_wait_recv_activation",
        pipe_schedule.SendActivationAsync: "exec_send_activation_async",
        pipe_schedule.PostRecvGrad: "post_recv_grads",
        pipe_schedule.WaitRecvGrad: "exec_wait_recv_grad",
        pipe_schedule.SendGradAsync: "exec_send_grad_async",
        pipe_schedule.WaitSends: "wait_sends",
    }

    def __init__(self, *args, run: RunConfig, seq_len: int, replica: tuple[int, int] | None = None,
                 transport=None, **kwargs):
        """`replica`: (this replica's id, the fleet's size) when the job is one replica of an elastic
        fleet (default: the module's replica in this world and the world's replicas). `transport`:
        engine -> ReplicaTransport, called once the stage's algorithm is set up (default: the static
        GroupTransport of each outer-sync block this rank holds)."""
        self.run = run
        self.hetloco = hetloco = run.hetloco
        self.seq_len = seq_len
        self.meter = ByteMeter()
        self.cast_weights_once = True
        """bf16: each weight's autocast cast made once per optimizer step, not once per micro-batch
        (`_weight_casts`); False gives the per-micro-batch casts (the same bits, more work)."""
        super().__init__(*args, **kwargs)
        self.step_casts = self._step_casts_pay(run)
        """Cast-once through `casts.step_casts` (each micro-batch's gradients leave as made) rather
        than autocast's cache alone: where `sizes.step_casts_pay` says it lowers this stage's peak."""
        self.replica, self.num_replicas = replica or self.module.replica
        self.dp_group = self.grid.get_data_parallel_group()
        self.replica_stages = self.hetloco.replica_stages if replica is None else None
        """Each replica's depth when this world's replicas have their own grids (static mode), else None."""
        self.block_depths = self.replica_stages or run.fleet_stages
        """The depths the outer-sync blocks are cut for (`sizes.block_parts`): the static world's replicas'
        or an elastic replica's fleet's; None when every replica has this one depth (a block per stage)."""
        self.pipe_group = self.grid.get_pipe_parallel_group()
        self.local_steps = 0
        self._count_deepspeed_init_traffic()
        # NCCL: a receive posted ahead is a kernel spinning on the device until the peer sends, and
        # the peer's send may wait on this stage's own later work. Anything that synchronises the
        # whole device meanwhile (CUDA's lazy loading of a kernel's first use, a cudaFree) then
        # deadlocks both stages. The first step, which loads every kernel and fills the allocator's
        # cache, therefore runs the blocking schedule (the same bits: only timing differs).
        self._blocking_steps_left = 1 if self.device.type == "cuda" else 0  # per process: a resumed one too
        self.compute_seconds = 0.0
        """Host seconds in forward and backward passes since the last step record (CPU: the
        compute; CUDA: mostly launch time, the device runs ahead)."""
        self.stage_link = PipeStageLink(self.pipe_group, self.grid.stage_to_global(0), self.is_first_stage(),
                                        self.num_stages, self.device, self.meter,
                                        self.grid.stage_to_global(self.num_stages - 1), self.is_last_stage())
        cfg = self.module.llama_config
        self.algorithm = StageAlgorithm(
            self.trainable_params(), hetloco, replica=self.replica, num_replicas=self.num_replicas,
            hidden_size=cfg.hidden_size, vocab_size=cfg.vocab_size, device=self.device,
            embeddings=self.module.embeddings(), layers=list(self.module.local_layers().values()),
            tied=bool(cfg.tie_word_embeddings) and (self.num_stages > 1 or self.module.head_apart),
            blocks=self._param_blocks(), bf16=run.bf16)
        self.module.autocast_dtype = torch.bfloat16 if run.bf16 else None
        self.module.codec = self.algorithm.codec
        self._open_links()
        self.algorithm.setup(self.stage_link)
        if transport is not None:
            self.transports = [transport(self)]
        elif self.replica_stages is None:
            self.transports = [GroupTransport(self.dp_group, self.meter)]
        else:
            groups = block_groups(sizes.block_ranks(cfg.num_hidden_layers, self.replica_stages))  # collective
            self.transports = [GroupTransport(groups[b], self.meter) for b in self.blocks_held()]
        self.transport = self.transports[0]
        """The first block's: the one that carries the hooks (`begin`, `outer_fields`, `state_dict`, ...)."""
        self.meter.since_mark()

    @property
    def num_blocks(self) -> int:
        """Outer-sync blocks of the model (`sizes.block_parts`): one per stage when every replica has this depth."""
        if self.block_depths is None:
            return self.num_stages
        return len(sizes.block_parts(self.module.llama_config.num_hidden_layers, self.block_depths)) - 1

    def blocks_held(self) -> list[int]:
        """The outer-sync blocks (`sizes.block_parts`) this rank holds, in order (one depth: its stage)."""
        if self.block_depths is None:
            return [self.stage_id]
        n = self.module.llama_config.num_hidden_layers
        return sizes.stage_blocks(n, self.num_stages, self.stage_id, sizes.block_parts(n, self.block_depths))

    def _param_blocks(self) -> list[list[int]] | None:
        """Indices into `trainable_params()` of each block this rank holds (None: the stage is one
        block). In the stage's parameter order within a block: DeepSpeed registers the tied modules
        first, then the layers by index, on every stage alike, so each replica lists a block's
        parameters in the same order."""
        if self.block_depths is None:
            return None
        n = self.module.llama_config.num_hidden_layers
        parts = sizes.block_parts(n, self.block_depths)
        layer_of: dict[int, int] = {}
        for idx, module in sorted(self.module.local_layers().items()):
            for p in module.parameters():
                layer_of.setdefault(id(p), idx)
        return sizes.params_by_block([layer_of[id(p)] for p in self.trainable_params()], self.blocks_held(), parts)

    def _open_links(self) -> None:
        """The schedule, and the stage links over the one backend `pipe.links.open_links` chooses for
        it (collective: every rank of the job)."""
        links = open_links(self.hetloco.pipeline, self._replica_ranks(), self.global_rank, self.device, self.meter,
                           self._message_spec)
        self.schedule, self.link_transport = links.schedule, links.transport
        self.links = StageLinks(
            self.grid.stage_to_global(self.stage_id - 1) if not self.is_first_stage() else None,
            self.grid.stage_to_global(self.stage_id + 1) if not self.is_last_stage() else None,
            self.device, self.meter, links.backend, self.stage_id)
        pipe = self.hetloco.pipeline
        self.gemm_sm_carveout = gemm_sm_carveout(pipe.gemm_sm_carveout, pipe.link_max_ctas, links.resident_kernels,
                                                 self.device)
        """SMs this process's matmuls leave to the stage's link kernels (0: none; pipe.links.gemm_sm_carveout)."""

    def _replica_ranks(self) -> list[list[int]]:
        """Every pipeline of this job, as its global ranks by stage."""
        return self.module.replica_ranks()

    def _count_deepspeed_init_traffic(self) -> None:
        if not self.is_last_stage():
            self.meter.add("sent", _DS_INIT_P2P_BYTES, "control")
        if not self.is_first_stage():
            self.meter.add("recv", _DS_INIT_P2P_BYTES, "control")
        if self.num_stages > 1:
            self.meter.add("sent", _DS_INIT_PARAM_COUNT_BYTES, "control")
            self.meter.add("recv", _DS_INIT_PARAM_COUNT_BYTES, "control")

    @property
    def outer_steps(self) -> int:
        return self.algorithm.outer_steps

    def trainable_params(self) -> list[torch.nn.Parameter]:
        """This stage's trainable parameters in a fixed order (the same on every replica)."""
        return [p for p in self.module.parameters() if p.requires_grad]

    # ------------------------------------------------------------ stage links (adapter hooks)
    def _message_spec(self):
        return self.algorithm.codec.message_spec(self.micro_batch_size, self.seq_len)

    def _grad_spec(self):
        return self.algorithm.codec.grad_spec(self.micro_batch_size, self.seq_len)

    def send_activations(self, outputs):
        self.links.send(outputs if isinstance(outputs, tuple) else (outputs,), True, "activation")

    def recv_activations(self):
        message = self.links.recv(self._message_spec(), True, "activation")
        for t in message:
            t.requires_grad = t.is_floating_point()
        return message[0] if len(message) == 1 else tuple(message)

    def send_grads(self, inputs):
        inputs = inputs if isinstance(inputs, tuple) else (inputs,)
        self.links.send([t.grad for t in inputs if t.is_floating_point()], False, "activation_grad")

    def recv_grads(self, outputs):
        grads = self.links.recv(self._grad_spec(), False, "activation_grad")
        return grads[0] if isinstance(outputs, torch.Tensor) else grads

    # ------------------------------------------------- overlapped schedule (adapter hooks)
    def train_schedule(self):
        if self.schedule == "blocking" or self._blocking_steps_left > 0:
            self._blocking_steps_left = max(0, self._blocking_steps_left - 1)
            return super().train_schedule()
        return pipe_schedule.OverlappedTrainSchedule(self.micro_batches, self.num_stages, self.stage_id)

    @property
    def _in_flight(self) -> int:
        """Sends kept in flight: the micro-batches this stage holds (their tensors are alive anyway)."""
        return order.depth(self.schedule, self.num_stages, self.stage_id, self.micro_batches)

    def post_recv_activations(self, micro_batch):
        self.links.post_recv(micro_batch, self._message_spec(), True, "activation")

    def wait_recv_activations(self, micro_batch):
        message = self.links.wait_recv(micro_batch, True)
        for t in message:
            t.requires_grad = t.is_floating_point()
        return message[0] if len(message) == 1 else tuple(message)

    def isend_activations(self, outputs, micro_batch):
        self.links.isend(outputs if isinstance(outputs, tuple) else (outputs,), True, "activation",
                         keep=self._in_flight)

    def post_recv_grads(self, micro_batch):
        self.links.post_recv(micro_batch, self._grad_spec(), False, "activation_grad")

    def wait_recv_grads(self, outputs, micro_batch):
        grads = self.links.wait_recv(micro_batch, False)
        return grads[0] if isinstance(outputs, torch.Tensor) else grads

    def isend_grads(self, inputs, micro_batch):
        inputs = inputs if isinstance(inputs, tuple) else (inputs,)
        self.links.isend([t.grad for t in inputs if t.is_floating_point()], False, "activation_grad",
                         keep=self._in_flight)

    def wait_sends(self):
        self.links.wait_sends()

    def batch_to_device(self, tensor):
        # DeepSpeed copies each micro-batch from pageable memory, which blocks the host until the
        # device has caught up, once per micro-batch on the first and last stage: the host can
        # never queue work ahead of the device. From pinned memory the copy is queued like a
        # kernel (the caching host allocator keeps the block until the copy is done).
        if self.device.type != "cuda":
            return super().batch_to_device(tensor)
        return tensor.detach().pin_memory().to(self.device, non_blocking=True)

    def forward_pass(self, buffer_id):
        start = time.perf_counter()
        super().forward_pass(buffer_id)
        self.compute_seconds += time.perf_counter() - start

    def backward_pass(self, buffer_id):
        start = time.perf_counter()
        super().backward_pass(buffer_id)
        self.compute_seconds += time.perf_counter() - start

    def reduce_tied_grads(self):
        if self.algorithm.tied_apart:
            return  # the copies train apart and meet at the outer step (StageAlgorithm.sync_embeddings)
        # Exact tying: gradients summed over the replica's own first and last stage (dense V x d).
        for weight, group in self.module.get_tied_weights_and_groups():
            if weight.grad is not None:
                dist.all_reduce(weight.grad, group=group)
                self.meter.add("sent", nbytes(weight.grad), "control")
                self.meter.add("recv", nbytes(weight.grad), "control")

    def reduce_grads(self):
        if self.algorithm.sparseloco:
            return  # SparseLoCo: no data-parallel communication between outer steps
        # Plain data parallelism (the H = 1 AdamW baseline): DeepSpeed's all-reduce.
        for p in self.trainable_params():
            if p.grad is not None:
                self.meter.add("sent", nbytes(p.grad), "outer_sync")
                self.meter.add("recv", nbytes(p.grad), "outer_sync")
        self.ds_reduce_grads()

    def replica_loss(self):
        # The replica's own loss; no all-reduce across replicas (they meet at outer steps).
        if self.is_last_stage():
            return self.gas_scaled_loss().detach().clone()
        return torch.zeros((), device=self.device)

    # ---------------------------------------------------------------- compute
    def _clip_gradients(self) -> torch.Tensor:
        params = [p for p in self.trainable_params() if p.grad is not None]
        # Exactly tied, a copy on a stage that is not its owner is counted once, by the owner;
        # tied apart, the copies are two parameters with their own gradients.
        sq = optim.grad_sq_norm([p.grad for p in params
                                 if self.algorithm.tied_apart or self.module.tied_copy_owned(p, self.global_rank)])
        sq = sq.to(self.device)
        if self.num_stages > 1:
            dist.all_reduce(sq, group=self.pipe_group)
            self.meter.add("sent", nbytes(sq), "control")
            self.meter.add("recv", nbytes(sq), "control")
        return optim.clip_([p.grad for p in params], sq, self.run.clip)

    def optimizer_step(self, lr_kwargs=None):
        self.last_grad_norm = self._clip_gradients()
        decay = optim.decoupled_decay(self.optimizer)
        self.ds_optimizer_step(lr_kwargs)
        self.algorithm.after_inner_step(self.stage_link, decay)

    # ------------------------------------------------------------------ steps
    def train_batch(self, data_iter=None) -> torch.Tensor:
        """DeepSpeed's contract: one optimizer step of this replica (every H-th also the outer
        sync); returns the replica's loss, the same tensor on every stage. The step's full record
        (bytes by link class, seconds, the outer step) is `last_record`."""
        return torch.tensor(self.train_step(data_iter).loss, device=self.device)

    def train_step(self, data_iter=None, force_outer: bool = False) -> StepRecord:
        """One local optimizer step; every H of them (or when forced), the outer step.

        Returns a StepRecord with the replica's loss and the bytes all its ranks moved.
        """
        start = time.perf_counter()
        # DeepSpeed's own monitor event would log a loss that only the last stage knows;
        # our record (below) writes the replica's loss to the monitor instead.
        monitor_enabled = self.monitor.enabled
        self.monitor.enabled = False
        try:
            with self._weight_casts():
                local_loss = super().train_batch(data_iter)
        finally:
            self.monitor.enabled = monitor_enabled
        self.local_steps += 1
        outer = None
        due = self.local_steps % self.hetloco.sparseloco.inner_steps == 0
        if self.algorithm.sparseloco and (due or force_outer):
            outer = self.outer_step()
        self.last_record = self._record(local_loss, start, outer)
        return self.last_record

    def _weight_casts(self):
        """Around one optimizer step under bf16: each weight cast to bf16 once for every micro-batch
        of the step instead of again each time (DeepSpeed's bf16 keeps bf16 weights and casts
        none): through autocast's own cache, kept by an outer, disabled autocast region until the
        step returns, and where `step_casts` (the linear layers' weights) through `casts.step_casts`,
        whose gradients leave each micro-batch's backward as they are made. Never for compiled
        layers (a cache that changes every step inside a compiled region would recompile it). The
        weights change only at the step's end; the casts are dropped when it returns. The cast values
        are the same, so are the bits."""
        if self.module.autocast_dtype is None or not self.cast_weights_once:
            return contextlib.nullcontext()
        stack = contextlib.ExitStack()
        stack.enter_context(torch.autocast(device_type=self.device.type, enabled=False))
        if self.step_casts:
            stack.enter_context(casts.step_casts(self.module.modules(), self.module.autocast_dtype))
        return stack

    def _step_casts_pay(self, run: RunConfig) -> bool:
        if not run.bf16 or self.hetloco.train.compile:
            return False
        cfg = self.module.llama_config
        linears = casts.cast_linears(self.module.modules())
        kv_dim = cfg.num_key_value_heads * head_dim(cfg)
        layers = sizes.decoder_layers_per_stage(cfg.num_hidden_layers, self.num_stages)[self.stage_id]
        parts = self.module.parts
        recomputed = sizes.recomputed_runs(cfg.num_hidden_layers, parts[self.stage_id], parts[self.stage_id + 1],
                                           self.module.activation_checkpoint_interval)
        return sizes.step_casts_pay(sum(m.weight.numel() for m in linears), self.micro_batches, layers,
                                    self.micro_batch_size * self.seq_len, cfg.hidden_size, cfg.intermediate_size,
                                    kv_dim, recomputed=recomputed)

    def _record(self, local_loss: torch.Tensor, start: float, outer: dict | None) -> StepRecord:
        counts = self.meter.since_mark()
        S = self.num_stages
        compute, memory = [0.0] * S, [0.0] * S
        compute[self.stage_id], self.compute_seconds = self.compute_seconds, 0.0
        memory[self.stage_id] = float(peak_memory_bytes(torch.device(self.device)))  # exact in float64 below 2**53
        vec = torch.tensor([float(local_loss)] + self.meter.as_vector(counts) + compute + memory, dtype=torch.float64,
                           device=self.device)
        if S > 1:
            # One small reduction on the replica's own stage links: the loss from the last
            # stage, every stage's byte counters (summed), each stage's compute seconds and
            # peak memory (the writer is one stage; the GPU nearest its limit may be another).
            self.meter.add("sent", nbytes(vec), "control")
            self.meter.add("recv", nbytes(vec), "control")
            dist.all_reduce(vec, group=self.pipe_group)
        values = vec.tolist()
        # Timed after the host has the loss: on a GPU the step's kernels are done only then.
        seconds = time.perf_counter() - start
        tokens = self.micro_batch_size * self.micro_batches * self.seq_len
        return StepRecord(
            step=self.local_steps,
            replica=self.replica,
            loss=values[0],
            tokens=tokens,
            seconds=seconds,
            bytes=ByteMeter.from_vector(values[1:-2 * S]),
            outer=outer,
            extra={"grad_norm": float(getattr(self, "last_grad_norm", float("nan"))), "lr": self.get_lr()[0],
                   "compute_seconds": values[-2 * S:-S], "peak_memory_bytes_by_stage": [int(v) for v in values[-S:]]},
        )

    def outer_step(self) -> dict:
        """SparseLoCo outer step for this stage, inside this stage's data-parallel group."""
        start = time.perf_counter()
        self.transport.begin()  # elastic: this boundary's quorum, which may replace the stage's synced state
        result = self.algorithm.outer_step(self.transports, self.stage_link)
        nonfinite = [m for m in result.excluded if m not in result.screened]
        if nonfinite and self.global_rank == 0:
            print(f"[hetloco] WARNING outer step {result.outer_step}: replicas {nonfinite} had a "
                  "non-finite pseudo-gradient and were excluded; they were reset to the synced parameters",
                  flush=True)
        # Rank 0 sees the first stage's decision, the metrics row the last stage's: both say theirs.
        if result.screened and (self.global_rank == 0 or (self.is_last_stage() and self.replica == 0)):
            why = {i: {k: round(v[m], 4) for k, v in result.scores.items()}
                   for i, m in zip(member_ids(result.screened), result.screened)}
            print(f"[hetloco] WARNING outer step {result.outer_step}, stage {self.stage_id}: replicas "
                  f"{member_ids(result.screened)} sent a pseudo-gradient that sparseloco.screen "
                  f"{self.hetloco.sparseloco.screen!r} rejected {why}; they were excluded and reset to the synced "
                  "parameters", flush=True)
        screen = {"screened": member_ids(result.screened), "screen_scores": result.scores}
        return {
            "outer_step": result.outer_step,
            "seconds": time.perf_counter() - start,
            "payload_bytes": result.payload_bytes,
            "excluded": member_ids(result.excluded),
            "contributors": member_ids(result.contributors),
            **(screen if result.scores else {}),
            **self.transport.outer_fields(),
        }

    # ------------------------------------------------------------- validation
    @torch.no_grad()
    def evaluate(self, data_iter, micro_batches: int) -> float | None:
        """Mean loss of this replica's pipeline over `micro_batches` batches; no cross-replica traffic."""
        train_iter = self.data_iterator
        self.module.eval()
        self.set_dataiterator(data_iter)
        losses = self.run_inference(micro_batches)
        loss = float(torch.stack([l.float() for l in losses]).mean()) if self.is_last_stage() else None
        self.set_dataiterator(train_iter)
        self.module.train()
        self.meter.since_mark()  # validation traffic stays out of the next step's row (totals keep it)
        return loss

    def _from_last_stage(self, values: list[float]) -> torch.Tensor:
        """The last stage's `values` on every stage of the replica (one small broadcast, control)."""
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        if self.num_stages > 1:
            dist.broadcast(t, src=self.grid.stage_to_global(self.num_stages - 1), group=self.pipe_group)
            self.meter.add("sent" if self.is_last_stage() else "recv", nbytes(t), "control")
        return t

    def eval_batch(self, data_iter, num_micro_batches: int | None = None) -> torch.Tensor:
        """DeepSpeed's contract: this replica's mean loss over `num_micro_batches` (default: the
        step's micro-batches) of `data_iter`, the same tensor on every stage."""
        loss = self.evaluate(data_iter, num_micro_batches or self.micro_batches)
        return self._from_last_stage([loss or 0.0])[0].float()

    def validation_losses(self, data_iter, micro_batches: int) -> dict[int, float]:
        """{replica: loss} of every replica of this job over the same held-out batches, each
        through its own pipeline (a compressed replica through its compressed boundaries), as the
        paper averages validation; the same on every rank. Every rank calls it at the same step.
        An elastic replica is its own job: only its own loss."""
        loss = self.evaluate(data_iter, micro_batches)
        me, here = self.module.replica
        losses = [0.0] * here
        if self.is_last_stage():
            losses[me] = loss
            if here > 1:
                # The replicas' last stages sum their one-hot vectors; then each broadcasts the
                # list over its own pipe group: two collectives, in this order on every rank.
                # (Replicas of their own depths: the last stages are the last block's group.)
                t = torch.tensor(losses, dtype=torch.float64, device=self.device)
                dist.all_reduce(t, group=self.dp_group if self.replica_stages is None else self.transports[-1].group)
                self.meter.add("sent", nbytes(t), "control")
                self.meter.add("recv", nbytes(t), "control")
                losses = t.tolist()
        values = self._from_last_stage(losses).tolist()
        ids = list(range(here)) if here == self.num_replicas else [self.replica]
        return dict(zip(ids, values))

    # ------------------------------------------------------------- checkpoints and export
    def save_checkpoint(self, save_dir, tag=None, client_state=None, save_latest=True, data_position: int | None = None,
                        keep: int = 0, **_):
        """Every rank's whole state (module, AdamW moments, error feedback, theta at the last sync,
        T_perp, LR schedule, counters, `data_position` (default: where the loader `initialize` made
        stands), `client_state`) under SAVE_DIR/TAG
        (default global_step<N>), committed atomically across ranks before it returns
        (`checkpoint.save`), and the model's HF metadata beside it, so `hetloco-ds export SAVE_DIR`
        works; a collective. `client_state` must be plain data (dicts, lists, tuples, strings,
        numbers, bytes, None, tensors): checkpoints are read back without running code, so
        anything else is refused (CheckpointError on every rank, nothing committed). DeepSpeed's own save would keep one replica's optimizer only and no
        algorithm state."""
        from . import checkpoint

        if not save_latest:
            raise ValueError("save_checkpoint(save_latest=False) is not supported: a commit always names itself in "
                             "`latest`, which is how --resume and export find the newest complete checkpoint")
        self.client_state = dict(client_state or {})
        if data_position is None:
            loader = getattr(self, "training_dataloader", None)
            data_position = loader.position if loader is not None else 0
        committed = checkpoint.save(self, str(save_dir), self.local_steps, data_position, keep=keep, tag=tag)
        if self.global_rank == 0:
            self._write_hf_meta(save_dir)
        dist.barrier()
        return committed

    def _write_hf_meta(self, ckpt_dir, tokenizer=None) -> None:
        from . import hf_export

        source = getattr(self, "hf_source", None)
        hf_export.save_hf_meta(ckpt_dir, self.module.llama_config, tokenizer, model_dir=source, tokenizer_dir=source)

    def load_checkpoint(self, load_dir, tag=None, load_module_strict=True, load_optimizer_states=True,
                        load_lr_scheduler_states=True, load_module_only=False, custom_load_fn=None, **_):
        """Restore what save_checkpoint wrote (default: the newest complete checkpoint); returns
        (path, client_state) as DeepSpeed does, the data position under client_state["data_position"].
        As DeepSpeed: `load_module_only` loads the weights alone (theta_prev set to them), and
        `load_optimizer_states` / `load_lr_scheduler_states` False keep this engine's own."""
        from . import checkpoint

        if not load_module_strict or custom_load_fn is not None:
            raise ValueError("load_checkpoint: load_module_strict=False and custom_load_fn are not supported "
                             "(a hetloco checkpoint always holds every layer of every stage)")
        position = checkpoint.load(self, str(load_dir), tag, module_only=load_module_only,
                                   optimizer=load_optimizer_states, lr_scheduler=load_lr_scheduler_states)
        if load_module_only:
            return str(load_dir), {}
        loader = getattr(self, "training_dataloader", None)
        if loader is not None:  # the loader `initialize` made continues where the saved run stood
            loader.load_state_dict({**loader.state_dict(), "position": position})
        return str(load_dir), {**getattr(self, "client_state", {}), "data_position": position}

    def replicas_synced(self) -> bool:
        """Whether every rank's parameters are the synced model of the last outer step
        (`StageAlgorithm.at_sync`): true right after a step that synced, false after inner steps
        since. A collective; the same answer on every rank."""
        flag = torch.tensor([1.0 if self.algorithm.at_sync() else 0.0], device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        self.meter.add("sent", nbytes(flag), "control")
        self.meter.add("recv", nbytes(flag), "control")
        return bool(flag.item())

    def save_pretrained(self, save_dir, tokenizer=None) -> None:
        """The synced model as a Hugging Face directory that `transformers` loads as is (a
        collective: every rank calls it). Written through a temporary checkpoint and
        `hf_export.export`, as `hetloco-ds export` writes it.

        Only at an outer-step boundary: between outer steps each replica holds its own inner
        weights and none of them is the model, so it raises (on every rank, before writing
        anything) rather than export replica 0's. `outer_step()` on every rank syncs first."""
        import shutil

        from . import checkpoint, hf_export

        if not self.replicas_synced():
            H = self.hetloco.sparseloco.inner_steps
            raise ValueError(f"save_pretrained at step {self.local_steps}: not at an outer-step boundary (inner steps "
                             f"since outer step {self.outer_steps}, hetloco.sparseloco.inner_steps = {H}), so the "
                             "replicas' weights differ from the synced model; call it after a step that syncs, or "
                             "call engine.outer_step() on every rank first")
        save_dir = os.path.abspath(save_dir)
        tmp = f"{save_dir}.ckpt-tmp"
        if self.global_rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        dist.barrier()
        checkpoint.save(self, tmp, self.local_steps, 0)
        if self.global_rank == 0:
            try:
                self._write_hf_meta(tmp, tokenizer)
                hf_export.export(tmp, save_dir, progress=False, overwrite=True)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
        dist.barrier()
