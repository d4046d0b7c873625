"""One replica's outer-sync payload for one stage: its layout, its self-checking header, and the
checks a gathered payload passes before any of it is summed (`SparseLoCoState.finish`).

One payload per stage and outer step (one collective, not one per tensor):

    header  16 bytes, little-endian: b"SLC1", version u8 (=1), flags u8 (bit 0: finite, i.e.
            this replica contributes), u16 zero, u32 crc32 fingerprint of (version, config,
            parameter shapes in order), u32 total payload length
    body    parameters grouped by shape, groups in order of first appearance, members of a
            group in parameter order; each parameter is one `TensorCodec` payload
            (see compress.py), each a multiple of 4 bytes.

The layout depends only on the configuration and the parameter shapes, so every replica of a
stage group produces a buffer of the same length (`payload_nbytes`) and the all-gather cannot
mismatch. What a payload must agree on to be summed with this replica's (magic, version, length,
fingerprint) is checked before anything is decoded, and a payload flagged finite whose values are
not (a faulty or hostile sender) is found here too: the flag is the sender's word.
"""
from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass
from typing import Iterable, Sequence

import torch
from torch import Tensor

from .. import sizes
from ..config import SparseLoCoConfig
from .aggregate import AGGREGATIONS, REGISTRIES
from .compress import DenseCodec, TensorCodec

HEADER = struct.Struct("<4sBBHII")
assert HEADER.size == sizes.PAYLOAD_HEADER_BYTES
MAGIC = b"SLC1"
VERSION = 1
FLAG_FINITE = 1
LOCAL_FIELDS = ("preset", "outer_state_device")
"""`SparseLoCoConfig` fields the payload fingerprint leaves out: a shorthand for the others, and where a
replica keeps its own state; replicas may differ in these and still sum each other's payloads."""


def outer_config(cfg=None) -> SparseLoCoConfig:
    """The outer step's settings: `config.SparseLoCoConfig`, the one schema and the one set of
    defaults (None: those defaults; a dict: validated as the config's `sparseloco` section). A copy,
    so a later assignment to the caller's config cannot part a state from the payloads it lays out."""
    if cfg is None:
        return SparseLoCoConfig()
    if isinstance(cfg, dict):
        return SparseLoCoConfig.model_validate(cfg)
    if isinstance(cfg, SparseLoCoConfig):
        return cfg.model_copy(deep=True)
    raise TypeError(f"the outer step's settings must be a SparseLoCoConfig, a dict or None, got {type(cfg).__name__}")


def is_dense(cfg: SparseLoCoConfig) -> bool:
    """Whether `cfg`'s aggregation sends whole pseudo-gradients (no top-k, no error feedback)."""
    return AGGREGATIONS[cfg.aggregation].dense


def tensor_codec(cfg: SparseLoCoConfig, shape) -> TensorCodec | DenseCodec:
    """The wire format of one tensor of `shape` under `cfg`."""
    value_dtype = getattr(torch, cfg.value_dtype)
    if is_dense(cfg):
        return DenseCodec(tuple(shape), value_dtype)
    return TensorCodec(tuple(shape), cfg.chunk_size, cfg.topk, cfg.quant_bits, value_dtype,
                       chunking=cfg.chunking, topk_rule=cfg.topk_rule, quant_rounding=cfg.quant_rounding,
                       quant_std=cfg.quant_std)


def payload_nbytes(shapes: Iterable[Sequence[int]], cfg=None) -> int:
    """Bytes of one replica's payload for parameters of `shapes`: a pure function of the config."""
    cfg = outer_config(cfg)
    return HEADER.size + sum(tensor_codec(cfg, s).nbytes for s in shapes)


def _fingerprint(shapes: Sequence[tuple[int, ...]], cfg: SparseLoCoConfig) -> int:
    # Every field but the local ones, and each chosen rule as its registry knows it: a rule
    # registered under the same name but defined otherwise on another replica is a mismatch too.
    settings = tuple(f"{name}={getattr(cfg, name)}" for name in type(cfg).model_fields if name not in LOCAL_FIELDS)
    rules = tuple(registry.identity(getattr(cfg, registry.key)) for registry in REGISTRIES)
    return zlib.crc32(repr((VERSION, settings, rules, tuple(shapes))).encode())


