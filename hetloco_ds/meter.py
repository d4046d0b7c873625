"""Byte accounting, counted where bytes are handed to a send, receive or collective; and a rank's
peak memory, the other thing each rank measures of itself and the step's record gathers.

Kinds are the link classes this project exists to shrink: `activation` and
`activation_grad` cross stage links every micro-batch; `outer_sync` crosses replica links
every H steps; `embedding_sync` crosses stage links at outer steps (the sparse T_S aggregate
that lets every stage apply eqs. 3-4); `control` is everything else we put on a wire
(telemetry scalars, the clipping norm, one-time set-up broadcasts), so nothing goes uncounted.
"""
from __future__ import annotations

import resource
import sys

import torch

from .sizes import BYTE_KINDS as KINDS


def peak_memory_bytes(device: torch.device) -> int:
    """This process's high-water mark: allocated GPU memory on CUDA, resident set size on CPU."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)  # bytes on macOS, KiB on Linux


def nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


class ByteMeter:
    """Per-rank cumulative counters of payload bytes sent and received, by kind.

    One per engine: the engine's own sends, receives and collectives (and the transports it
    hands the meter to) count here, where the bytes are handed over, never through a global."""

    def __init__(self) -> None:
        self.total = {k: {"sent": 0, "recv": 0} for k in KINDS}
        self._mark = self.snapshot()

    def add(self, direction: str, n: int, kind: str) -> None:
        if kind not in self.total:
            raise ValueError(f"unknown byte kind {kind!r}; expected one of {KINDS}")
        self.total[kind][direction] += int(n)

    def snapshot(self) -> dict[str, dict[str, int]]:
        return {k: dict(v) for k, v in self.total.items()}

    def since_mark(self) -> dict[str, dict[str, int]]:
        """Bytes since the previous call (one optimizer step's worth when called once a step)."""
        now = self.snapshot()
        delta = {k: {d: now[k][d] - self._mark[k][d] for d in ("sent", "recv")} for k in KINDS}
        self._mark = now
        return delta

    def as_vector(self, counts: dict[str, dict[str, int]]) -> list[int]:
        return [counts[k][d] for k in KINDS for d in ("sent", "recv")]

    @staticmethod
    def from_vector(values) -> dict[str, dict[str, int]]:
        it = iter(int(v) for v in values)
        return {k: {"sent": next(it), "recv": next(it)} for k in KINDS}
