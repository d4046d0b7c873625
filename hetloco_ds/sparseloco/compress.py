"""SparseLoCo's compressor on one tensor: chunk, per-chunk top-k, optional quantisation, pack.

Pure functions of tensors: no processes, no collectives, no optimizer state. Every function
works on any device and on an optional leading batch dimension (a stack of same-shape
tensors), so the outer step can compress all same-shape parameters of a stage in one pass.

Chunking, k per chunk, index widths and section sizes are size rules: they live in
`hetloco_ds.sizes` (shared with the cost model) and are only applied here. Tiles are numbered
row-major over the tile grid; each tile is flattened row-major into one chunk. `chunking`
"tiles" (ours) or "per_dim" (templar: 1-D tensors in chunks of <= 64) and `topk_rule` "scaled"
(ours) or "fixed" (templar: k = topk in every chunk) select the rule (see sizes.py).

Top-k
    k = sizes.topk_per_chunk(chunk_len, rule=topk_rule). Selection is `torch.topk(|x|, k, sorted=False)` per
    chunk; the *signed* values are sent. Ties in magnitude are broken however torch.topk
    breaks them on that device (PyTorch leaves it unspecified). Either choice is valid under
    error feedback (the entry not sent stays in the error buffer), and only the sender ever
    selects, so a tie can never make replicas disagree. The order of the k indices inside a
    chunk is unspecified too. NaN and +-inf rank above every finite magnitude (torch.topk's
    behaviour, guarded by a test): a chunk holding a non-finite entry always sends one, which
    is what lets the outer step detect a non-finite replica from the k selected values alone.

Quantisation (optional, bits in {2, 4, 8}; levels = 2**bits), per tensor over its selected values
    centre = mean, std = population std ("population", ours: defined for a single value) or
    sample std ("sample", templar's ||v - mean|| / sqrt(n - 1); population for n = 1), width =
    6 * std / levels, code = clamp(R((v - centre) / width + levels/2), 0, levels-1),
    R = floor ("floor", ours: `levels` bins of equal width covering centre +- 3 std) or
    round-half-to-even ("nearest", templar's _quantize_values: bin b is centred on
    centre + (b - levels/2) * width, so the range is skewed by half a bin to the negative side).
    The lookup table (float32, `levels` entries) holds each bin's mean of the values that fell
    into it (accumulated in float64); an empty bin (never decoded) holds its centre,
    centre + (code - levels/2 + 1/2) * width for floor, centre + (code - levels/2) * width
    for nearest. The two stds differ by a factor sqrt(n / (n - 1)) ~ 1 + 1/(2n), enough to move
    a value lying near a bin edge to the next bin. std == 0 (all values equal): width is
    replaced by 1 for the division, so codes stay finite and the table holds the values'
    mean - no NaN. Decoding is lut[code].

Payload of one tensor (`TensorCodec.nbytes` bytes; a batch is `[B, nbytes]`, one row per tensor)
    unquantised:  values  n_sel x value_dtype (float32 or bfloat16, little-endian)
                  indices packed at `index_bits(chunk_len)` bits
                  zero padding to a multiple of 4 bytes
    quantised:    lut     levels x float32
                  indices packed as above
                  codes   packed at `bits` bits (8 // bits codes per byte, first code in the low bits)
                  zero padding to a multiple of 4 bytes
    n_sel = n_chunks * k, in chunk order: entries [c*k, (c+1)*k) belong to chunk c, so the
    chunk id is implicit and only the index inside the chunk travels. Indices of chunks of
    <= 4096 elements take 12 bits: two indices in three bytes, (a & 0xff), (a >> 8) | (b & 0xf) << 4,
    b >> 4, an odd count padded with a zero index. Larger chunks use 16 or 32 bits. Float
    sections come first and every payload is a multiple of 4 bytes, so in a concatenation of
    payloads every float section stays 4-byte aligned and is read as a view, without a copy.
    Small chunks (per_dim 1-D chunks of 64) keep 12-bit indices, as templar does: 6 bits
    would fit, but 1-D tensors are a few thousandths of a LLaMA's parameters.

Dense payload (`DenseCodec`, the uncompressed DiLoCo control): the whole tensor, row-major,
as value_dtype, zero padding to a multiple of 4 bytes (`sizes.dense_wire_nbytes`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
from torch import Tensor

from .. import sizes
from ..sizes import QUANT_BITS

VALUE_DTYPES = (torch.float32, torch.bfloat16)
QUANT_ROUNDINGS = ("floor", "nearest")
QUANT_STDS = ("population", "sample")


# --------------------------------------------------------------------------- chunking
@dataclass(frozen=True)
class ChunkLayout:
    """How a tensor of `shape` is cut into `n_chunks` chunks of `chunk_len` elements.

    `tile` is (tr, tc) for 2-D tensors and None for flattened ones. `to_chunks` and
    `from_chunks` are exact inverses; both accept leading batch dimensions.
    """

    shape: tuple[int, ...]
    n_chunks: int
    chunk_len: int
    tile: tuple[int, int] | None

    @classmethod
    def for_shape(cls, shape, chunk_size: int = 4096, chunking: str = "tiles") -> "ChunkLayout":
        c = sizes.chunking(shape, chunk_size, chunking)  # the rule lives in sizes
        return cls(c.shape, c.n_chunks, c.chunk_len, c.tile)

    @property
    def numel(self) -> int:
        return self.n_chunks * self.chunk_len

    def _batch(self, t: Tensor, trailing: int) -> tuple[int, ...]:
        return tuple(t.shape[: t.dim() - trailing])

    def chunk_view(self, t: Tensor) -> Tensor:
        """A view (no copy where t is contiguous) whose last axes enumerate chunks then elements.

        Tiled: [*batch, R/tr, C/tc, tr, tc] (strided); flat: [*batch, n_chunks, chunk_len].
        """
        batch = self._batch(t, len(self.shape))
        if tuple(t.shape[len(batch):]) != self.shape:
            raise ValueError(f"tensor of shape {tuple(t.shape)} does not end in the layout's shape {self.shape}")
        if self.tile is None:
            return t.reshape(*batch, self.n_chunks, self.chunk_len)
        (rows, cols), (tr, tc) = self.shape, self.tile
        b = len(batch)
        t = t.reshape(*batch, rows // tr, tr, cols // tc, tc)
        return t.permute(*range(b), b, b + 2, b + 1, b + 3)

    def to_chunks(self, t: Tensor) -> Tensor:
        """[*batch, *shape] -> [*batch, n_chunks, chunk_len]."""
        batch = self._batch(t, len(self.shape))
        return self.chunk_view(t).reshape(*batch, self.n_chunks, self.chunk_len)

    def from_chunks(self, c: Tensor) -> Tensor:
        """[*batch, n_chunks, chunk_len] -> [*batch, *shape]; inverse of `to_chunks`."""
        batch = self._batch(c, 2)
        if tuple(c.shape[len(batch):]) != (self.n_chunks, self.chunk_len):
            raise ValueError(f"chunks of shape {tuple(c.shape)} do not end in {(self.n_chunks, self.chunk_len)}")
        if self.tile is None:
            return c.reshape(*batch, *self.shape)
        (rows, cols), (tr, tc) = self.shape, self.tile
        b = len(batch)
        c = c.reshape(*batch, rows // tr, cols // tc, tr, tc).permute(*range(b), b, b + 2, b + 1, b + 3)
        return c.reshape(*batch, rows, cols)

    def chunk_offsets(self, device=None) -> Tensor:
        """int64 [n_chunks]: flat position (in the tensor) of each chunk's first element."""
        c = torch.arange(self.n_chunks, device=device, dtype=torch.int64)
        if self.tile is None:
            return c * self.chunk_len
        (_, cols), (tr, tc) = self.shape, self.tile
        nbj = cols // tc
        return (c // nbj) * (tr * cols) + (c % nbj) * tc

    def element_offsets(self, device=None) -> Tensor:
        """int64 [chunk_len]: flat position of each in-chunk index relative to the chunk's first element."""
        j = torch.arange(self.chunk_len, device=device, dtype=torch.int64)
        if self.tile is None:
            return j
        tc, cols = self.tile[1], self.shape[1]
        return (j // tc) * cols + j % tc


# --------------------------------------------------------------------------- top-k
def topk_abs(chunks: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """Per chunk (last axis) the k entries of largest magnitude: (signed values, int64 indices).

    The one-tensor form of what `TensorCodec.select` does (which fuses tiling and |.| into one pass).
    """
    _, idx = torch.topk(chunks.abs(), k, dim=-1, largest=True, sorted=False)
    return chunks.gather(-1, idx), idx


# --------------------------------------------------------------------------- quantisation
def quantise(values: Tensor, bits: int, rounding: str = "floor", std: str = "population") -> tuple[Tensor, Tensor]:
    """Quantise along the last axis (one tensor per row): (uint8 codes, float32 lut [..., 2**bits]).

    See the module docstring for the rule. `values` must be finite.
    """
    if bits not in QUANT_BITS:
        raise ValueError(f"quant_bits must be one of {QUANT_BITS}, got {bits}")
    check_quant_rules(rounding, std)
    levels = 1 << bits
    v = values.float()
    centre = v.mean(-1, keepdim=True)
    correction = 1 if std == "sample" and v.shape[-1] > 1 else 0
    width = v.std(-1, correction=correction, keepdim=True) * (6.0 / levels)
    safe = torch.where(width > 0, width, torch.ones_like(width))
    bin_of = torch.floor if rounding == "floor" else torch.round
    codes = bin_of((v - centre) / safe + levels / 2).clamp_(0, levels - 1).to(torch.int64)
    # Per-row histograms as one bincount over row-offset codes (a shared-memory histogram on
    # CUDA; a scatter_add into 4 bins would serialise on atomics).
    shape = (*v.shape[:-1], levels)
    rows = math.prod(shape[:-1])
    flat = (codes.reshape(rows, -1) + torch.arange(rows, device=v.device).unsqueeze(1) * levels).reshape(-1)
    sums = torch.bincount(flat, weights=v.double().reshape(-1), minlength=rows * levels).view(shape)
    counts = torch.bincount(flat, minlength=rows * levels).view(shape)
    bin_centre = levels / 2 - (0.5 if rounding == "floor" else 0.0)
    offsets = torch.arange(levels, device=v.device, dtype=torch.float64) - bin_centre
    empty = centre.double() + offsets * width.double()
    lut = torch.where(counts > 0, sums / counts.clamp(min=1), empty).float()
    return codes.to(torch.uint8), lut


def dequantise(codes: Tensor, lut: Tensor) -> Tensor:
    """lut[code] along the last axis: float32 values."""
    return lut.gather(-1, codes.long())


# --------------------------------------------------------------------------- packing
def _pad_last(t: Tensor, multiple: int) -> Tensor:
    pad = (-t.shape[-1]) % multiple
    if pad == 0:
        return t
    return torch.cat([t, t.new_zeros(*t.shape[:-1], pad)], dim=-1)


def pack_indices(idx: Tensor, bits: int = 12) -> Tensor:
    """Integer indices [..., n] (each < 2**bits) -> uint8 [..., packed_index_nbytes(n, bits)]."""
    idx = idx.to(torch.int64)
    if bits == 12:
        pairs = _pad_last(idx, 2).reshape(*idx.shape[:-1], -1, 2)
        a, b = pairs[..., 0], pairs[..., 1]
        out = torch.stack([a & 0xFF, (a >> 8) | ((b & 0xF) << 4), b >> 4], dim=-1)
        return out.to(torch.uint8).reshape(*idx.shape[:-1], -1)
    if bits in (16, 32):
        out = torch.stack([(idx >> (8 * j)) & 0xFF for j in range(bits // 8)], dim=-1)
        return out.to(torch.uint8).reshape(*idx.shape[:-1], -1)
    raise ValueError(f"index bits must be 12, 16 or 32, got {bits}")


def unpack_indices(packed: Tensor, n: int, bits: int = 12) -> Tensor:
    """Inverse of `pack_indices`: uint8 [..., nbytes] -> int64 [..., n]."""
    batch = packed.shape[:-1]
    p = packed.to(torch.int64)
    if bits == 12:
        p = p.reshape(*batch, -1, 3)
        a = p[..., 0] | ((p[..., 1] & 0xF) << 8)
        b = (p[..., 1] >> 4) | (p[..., 2] << 4)
        return torch.stack([a, b], dim=-1).reshape(*batch, -1)[..., :n]
    if bits in (16, 32):
        p = p.reshape(*batch, -1, bits // 8)
        shifts = torch.arange(0, bits, 8, device=p.device, dtype=torch.int64)
        return (p << shifts).sum(-1)[..., :n]
    raise ValueError(f"index bits must be 12, 16 or 32, got {bits}")


def pack_codes(codes: Tensor, bits: int) -> Tensor:
    """Codes [..., n] (each < 2**bits) -> uint8 [..., ceil(n * bits / 8)], first code in the low bits."""
    if bits not in QUANT_BITS:
        raise ValueError(f"code bits must be one of {QUANT_BITS}, got {bits}")
    c = codes.to(torch.uint8)
    if bits == 8:
        return c.clone()
    per = 8 // bits
    c = _pad_last(c, per).reshape(*c.shape[:-1], -1, per)
    out = c[..., 0].clone()
    for j in range(1, per):  # at most 3 iterations: one per code slot in a byte
        out |= c[..., j] << (bits * j)
    return out


def unpack_codes(packed: Tensor, n: int, bits: int) -> Tensor:
    """Inverse of `pack_codes`: uint8 [..., nbytes] -> uint8 [..., n]."""
    if bits not in QUANT_BITS:
        raise ValueError(f"code bits must be one of {QUANT_BITS}, got {bits}")
    if bits == 8:
        return packed[..., :n].to(torch.uint8)
    shifts = torch.arange(0, 8, bits, device=packed.device, dtype=torch.uint8)
    out = (packed.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    return out.reshape(*packed.shape[:-1], -1)[..., :n]


def bytes_as(b: Tensor, dtype: torch.dtype) -> Tensor:
    """Reinterpret uint8 [..., m] as dtype [..., m / size]: a view when aligned, else a copy."""
    size = torch.empty((), dtype=dtype).element_size()
    if (b.data_ptr() % size or b.storage_offset() % size or b.stride(-1) != 1
            or any(s % size for s in b.stride()[:-1])):
        b = b.clone(memory_format=torch.contiguous_format)
    return b.view(dtype)


# --------------------------------------------------------------------------- codec
class Selection(NamedTuple):
    """What top-k picked in a batch of B tensors; every field is [B, n_selected], chunk-major."""

    idx: Tensor  # int64 index inside its chunk
    pos: Tensor  # int64 flat position inside its tensor
    values: Tensor  # float32 signed values before quantisation


def value_nbytes(value_dtype: torch.dtype) -> int:
    """Wire bytes of one unquantised value; one error naming the dtype if it cannot travel."""
    if value_dtype not in VALUE_DTYPES:
        raise ValueError(f"value_dtype must be one of {VALUE_DTYPES}, got {value_dtype}")
    return torch.empty((), dtype=value_dtype).element_size()


def check_quant_rules(rounding: str, std: str) -> None:
    if rounding not in QUANT_ROUNDINGS:
        raise ValueError(f"quant_rounding must be one of {QUANT_ROUNDINGS}, got {rounding!r}")
    if std not in QUANT_STDS:
        raise ValueError(f"quant_std must be one of {QUANT_STDS}, got {std!r}")


def check_codec_settings(chunk_size: int, topk: int, quant_bits: int | None, value_dtype: torch.dtype,
                         chunking: str = "tiles", topk_rule: str = "scaled", quant_rounding: str = "floor",
                         quant_std: str = "population") -> None:
    """One error naming the bad value, for every place these settings enter (`sizes.check_codec`)."""
    sizes.check_codec(chunk_size, topk, quant_bits, value_nbytes(value_dtype), chunking, topk_rule)
    check_quant_rules(quant_rounding, quant_std)


@dataclass(frozen=True)
class TensorCodec:
    """Compressor and wire format for tensors of one shape and one configuration.

    Methods take a tensor of `shape` or a batch `[B, *shape]` of them; payloads are then
    `[nbytes]` or `[B, nbytes]` uint8.
    """

    shape: tuple[int, ...]
    chunk_size: int = 4096
    topk: int = 32
    quant_bits: int | None = None
    value_dtype: torch.dtype = torch.float32
    chunking: str = "tiles"
    topk_rule: str = "scaled"
    quant_rounding: str = "floor"
    quant_std: str = "population"
    layout: ChunkLayout = field(init=False, repr=False)
    k: int = field(init=False)
    n_selected: int = field(init=False)
    index_bits: int = field(init=False)
    nbytes: int = field(init=False)
    _head_nbytes: int = field(init=False, repr=False)
    _index_nbytes: int = field(init=False, repr=False)
    _code_nbytes: int = field(init=False, repr=False)
    _tables: dict = field(init=False, default_factory=dict, repr=False, compare=False)

    def __post_init__(self):
        check_quant_rules(self.quant_rounding, self.quant_std)
        shape = tuple(int(s) for s in self.shape)
        wire = sizes.tensor_wire(shape, self.chunk_size, self.topk, self.quant_bits, value_nbytes(self.value_dtype),
                                 self.chunking, self.topk_rule)
        set_ = object.__setattr__
        set_(self, "shape", shape)
        set_(self, "layout", ChunkLayout(shape, wire.chunks.n_chunks, wire.chunks.chunk_len, wire.chunks.tile))
        set_(self, "k", wire.k)
        set_(self, "n_selected", wire.n_selected)
        set_(self, "index_bits", wire.index_bits)
        set_(self, "nbytes", wire.nbytes)
        # section sizes (bytes): [head = values or lut][indices][codes][pad]
        set_(self, "_head_nbytes", wire.head_nbytes)
        set_(self, "_index_nbytes", wire.index_nbytes)
        set_(self, "_code_nbytes", wire.code_nbytes)

    def _positions(self, idx: Tensor) -> Tensor:
        """[B, n_chunks, k] in-chunk indices -> [B, n_selected] flat positions in each tensor."""
        key = idx.device
        if key not in self._tables:  # two small int64 tables per device, built once
            self._tables[key] = (self.layout.chunk_offsets(key).unsqueeze(-1), self.layout.element_offsets(key))
        base, offs = self._tables[key]
        return (offs[idx] + base).reshape(idx.shape[0], -1)

    def _as_batch(self, t: Tensor) -> tuple[Tensor, bool]:
        if tuple(t.shape) == self.shape:
            return t.unsqueeze(0), False
        if tuple(t.shape[1:]) == self.shape and t.dim() == len(self.shape) + 1:
            return t, True
        raise ValueError(f"expected a tensor of shape {self.shape} or [B, *{self.shape}], got {tuple(t.shape)}")

    # ---------------------------------------------------------------- sender
    def select(self, e: Tensor) -> Selection:
        """Per-chunk top-k by magnitude of e ([*shape] or [B, *shape]); always batched output."""
        e, _ = self._as_batch(e)
        lay, bsz = self.layout, e.shape[0]
        view = lay.chunk_view(e)
        if lay.tile is None:
            mag = view.abs()
        else:  # one pass: gather the tiles and take |.| into a contiguous [B, n_chunks, len] buffer
            mag = torch.empty(bsz, lay.n_chunks, lay.chunk_len, dtype=e.dtype, device=e.device)
            torch.abs(view, out=mag.view(view.shape))
        _, idx = torch.topk(mag, self.k, dim=-1, largest=True, sorted=False)
        del mag
        pos = self._positions(idx)
        values = e.reshape(bsz, -1).gather(1, pos).float()
        return Selection(idx.reshape(bsz, -1), pos, values)

    def pack_(self, out: Tensor, sel: Selection) -> Tensor:
        """Write the payload rows of `sel` into `out` [B, nbytes] (uint8); return the sent values.

        The returned float32 [B, n_selected] are exactly what a receiver decodes (after
        quantisation or the cast to `value_dtype`): the sender subtracts them from its error buffer.
        """
        head, ib = self._head_nbytes, self._index_nbytes
        if self.quant_bits is None:
            wire = sel.values.to(self.value_dtype)
            out[:, :head] = wire.view(torch.uint8)
            sent = wire.float()
        else:
            codes, lut = quantise(sel.values, self.quant_bits, self.quant_rounding, self.quant_std)
            out[:, :head] = lut.view(torch.uint8)
            out[:, head + ib: head + ib + self._code_nbytes] = pack_codes(codes, self.quant_bits)
            sent = dequantise(codes, lut)
        out[:, head: head + ib] = pack_indices(sel.idx, self.index_bits)
        return sent

    def encode(self, e: Tensor) -> tuple[Tensor, Tensor]:
        """(payload uint8 of exactly `nbytes` per tensor, dense float32 tensor of what is sent).

        `sent` holds the decoded values at the selected positions and zeros elsewhere, so the
        caller's error feedback is `e - sent`.
        """
        batch, batched = self._as_batch(e)
        sel = self.select(batch)
        payload = torch.zeros(batch.shape[0], self.nbytes, dtype=torch.uint8, device=e.device)
        values = self.pack_(payload, sel)
        sent = torch.zeros(batch.shape[0], self.layout.numel, dtype=torch.float32, device=e.device)
        sent.scatter_(1, sel.pos, values)
        sent = sent.reshape(batch.shape)
        return (payload, sent) if batched else (payload[0], sent[0])

    # ---------------------------------------------------------------- receiver
    def unpack(self, payload: Tensor) -> tuple[Tensor, Tensor]:
        """Payload [nbytes] or [B, nbytes] -> (int64 flat positions, float32 values), both [B, n_selected]."""
        rows = payload.unsqueeze(0) if payload.dim() == 1 else payload
        if rows.dim() != 2 or rows.shape[1] != self.nbytes or rows.dtype != torch.uint8:
            raise ValueError(f"expected uint8 payload rows of {self.nbytes} bytes, got {rows.dtype} {tuple(rows.shape)}")
        head, ib, n = self._head_nbytes, self._index_nbytes, self.n_selected
        idx = unpack_indices(rows[:, head: head + ib], n, self.index_bits)
        pos = self._positions(idx.view(rows.shape[0], self.layout.n_chunks, self.k))
        if self.quant_bits is None:
            values = bytes_as(rows[:, :head], self.value_dtype).float()
        else:
            lut = bytes_as(rows[:, :head], torch.float32)
            codes = unpack_codes(rows[:, head + ib: head + ib + self._code_nbytes], n, self.quant_bits)
            values = dequantise(codes, lut)
        return pos, values

    def value_section(self, rows: Tensor) -> Tensor:
        """A writable view of the payload rows' [B, nbytes] float section: the values (value_dtype)
        unquantised, the per-tensor lookup table (float32) quantised; what a decoded value scales with."""
        return rows[:, : self._head_nbytes].view(self.value_dtype if self.quant_bits is None else torch.float32)

    def decode_add_(self, payload: Tensor, out: Tensor) -> Tensor:
        """out += decode(payload), in place; `out` is [*shape] (payload [nbytes]) or [B, *shape].

        Positions inside one payload are distinct, so the add is a gather/add/scatter with
        no atomics: deterministic on every device. Summing replicas = one call per replica,
        in a fixed order.
        """
        pos, values = self.unpack(payload)
        target, _ = self._as_batch(out)
        flat = target.view(target.shape[0], -1)  # raises for a non-contiguous `out`
        flat.scatter_(1, pos, flat.gather(1, pos) + values.to(flat.dtype))
        return out


@dataclass(frozen=True)
class DenseCodec:
    """Wire format of a whole tensor (the uncompressed control): value_dtype, row-major, padded.

    Methods take a batch `[B, *shape]`; payload rows are `[B, nbytes]` uint8.
    """

    shape: tuple[int, ...]
    value_dtype: torch.dtype = torch.float32
    numel: int = field(init=False)
    nbytes: int = field(init=False)

    def __post_init__(self):
        shape = tuple(int(s) for s in self.shape)
        object.__setattr__(self, "shape", shape)
        object.__setattr__(self, "numel", math.prod(shape))
        object.__setattr__(self, "nbytes", sizes.dense_wire_nbytes(shape, value_nbytes(self.value_dtype)))

    def pack_(self, out: Tensor, e: Tensor) -> Tensor:
        """Write `e` [B, *shape] into `out` [B, nbytes]; return what a receiver decodes, float32 [B, numel]."""
        wire = e.reshape(e.shape[0], self.numel).to(self.value_dtype)
        out[:, : wire.shape[1] * wire.element_size()] = wire.view(torch.uint8)
        return wire.float()

    def value_section(self, rows: Tensor) -> Tensor:
        """A writable view of the payload rows' [B, nbytes] values (value_dtype)."""
        return rows[:, : self.numel * value_nbytes(self.value_dtype)].view(self.value_dtype)

    def unpack(self, payload: Tensor) -> Tensor:
        """Payload rows [B, nbytes] -> float32 values [B, numel]."""
        if payload.dim() != 2 or payload.shape[1] != self.nbytes or payload.dtype != torch.uint8:
            raise ValueError(f"expected uint8 payload rows of {self.nbytes} bytes, "
                             f"got {payload.dtype} {tuple(payload.shape)}")
        return bytes_as(payload[:, : self.numel * value_nbytes(self.value_dtype)], self.value_dtype).float()