@dataclass
class Section:
    """Parameters of one shape and their place in the payload: one row of `codec.nbytes` bytes per
    member, from `offset` on."""

    shape: tuple[int, ...]
    members: list[int]
    codec: TensorCodec | DenseCodec
    offset: int

    @property
    def nbytes(self) -> int:
        return len(self.members) * self.codec.nbytes

    def rows(self, payload: Tensor) -> Tensor:
        return payload[self.offset: self.offset + self.nbytes].view(len(self.members), self.codec.nbytes)


class PayloadLayout:
    """The payload of parameters of `shapes` under `cfg` (the module docstring): its sections, its
    length, the header this replica writes (on `device`) and the checks of the payloads it gathers."""

    def __init__(self, shapes: Sequence[tuple[int, ...]], cfg: SparseLoCoConfig, device: torch.device):
        self.device = device
        self.nbytes = payload_nbytes(shapes, cfg)
        by_shape: dict[tuple[int, ...], list[int]] = {}
        for i, s in enumerate(shapes):
            by_shape.setdefault(s, []).append(i)
        self.sections: list[Section] = []
        offset = HEADER.size
        for shape, members in by_shape.items():
            self.sections.append(Section(shape, members, tensor_codec(cfg, shape), offset))
            offset += self.sections[-1].nbytes
        assert offset == self.nbytes
        self.fingerprint = fp = _fingerprint(shapes, cfg)
        self._headers = {
            ok: torch.tensor(list(HEADER.pack(MAGIC, VERSION, FLAG_FINITE if ok else 0, 0, fp, self.nbytes)),
                             dtype=torch.uint8, device=device)
            for ok in (True, False)
        }

    def blank(self, finite: bool) -> Tensor:
        """A payload of this layout with a zero body under this replica's header, flagged finite (it
        contributes: the caller fills the body) or not."""
        payload = torch.zeros(self.nbytes, dtype=torch.uint8, device=self.device)
        payload[: HEADER.size] = self._headers[finite]
        return payload

    def value_sections(self, payload: Tensor) -> list[Tensor]:
        """Writable views of a payload's float sections, one [members, n] per section
        (`TensorCodec.value_section`)."""
        return [s.codec.value_section(s.rows(payload)) for s in self.sections]

    def flags(self, payloads: Sequence[Tensor]) -> list[bool]:
        """Each gathered payload's finite flag, once every payload has proved laid out as this one
        (dtype, length, magic, version, fingerprint): one host sync for all the headers."""
        if not payloads:
            raise ValueError("finish() needs the payloads of all replicas, got none")
        for m, p in enumerate(payloads):
            if p.dtype != torch.uint8 or p.dim() != 1 or p.numel() != self.nbytes:
                raise ValueError(f"payload of replica {m} is {p.dtype} {tuple(p.shape)}; expected uint8 "
                                 f"({self.nbytes},): replicas disagree on the stage's parameters or config")
        heads = torch.stack([p[: HEADER.size].to(self.device) for p in payloads]).cpu()
        flags = []
        for m, raw in enumerate(heads.tolist()):
            magic, version, flag, _, fp, length = HEADER.unpack(bytes(raw))
            if magic != MAGIC or version != VERSION or length != self.nbytes:
                raise ValueError(f"payload of replica {m} is not a version-{VERSION} SparseLoCo payload of "
                                 f"{self.nbytes} bytes (magic {magic!r}, version {version}, length {length})")
            if fp != self.fingerprint:
                raise ValueError(f"payload of replica {m} was built with another config or parameter list "
                                 f"(fingerprint {fp:#010x}, this replica {self.fingerprint:#010x})")
            flags.append(bool(flag & FLAG_FINITE))
        return flags

    def finite_values(self, payloads: list[Tensor], flagged: tuple[int, ...]) -> tuple[int, ...]:
        """Those of `flagged` (finite by their header) whose sent values (or lookup tables) are all
        finite: one NaN summed in would reach every replica's theta."""
        if not flagged:
            return flagged
        ok = torch.stack([torch.stack([torch.isfinite(v).all() for v in self.value_sections(payloads[m])]).all()
                          for m in flagged]).tolist()
        return tuple(m for m, good in zip(flagged, ok) if good)
