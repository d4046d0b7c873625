"""How the replicas of one stage meet at the outer sync, and how a replica's stages share a
tensor: two small interfaces the method talks to, with the implementations beside them.

* `ReplicaTransport`: everything a caller asks of a stage's outer sync - `exchange(payload) ->
  Gathered` (every contributing replica's payload of this stage), and the hooks only a fleet
  whose members change needs (`begin` at each boundary, `outer_fields` for the metrics row,
  `start`, `waited_seconds`, `state_dict` / `load_state_dict` for checkpoints, `close`), which
  a fixed group leaves as the no-ops defined here. `static.GroupTransport` is a fixed DeepSpeed
  data-parallel group (one world); `elastic` (torchft) is a group whose members change between
  outer steps, and `hetloco_ds.elastic.replica.FleetTransport` ties it to an engine;
  `LocalExchange` is the simulator's, where all replicas live in one process.
* `StageLink`: what the method sends across a replica's own stage links outside the pipeline
  schedule - one tensor from the first (or the last) stage to every stage (the T_perp set-up,
  the sparse T_S aggregate of eqs. 3-4, the tied head's sparse aggregate).
  `static.PipeStageLink` broadcasts over the pipe group; `LocalStageLink` hands the tensor
  over in memory, which is why an owner `offer`s its sparse tensor first: the simulator runs
  one stage at a time, so every owner offers before any stage shares.

The method (`hetloco_ds.algorithm`) imports only this module; it never sees a process group.
"""
from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass(frozen=True)
class Gathered:
    """The payloads of one outer step's exchange, one per contributing replica."""

    payloads: list[torch.Tensor]
    """uint8 payloads, in `members` order."""
    members: tuple[str, ...]
    """Replica ids of the payloads' senders, in a fixed order every member sees alike."""


class ReplicaTransport(abc.ABC):
    """A stage's outer sync with the stage's other replicas. Every caller (the engine, checkpoints,
    the training loop) calls these unconditionally; a fixed group inherits the no-ops."""

    @abc.abstractmethod
    def exchange(self, payload: torch.Tensor) -> Gathered:
        """Send this replica's payload to the stage's other live replicas; return all of them.

        Every member must get the same list in the same order (the outer step sums in list
        order, which keeps replicas bitwise identical)."""

    def exchange_blocks(self, payloads: list[torch.Tensor]) -> list[Gathered]:
        """Every outer-sync block's payload of this stage, in block order; each block's gathered
        payloads. A fixed group is one block's (the static mode gives a stage one transport per
        block); a transport that exchanges all of a stage's blocks at once, and commits them all
        or none (the elastic one), overrides it."""
        if len(payloads) != 1:
            raise ValueError(f"this transport exchanges one block, the stage has {len(payloads)}: give one "
                             "transport per block")
        return [self.exchange(payloads[0])]

    def start(self) -> None:
        """Once, after the job has built (and maybe loaded) its state, before its first step: wait
        until the replicas that must start together have. A fixed group starts with its world."""

    def begin(self) -> None:
        """At each outer boundary, before the stage prepares its payload: learn who takes part. A
        fleet may replace the stage's synced state here (a replica behind it is healed)."""

    def outer_fields(self) -> dict:
        """Fields of the outer step just finished for its metrics row, beyond the engine's."""
        return {}

    def waited_seconds(self, outer: dict) -> float:
        """Seconds of the outer step just finished (`outer`: the engine's record of it) that were a
        wait for other replicas bounded by their own timeouts rather than work of this rank; the
        watchdog leaves them out of what it learns a slow step is. A fixed group's exchange is
        part of the step: none."""
        return 0.0

    def state_dict(self) -> dict | None:
        """What a checkpoint must keep to resume this transport (None: nothing)."""
        return None

    def load_state_dict(self, state: dict) -> None:
        """Restore what `state_dict` returned (called only with a state it did return)."""

    def close(self) -> None:
        """Release what the transport holds (servers, heartbeats); called once, at the end of the run."""


def member_ids(members) -> list:
    """Replica ids as metrics.jsonl writes them: ints for the static world's replica indices, an
    elastic fleet's names as they are."""
    return [int(m) if m.isdigit() else m for m in members]


class StageLink(Protocol):
    is_first: bool
    """Whether this stage is the replica's first (the one that holds T_S and sends)."""
    is_last: bool
    """Whether this stage is the replica's last (the one that holds a tied head)."""

    def share_dense(self, tensor: torch.Tensor | None, shape: tuple[int, ...], kind: str = "control",
                    source: str = "first") -> torch.Tensor:
        """The `source` stage's `tensor` ("first" or "last"; the others pass None) on every stage
        of the replica; its bytes are counted as `kind`."""

    def offer(self, tensor: torch.Tensor, source: str) -> None:
        """An owner's tensor, before any stage of the replica calls `share_sparse` or
        `share_dense` for it."""

    def share_sparse(self, tensor: torch.Tensor | None, shape: tuple[int, ...],
                     kind: str = "embedding_sync", source: str = "first") -> torch.Tensor:
        """As `share_dense` for a mostly-zero tensor, from the `source` stage ("first" or
        "last"; the others pass None): only its non-zeros travel. Every stage of the replica
        calls it at the same point, for the same sources in the same order."""


class LocalExchange(ReplicaTransport):
    """The simulator's exchange: the caller collects every replica's payload itself."""

    def __init__(self, payloads: list[torch.Tensor], members: tuple[str, ...] | None = None):
        self.gathered = Gathered(list(payloads), members or tuple(str(m) for m in range(len(payloads))))

    def exchange(self, payload: torch.Tensor) -> Gathered:
        return self.gathered


class LocalStageLink:
    """A replica's stages in one process: the owner's tensor is handed to the others.

    A dense tensor: the first stage must share before the others ask (the simulator walks
    stages in order). A sparse one: its owner offers it first (see the module docstring)."""

    def __init__(self, is_first: bool, shared: dict, is_last: bool = False):
        self.is_first, self.is_last = is_first, is_last
        self._shared = shared  # one dict per replica, common to its stages' links

    def _share(self, tensor, key, owner: bool):
        if owner:
            self._shared[key] = tensor
            return tensor
        if key not in self._shared:
            raise RuntimeError(f"a stage asked for a tensor ({key}) its owner has not shared yet")
        return self._shared[key]

    def _owns(self, source: str) -> bool:
        return self.is_first if source == "first" else self.is_last

    def share_dense(self, tensor, shape, kind="control", source="first"):
        return self._share(tensor, ("dense", source), self._owns(source))

    def offer(self, tensor, source):
        self._shared[("sparse", source)] = self._shared[("dense", source)] = tensor

    def share_sparse(self, tensor, shape, kind="embedding_sync", source="first"):
        return self._share(tensor, ("sparse", source), self._owns(source))

    @staticmethod
    def for_replica(stages: int) -> list["LocalStageLink"]:
        shared: dict = {}
        return [LocalStageLink(s == 0, shared, s == stages - 1) for s in range(stages)]
