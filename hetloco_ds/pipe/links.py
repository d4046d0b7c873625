"""A replica's pipeline links: this stage's sends to and receives from its neighbour stages.

The engine's pipeline instructions call these instead of DeepSpeed's p2p module, so every byte
is counted where it is handed to torch.distributed, by kind. Receivers allocate from the
message's spec (`BoundaryCodec.message_spec`), which both ends derive from the same config, so
no shape metadata travels.
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as tdist

from ..meter import ByteMeter, nbytes

Spec = Sequence[tuple[tuple[int, ...], torch.dtype]]


class StageLinks:
    def __init__(self, prev_rank: int | None, next_rank: int | None, device, meter: ByteMeter):
        self.prev_rank, self.next_rank, self.device, self.meter = prev_rank, next_rank, device, meter

    def send(self, tensors: Sequence[torch.Tensor], to_next: bool, kind: str) -> None:
        dst = self.next_rank if to_next else self.prev_rank
        for t in tensors:
            tdist.send(t.contiguous(), dst)
            self.meter.add("sent", nbytes(t), kind)

    def recv(self, spec: Spec, from_prev: bool, kind: str) -> list[torch.Tensor]:
        src = self.prev_rank if from_prev else self.next_rank
        out = []
        for shape, dtype in spec:
            t = torch.empty(shape, dtype=dtype, device=self.device)
            tdist.recv(t, src)
            self.meter.add("recv", nbytes(t), kind)
            out.append(t)
        return out
