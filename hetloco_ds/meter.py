"""Byte accounting, counted where bytes are handed to a send, receive or collective.

Kinds are the link classes this project exists to shrink: `activation` and
`activation_grad` cross stage links every micro-batch; `outer_sync` crosses replica links
every H steps; `embedding_sync` crosses stage links at outer steps (the sparse T_S aggregate
that lets every stage apply eqs. 3-4); `control` is everything else we put on a wire
(telemetry scalars, the clipping norm, one-time set-up broadcasts), so nothing goes uncounted.
"""
from __future__ import annotations

import contextlib
from collections import defaultdict

import torch

KINDS = ("activation", "activation_grad", "outer_sync", "embedding_sync", "control")


def nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


class ByteMeter:
    """Per-rank cumulative counters of payload bytes sent and received, by kind."""

    def __init__(self) -> None:
        self.total = {k: {"sent": 0, "recv": 0} for k in KINDS}
        self._kind: list[str] = []
        self._mark = self.snapshot()

    @contextlib.contextmanager
    def kind(self, kind: str):
        """Attribute the p2p calls made inside this block to `kind`."""
        if kind not in self.total:
            raise ValueError(f"unknown byte kind {kind!r}; expected one of {KINDS}")
        self._kind.append(kind)
        try:
            yield
        finally:
            self._kind.pop()

    @property
    def current_kind(self) -> str:
        return self._kind[-1] if self._kind else "control"

    def add(self, direction: str, n: int, kind: str | None = None) -> None:
        self.total[kind or self.current_kind][direction] += int(n)

    def sent(self, tensor: torch.Tensor, kind: str | None = None) -> None:
        self.add("sent", nbytes(tensor), kind)

    def recv(self, tensor: torch.Tensor, kind: str | None = None) -> None:
        self.add("recv", nbytes(tensor), kind)

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


_METER: ByteMeter | None = None


def get_meter() -> ByteMeter:
    """The process's meter (one engine per process)."""
    global _METER
    if _METER is None:
        _METER = ByteMeter()
    return _METER


def reset_meter() -> ByteMeter:
    global _METER
    _METER = ByteMeter()
    return _METER


def merge(a: dict, b: dict) -> dict:
    out = defaultdict(dict)
    for k in KINDS:
        for d in ("sent", "recv"):
            out[k][d] = a[k][d] + b[k][d]
    return dict(out)
