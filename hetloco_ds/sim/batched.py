"""The simulator with the M replicas of a row run as one batched computation on one device.

`replica.Simulation` gives each replica its own modules, so a step launches every kernel M
times at a size one replica fills; on a GPU a 20M-parameter model is then bound by kernel
launches, not by arithmetic. Here every parameter is stored once, stacked along a leading replica
dimension ([M, *shape]); each virtual stage's layers (the same `model.py` modules the engine
runs) are called once for all replicas through `torch.func.functional_call` under
`torch.func.vmap`, so a linear layer is one batched GEMM over the M replicas' weights and
attention folds the replicas into its batch. One AdamW steps the stacked tensors (AdamW is
elementwise, so it is M AdamWs); clipping scales each replica by its own norm.

The method is not re-implemented: each (replica, stage) keeps its own `StageAlgorithm` and
`LocalStageLink`, built on per-replica modules whose parameters are views of row m of the stacked
tensors and whose T_perp is a view of a stacked buffer. The embedding split, what follows each
inner step (T_perp's share of the weight decay, the ablations' projections, the AdamW-het
re-split) and the outer step (`core.outer_step_all`, shared with the per-replica simulator)
write through those views into the tensors the batched forward reads.

Stage boundaries: every replica's codec is its StageAlgorithm's (`StageAlgorithm.codec`). Each
codec class in the row runs its own pure functions (`BoundaryCodec.encode_hidden` /
`decode_hidden`) once under vmap for all replicas, over its replicas' `tensors()` stacked by the
class (`BoundaryCodec.stack`: the subspace codec zero-pads bases to the row's largest k, whose
extra columns carry zeros both ways, so replicas of different ratios share one batched codec);
each replica's row is then taken from its own class's result.
"""
from __future__ import annotations

import copy
import functools

import torch
from torch import nn
from torch.func import functional_call, vmap

from .. import optim, sizes
from ..boundary import CODECS, codec_name
from ..config import ConfigError, HetlocoConfig, RunConfig
from ..model import TokenEmbedding, causal_lm_loss, layer_list
from .core import build_layers, link_bytes, outer_step_all, stage_algorithms, tied_apart
from .sharded import Shards


class _Stage(nn.Module):
    """One virtual stage's template layers in order (a tied head through its forward_fn)."""

    def __init__(self, layers, fns):
        super().__init__()
        self.layers = nn.ModuleList(layers)
        self.fns = fns

    def forward(self, x):
        for layer, fn in zip(self.layers, self.fns):
            x = layer(x) if fn is None else fn(layer, x)
        return x


class ReplicaView:
    """Replica m's modules, parameters and per-stage method state, its parameters being views of
    row m of the stacked tensors (what StageAlgorithm reads and writes)."""

    def __init__(self, template, stacked: dict[int, nn.Parameter], m: int, parts, hetloco, num_replicas, device,
                 row: int | None = None, bf16: bool = False):
        self.replica = m  # the global id (a sharded row's block holds rows 0.. of its stacked tensors)
        row = m if row is None else row
        memo = {pid: nn.Parameter(t.detach()[row], requires_grad=False) for pid, t in stacked.items()}
        self.layers = copy.deepcopy(template, memo)
        self.parts = parts
        self.stage_params, self.algorithms, self.links, self.block_ids = stage_algorithms(
            self.layers, parts, hetloco, m, num_replicas, device, bf16=bf16)
        self.params = [p for ps in self.stage_params for p in ps]

    @property
    def width(self) -> int:
        """Elements per token on this replica's stage links (its codec's: k when compressed, d otherwise)."""
        return self.algorithms[0].codec.width


