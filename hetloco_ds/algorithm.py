"""The method, for one pipeline stage of one replica: the one object every driver calls.

`StageAlgorithm` owns the state the paper adds to a stage and every step of the method that
touches it:

    SparseLoCo   theta at the last sync and the error-feedback buffers (sparseloco.outer, by block:
                 sparseloco.blocks)
    boundary     the replica's stage-boundary codec (`boundary.BoundaryCodec`, built here from the
                 config: every driver asks this object for it), the fleet's embedding split (the
                 basis T_S lives in and T_perp: `boundary.EmbeddingSplit`), and which of the
                 stage's parameters are T_S copies

and three entry points:

    setup(link)                   split TE into T_S + T_perp (paper 2.4) before training
    after_inner_step(link, decay) after each optimizer step: T_perp's share of the weight decay
                                  (into T_S); under plain data parallelism the re-split of eqs. 3-4;
                                  the ablations' projections
    prepare() / finish(g, link)   the outer step (eq. 2, then eqs. 3-4), two-phase so that a
    outer_step(transports, link)  driver holding every replica in one process (the simulator)
                                  can gather the payloads itself; one payload and exchange per
                                  outer-sync block the stage holds (the stage itself unless the
                                  replicas have their own depths: sizes.block_parts)

The engine (one stage per process), the simulator (all stages and replicas in one process)
and the checkpoint code call only these; the collective is a `transport.ReplicaTransport` and
the replica's stage links a `transport.StageLink`, so the object never sees a process group.

Why T_S trains freely between outer syncs, also on a compressed replica: the paper projects it
"only after each SparseLoCo outer synchronization" (eqs. 3-4), and the authors' code trains the
whole token embedding between syncs and re-snapshots it as the fixed part at each. The first
boundary sends (X - T_perp[x]) U, so what T_S gains outside Col(U) between syncs is seen by the
first stage and lost at its boundary; it is not lost to the model: it is in the pseudo-gradient,
and at the sync eqs. 3-4 move its aggregate into T_perp, which every stage sees. Projecting after
every inner step (`subspace.project_embedding_every_step`, an ablation) keeps the stages agreeing
at every step but throws that part of each update away.

Why T_S also carries T_perp's share of the weight decay (`subspace.embedding_weight_decay:
table`): in the authors' code AdamW decays the whole embedding, and its decay is in the
pseudo-gradient like the rest of the update. Here T_perp is a buffer that every stage must hold
bitwise alike and that changes only at a sync, so after each AdamW step (which shrank T_S by
1 - lr wd) T_S -= lr wd T_perp: TE = T_S + T_perp shrinks as a whole, and T_perp's share reaches
T_perp the authors' way, through error feedback, top-k and the sync. `t_s` decays T_S alone.

Why under plain data parallelism (the AdamW baselines) every replica re-splits after every
step: there the gradient all-reduce is a sync every step, and replicas must stay identical.
Projecting T_S only on compressed replicas would make them drift apart, so every replica moves
T_S's off-subspace part into T_perp (eqs. 3-4 with H = 1): T_perp += T_S - Pi(T_S), T_S = Pi(T_S).
That part is dense and crosses the replica's stage links (counted as embedding_sync); it is
the baseline's cost, not SparseLoCo's.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch
from torch import Tensor, nn

from .boundary import BoundaryCodec, EmbeddingSplit, SubspaceCodec, build_codec, fleet_split, wire_dtype_of
from .model import DecoderLayer, TokenEmbedding
from .sparseloco.blocks import BlockStates
from .transport import Gathered, ReplicaTransport, StageLink


@dataclass(frozen=True)
class OuterResult:
    """What one outer step did on this stage."""

    outer_step: int
    payload_bytes: int
    contributors: tuple[str, ...]
    """Replica ids whose pseudo-gradients were averaged."""
    excluded: tuple[str, ...]
    """Replica ids left out (reset to the synced theta like every replica): a non-finite pseudo-gradient,
    or dropped by the screen (`screened`)."""
    selected: int | None = None
    """With `count_selected`: entries the contributors sent (`OuterReport.selected`)."""
    distinct: int | None = None
    """With `count_selected`: coordinates at least one contributor sent (`OuterReport.distinct`)."""
    screened: tuple[str, ...] = ()
    """Replica ids the screen (`sparseloco.screen`) dropped from a finite payload; also in `excluded`."""
    scores: dict = field(default_factory=dict)
    """The screen's scores by name, each {replica id: score} over the finite payloads (`OuterReport.scores`)."""


