"""Named corruptions of a replica's outer-sync payload: the bad contributions the outer step's screen
(`sparseloco.screen`) is measured and tested against. Injected by the simulator (`Variant.attack`:
one replica's payloads at every outer step) and by the tests' fault injection into engine ranks.

Each acts on the payload's float section of every tensor (`SparseLoCoState.value_sections`: the
sent values, or the lookup table when quantised), per tensor, in place; positions, header and
length stay, so the payload passes every check a well-formed one does (a peer holding the fleet's
secret, or a buggy one, sends such bytes):

    flip      -v                                       the pseudo-gradient's sign flipped
    scale     100 v                                    x100
    noise     u * ||v|| / ||u||, u ~ U(-1, 1)          uniform noise of the tensor's norm
    constant  ||v|| / sqrt(n) in every entry           a constant of the tensor's norm

and one that is no attack: `absent` marks the payload non-finite (a zero body), so the replica takes
no part in any outer step while it trains on its own data shard: the M - 1 others are "the honest
replicas alone", on exactly the data they have beside an attacker. A payload flagged non-finite (a
zero body) is left as it is.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .outer import SparseLoCoState
from .payload import FLAG_FINITE, HEADER

ATTACKS = ("flip", "scale", "noise", "constant", "absent")
SCALE = 100.0


def check_attack(kind: str) -> str:
    if kind not in ATTACKS:
        raise ValueError(f"attack must be one of {ATTACKS}, got {kind!r}")
    return kind


@torch.no_grad()
def corrupt_(state: SparseLoCoState, payload: Tensor, kind: str, generator: torch.Generator) -> Tensor:
    """`payload` (laid out by `state`) corrupted in place the named way; `generator` (a CPU one) draws
    the noise, so every process that corrupts the same payload with the same seed writes the same bytes."""
    check_attack(kind)
    magic, version, flags, zero, fp, length = HEADER.unpack(bytes(payload[: HEADER.size].tolist()))
    if not flags & FLAG_FINITE:
        return payload
    if kind == "absent":
        payload[HEADER.size:] = 0
        header = HEADER.pack(magic, version, flags & ~FLAG_FINITE, zero, fp, length)
        payload[: HEADER.size] = torch.tensor(list(header), dtype=torch.uint8)
        return payload
    for section in state.value_sections(payload):
        v = section.float()
        norm = torch.linalg.vector_norm(v, dim=1, keepdim=True)
        if kind == "flip":
            new = -v
        elif kind == "scale":
            new = SCALE * v
        elif kind == "noise":
            u = torch.rand(v.shape, generator=generator).to(v.device) * 2 - 1
            new = u * (norm / torch.linalg.vector_norm(u, dim=1, keepdim=True).clamp(min=1e-30))
        else:
            new = (norm / v.shape[1] ** 0.5).expand_as(v)
        section.copy_(new.to(section.dtype))
    return payload


@dataclass(frozen=True)
class Attack:
    """One replica attacking at every outer step (the simulator's `Variant.attack`)."""

    kind: str
    replica: int
    """Its position in every gathered list (the replica id, in replica order)."""
    seed: int = 0

    def __post_init__(self):
        check_attack(self.kind)

    def apply(self, state: SparseLoCoState, payloads: list[Tensor], outer_step: int, block: int) -> None:
        """Replace the attacker's payload in `payloads` (one block's, gathered) by a corrupted copy;
        the noise is drawn from (seed, outer step, block), the same in every process of a sharded row."""
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + outer_step * 1_009 + block)
        payloads[self.replica] = corrupt_(state, payloads[self.replica].clone(), self.kind, generator)
