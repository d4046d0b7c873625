"""HetlocoEngine: DeepSpeed's PipelineEngine with SparseLoCo in place of its optimizer step.

What changes against the stock engine, and nothing else:
- no data-parallel gradient all-reduce and no data-parallel loss all-reduce: each replica
  takes H local AdamW steps on its own data (`_exec_reduce_grads`, `_aggregate_total_loss`);
- gradient clipping over the replica's own stages (the norm is reduced over the pipe group);
- bf16 as autocast over fp32 parameters held per replica (DeepSpeed's BF16_Optimizer shards
  master weights across replicas and all-gathers them every step);
- every H steps, the outer step of each stage inside that stage's data-parallel group;
- subspace bookkeeping on compressed replicas (T_S kept in Col(U), eqs. 3-4 after a sync);
- every p2p call and collective is counted by kind (hetloco_ds.meter).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from deepspeed import comm as dist
from deepspeed.runtime.pipe.engine import PipelineEngine

from . import optim, subspace
from .config import HetlocoConfig
from .exchange import all_gather_payloads
from .meter import ByteMeter, get_meter, nbytes
from .sparseloco.outer import SparseLoCoState


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


def _dispatch(name: str):
    def call(self, **kwargs):
        return getattr(self, name)(**kwargs)

    call.__name__ = name
    return call


class HetlocoEngine(PipelineEngine):
    # The stock map holds PipelineEngine's own functions, so subclass overrides would never
    # run; dispatching by name makes every instruction go through normal method lookup.
    _INSTRUCTION_MAP = {cmd: _dispatch(fn.__name__) for cmd, fn in PipelineEngine._INSTRUCTION_MAP.items()}

    def __init__(self, *args, hetloco: HetlocoConfig, bf16: bool, seq_len: int, clip: float, **kwargs):
        self.hetloco = hetloco
        self.clip_norm = clip
        self.bf16 = bf16
        self.seq_len = seq_len
        self.meter: ByteMeter = get_meter()
        super().__init__(*args, **kwargs)
        self.replica = self.grid.data_parallel_id
        self.num_replicas = self.grid.data_parallel_size
        self.dp_group = self.grid.get_data_parallel_group()
        self.pipe_group = self.grid.get_pipe_parallel_group()
        self.local_steps = 0
        self.outer_steps = 0
        self.split_basis: torch.Tensor | None = None
        self.ratio = hetloco.subspace.ratio_for(self.replica, self.num_replicas)
        self.module.autocast_dtype = torch.bfloat16 if bf16 else None
        self._setup_subspace()
        self.outer: SparseLoCoState | None = None
        if hetloco.sparseloco.enabled:
            self.outer = SparseLoCoState(self.trainable_params(), hetloco.sparseloco)
        self.meter.since_mark()

    # ----------------------------------------------------------------- parameters
    def trainable_params(self) -> list[torch.nn.Parameter]:
        """This stage's trainable parameters in a fixed order (the same on every replica)."""
        return [p for p in self.module.parameters() if p.requires_grad]

    def _owned(self, param: torch.nn.Parameter) -> bool:
        """False for a tied copy held by a stage that is not its owner (counted once in norms)."""
        for d in self.module.tied_comms.values():
            if self.global_rank != min(d["ranks"]) and any(param is p for p in d["module"].parameters()):
                return False
        return True

    # ------------------------------------------------------------------- subspace
    def _setup_subspace(self) -> None:
        cfg = self.hetloco.subspace
        d = self.module.llama_config.hidden_size
        wire = torch.bfloat16 if self.bf16 else torch.float32
        if not cfg.any_compressed:
            self.module.configure_boundary(None, wire)
            return
        self.split_basis = subspace.split_basis(cfg, self.num_replicas, d, cfg.seed).to(self.device)
        basis = None
        if cfg.compressed(self.replica, self.num_replicas):
            basis = subspace.make_basis(d, subspace.subspace_dim(d, self.ratio), cfg.seed)
        self.module.configure_boundary(basis, wire)
        # TE lives on the first stage; every stage of the replica needs T_perp = TE - Pi(TE).
        # One dense V x d broadcast at start-up; after that only sparse aggregates move.
        first = self.module.embeddings()[0] if self.module.is_first_stage else None
        table = (first.table().detach().clone() if first is not None else torch.empty(
            self.module.llama_config.vocab_size, d, device=self.device))
        if self.num_stages > 1:
            src = self.grid.stage_to_global(0)
            dist.broadcast(table, src=src, group=self.pipe_group)
            self.meter.add("sent" if self.module.is_first_stage else "recv", nbytes(table), "control")
        t_s, perp = subspace.split_embedding(table, self.split_basis)
        self.module.set_perp(perp)
        with torch.no_grad():
            for emb in self.module.embeddings():
                emb.weight.copy_(t_s)

    def _after_inner_step(self) -> None:
        basis = self.module.codec.basis
        if basis is not None:
            subspace.after_inner_step_(self.module.embeddings(), self.module.local_layers().values(), basis,
                                       self.hetloco.subspace.project_residual_weights)

    # ------------------------------------------------------------ communication
    def _exec_send_activations(self, buffer_id):
        with self.meter.kind("activation"):
            super()._exec_send_activations(buffer_id)

    def _exec_recv_activations(self, buffer_id):
        with self.meter.kind("activation"):
            super()._exec_recv_activations(buffer_id)

    def _exec_send_grads(self, buffer_id):
        with self.meter.kind("activation_grad"):
            super()._exec_send_grads(buffer_id)

    def _exec_recv_grads(self, buffer_id):
        with self.meter.kind("activation_grad"):
            super()._exec_recv_grads(buffer_id)

    def _exec_reduce_tied_grads(self):
        # Tied embedding/head gradients are summed over the replica's own first and last stage.
        for weight, group in self.module.get_tied_weights_and_groups():
            if weight.grad is not None:
                dist.all_reduce(weight.grad, group=group)
                self.meter.add("sent", nbytes(weight.grad), "control")
                self.meter.add("recv", nbytes(weight.grad), "control")

    def _exec_reduce_grads(self):
        if self.outer is None:  # plain data parallelism (the H = 1 AdamW baseline)
            for p in self.trainable_params():
                if p.grad is not None:
                    self.meter.add("sent", nbytes(p.grad), "outer_sync")
                    self.meter.add("recv", nbytes(p.grad), "outer_sync")
            super()._exec_reduce_grads()
        # SparseLoCo: no data-parallel communication between outer steps.

    def _aggregate_total_loss(self):
        # The replica's own loss; no all-reduce across replicas (they meet at outer steps).
        if self.is_last_stage():
            return self._scale_loss_by_gas(self.total_loss).detach().clone()
        return torch.zeros((), device=self.device)

    # ---------------------------------------------------------------- compute
    def _clip_gradients(self) -> torch.Tensor:
        params = [p for p in self.trainable_params() if p.grad is not None]
        # A tied copy on a stage that is not its owner is counted once, by the owner.
        sq = optim.grad_sq_norm([p.grad for p in params if self._owned(p)]).to(self.device)
        if self.num_stages > 1:
            dist.all_reduce(sq, group=self.pipe_group)
            self.meter.add("sent", nbytes(sq), "control")
            self.meter.add("recv", nbytes(sq), "control")
        return optim.clip_([p.grad for p in params], sq, self.clip_norm)

    def _exec_optimizer_step(self, lr_kwargs=None):
        self.last_grad_norm = self._clip_gradients()
        super()._exec_optimizer_step(lr_kwargs)
        self._after_inner_step()

    # ------------------------------------------------------------------ steps
    def train_batch(self, data_iter=None, force_outer: bool = False):
        """One local optimizer step; every H of them (or when forced), the outer step.

        Returns a StepRecord with the replica's loss and the bytes all its ranks moved.
        """
        start = time.perf_counter()
        # DeepSpeed's own monitor event would log a loss that only the last stage knows;
        # our record (below) writes the replica's loss to the monitor instead.
        monitor_enabled = self.monitor.enabled
        self.monitor.enabled = False
        try:
            local_loss = super().train_batch(data_iter)
        finally:
            self.monitor.enabled = monitor_enabled
        self.local_steps += 1
        outer = None
        due = self.local_steps % self.hetloco.sparseloco.inner_steps == 0
        if self.outer is not None and (due or force_outer):
            outer = self.outer_step()
        return self._record(local_loss, time.perf_counter() - start, outer)

    def _record(self, local_loss: torch.Tensor, seconds: float, outer: dict | None) -> StepRecord:
        counts = self.meter.since_mark()
        vec = torch.tensor([float(local_loss)] + self.meter.as_vector(counts), dtype=torch.float64, device=self.device)
        if self.num_stages > 1:
            # One small reduction on the replica's own stage links: the loss from the last
            # stage and every stage's byte counters, summed.
            self.meter.add("sent", nbytes(vec), "control")
            self.meter.add("recv", nbytes(vec), "control")
            dist.all_reduce(vec, group=self.pipe_group)
        values = vec.tolist()
        tokens = self.micro_batch_size * self.micro_batches * self.seq_len
        return StepRecord(
            step=self.local_steps,
            replica=self.replica,
            loss=values[0],
            tokens=tokens,
            seconds=seconds,
            bytes=ByteMeter.from_vector(values[1:]),
            outer=outer,
            extra={"grad_norm": float(getattr(self, "last_grad_norm", float("nan"))), "lr": self.get_lr()[0]},
        )

    def outer_step(self) -> dict:
        """SparseLoCo outer step for this stage, inside this stage's data-parallel group.

        Every rank of the group reaches the all-gather (`exchange.all_gather_payloads`) at the
        same local step with payloads of the same length (the layout depends only on parameter
        shapes), so it cannot deadlock.
        """
        start = time.perf_counter()
        params = self.trainable_params()
        payload = self.outer.prepare(params)
        if self.num_replicas > 1:
            # all_gather on NCCL; on gloo a recv-first pairwise exchange (hetloco_ds.exchange says why)
            gathered = all_gather_payloads(payload, self.dp_group)
            self.meter.add("sent", nbytes(payload), "outer_sync")
            self.meter.add("recv", nbytes(payload) * (self.num_replicas - 1), "outer_sync")
        else:
            gathered = [payload]
        report = self.outer.finish(params, gathered, keep_average=self._embedding_param_indices())
        self._resync_embedding(report)
        self.outer_steps += 1
        if report.excluded and self.global_rank == 0:
            print(f"[hetloco] WARNING outer step {self.outer_steps}: replicas {report.excluded} had a "
                  "non-finite pseudo-gradient and were excluded; they were reset to the synced parameters",
                  flush=True)
        return {
            "outer_step": self.outer_steps,
            "seconds": time.perf_counter() - start,
            "payload_bytes": nbytes(payload),
            "excluded": list(report.excluded),
            "contributors": report.contributors,
        }

    def _embedding_param_indices(self) -> list[int]:
        if self.split_basis is None or not self.hetloco.subspace.embedding_adaptation:
            return []
        params = self.trainable_params()
        return [i for i, p in enumerate(params) if any(p is e.weight for e in self.module.embeddings())]

    def _resync_embedding(self, report) -> None:
        """Eqs. 3-4 on every stage that holds T_perp, from the sparse T_S aggregate alone."""
        if self.split_basis is None or not self.hetloco.subspace.embedding_adaptation:
            return
        params = self.trainable_params()
        vocab, d = self.module.llama_config.vocab_size, self.module.llama_config.hidden_size
        if self.module.is_first_stage:
            idx = self._embedding_param_indices()[0]
            avg = report.averages[idx]
        else:
            avg = torch.empty(vocab, d, device=self.device)
        if self.num_stages > 1:
            # The first stage sends the averaged T_S pseudo-gradient's sparse form: the
            # decoded average of M top-k payloads has at most M*k entries per chunk.
            avg = self._broadcast_sparse(avg)
        embeddings = self.module.embeddings()
        t_s = embeddings[0].weight if embeddings else None
        subspace.resync_embedding_(t_s, self.module.codec.perp, avg, self.hetloco.sparseloco.outer_lr, self.split_basis)
        with torch.no_grad():
            for emb in embeddings[1:]:
                emb.weight.copy_(t_s)
        for i, p in enumerate(params):
            if any(p is e.weight for e in embeddings):
                self.outer.rebase(i, p)

    def _broadcast_sparse(self, dense: torch.Tensor) -> torch.Tensor:
        """Broadcast a mostly-zero tensor from the first stage as (int32 indices, values)."""
        src = self.grid.stage_to_global(0)
        count = torch.zeros(1, dtype=torch.int64, device=self.device)
        if self.module.is_first_stage:
            flat = dense.reshape(-1)
            idx = flat.nonzero().reshape(-1).to(torch.int32)
            vals = flat[idx.long()]
            count[0] = idx.numel()
        dist.broadcast(count, src=src, group=self.pipe_group)
        n = int(count.item())
        if not self.module.is_first_stage:
            idx = torch.empty(n, dtype=torch.int32, device=self.device)
            vals = torch.empty(n, dtype=dense.dtype, device=self.device)
        dist.broadcast(idx, src=src, group=self.pipe_group)
        dist.broadcast(vals, src=src, group=self.pipe_group)
        size = nbytes(count) + nbytes(idx) + nbytes(vals)
        self.meter.add("sent" if self.module.is_first_stage else "recv", size, "embedding_sync")
        if self.module.is_first_stage:
            return dense
        out = torch.zeros_like(dense).reshape(-1)
        out[idx.long()] = vals
        return out.reshape(dense.shape)

    # ------------------------------------------------------------- validation
    @torch.no_grad()
    def evaluate(self, data_iter, micro_batches: int) -> float | None:
        """Mean loss of this replica's pipeline over `micro_batches` batches; no cross-replica traffic."""
        train_iter = self.data_iterator
        self.module.eval()
        self._compute_loss = True
        self.set_dataiterator(data_iter)
        self._exec_schedule(self._inference_schedule(micro_batches))
        loss = None
        if self.is_last_stage():
            loss = float(torch.stack([l.float() for l in self.fwd_outputs]).mean())
        self.set_dataiterator(train_iter)
        self.module.train()
        self.meter.since_mark()  # validation traffic stays out of the next step's row (totals keep it)
        return loss
