"""SparseLoCo's one-tensor compressor against an independent float64 reference.

The reference below follows METHOD.md literally with plain loops over tiles and chunks and
numpy float64 arithmetic; it shares no code with `hetloco_ds.sparseloco.compress`. Only the
per-chunk selection calls torch.topk, on float64 magnitudes, so that the rare tie is broken
the same way and indices compare equal.
"""
from __future__ import annotations

import math
import zlib

import numpy as np
import pytest
import torch

from hetloco_ds.sizes import largest_divisor, topk_per_chunk
from hetloco_ds.sparseloco.compress import (
    ChunkLayout,
    DenseCodec,
    TensorCodec,
    pack_codes,
    pack_indices,
    quantise,
    topk_abs,
    unpack_codes,
    unpack_indices,
)

SHAPES = [(1,), (7,), (4097,), (10000,), (3, 5), (65, 130), (64, 64), (128, 96), (1, 300), (2, 3, 5)]
CONFIGS = [(4096, 32), (64, 8)]  # (chunk_size, topk): the paper's, and one with several values per small chunk
# (chunking, topk_rule, quant_rounding, quant_std): ours, and the SparseLoCo authors' code (templar)
RULES = [("tiles", "scaled", "floor", "population"), ("per_dim", "fixed", "nearest", "sample")]


# ------------------------------------------------------------------ float64 reference
def ref_divisor(n: int, cap: int) -> int:
    return max(d for d in range(1, min(n, cap) + 1) if n % d == 0)