class StageAlgorithm:
    """SparseLoCo + subspace state of one pipeline stage of one replica (see the module docstring).

    `params`: the stage's trainable parameters in a fixed order, the same on every replica of the
    stage. `embeddings`: TokenEmbedding modules on this stage (the first stage's embedding, the
    tied head's copy on the last); only those whose weight is among `params` are T_S copies this
    object updates. `layers`: the stage's layers (the Table 5b ablation projects DecoderLayers).
    `tied`: the model ties its embedding and head and they sit on different stages (every stage
    of the replica passes the same value; a one-stage replica that holds the head as a copy of its own,
    `pipe.module.head_apart`, passes True too). `blocks`: the indices into `params` of each
    outer-sync block the stage holds (`sizes.block_parts`), one payload and exchange each; None: one
    block, the whole stage (every replica cut alike). `bf16`: bf16 training, whose codec puts bf16
    on the stage links (`boundary.wire_dtype_of`).
    """

    def __init__(self, params: Sequence[nn.Parameter], hetloco, *, replica: int, num_replicas: int,
                 hidden_size: int, vocab_size: int, device, embeddings: Sequence[TokenEmbedding] = (),
                 layers: Sequence[nn.Module] = (), tied: bool = False, blocks: Sequence[Sequence[int]] | None = None,
                 bf16: bool = False):
        self.params = list(params)
        self.blocks = [list(range(len(self.params)))] if blocks is None else [list(b) for b in blocks]
        self.cfg = hetloco
        self.replica, self.num_replicas = replica, num_replicas
        self.shape = (vocab_size, hidden_size)
        self.device = torch.device(device)
        sub = hetloco.subspace
        ids = {id(p) for p in self.params}
        self.embeddings = [e for e in embeddings if id(e.weight) in ids]
        self._embedding_index = [i for i, p in enumerate(self.params) if any(p is e.weight for e in self.embeddings)]
        self.layers = [m for m in layers if isinstance(m, DecoderLayer)]
        self.split: EmbeddingSplit | None = fleet_split(sub, num_replicas, hidden_size, self.device)
        self.codec: BoundaryCodec = build_codec(sub, replica=replica, num_replicas=num_replicas, hidden_size=hidden_size,
                                                vocab_size=vocab_size, wire_dtype=wire_dtype_of(bf16), device=self.device)
        """This replica's stage-boundary codec, the one every driver encodes and decodes with."""
        self.codec.split = self.split
        self.outer: BlockStates | None = None
        self.outer_steps = 0
        self.tied_apart = tied and self.sparseloco and hetloco.sparseloco.tied_embeddings == "outer_step"
        """The embedding and head copies train apart between outer steps (module docstring)."""
        self._synced: tuple[Tensor | None, Tensor | None] | None = None  # finish -> sync_embeddings

    @property
    def sparseloco(self) -> bool:
        """False under plain data parallelism (the AdamW baselines): no outer step."""
        return self.cfg.sparseloco.enabled

    @property
    def compressed(self) -> bool:
        return self.codec.compressed

    @property
    def basis(self) -> Tensor | None:
        """U of this replica's boundary (a subspace codec's; None for a codec without one)."""
        return self.codec.basis if isinstance(self.codec, SubspaceCodec) else None

    @property
    def split_basis(self) -> Tensor | None:
        """The basis T_S lives in (None: no embedding split)."""
        return None if self.split is None else self.split.basis

    @property
    def perp(self) -> Tensor | None:
        """T_perp (the embedding split's; None before `setup` or without a split)."""
        return None if self.split is None else self.split.perp

    @perp.setter
    def perp(self, value: Tensor) -> None:
        # The batched simulator makes it a view of its stacked buffer; the codec reads it through the split.
        self.split.perp = value

    # ------------------------------------------------------------------ before training
    @torch.no_grad()
    def setup(self, link: StageLink) -> None:
        """T_S = TE U U^T, T_perp = TE - T_S on every stage (the first stage's TE, shared once,
        dense, over the replica's stage links); then snapshot theta for the first outer step.

        Every stage of every replica calls it once, before training, from identical parameters.
        """
        if self.split is not None:
            first = self.embeddings[0].table().detach().clone() if link.is_first else None
            self.split.split_(link.share_dense(first, self.shape), self.embeddings)
        if self.sparseloco:
            self.outer = BlockStates(self.params, self.blocks, self.cfg.sparseloco,
                                     on_host=self.cfg.sparseloco.outer_state_device == "cpu")

    # ------------------------------------------------------------------ inner loop
    @torch.no_grad()
    def after_inner_step(self, link: StageLink, decay: float) -> None:
        """After each optimizer step (see the module docstring for every case). `decay`: lr x
        weight_decay of the AdamW step just taken (`optim.decoupled_decay`, read before it)."""
        if self.split is not None:
            if self.cfg.subspace.embedding_weight_decay == "table":
                self.split.decay_(self.embeddings, decay)
            if not self.sparseloco:
                first = self.split.off_subspace(self.embeddings[0].weight) if link.is_first else None
                self.split.perp.add_(link.share_dense(first, self.shape, kind="embedding_sync"))
                self.split.project_(self.embeddings)
        if self.sparseloco:
            self.codec.after_inner_step(self.embeddings, self.layers)

    # ------------------------------------------------------------------ outer step
    def prepare(self) -> list[Tensor]:
        """Error feedback and compression of this stage's pseudo-gradient: a uint8 payload per block."""
        return self.outer.prepare(self.params)

    def finish(self, gathered: Sequence[Gathered], link: StageLink, count_selected: bool = False) -> OuterResult:
        """Aggregate each block's gathered payloads (`gathered[k]`, every replica's payload of block k,
        members alike) into the synced theta (eq. 2). A driver then calls `sync_embeddings` on every
        stage (the engine at once; the simulator after every stage's finish, since it runs one stage
        at a time). `count_selected` adds the overlap of the replicas' selections (a diagnostic)."""
        keep = self.kept_average
        theta_old = None
        if self.tied_apart and keep:
            theta_old = self.outer.synced(keep[0])
        report = self.outer.finish(self.params, [g.payloads for g in gathered], keep_average=keep,
                                   count_selected=count_selected)
        if self._syncs_embedding:
            # The embedding on a first stage, a tied head's copy on a last one; a one-stage replica
            # holding both copies owns both aggregates.
            sources = ["first"] * link.is_first + ["last"] * (link.is_last and (self.tied_apart or not link.is_first))
            own = {src: report.averages[i] for src, i in zip(sources, keep)}
            if self.tied_apart:
                for src, avg in own.items():
                    link.offer(avg, src)
            self._synced = (own, theta_old)
        self.outer_steps += 1
        members = gathered[0].members
        return OuterResult(
            outer_step=self.outer_steps,
            payload_bytes=report.bytes_per_replica,
            contributors=tuple(members[i] for i in report.contributors),
            excluded=tuple(members[i] for i in report.excluded),
            selected=report.selected,
            distinct=report.distinct,
            screened=tuple(members[i] for i in report.screened),
            scores={name: {members[i]: v for i, v in enumerate(values) if v is not None}
                    for name, values in report.scores.items()},
        )

    def outer_step(self, transports: Sequence[ReplicaTransport], link: StageLink) -> OuterResult:
        """The whole outer step through `transports[k]`, block k's exchange, or through one transport
        that exchanges every block of the stage (`ReplicaTransport.exchange_blocks`). Every rank
        exchanges its blocks in block order, so a rank waiting in one exchange waits only for ranks
        that are done with every earlier block: no cycle, no deadlock."""
        payloads = self.prepare()
        if len(transports) == 1:
            gathered = transports[0].exchange_blocks(payloads)
        else:
            gathered = [t.exchange(p) for t, p in zip(transports, payloads, strict=True)]
        result = self.finish(gathered, link)
        self.sync_embeddings(link)
        return result

    @property
    def kept_average(self) -> list[int]:
        """Indices of the parameters whose outer step also keeps the dense average (the embedding's
        resync, or a tied copy's); empty when neither applies."""
        return self._embedding_index if self._syncs_embedding else []

    @property
    def _adapts_embedding(self) -> bool:
        return self.split is not None and self.cfg.subspace.embedding_adaptation

    @property
    def _syncs_embedding(self) -> bool:
        return self._adapts_embedding or self.tied_apart

    @torch.no_grad()
    def sync_embeddings(self, link: StageLink) -> None:
        """After `finish`, on every stage of the replica (the shares are collectives).

        Tied apart: the embedding (first stage) and the head copy (last stage) each got their own
        outer step; both share their aggregate (the update direction avg with theta = theta_prev -
        outer_lr * avg), and both copies become theta_prev - outer_lr * (avg_embedding + avg_head),
        the same operations on the same values on both stages, so they are bitwise equal again.
        The sum is what exact tying does with the two gradients of one tied weight.

        Then eqs. 3-4 on every stage that holds T_perp, from the (combined) aggregate alone:
        every stage applies the same operations in the same order, so every T_perp stays
        bitwise equal."""
        if self._synced is None:
            return
        (own, theta_old), self._synced = self._synced, None
        # The top-k aggregate has at most M*k non-zeros a chunk; a dense or momentum step has no
        # zeros to skip, and its index list would double the bytes.
        sparse = not (self.outer.dense or self.outer.cfg.outer_momentum > 0)

        def share(source: str):
            mine = own.get(source)
            if sparse:
                return link.share_sparse(mine, self.shape, source=source)
            return link.share_dense(mine, self.shape, kind="embedding_sync", source=source)

        avg = share("first")
        if self.tied_apart:
            avg = avg + share("last")
            for i in self._embedding_index:
                self.params[i].copy_(theta_old.add(avg, alpha=-self.cfg.sparseloco.outer_lr))
        if self._adapts_embedding:
            self.split.resync_(avg, self.cfg.sparseloco.outer_lr, self.embeddings)
        for i in self._embedding_index:
            self.outer.rebase(i, self.params[i])

    @torch.no_grad()
    def at_sync(self) -> bool:
        """Whether the stage's parameters are the synced theta of the last outer step, as every
        replica holds it: true after an outer step (and before the first inner step), false once
        an inner step moved them. Plain data parallelism: always (replicas agree after every step)."""
        if self.outer is None:
            return True
        return self.outer.matches(self.params)

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict:
        """Everything this object keeps (views: serialise before the next outer step)."""
        return {"outer": self.outer.state_dict() if self.outer is not None else None,
                "perp": self.perp, "outer_steps": self.outer_steps}

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        if (state["outer"] is None) != (self.outer is None):
            raise ValueError("checkpointed algorithm state and this run disagree on sparseloco.enabled")
        if self.outer is not None:
            self.outer.load_state_dict(state["outer"])
        if (state["perp"] is None) != (self.perp is None):
            raise ValueError("checkpointed algorithm state and this run disagree on whether any replica compresses")
        if self.perp is not None:
            self.perp.copy_(state["perp"])
        self.outer_steps = int(state["outer_steps"])

    def global_state_dict(self) -> dict:
        """What every replica of this stage holds alike at an outer boundary: what a joining
        replica needs from a live peer (its own error feedback starts at zero). By outer-sync
        block (`blocks[k]`: block k's synced parameters and outer momentum; a joiner of another
        depth gets each block from the peer's rank that holds it), then what every stage of a
        replica holds alike (T_perp, the outer-step count). theta is the synced theta_prev, not
        the parameters: a donor is asked after its own inner steps."""
        synced = self.outer.theta_prev if self.outer is not None else [p.detach() for p in self.params]
        momentum = self.outer.momentum if self.outer is not None else None
        return {"blocks": [{"theta": [synced[i].clone() for i in b],
                            "momentum": None if momentum is None else [momentum[i].clone() for i in b]}
                           for b in self.blocks],
                "perp": None if self.perp is None else self.perp.clone(), "outer_steps": self.outer_steps}

    @torch.no_grad()
    def load_global_state_dict(self, state: dict) -> None:
        """Adopt a peer's synced stage: parameters, theta_prev, outer momentum, T_perp; error
        feedback zeroed. In place and without SparseLoCoState.load_state_dict, which would clear
        the pending flag: an elastic heal can come between prepare and finish."""
        for block, part in zip(self.blocks, state["blocks"], strict=True):
            for i, t in zip(block, part["theta"], strict=True):
                t = t.to(self.device)
                self.params[i].copy_(t)
                if self.outer is not None:
                    self.outer.rebase(i, t)
            if self.outer is not None and self.outer.momentum is not None:
                momentum = self.outer.momentum
                for i, t in zip(block, part["momentum"], strict=True):
                    momentum[i].copy_(t)
        if self.outer is not None:
            for e in self.outer.error:
                e.zero_()
        if self.perp is not None:
            self.perp.copy_(state["perp"])
        self.outer_steps = int(state["outer_steps"])
