"""A stage's outer state by outer-sync block (`BlockStates`), for fleets whose replicas have their
own depths and so meet only on blocks every replica holds whole."""
from __future__ import annotations

from typing import Iterable, Sequence

from torch import Tensor

from .outer import OuterReport, SparseLoCoState


class BlockStates:
    """The outer state of a stage whose parameters fall into several outer-sync blocks: one
    SparseLoCoState (one payload, one exchange) per block, so replicas cut into different stages
    exchange the same coordinates (`sizes.block_parts`). Per parameter it reads as one
    SparseLoCoState over the stage's parameters (`theta_prev`, `error`, `momentum`, `synced`,
    `rebase`); the outer step is per block: `prepare` gives a payload per block, `finish` takes
    each block's gathered payloads. One block (every replica of one depth) is today's state,
    payload and checkpoint format exactly.

    `blocks`: the parameter indices of each block, in order (together each index once)."""

    def __init__(self, params: Sequence[Tensor], blocks: Sequence[Sequence[int]], cfg=None, *, on_host: bool = False):
        params = list(params)
        self.blocks = [list(b) for b in blocks]
        if sorted(i for b in self.blocks for i in b) != list(range(len(params))):
            raise ValueError(f"blocks {self.blocks} do not cover the {len(params)} parameters once each")
        self.states = [SparseLoCoState([params[i] for i in b], cfg, on_host=on_host) for b in self.blocks]
        self.cfg, self.dense, self.on_host = self.states[0].cfg, self.states[0].dense, on_host
        self._where = {i: (k, j) for k, b in enumerate(self.blocks) for j, i in enumerate(b)}

    def _per_param(self, name: str) -> list[Tensor] | None:
        lists = [getattr(s, name) for s in self.states]
        if lists[0] is None:
            return None
        return [lists[k][j] for k, j in (self._where[i] for i in range(len(self._where)))]

    @property
    def nbytes(self) -> list[int]:
        """Payload bytes of each block."""
        return [s.nbytes for s in self.states]

    @property
    def theta_prev(self) -> list[Tensor]:
        return self._per_param("theta_prev")

    @property
    def error(self) -> list[Tensor]:
        return self._per_param("error")

    @property
    def momentum(self) -> list[Tensor] | None:
        return self._per_param("momentum")

    def synced(self, i: int) -> Tensor:
        k, j = self._where[i]
        return self.states[k].synced(j)

    def rebase(self, i: int, value: Tensor) -> None:
        k, j = self._where[i]
        self.states[k].rebase(j, value)

    def matches(self, params: Sequence[Tensor]) -> bool:
        return all(s.matches([params[i] for i in b]) for s, b in zip(self.states, self.blocks))

    def prepare(self, params: Sequence[Tensor]) -> list[Tensor]:
        """Each block's payload, in block order."""
        return [s.prepare([params[i] for i in b]) for s, b in zip(self.states, self.blocks)]

    def finish(self, params: Sequence[Tensor], payloads: Sequence[Sequence[Tensor]],
               keep_average: Iterable[int] = (), count_selected: bool = False) -> OuterReport:
        """`payloads[k]`: block k's gathered payloads. One report for the stage: bytes summed over
        the blocks, a replica excluded (or screened) if any of its block payloads was (the others
        average it out of that block only), `averages` by stage parameter index, the screen's
        scores of block k under "block<k>.<name>" when there are several."""
        keep = set(keep_average)
        reports = [s.finish([params[i] for i in b], p, keep_average=[j for j, i in enumerate(b) if i in keep],
                            count_selected=count_selected)
                   for s, b, p in zip(self.states, self.blocks, payloads)]
        excluded = tuple(sorted({m for r in reports for m in r.excluded}))
        averages = {b[j]: avg for r, b in zip(reports, self.blocks) for j, avg in r.averages.items()}
        counted = [r for r in reports if r.selected is not None]
        scores = reports[0].scores if len(reports) == 1 else {
            f"block{k}.{name}": v for k, r in enumerate(reports) for name, v in r.scores.items()}
        return OuterReport(sum(r.bytes_per_replica for r in reports),
                           tuple(m for m in range(len(payloads[0])) if m not in excluded),
                           excluded, averages,
                           sum(r.selected for r in counted) if counted else None,
                           sum(r.distinct for r in counted) if counted else None,
                           tuple(sorted({m for r in reports for m in r.screened})), scores)

    def state_dict(self) -> dict:
        """One block: SparseLoCoState's own state dict; several: {"blocks": theirs}."""
        if len(self.states) == 1:
            return self.states[0].state_dict()
        return {"blocks": [s.state_dict() for s in self.states]}

    def load_state_dict(self, state: dict) -> None:
        if len(self.states) == 1:
            self.states[0].load_state_dict(state)
            return
        if len(state.get("blocks", ())) != len(self.states):
            raise ValueError(f"checkpointed SparseLoCo state has {len(state.get('blocks', ()))} outer-sync blocks, "
                             f"this stage has {len(self.states)}")
        for s, sd in zip(self.states, state["blocks"]):
            s.load_state_dict(sd)