def ref_chunk_positions(shape, chunk_size, chunking="tiles"):
    """Flat positions of every chunk, tile by tile, each tile read row by row; a tensor that is not
    2-D in runs of <= chunk_size ("tiles") or <= the tile side ("per_dim") elements."""
    if len(shape) == 2:
        rows, cols = shape
        side = math.isqrt(chunk_size)
        tr, tc = ref_divisor(rows, side), ref_divisor(cols, side)
        chunks = []
        for bi in range(rows // tr):
            for bj in range(cols // tc):
                chunks.append(np.array([r * cols + c for r in range(bi * tr, (bi + 1) * tr)
                                        for c in range(bj * tc, (bj + 1) * tc)]))
        return chunks
    n = math.prod(shape)
    length = ref_divisor(n, chunk_size if chunking == "tiles" else math.isqrt(chunk_size))
    return [np.arange(c * length, (c + 1) * length) for c in range(n // length)]


def ref_k(length, chunk_size, topk, rule):
    if rule == "scaled":
        return min(length, max(1, round(topk * length / chunk_size)))
    k = min(topk, length)  # fixed: the same k in every chunk, >= 2 and even where the chunk allows
    k = max(k, 2)
    if k % 2:
        k -= 1
    return min(k, length)


def ref_quantise(v: np.ndarray, bits: int, edge_codes: np.ndarray | None = None, rounding: str = "floor",
                 std: str = "population"):
    """(codes, lut, ambiguous): ambiguous marks values within 1e-4 bins of a bin edge.

    Float32 rounding may put such a value on either side; where `edge_codes` (the
    implementation's codes) is given, an ambiguous value takes it if it is one of the two bins
    that meet at that edge, so the comparison stays exact everywhere else. Bins: floor puts bin b
    on [b, b + 1) of x; nearest on [b - 1/2, b + 1/2] (numpy rounds halves to even, as torch).
    std: population (divide by n), or sample (by n - 1, for n > 1).
    """
    levels = 2 ** bits
    centre = v.mean()
    width = 6 * v.std(ddof=1 if std == "sample" and v.size > 1 else 0) / levels
    x = (v - centre) / (width if width > 0 else 1.0) + levels / 2
    if rounding == "floor":
        codes, edge = np.floor(x), np.round(x)  # the nearest edge, between bins edge - 1 and edge
        below = edge - 1
        centres = np.arange(levels) - levels / 2 + 0.5
    else:
        codes, edge = np.round(x), np.floor(x) + 0.5  # edges sit halfway, between floor(x) and floor(x) + 1
        below = np.floor(x)
        centres = np.arange(levels) - levels / 2
    codes = np.clip(codes, 0, levels - 1).astype(np.int64)
    # with width == 0 all values are equal, and whichever bin they land in decodes to them
    ambiguous = (np.abs(x - edge) < 1e-4) & (below >= 0) & (below + 1 <= levels - 1) & (width > 0)
    if edge_codes is not None and ambiguous.any():
        assert np.isin(edge_codes[ambiguous] - below[ambiguous], [0, 1]).all(), "code off by more than one edge"
        codes[ambiguous] = edge_codes[ambiguous]
    lut = np.array([v[codes == b].mean() if (codes == b).any() else centre + centres[b] * width
                    for b in range(levels)])
    return codes, lut, ambiguous


def ref_encode(x: np.ndarray, chunk_size, topk, bits, value_dtype=torch.float32, edge_codes=None,
               rules=RULES[0]):
    """(dense sent float64, per-chunk sorted selected indices); `edge_codes`: flat position -> code."""
    chunking, topk_rule, rounding, std = rules
    flat = x.reshape(-1)
    chunks = ref_chunk_positions(x.shape, chunk_size, chunking)
    length = len(chunks[0])
    k = ref_k(length, chunk_size, topk, topk_rule)
    positions, values, selected = [], [], []
    for pos in chunks:
        vals = flat[pos]
        _, j = torch.topk(torch.from_numpy(np.abs(vals)), k)
        j = j.numpy()
        selected.append(np.sort(j))
        positions.extend(pos[j])
        values.extend(vals[j])
    values = np.array(values)
    if bits is None:
        sent = torch.from_numpy(values).to(value_dtype).double().numpy()
    else:
        hints = None if edge_codes is None else np.array([edge_codes[p] for p in positions])
        codes, lut, _ = ref_quantise(values, bits, hints, rounding, std)
        sent = lut[codes]
    dense = np.zeros(flat.size)
    dense[np.array(positions)] = sent
    return dense.reshape(x.shape), selected


def randn(shape, seed):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


# ------------------------------------------------------------------ chunking
@pytest.mark.parametrize("shape, chunk_len, tile", [
    ((1,), 1, None), ((7,), 7, None), ((4097,), 241, None), ((10000,), 2500, None), ((2, 3, 5), 30, None),
    ((3, 5), 15, (3, 5)), ((65, 130), 338, (13, 26)), ((64, 64), 4096, (64, 64)), ((128, 96), 3072, (64, 48)),
    ((1, 300), 60, (1, 60)),
])
def test_chunk_layout_uses_largest_divisors_up_to_64_tiles_and_4096(shape, chunk_len, tile):
    """Guards METHOD.md's chunking rule: a wrong divisor or tile side changes which k values are sent."""
    layout = ChunkLayout.for_shape(shape)
    assert (layout.chunk_len, layout.tile) == (chunk_len, tile)
    assert layout.n_chunks * layout.chunk_len == math.prod(shape)
    assert largest_divisor(4097, 4096) == 241 and largest_divisor(4099, 4096) == 1


@pytest.mark.parametrize("shape, chunk_len, tile", [
    ((1,), 1, None), ((7,), 7, None), ((4097,), 17, None), ((10000,), 50, None), ((2, 3, 5), 30, None),
    ((384,), 64, None), ((65, 130), 338, (13, 26)), ((64, 64), 4096, (64, 64)), ((128, 96), 3072, (64, 48)),
])
def test_per_dim_chunking_cuts_every_dimension_to_the_tile_side(shape, chunk_len, tile):
    """Guards templar's ChunkingTransformer rule: 1-D tensors in chunks of <= 64 (largest divisor),
    2-D tiles unchanged; with the 'tiles' rule a (384,) norm weight is one chunk of 384."""
    layout = ChunkLayout.for_shape(shape, 4096, "per_dim")
    assert (layout.chunk_len, layout.tile) == (chunk_len, tile)
    assert layout.n_chunks * layout.chunk_len == math.prod(shape)
    assert ChunkLayout.for_shape((384,)).chunk_len == 384
    with pytest.raises(ValueError, match="'flat'"):
        ChunkLayout.for_shape((384,), 4096, "flat")


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("chunk_size", [4096, 64])
@pytest.mark.parametrize("chunking", ["tiles", "per_dim"])
def test_to_chunks_reads_tiles_row_major_and_from_chunks_inverts(shape, chunk_size, chunking):
    """Guards the vectorised tiling against the loop definition; a wrong permute scrambles indices."""
    t = randn(shape, 0)
    layout = ChunkLayout.for_shape(shape, chunk_size, chunking)
    chunks = layout.to_chunks(t)
    expected = np.stack([t.reshape(-1).numpy()[pos] for pos in ref_chunk_positions(shape, chunk_size, chunking)])
    np.testing.assert_array_equal(chunks.numpy(), expected)
    assert torch.equal(layout.from_chunks(chunks), t)
    batch = torch.stack([t, -t])  # leading batch dimension
    assert torch.equal(layout.to_chunks(batch)[1], -chunks)
    assert torch.equal(layout.from_chunks(layout.to_chunks(batch)), batch)


def test_k_per_chunk_scales_with_chunk_length_and_is_at_least_one():
    """Guards the density: 32 of 4096, proportionally fewer in smaller chunks, never zero or > chunk."""
    assert topk_per_chunk(4096) == 32
    assert topk_per_chunk(2048) == 16
    assert topk_per_chunk(338) == 3  # 2.64 rounds to 3
    assert topk_per_chunk(60) == 1 and topk_per_chunk(1) == 1
    assert topk_per_chunk(7, topk=4096) == 7


def test_fixed_k_is_topk_in_every_chunk_even_and_at_least_two():
    """Guards templar's _clamp_topk: 32 of a 64-element chunk (not 1 of 128 as scaled), clamped to
    the chunk, made even, at least 2, but never more than a 1-element chunk holds."""
    fixed = dict(topk=32, chunk_size=4096, rule="fixed")
    assert topk_per_chunk(4096, **fixed) == 32 and topk_per_chunk(64, **fixed) == 32
    assert topk_per_chunk(64) == 1  # the scaled rule on the same chunk: 32 * 64 / 4096 = 0.5 -> 1
    assert topk_per_chunk(15, **fixed) == 14 and topk_per_chunk(3, **fixed) == 2
    assert topk_per_chunk(2, **fixed) == 2 and topk_per_chunk(1, **fixed) == 1
    assert topk_per_chunk(4096, topk=33, chunk_size=4096, rule="fixed") == 32
    assert topk_per_chunk(4096, topk=1, chunk_size=4096, rule="fixed") == 2
    with pytest.raises(ValueError, match="'fixed_k'"):
        topk_per_chunk(64, rule="fixed_k")


# ------------------------------------------------------------------ top-k + quantisation vs reference
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("bits", [None, 2, 4, 8])
@pytest.mark.parametrize("chunk_size, topk", CONFIGS)
@pytest.mark.parametrize("rules", RULES, ids=["ours", "templar"])
def test_encode_matches_float64_reference(shape, bits, chunk_size, topk, rules):
    """Guards selection (same indices per chunk) and what is sent (values or lut[code]) against the
    literal reference, under our rules and templar's; also that the payload decodes to exactly the
    `sent` the sender reports."""
    e = randn(shape, zlib.crc32(repr((shape, bits, chunk_size)).encode()) % 1000)
    codec = TensorCodec(shape, chunk_size, topk, bits, torch.float32, *rules)
    rounding, std = rules[2:]
    payload, sent = codec.encode(e)
    sel = codec.select(e)
    edge_codes = (None if bits is None else
                  dict(zip(sel.pos[0].tolist(), quantise(sel.values, bits, rounding, std)[0][0].tolist())))
    ref_sent, ref_selected = ref_encode(e.double().numpy(), chunk_size, topk, bits, edge_codes=edge_codes,
                                        rules=rules)

    idx = sel.idx.reshape(codec.layout.n_chunks, codec.k)
    got_selected = np.sort(idx.numpy(), axis=1)
    np.testing.assert_array_equal(got_selected, np.stack(ref_selected))
    values, plain_idx = topk_abs(codec.layout.to_chunks(e), codec.k)  # the unfused one-tensor form
    assert torch.equal(plain_idx.sort(1).values, torch.from_numpy(got_selected))
    assert torch.equal(values.sort(1).values, sel.values.view(codec.layout.n_chunks, codec.k).sort(1).values)
    if bits is None:
        np.testing.assert_array_equal(sent.double().numpy(), ref_sent)
    else:
        np.testing.assert_allclose(sent.double().numpy(), ref_sent, rtol=1e-5, atol=1e-6)
    assert payload.dtype == torch.uint8 and payload.shape == (codec.nbytes,)
    decoded = torch.zeros(shape)
    codec.decode_add_(payload, decoded)
    assert torch.equal(decoded, sent)


def test_bf16_values_travel_as_bfloat16():
    """Guards value_dtype: sent values are the bf16-rounded ones, and the payload halves its value bytes."""
    e = randn((65, 130), 3)
    f32, b16 = TensorCodec((65, 130)), TensorCodec((65, 130), value_dtype=torch.bfloat16)
    payload, sent = b16.encode(e)
    ref_sent, _ = ref_encode(e.double().numpy(), 4096, 32, None, torch.bfloat16)
    np.testing.assert_array_equal(sent.double().numpy(), ref_sent)
    n = f32.n_selected
    assert b16.nbytes == -(-(2 * n + 3 * ((n + 1) // 2)) // 4) * 4 < f32.nbytes
    decoded = torch.zeros(65, 130)
    b16.decode_add_(payload, decoded)
    assert torch.equal(decoded, sent)


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("rounding, std", [("floor", "population"), ("nearest", "sample"), ("nearest", "population")])
def test_quantise_codes_and_lut_follow_the_reference(bits, rounding, std):
    """Guards Q: centre/std (population: ours, sample: templar)/width, floor (ours) or round-to-nearest
    (templar) + clamp codes, lut = mean per bin, empty bin = its centre."""
    v = randn((2, 301), bits) ** 3  # heavy tails: some bins empty, clamping used
    codes, lut = quantise(v, bits, rounding, std)
    assert codes.dtype == torch.uint8 and lut.dtype == torch.float32 and lut.shape == (2, 2 ** bits)
    for row in range(2):
        x = v[row].double().numpy()
        ref_codes, ref_lut, ambiguous = ref_quantise(x, bits, rounding=rounding, std=std)
        np.testing.assert_array_equal(codes[row].numpy()[~ambiguous], ref_codes[~ambiguous])
        # bin means given the implementation's own codes (robust to an edge value landing either side)
        got = codes[row].numpy().astype(np.int64)
        levels = 2 ** bits
        width = 6 * x.std(ddof=1 if std == "sample" else 0) / levels
        centre = levels / 2 - (0.5 if rounding == "floor" else 0.0)
        expect = np.array([x[got == b].mean() if (got == b).any() else x.mean() + (b - centre) * width
                           for b in range(levels)])
        np.testing.assert_allclose(lut[row].double().numpy(), expect, rtol=1e-6, atol=1e-6)
        assert bits != 8 or (np.bincount(got, minlength=levels) == 0).any()  # empty bins exercised


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("n", [1, 5])
@pytest.mark.parametrize("value", [0.0, 0.1, -3.0])
@pytest.mark.parametrize("std", ["population", "sample"])
def test_quantise_equal_values_give_no_nan(bits, n, value, std):
    """Guards std == 0 (one selected value, or all equal): a zero bin width, or the sample std of one
    value (0 / 0), must not yield NaN codes/lut."""
    v = torch.full((n,), value)
    codes, lut = quantise(v, bits, std=std)
    assert torch.isfinite(lut).all()
    torch.testing.assert_close(lut.gather(-1, codes.long()), v, rtol=1e-6, atol=0)


# ------------------------------------------------------------------ packing
@pytest.mark.parametrize("bits, limit", [(12, 4096), (16, 65536), (32, 2 ** 31)])
@pytest.mark.parametrize("n", [1, 2, 3, 7, 32, 4097])
def test_index_packing_round_trips_exactly_including_odd_counts(bits, limit, n):
    """Guards the 12-bit wire format (two indices in three bytes, odd count padded) and its wider fallbacks."""
    idx = torch.randint(0, limit, (3, n), generator=torch.Generator().manual_seed(n))
    idx[0, 0], idx[-1, -1] = 0, limit - 1  # both extremes
    packed = pack_indices(idx, bits)
    expected_bytes = 3 * ((n + 1) // 2) if bits == 12 else n * bits // 8
    assert packed.dtype == torch.uint8 and packed.shape == (3, expected_bytes)
    assert torch.equal(unpack_indices(packed, n, bits), idx)
    assert torch.equal(unpack_indices(pack_indices(idx[1], bits), n, bits), idx[1])  # unbatched


def test_twelve_bit_layout_is_two_indices_in_three_bytes():
    """Guards the documented bit order, so a receiver written elsewhere decodes the same indices."""
    packed = pack_indices(torch.tensor([0xABC, 0x123, 0xFFF]), 12)
    assert packed.tolist() == [0xBC, 0x3A, 0x12, 0xFF, 0x0F, 0x00]


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 9, 1001])
def test_code_packing_round_trips_exactly_at_its_bit_width(bits, n):
    """Guards code packing: 4/2/1 codes per byte, partial last byte, exact inverse."""
    codes = torch.randint(0, 2 ** bits, (2, n), generator=torch.Generator().manual_seed(n), dtype=torch.uint8)
    packed = pack_codes(codes, bits)
    assert packed.shape == (2, math.ceil(n * bits / 8))
    assert torch.equal(unpack_codes(packed, n, bits), codes)
    assert pack_codes(torch.tensor([1, 2, 3, 0, 1], dtype=torch.uint8), 2).tolist() == [0b00111001, 0b01]


# ------------------------------------------------------------------ payload
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("bits, value_dtype", [(None, torch.float32), (None, torch.bfloat16), (2, torch.float32),
                                               (4, torch.float32), (8, torch.float32)])
def test_payload_length_equals_analytic_nbytes(shape, bits, value_dtype):
    """Guards `nbytes` as a pure function of the config (the all-gather length) against the sections."""
    codec = TensorCodec(shape, quant_bits=bits, value_dtype=value_dtype)
    layout = ChunkLayout.for_shape(shape)
    n = layout.n_chunks * topk_per_chunk(layout.chunk_len)
    head = n * (4 if value_dtype == torch.float32 else 2) if bits is None else 4 * 2 ** bits
    body = head + 3 * ((n + 1) // 2) + (0 if bits is None else math.ceil(n * bits / 8))
    assert codec.nbytes == body + (-body) % 4
    payload, _ = codec.encode(randn(shape, 1))
    assert payload.numel() == codec.nbytes


def test_payload_for_a_full_4096_chunk_is_176_bytes():
    """Guards the wire cost of the paper's setting: 32 float32 values + 32 12-bit indices per 64x64 tile."""
    assert TensorCodec((64, 64)).nbytes == 32 * 4 + 48
    assert TensorCodec((64, 64), quant_bits=2).nbytes == 16 + 48 + 8


@pytest.mark.parametrize("bits", [None, 2])
def test_batched_encode_equals_per_tensor_and_decode_add_accumulates(bits):
    """Guards the batched path the outer step uses (same bytes as one-by-one) and decode_add_ as a sum."""
    codec = TensorCodec((65, 130), chunk_size=64, topk=8, quant_bits=bits)
    batch = torch.stack([randn((65, 130), 5), randn((65, 130), 6)])
    payload, sent = codec.encode(batch)
    for b in range(2):
        p, s = codec.encode(batch[b])
        assert torch.equal(payload[b], p) and torch.equal(sent[b], s)
    out = torch.zeros(2, 65, 130)
    codec.decode_add_(payload, out)
    codec.decode_add_(payload, out)
    assert torch.equal(out, sent + sent)


def test_misaligned_payload_still_decodes():
    """Guards decoding a payload that does not start on a 4-byte boundary (falls back to a copy)."""
    codec = TensorCodec((10000,))
    payload, sent = codec.encode(randn((10000,), 2))
    buf = torch.zeros(codec.nbytes + 1, dtype=torch.uint8)
    buf[1:] = payload
    out = torch.zeros(10000)
    codec.decode_add_(buf[1:], out)
    assert torch.equal(out, sent)


def test_topk_selects_nonfinite_first():
    """Guards the assumption behind the outer step's cheap NaN guard: a NaN or Inf anywhere in a
    chunk is among that chunk's selected values (else a poisoned replica would go unnoticed)."""
    e = randn((128, 96), 7) * 1e30
    e[70, 5] = float("nan")
    e[3, 90] = float("-inf")
    values = TensorCodec((128, 96)).select(e).values
    assert torch.isnan(values).sum() == 1 and torch.isinf(values).sum() == 1


@pytest.mark.parametrize("shape", [(7,), (3, 5), (65, 130)])
@pytest.mark.parametrize("value_dtype", [torch.float32, torch.bfloat16])
def test_dense_codec_sends_the_whole_tensor_exactly_in_value_dtype(shape, value_dtype):
    """Guards the dense control's wire format: numel values of value_dtype, padded to 4 bytes, decoding
    to the value_dtype-rounded tensor (bf16 halves the bytes and rounds; float32 is exact)."""
    e = randn((2, *shape), 11)
    codec = DenseCodec(shape, value_dtype)
    size = 4 if value_dtype == torch.float32 else 2
    assert codec.nbytes == -(-math.prod(shape) * size // 4) * 4
    out = torch.zeros(2, codec.nbytes, dtype=torch.uint8)
    sent = codec.pack_(out, e)
    expect = e.reshape(2, -1).to(value_dtype).double()
    np.testing.assert_array_equal(sent.double().numpy(), expect.numpy())
    assert torch.equal(codec.unpack(out), sent)
    assert value_dtype == torch.bfloat16 or torch.equal(sent, e.reshape(2, -1))