class BatchedSimulation:
    """M replicas x S virtual stages as one batched computation; the interface of
    `replica.Simulation` (train_step, outer_step, validation_losses, link_bytes_per_step).

    With `shards` (a `sharded.Shards` of G processes) this process holds only its block of the M
    replicas (`replicas`, `params` and losses are that block's); whatever couples replicas
    meets the other blocks through it (sim/sharded.py)."""

    def __init__(self, run: RunConfig, hetloco: HetlocoConfig, llama_config, replicas: int, stages: int, device,
                 compile: bool = False, shards: Shards | None = None):
        if hetloco.replica_stages is not None and len(set(hetloco.replica_stages)) > 1:
            # vmap runs one stage function over every replica's row: the replicas must be cut alike.
            raise ConfigError(f"the batched simulator runs replicas cut alike; hetloco.replica_stages = "
                              f"{hetloco.replica_stages} mixes depths: use --per-replica")
        self.run, self.hetloco, self.M, self.S, self.device = run, hetloco, replicas, stages, device
        self.micro, self.gas = run.micro_batch, run.grad_accum
        self.step = 0
        self.outer_steps = 0
        self.members = tuple(str(m) for m in range(replicas))
        self.attack = None
        """A `sparseloco.attacks.Attack` injected at every outer step (`simulate_variant` sets the row's)."""
        self.shards = shards or Shards(replicas)
        M = self.shards.local  # replicas stacked in this process
        template = [m.to(device) for m in build_layers(llama_config, hetloco.train.seed,
                                                       tied_apart(llama_config, hetloco, stages))]
        stacked: dict[int, nn.Parameter] = {}
        for layer in template:
            for p in layer.parameters():
                if id(p) not in stacked:
                    stacked[id(p)] = nn.Parameter(p.detach().unsqueeze(0).repeat(M, *([1] * p.dim())))
        self.params = list(stacked.values())
        parts = sizes.stage_parts(llama_config.num_hidden_layers, stages)
        self.replicas = [ReplicaView(template, stacked, m, parts, hetloco, replicas, device, row, run.bf16)
                         for row, m in enumerate(self.shards.ids)]

        # T_perp of every (replica, stage) becomes a view of one stacked buffer per stage; every
        # later change of it (eqs. 3-4, the AdamW-het re-split, a checkpoint load) is in place.
        self.perp: list[torch.Tensor | None] = [None] * stages
        if self.replicas[0].algorithms[0].perp is not None:
            for s in range(stages):
                self.perp[s] = torch.stack([r.algorithms[s].perp for r in self.replicas])
                for m, r in enumerate(self.replicas):
                    alg = r.algorithms[s]
                    alg.perp = self.perp[s][m]
                    for emb in alg.embeddings:
                        emb.perp = alg.perp
            for layer in template:
                if isinstance(layer, TokenEmbedding):
                    layer.perp = self.perp[0][0]  # a real buffer, so functional_call can swap it

        # Per stage: the template layers and what functional_call substitutes for their tensors.
        fns = [e.forward_fn for e in layer_list(llama_config)]
        self.stages, self.stage_tensors = [], []
        for s in range(stages):
            stage = _Stage(template[parts[s]:parts[s + 1]], fns[parts[s]:parts[s + 1]])
            tensors = {name: stacked[id(p)] for name, p in stage.named_parameters()}
            if self.perp[0] is not None:
                # every TokenEmbedding (the first stage's, a tied head) reads the owner's T_perp
                tensors.update({f"{name}.perp": self.perp[0] for name, mod in stage.named_modules()
                                if isinstance(mod, TokenEmbedding)})
            self.stages.append(stage)
            self.stage_tensors.append(tensors)
        self._stage_fns = [vmap(self._stage_call(stage)) for stage in self.stages]
        self._loss = vmap(causal_lm_loss)

        self.bf16 = run.bf16
        self._codecs(hetloco)
        # One compiled graph for the whole forward and loss: compiling the vmapped pieces one
        # by one would put them all in the cache of functorch's one `wrapped` code object.
        if torch.device(device).type == "cuda":
            # cuDNN attention under vmap is off: compiled, inductor's output of it fails its own
            # stride check (torch 2.11, H100: "expected Tensor() for op
            # _scaled_dot_product_cudnn_attention"), and eager the batched run's outer steps saw
            # non-finite pseudo-gradients on every replica where the per-replica run saw none.
            # SDPA then picks flash attention.
            torch.backends.cuda.enable_cudnn_sdp(False)
        self._forward = torch.compile(self._forward_eager) if compile else self._forward_eager

        self.optimizer = optim.build_optimizer(self.params, run.optimizer, hetloco.train.optimizer_state,
                                               replicas=len(self.replicas))
        self.scheduler = optim.build_scheduler(run.scheduler, self.optimizer)

    def _codecs(self, hetloco: HetlocoConfig) -> None:
        """Every replica's link width (a sharded row gathers every block's), and per codec class of
        the replicas held here: which rows are its, its pure functions under vmap, and per stage its
        replicas' tensors stacked (the others' rows zero). A class stacks for the whole row's widths,
        so each block computes exactly as the row's batched codec."""
        local = [r.algorithms[0].codec for r in self.replicas]
        widths = self.shards.gather(torch.tensor([c.width for c in local], device=self.device)).tolist()
        self.widths = widths
        names = [codec_name(hetloco.subspace, m, self.M) for m in range(self.M)]
        self._codec_groups = []
        for name in sorted({c.name for c in local}):
            cls = CODECS[name]
            row_widths = [w for w, n in zip(widths, names) if n == name]
            mine = torch.tensor([c.name == name for c in local], device=self.device)
            tensors = [cls.stack([a.codec if a.codec.name == name else None for a in stage], row_widths)
                       for stage in zip(*(r.algorithms for r in self.replicas))]
            dims = (0, 0, 0, None if self.perp[0] is None else 0)  # T_perp: none without an embedding split
            encode = vmap(functools.partial(cls.encode_hidden, wire_dtype=local[0].wire_dtype), in_dims=dims)
            self._codec_groups.append((mine, tensors, encode, vmap(cls.decode_hidden, in_dims=dims)))

    @staticmethod
    def _stage_call(stage: _Stage):
        def call(tensors, x):
            return functional_call(stage, tensors, (x,))
        return call

    # ------------------------------------------------------------------ forward
    def _boundary(self, s: int, x):
        """Stage s's output as stage s + 1 receives it, every replica through its own codec."""
        hidden, ids = x
        out = None
        for mine, tensors, encode, decode in self._codec_groups:
            got = decode(tensors[s + 1], encode(tensors[s], hidden, ids, self.perp[s]), ids, self.perp[s + 1])
            out = got if out is None else torch.where(mine.view(-1, *([1] * (hidden.dim() - 1))), got, out)
        return out, ids

    def losses(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Every replica's loss on its own [b, L] batch (ids [M, b, L]): a float32 [M] tensor."""
        return self._forward(ids, labels)

    def _forward_eager(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = ids
        with torch.autocast(device_type=ids.device.type, dtype=torch.bfloat16, enabled=self.bf16):
            for s in range(self.S):
                if s > 0:
                    x = self._boundary(s - 1, x)
                x = self._stage_fns[s](self.stage_tensors[s], x)
        return self._loss(x, labels)

    # ------------------------------------------------------------------ steps
    def train_step(self, batches_per_replica) -> torch.Tensor:
        """One optimizer step of every replica; `batches_per_replica[m]` is its micro-batches.
        Returns the micro-batch losses, [M, gas] on the device."""
        gas = len(batches_per_replica[0])
        losses = []
        for g in range(gas):
            ids = torch.stack([b[g][0] for b in batches_per_replica])
            labels = torch.stack([b[g][1] for b in batches_per_replica])
            loss = self.losses(ids, labels)
            # Replica m's loss depends on row m only, so the sum's gradient is each replica's own.
            (loss.sum() / gas).backward()
            losses.append(loss.detach())
        grads = [p.grad for p in self.params if p.grad is not None]
        with torch.no_grad():
            if not self.hetloco.sparseloco.enabled:
                # Plain data parallelism: every replica steps with the mean gradient (of every
                # block's replicas: each process gathers the row's [M, ...] and takes the same mean).
                for g in grads:
                    g.copy_(self.shards.gather(g).mean(0, keepdim=True).expand_as(g))
            self._clip(grads)
        decay = optim.decoupled_decay(self.optimizer)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.scheduler is not None:
            self.scheduler.step()
        for r in self.replicas:
            for alg, link in zip(r.algorithms, r.links):
                alg.after_inner_step(link, decay)
        self.step += 1
        return torch.stack(losses, 1)

    def _clip(self, grads: list[torch.Tensor]) -> None:
        """Each replica's gradients scaled by optim.clip_'s rule with that replica's own norm."""
        if self.run.clip <= 0 or not grads:
            return
        # [tensors, replicas] summed over tensors: a sharded row sums the whole row's matrix, as a
        # reduction's order depends on its shape, then takes its block's norms.
        sq = self.shards.gather(torch.stack([g.float().reshape(len(self.replicas), -1).pow(2).sum(1) for g in grads]),
                                dim=1)
        sq = self.shards.mine(sq.sum(0))
        coef = (self.run.clip / (sq.sqrt() + 1e-6)).clamp(max=1.0)
        torch._foreach_mul_(grads, [coef.view(-1, *([1] * (g.dim() - 1))).to(g.dtype) for g in grads])

    def outer_step(self) -> dict:
        self.outer_steps += 1
        return {"outer_step": self.outer_steps, **outer_step_all(self.replicas, self.members, self.shards, self.attack)}

    def state_dict(self) -> dict:
        """Everything a row needs to continue (at an outer-step boundary): the stacked parameters,
        AdamW, the LR schedule, every StageAlgorithm's state (views: serialise before stepping on)."""
        return {"params": [p.detach() for p in self.params], "optimizer": self.optimizer.state_dict(),
                "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
                "algorithms": [[a.state_dict() for a in r.algorithms] for r in self.replicas],
                "step": self.step, "outer_steps": self.outer_steps}

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        """In place, so every StageAlgorithm's views and the optimizer keep their tensors."""
        torch._foreach_copy_([p.data for p in self.params], state["params"])
        self.optimizer.load_state_dict(state["optimizer"])
        if self.scheduler is not None:
            self.scheduler.load_state_dict(state["scheduler"])
        for r, algs in zip(self.replicas, state["algorithms"]):
            for a, st in zip(r.algorithms, algs):
                a.load_state_dict(st)
        self.step, self.outer_steps = state["step"], state["outer_steps"]

    @torch.no_grad()
    def validation_losses(self, batches) -> list[float]:
        """Every replica's mean loss over the same held-out batches, each through its own pipeline
        (a sharded row's: every block's, gathered)."""
        M = len(self.replicas)
        rows = [self.losses(ids.expand(M, *ids.shape), labels.expand(M, *labels.shape)) for ids, labels in batches]
        return self.shards.gather(torch.stack(rows), dim=1).mean(0).tolist()

    def link_bytes_per_step(self, seq_len: int) -> dict:
        """As `replica.Simulation`'s; on a sharded row a gather, which every process calls (rows does)."""
        local = [r.algorithms[0].codec.nbytes(self.micro, seq_len) for r in self.replicas]
        return link_bytes(self, [tuple(b) for b in self.shards.gather(torch.tensor(local, device=self.device)).tolist()])
