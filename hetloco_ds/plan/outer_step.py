"""One outer step of M replicas that may each have their own pipeline depth, subspace ratio, links
and devices (`hetloco.replica_stages`): each replica's H inner steps, the outer exchange by
parameter block, and who waits for whom.

* Inner phase: each replica's inner step is `predict` with its own Settings (its S, ratio, stage
  links, FLOP/s), H of them a phase.
* Exchange, by block: `sizes.block_parts` (the finest common partition of the replicas' stage
  cuts) cuts the layer list into blocks, each held whole by one rank of every replica; each block
  is its own exchange among those M ranks, one payload per block and rank (`sizes.
  stage_payload_nbytes` of its tensors). A rank holding b blocks takes part in b exchanges, one
  after another on its one link: (M - 1) * (its blocks' payload bytes * 8 / bw + b * latency), the
  all-gather of `plan.model` summed over its blocks. Ranks holding different blocks use disjoint
  links and run at the same time; the slowest rank sets the exchange's time. With one S for every
  replica the blocks are the stages and this is `predict`'s own all-gather, to the bit.
* Outer step: every replica enters the exchange after its H inner steps, so the step takes
  H x (the slowest replica's inner step) + the exchange + the slowest embedding share (each
  compressed fleet's stage-0 share over a replica's own stage links). A faster replica waits the
  difference, idle; its utilisation counts the wait.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Sequence

from .. import sizes
from .model import Prediction, Settings, outer_payload_bytes, predict
from .shapes import ModelShape, block_tensors, resolve_model

_SHARED = ("H", "topk", "chunk", "quant_bits", "value_bytes")
"""Settings every replica of one fleet has alike: the outer step's period and the payload's codec."""


@dataclass
class ReplicaStep:
    """One replica's part of an outer step (times in seconds, per outer step unless named)."""

    replica: int
    stages: int
    k: int
    """Subspace width on its stage boundaries (d: uncompressed)."""
    inner_step_time: float
    """One inner step: its schedule on its own links and devices."""
    inner_phase_time: float
    """H inner steps."""
    wait_time: float
    """Idle before the exchange, until the slowest replica has run its H inner steps."""
    utilisation: float
    """Its busiest stage's compute over the whole outer step (the wait and the sync counted)."""
    blocks: list[list[int]]
    """The blocks (indices into `OuterStep.block_parts`) each of its stages holds."""
    exchange_bytes: list[int]
    """Bytes each of its stages sends to each other replica: the payloads of its blocks."""
    exchange_time: float
    """Its slowest rank's exchanges."""
    tokens_per_step: int
    """Tokens it trains on per inner step."""
    prediction: Prediction


@dataclass
class OuterStep:
    """What `predict_outer_step` returns."""

    model: str
    replica_stages: list[int]
    H: int
    block_parts: list[int]
    """Layer-list boundaries of the exchange's blocks (`sizes.block_parts`)."""
    block_payload_bytes: list[int]
    """One rank's payload for each block."""
    exchange_time: float
    """The slowest rank's exchanges, per outer step."""
    outer_sync_time: float
    """The exchange, then the slowest replica's embedding shares."""
    outer_step_time: float
    """H x the slowest replica's inner step + the outer sync."""
    slowest: int
    """The replica every other waits for (the first of equals)."""
    tokens_per_second: float
    """Every replica's tokens per outer step / the outer step."""
    replicas: list[ReplicaStep]

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def replica_blocks(n_layers: int, replica_stages: Sequence[int]) -> list[list[list[int]]]:
    """For each replica, the blocks (`sizes.block_parts`) each of its stages holds."""
    parts = sizes.block_parts(n_layers, replica_stages)
    return [[sizes.stage_blocks(n_layers, stages, s, parts) for s in range(stages)] for stages in replica_stages]


def exchange_times(model: str | ModelShape, replicas: Sequence[Settings]) -> tuple[list[int], list[list[int]], list[float]]:
    """The outer exchange by block (the module docstring): each block's payload, the bytes each
    stage of each replica sends to each other replica, and each replica's slowest rank's time.
    `replicas`: one Settings per replica (its `stages`, `replica_bw`, `replica_latency`)."""
    m = resolve_model(model)
    res = [s.resolved(m) for s in _checked(replicas)]
    M = len(res)
    payload = [outer_payload_bytes(ts, res[0].topk, res[0].chunk, res[0].quant_bits, res[0].value_bytes)
               for ts in block_tensors(m, [s.stages for s in res])]
    sent, times = [], []
    for s, held in zip(res, replica_blocks(m.n_layers, [s.stages for s in res])):
        per_stage = [sum(payload[b] for b in blocks) for blocks in held]
        rate = s.replica_bw * s.link_efficiency
        sent.append(per_stage)
        times.append(max((M - 1) * (nbytes * 8 / rate + len(blocks) * s.replica_latency)
                         for nbytes, blocks in zip(per_stage, held)) if M > 1 else 0.0)
    return payload, sent, times


def predict_outer_step(model: str | ModelShape, replicas: Sequence[Settings]) -> OuterStep:
    """One outer step of these replicas, one Settings each (their `replicas` field is set to M):
    see the module docstring."""
    m = resolve_model(model)
    M = len(_checked(replicas))
    settings = [dataclasses.replace(s, replicas=M) for s in replicas]
    payload, sent, times = exchange_times(m, settings)
    exchange = max(times)
    cache: dict[Settings, Prediction] = {}  # a fleet's group has many alike replicas
    for s in settings:
        if s not in cache:
            cache[s] = predict(m, s, outer_exchange=exchange)
    preds = [cache[s] for s in settings]
    H = settings[0].H
    slowest = max(range(M), key=lambda r: preds[r].schedule_time)
    sync = max(p.outer_sync_time for p in preds)
    outer_step = H * preds[slowest].schedule_time + sync
    blocks = replica_blocks(m.n_layers, [s.stages for s in settings])
    steps = [ReplicaStep(r, settings[r].stages, p.k, p.schedule_time, H * p.schedule_time,
                         H * preds[slowest].schedule_time - H * p.schedule_time,
                         H * p.breakdown["compute"] / outer_step, blocks[r], sent[r], times[r],
                         p.tokens_per_step, p) for r, p in enumerate(preds)]
    tokens = sum(p.tokens_per_step * H for p in preds)
    return OuterStep(m.name, [s.stages for s in settings], H, sizes.block_parts(m.n_layers, [s.stages for s in settings]),
                     payload, exchange, sync, outer_step, slowest, tokens / outer_step, steps)


def _checked(replicas: Sequence[Settings]) -> Sequence[Settings]:
    """At least one replica, and the fields one fleet shares alike in all (one error naming the first that differs)."""
    if not replicas:
        raise ValueError("an outer step needs at least one replica")
    for f in _SHARED:
        values = [getattr(s, f) for s in replicas]
        if len(set(values)) > 1:
            raise ValueError(f"every replica of a fleet has the same {f}; got {values}")
    return replicas
