"""Every size rule of the method and the pipeline, once: pure integers, no torch.

The codec (sparseloco.compress), the outer step's payload (sparseloco.payload), the boundary codec
(pipe.module), the HF key map (convert), the simulator and the cost model (`plan`) all import
these; none restates them. `plan` runs without torch, so nothing here imports it.

Chunking (METHOD.md, "Outer step")
    2-D [R, C]: tiles of tr x tc, tr = largest divisor of R that is <= side, tc = largest divisor
    of C that is <= side, side = isqrt(chunk_size) (64 for 4096). Anything else is flattened and
    cut into chunks of the largest divisor of numel that is <= chunk_size ("tiles", ours) or
    <= side ("per_dim", templar's ChunkingTransformer: every dimension cut to <= 64).
Top-k: "scaled" (ours): k = min(chunk_len, max(1, round(topk * chunk_len / chunk_size)))
    (Python's round). "fixed" (templar's _clamp_topk): k = min(topk, chunk_len), raised to 2,
    lowered to even, at most chunk_len, in every chunk whatever its length (32 of a 64-element
    1-D chunk; templar itself would fail on a 1-element chunk).
Indices: 12 bits up to 4096 elements a chunk (two in three bytes), then 16, then 32.
Quantised values: codes packed at `bits` bits plus a float32 lookup table of 2**bits entries.
Every tensor's section is padded to a multiple of 4 bytes; a stage payload is a 16-byte header
plus its tensors' sections. The dense control sends each tensor whole: numel x value bytes, padded.
Token ids cross a compressed boundary as the narrowest *signed* integer holding every id (gloo
and NCCL have no uint16): int8 up to a vocabulary of 128, int16 up to 32768, else int32.
"""
from __future__ import annotations

import bisect
import functools
import math
from dataclasses import dataclass
from typing import Iterable, Sequence

QUANT_BITS = (2, 4, 8)
"""Allowed quantisation widths of selected values."""
VALUE_BYTES = {"float32": 4, "bfloat16": 2}
"""Wire widths of unquantised values, by dtype name."""
PAYLOAD_ALIGN = 4
PAYLOAD_HEADER_BYTES = 16
"""The self-checking header of one stage payload (sparseloco.payload.HEADER)."""
MAX_CHUNK = 4096
"""Largest chunk: its in-chunk indices fit 12 bits."""
BYTE_KINDS = ("activation", "activation_grad", "outer_sync", "embedding_sync", "control")
"""What the engine's ByteMeter counts, by link class (meter.py); the step record's length follows."""
CHUNKINGS = ("tiles", "per_dim")
"""How tensors that are not 2-D are chunked: <= chunk_size (ours) or <= isqrt(chunk_size) (templar)."""


# --------------------------------------------------------------------------- chunks and top-k
def largest_divisor(n: int, cap: int) -> int:
    """The largest divisor of n that is <= cap (n >= 1, cap >= 1)."""
    if n < 1 or cap < 1:
        raise ValueError(f"largest_divisor needs n >= 1 and cap >= 1, got n={n}, cap={cap}")
    for d in range(min(n, cap), 0, -1):
        if n % d == 0:
            return d
    return 1  # unreachable: 1 divides n


@dataclass(frozen=True)
class Chunking:
    """How a tensor of `shape` is cut: `n_chunks` chunks of `chunk_len`; `tile` = (tr, tc) or None."""

    shape: tuple[int, ...]
    n_chunks: int
    chunk_len: int
    tile: tuple[int, int] | None

    @property
    def numel(self) -> int:
        return self.n_chunks * self.chunk_len


def chunking(shape: Sequence[int], chunk_size: int = MAX_CHUNK, rule: str = "tiles") -> Chunking:
    if rule not in CHUNKINGS:
        raise ValueError(f"chunking must be one of {CHUNKINGS}, got {rule!r}")
    shape = tuple(int(s) for s in shape)
    numel = math.prod(shape)
    if numel == 0:
        raise ValueError(f"cannot chunk an empty tensor of shape {shape}")
    side = math.isqrt(chunk_size)
    if len(shape) == 2:
        tr, tc = largest_divisor(shape[0], side), largest_divisor(shape[1], side)
        return Chunking(shape, numel // (tr * tc), tr * tc, (tr, tc))
    length = largest_divisor(numel, chunk_size if rule == "tiles" else side)
    return Chunking(shape, numel // length, length, None)


def _k_scaled(chunk_len: int, topk: int, chunk_size: int) -> int:
    return min(chunk_len, max(1, round(topk * chunk_len / chunk_size)))


def _k_fixed(chunk_len: int, topk: int, chunk_size: int) -> int:
    k = max(min(topk, chunk_len), 2)
    return min(chunk_len, k - k % 2)


TOPK_RULES: dict = {"scaled": _k_scaled, "fixed": _k_fixed}
"""k per chunk by rule name, (chunk_len, topk, chunk_size) -> k: topk per chunk_size elements (ours) or
topk in every chunk (templar). Rules registered at run time (`sparseloco.aggregate.TOPK_RULES`, which
is this table) join it, so the cost model and the codec lay out the same bytes for them."""


def topk_per_chunk(chunk_len: int, topk: int = 32, chunk_size: int = MAX_CHUNK, rule: str = "scaled") -> int:
    """k for a chunk of `chunk_len`. scaled: `topk` per `chunk_size`, at least 1, at most chunk_len.
    fixed (templar): `topk` whatever the length, at least 2, even, at most chunk_len."""
    if rule not in TOPK_RULES:
        raise ValueError(f"topk_rule must be one of {tuple(TOPK_RULES)}, got {rule!r}")
    k = TOPK_RULES[rule](chunk_len, topk, chunk_size)
    # A registered rule outside [1, chunk_len] would lay out a payload the codec cannot fill.
    if not isinstance(k, int) or not 1 <= k <= chunk_len:
        raise ValueError(f"topk_rule {rule!r} gave k = {k!r} for a chunk of {chunk_len}; k must be in [1, {chunk_len}]")
    return k


# --------------------------------------------------------------------------- wire format
def index_bits(chunk_len: int) -> int:
    """Bits per in-chunk index on the wire: 12 up to 4096 elements, then 16, then 32."""
    if chunk_len <= 1 << 12:
        return 12
    if chunk_len <= 1 << 16:
        return 16
    return 32


def packed_index_nbytes(n: int, bits: int = 12) -> int:
    return 3 * ((n + 1) // 2) if bits == 12 else n * (bits // 8)


def packed_code_nbytes(n: int, bits: int) -> int:
    per = 8 // bits
    return (n + per - 1) // per


def round_up(n: int, multiple: int) -> int:
    return (n + multiple - 1) // multiple * multiple


def check_codec(chunk_size: int, topk: int, quant_bits: int | None, value_bytes: int,
                chunk_rule: str = "tiles", topk_rule: str = "scaled") -> None:
    """One error naming the bad value, for every place codec settings enter (config, codec, plan)."""
    if chunk_rule not in CHUNKINGS:
        raise ValueError(f"chunking must be one of {CHUNKINGS}, got {chunk_rule!r}")
    if topk_rule not in TOPK_RULES:
        raise ValueError(f"topk_rule must be one of {tuple(TOPK_RULES)}, got {topk_rule!r}")
    if not isinstance(chunk_size, int) or not 1 <= chunk_size <= MAX_CHUNK:
        raise ValueError(f"chunk_size must be an integer in [1, {MAX_CHUNK}], got {chunk_size!r}")
    if not isinstance(topk, int) or not 1 <= topk <= chunk_size:
        raise ValueError(f"topk must be an integer in [1, chunk_size = {chunk_size}], got {topk!r}")
    if quant_bits is not None and quant_bits not in QUANT_BITS:
        raise ValueError(f"quant_bits must be null or one of {QUANT_BITS}, got {quant_bits!r}")
    if value_bytes not in VALUE_BYTES.values():
        raise ValueError(f"value bytes must be one of {sorted(VALUE_BYTES.values())}, got {value_bytes!r}")


@dataclass(frozen=True)
class TensorWire:
    """Byte layout of one tensor's compressed pseudo-gradient (see sparseloco.compress)."""

    chunks: Chunking
    k: int
    n_selected: int
    index_bits: int
    head_nbytes: int
    """Values (unquantised) or the lookup table (quantised)."""
    index_nbytes: int
    code_nbytes: int
    nbytes: int
    """The whole section, padded to PAYLOAD_ALIGN."""


def tensor_wire(shape: Sequence[int], chunk_size: int = MAX_CHUNK, topk: int = 32,
                quant_bits: int | None = None, value_bytes: int = 4,
                chunk_rule: str = "tiles", topk_rule: str = "scaled") -> TensorWire:
    return _tensor_wire(tuple(int(s) for s in shape), chunk_size, topk, quant_bits, value_bytes, chunk_rule, topk_rule)


@functools.lru_cache(maxsize=4096)
def _tensor_wire(shape: tuple[int, ...], chunk_size: int, topk: int, quant_bits: int | None, value_bytes: int,
                 chunk_rule: str, topk_rule: str) -> TensorWire:
    """`tensor_wire`, once per distinct argument list: a model has a handful of shapes, and the planner
    asks for every parameter of every stage at every point it predicts."""
    check_codec(chunk_size, topk, quant_bits, value_bytes, chunk_rule, topk_rule)
    chunks = chunking(shape, chunk_size, chunk_rule)
    k = topk_per_chunk(chunks.chunk_len, topk, chunk_size, topk_rule)
    n_sel = chunks.n_chunks * k
    bits = index_bits(chunks.chunk_len)
    idx = packed_index_nbytes(n_sel, bits)
    if quant_bits is None:
        head, codes = n_sel * value_bytes, 0
    else:
        head, codes = (1 << quant_bits) * 4, packed_code_nbytes(n_sel, quant_bits)
    return TensorWire(chunks, k, n_sel, bits, head, idx, codes, round_up(head + idx + codes, PAYLOAD_ALIGN))


def dense_wire_nbytes(shape: Sequence[int], value_bytes: int = 4) -> int:
    """One tensor's section in the dense control: every value, padded to PAYLOAD_ALIGN."""
    if value_bytes not in VALUE_BYTES.values():
        raise ValueError(f"value bytes must be one of {sorted(VALUE_BYTES.values())}, got {value_bytes!r}")
    return round_up(math.prod(int(s) for s in shape) * value_bytes, PAYLOAD_ALIGN)


def stage_payload_nbytes(shapes: Iterable[Sequence[int]], chunk_size: int = MAX_CHUNK, topk: int = 32,
                         quant_bits: int | None = None, value_bytes: int = 4,
                         chunk_rule: str = "tiles", topk_rule: str = "scaled", dense: bool = False) -> int:
    """One replica's payload for a stage whose parameters have `shapes`: header + sections."""
    if dense:
        return PAYLOAD_HEADER_BYTES + sum(dense_wire_nbytes(s, value_bytes) for s in shapes)
    return PAYLOAD_HEADER_BYTES + sum(tensor_wire(s, chunk_size, topk, quant_bits, value_bytes,
                                                  chunk_rule, topk_rule).nbytes for s in shapes)


# --------------------------------------------------------------------------- stage boundaries
def id_bytes(vocab_size: int) -> int:
    """Bytes of one token id on a compressed boundary (narrowest signed int holding vocab - 1)."""
    if vocab_size < 1:
        raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
    if vocab_size <= 1 << 7:
        return 1
    if vocab_size <= 1 << 15:
        return 2
    return 4


def subspace_dim(d: int, ratio: int) -> int:
    """k = d / ratio; the ratio must divide d."""
    if not isinstance(ratio, int) or isinstance(ratio, bool) or ratio < 1 or d % ratio != 0:
        raise ValueError(f"subspace ratio {ratio!r} must be a positive integer dividing the hidden size d = {d}")
    return d // ratio


def boundary_nbytes(micro_batch: int, seq_len: int, d: int, k: int, act_bytes: int, vocab_size: int) -> tuple[int, int]:
    """(forward, backward) bytes one micro-batch puts on one stage boundary.

    Forward: b*L*k activations, plus the token ids when compressed (k < d: the receiver needs
    T_perp[x]); backward: b*L*k activation gradients.
    """
    act = micro_batch * seq_len * k * act_bytes
    ids = micro_batch * seq_len * id_bytes(vocab_size) if k < d else 0
    return act + ids, act


def sparse_share_max_nbytes(shape: Sequence[int], replicas: int, chunk_size: int = MAX_CHUNK, topk: int = 32) -> int:
    """Most bytes one `StageLink.share_sparse` of a decoded outer aggregate of `shape` sends to
    one stage: an int64 count, then (int32 index, fp32 value) per non-zero; the average of
    `replicas` top-k payloads has at most replicas * k non-zeros a chunk."""
    nnz = min(math.prod(shape), replicas * tensor_wire(shape, chunk_size, topk).n_selected)
    return 8 + 8 * nnz


def step_control_nbytes(stages: int) -> int:
    """Control bytes one rank's meter counts as sent per inner step when S > 1: the gradient
    norm (one fp32 scalar all-reduced over the pipe group) and the step record (the loss, a
    sent/recv pair per byte kind and each stage's compute seconds and peak memory, float64,
    all-reduced over the pipe group)."""
    return 0 if stages == 1 else 4 + 8 * (1 + 2 * len(BYTE_KINDS) + 2 * stages)


# --------------------------------------------------------------------------- device memory
OPTIMIZER_STATES = ("fp32", "bf16", "8bit", "cpu_offload")
"""`hetloco.train.optimizer_state`: how the inner AdamW holds its two moments (`optim.build_optimizer`)."""

LOWBIT_BLOCK = 256
"""Values per fp32 scale of an 8-bit moment (torchao's AdamW8bit block size)."""
LOWBIT_MIN_NUMEL = 4096
"""torchao quantises a moment only if its tensor has at least this many values and a whole number of
blocks (as bitsandbytes does); a smaller or ragged tensor keeps fp32 moments (8 B/param). In the batched
simulator the rule is applied to one replica's slice, so every driver quantises the same tensors."""


def optimizer_state_bytes_per_param(option: str, where: str = "device") -> float:
    """Bytes per parameter AdamW's state takes on the device (`where` "device") or the host ("host")
    under `hetloco.train.optimizer_state` `option`, for tensors large enough to be quantised:
    "fp32" two fp32 moments, 8 on the device; "bf16" two bf16 moments, 4; "8bit" two uint8 codes plus
    one fp32 scale per LOWBIT_BLOCK values each, 2 + 8/256 = 2.03125 (and a 256-entry fp32 code map,
    1 KiB, per quantised moment tensor; tensors under LOWBIT_MIN_NUMEL keep 8); "cpu_offload" none on
    the device, and on the host the fp32 moments 8 plus the fp32 copy of the weights and of the
    gradients AdamW steps there, 16."""
    if option not in OPTIMIZER_STATES:
        raise ValueError(f"optimizer_state must be one of {OPTIMIZER_STATES}, got {option!r}")
    if where not in ("device", "host"):
        raise ValueError(f"where must be 'device' or 'host', got {where!r}")
    device = {"fp32": 8.0, "bf16": 4.0, "8bit": 2.0 + 2 * 4 / LOWBIT_BLOCK, "cpu_offload": 0.0}[option]
    return device if where == "device" else (16.0 if option == "cpu_offload" else 0.0)


def stage_state_bytes(params: int, bf16: bool = True, sparseloco: bool = True, outer_state_device: str = "gpu",
                      outer_momentum: bool = False, optimizer_state: str = "fp32") -> int:
    """Device bytes a stage's `params` trainable parameters hold at the height of a training step,
    activations aside: fp32 weights 4 + fp32 gradients 4 + AdamW's state,
    `optimizer_state_bytes_per_param(optimizer_state)` (two fp32 moments, 8, by default; rounded up);
    under bf16 the step's cached bf16 weight casts 2 (`HetlocoEngine._weight_casts`; an upper bound,
    embedding and norm weights are never cast); under SparseLoCo with the outer state on the device,
    theta at the last sync 4 + error feedback 4 (+ outer momentum 4). `outer_state_device` "cpu" keeps
    those on the host (`sparseloco.outer_state_device`)."""
    if outer_state_device not in ("gpu", "cpu"):
        raise ValueError(f"outer_state_device must be 'gpu' or 'cpu', got {outer_state_device!r}")
    per = 4 + 4 + (2 if bf16 else 0)
    if sparseloco and outer_state_device == "gpu":
        per += 8 + (4 if outer_momentum else 0)
    return params * per + math.ceil(params * optimizer_state_bytes_per_param(optimizer_state))


CUBLAS_WORKSPACE_BYTES = 32 * 2**20
"""torch's cuBLAS workspace on Hopper (sm90; 8.125 MiB a handle on older GPUs, so an upper bound
there): one a (thread, stream) handle, taken from the caching allocator at that handle's first
matmul and never given back. A training stage holds two, its forward's thread's and autograd's
backward thread's: the allocator trace of the H200 memory jobs shows both, 32 MiB each, at every
peak (tests/gpu/last_run.json's job logs, `peak_breakdown`)."""
CUBLAS_WORKSPACES = 2


OUTER_UNIT_NUMEL = 1 << 26
"""Elements of the largest slice of a same-shape group the outer step works on at once
(`sparseloco.outer`: the transients beside the state are a few units, not a whole group)."""


def outer_units(shapes: Sequence[Sequence[int]], unit_numel: int = OUTER_UNIT_NUMEL) -> list[tuple[tuple[int, ...], int, int]]:
    """The outer step's units in the order it walks them: (shape, first member, end member) of each
    slice of a same-shape group (the groups in order of first appearance in `shapes`, as the
    payload's sections), at most `unit_numel` elements a slice, one member where a member is larger."""
    if unit_numel < 1:
        raise ValueError(f"unit_numel must be >= 1, got {unit_numel}")
    groups: dict[tuple[int, ...], int] = {}
    for s in shapes:
        key = tuple(int(x) for x in s)
        groups[key] = groups.get(key, 0) + 1
    out = []
    for shape, members in groups.items():
        step = max(1, unit_numel // max(1, math.prod(shape)))
        out += [(shape, lo, min(lo + step, members)) for lo in range(0, members, step)]
    return out


def outer_step_transient_bytes(shapes: Sequence[Sequence[int]], on_host: bool, chunk_size: int = MAX_CHUNK,
                               topk: int = 32, chunk_rule: str = "tiles", topk_rule: str = "scaled",
                               error_feedback: bool = True, unit_numel: int = OUTER_UNIT_NUMEL) -> int:
    """Device bytes the outer step of a stage of `shapes` allocates beside the state at its height,
    which is `SparseLoCoState.prepare` (finish holds fewer: one state name, no new error buffers):
    the new error buffers of the whole stage, fp32 (held until the replica is known finite); each
    tensor's top-k selection, staged until packing (int64 in-chunk and flat indices, fp32 values:
    20 B an entry); and the units' working set: on the device, |e| of one unit (fp32) for the top-k;
    with the state on the host, also the device copies of its state (theta_prev and, with error
    feedback, the error buffer), three units' worth at the moment the walk fetches the next unit
    while the caller still holds the previous one, two beside |e|; and each shape's int64 tables
    of chunk and in-chunk offsets (built at the first outer step, then kept). The sparse path only: the dense
    control's gathered payloads (replicas x numel x value bytes) are left out."""
    shapes = [tuple(int(x) for x in s) for s in shapes]
    numel = sum(math.prod(s) for s in shapes)
    wires = {s: tensor_wire(s, chunk_size, topk, None, 4, chunk_rule, topk_rule) for s in shapes}
    selected = sum(wires[s].n_selected for s in shapes)
    tables = sum(8 * (w.chunks.n_chunks + w.chunks.chunk_len) for w in wires.values())
    units = [math.prod(shape) * (hi - lo) for shape, lo, hi in outer_units(shapes, unit_numel)]
    names = 2 if error_feedback else 1
    work = 0
    for k, u in enumerate(units):
        if on_host:
            prev = units[k - 1] if k else 0
            nxt = units[k + 1] if k + 1 < len(units) else 0
            work = max(work, names * (prev + u + nxt), names * (u + nxt) + u)
        else:
            work = max(work, u)
    return 4 * numel + 20 * selected + tables + 4 * work


def host_state_bytes(params: int, on_gpu: bool, outer_on_host: bool, bf16: bool = True, sparseloco: bool = True,
                     outer_momentum: bool = False, optimizer_state: str = "fp32", checkpoint_copy: bool = True) -> int:
    """Host bytes `params` trainable parameters of a rank take: with `checkpoint_copy`
    (`train.checkpoint_staging` "host"), a checkpoint's host copy, kept between saves (weights 4,
    AdamW's state as saved, error feedback 4: an upper bound, a replica other than 0 stores no weights;
    the state as `optimizer_state` keeps it, fp32 moments 8 where they are fp32 on the device or the
    host; without it a save holds one tensor at a time, left out); on a GPU with the outer state on the host (`sparseloco.outer_state_device`
    "cpu", pinned), theta at the last sync 4 + error feedback 4 (+ outer momentum 4), and with the
    moments on the host (`optimizer_state` "cpu_offload") what it keeps there; on the CPU the whole
    training state as well (`stage_state_bytes`, its outer state wherever it is placed)."""
    saved = optimizer_state_bytes_per_param(optimizer_state) or 8.0  # cpu_offload saves its fp32 moments
    ckpt = math.ceil(params * (8 + saved)) if checkpoint_copy else 0
    if not on_gpu:
        return ckpt + stage_state_bytes(params, bf16, sparseloco, "gpu", outer_momentum, optimizer_state)
    per_param = optimizer_state_bytes_per_param(optimizer_state, "host")
    if sparseloco and outer_on_host:
        per_param += 8 + (4 if outer_momentum else 0)
    return ckpt + math.ceil(params * per_param)


def layer_activation_bytes(d: int, ffn: int, kv_dim: int, act_bytes: int = 2) -> int:
    """Bytes one decoder layer (`model.DecoderLayer`: transformers' LlamaDecoderLayer, SDPA, our
    RMSNorm) saves for its backward, per token, under autocast at `act_bytes` (2: bf16): each of the
    two RMSNorms its fp32 input (4d) and its normalised input and output (2 x act d); attention q
    and its output (2 x act d; SDPA's output is o_proj's input as is) and k, v (2 x act kv_dim);
    SwiGLU gate and up outputs, silu(gate) and their product (4 x act ffn). No L^2 term (fused
    attention keeps one log-sum-exp a head and position)."""
    return 8 * d + act_bytes * (6 * d + 2 * kv_dim + 4 * ffn)


def logit_bytes(vocab: int, act_bytes: int = 2) -> int:
    """Bytes per token of the last stage's loss at the height of its backward (`model.causal_lm_loss`):
    the logits (act_bytes a logit), log-softmax's fp32 output, its fp32 gradient and the fp32
    gradient of its input (12 a logit). A chunked loss (`model.chunked_lm_loss`) holds one chunk's
    tokens' worth (`loss_tokens`)."""
    return vocab * (act_bytes + 12)


def loss_tokens(tokens: int, loss_chunk_tokens: int = 0) -> int:
    """Tokens whose logits the last stage's loss holds at once: a micro-batch's, or one chunk's under
    `train.loss_chunk_tokens`."""
    return min(tokens, loss_chunk_tokens) if loss_chunk_tokens > 0 else tokens


def deferred_cast_grad_bytes(cast_params: int, micro_batches: int, bf16: bool = True) -> int:
    """Bytes of weight gradients a bf16 backward holds until its end when autocast's own cache casts
    the weights once a step (compiled layers; every run before `casts.step_casts`): the bf16
    gradient (2 bytes) of each of `cast_params` weights. The cast's backward node was made in the
    step's first micro-batch, so in every later micro-batch's backward it has a lower sequence
    number than all of that micro-batch's nodes and autograd runs it last: each gradient waits there
    while the activations are freed. None with one micro-batch a step or without bf16."""
    return 2 * cast_params if bf16 and micro_batches > 1 else 0


def kept_activation_bytes(tokens: int, layers: int, d: int, ffn: int, kv_dim: int, act_bytes: int = 2,
                          recomputed: Sequence[int] = ()) -> int:
    """Bytes one micro-batch of `tokens` tokens leaves for its backward through `layers` decoder layers
    (`layer_activation_bytes`), of which the runs `recomputed` (`recomputed_runs`) keep only their
    input, the residual stream (act_bytes a value)."""
    kept = layers - sum(recomputed)
    return tokens * (kept * layer_activation_bytes(d, ffn, kv_dim, act_bytes) + len(recomputed) * act_bytes * d)


def step_casts_pay(cast_params: int, micro_batches: int, layers: int, tokens: int, d: int, ffn: int, kv_dim: int,
                   bf16: bool = True, recomputed: Sequence[int] = ()) -> bool:
    """Whether a stage's backward would peak higher with autocast's cache than with per-micro-batch
    cast nodes (`casts.step_casts`): its deferred gradients (`deferred_cast_grad_bytes`) outweigh one
    micro-batch's activations through its `layers` decoder layers (`tokens` a micro-batch), which
    they would take the place of. Where they do not, the peak is the activations' either way and
    the per-micro-batch nodes would only cost host time (an autograd Function a weight per
    micro-batch)."""
    return deferred_cast_grad_bytes(cast_params, micro_batches, bf16) > \
        kept_activation_bytes(tokens, layers, d, ffn, kv_dim, 2 if bf16 else 4, recomputed)


def recomputed_runs(num_layers: int, start: int, stop: int, interval: int) -> list[int]:
    """The lengths of the runs of decoder layers whose forward the stage holding pipeline layers
    [start, stop) (`stage_parts`) runs again in its backward under pipeline.activation_checkpoint_interval
    = `interval`: DeepSpeed's PipelineModule cuts the stage's layers into runs of `interval` from its
    first, and ours recomputes a run whose layers are all decoder layers (`pipe.module.RECOMPUTED_LAYERS`);
    a run holding the embedding, the final norm or the head keeps its activations. [] when off."""
    if interval <= 0:
        return []
    decoders = LayerLayout(num_layers).decoders
    runs = []
    for a in range(start, stop, interval):
        b = min(a + interval, stop)
        if all(i in decoders for i in range(a, b)):
            runs.append(b - a)
    return runs


def stage_activation_bytes(tokens: int, layers: int, in_flight: int, d: int, ffn: int, kv_dim: int,
                           vocab: int | None = None, act_bytes: int = 2, deferred_grad_bytes: int = 0,
                           recomputed: Sequence[int] = (), loss_chunk_tokens: int = 0) -> int:
    """Device bytes a stage's activations hold at their peak: `in_flight` micro-batches of `tokens`
    tokens (`pipe.order.depth` for its schedule) through its `layers` decoder layers
    (`layer_activation_bytes`), plus one layer's worth as the backward's working set (the gradients
    of the layer being differentiated); on the last stage (`vocab` given) the final RMSNorm's
    saved tensors per micro-batch in flight and one micro-batch's loss (`logit_bytes` of
    `loss_tokens`: one chunk's under `loss_chunk_tokens`). While one
    micro-batch's backward frees its activations layer by layer, `deferred_grad_bytes`
    (`deferred_cast_grad_bytes`) accumulate in their place: the backward peaks at the larger of the
    two, which at few tokens a micro-batch is the gradients (an 8B stage of 8 layers: 3.3 GiB against
    1.7 GiB of activations at 1024 tokens, measured before `casts.step_casts` took them out).
    `recomputed` (`recomputed_runs`): runs of decoder layers that keep only their input (the residual
    stream, act_bytes a value) per micro-batch in flight; the backward then holds one run's
    activations again, the longest at its height, beside them."""
    per_layer = layer_activation_bytes(d, ffn, kv_dim, act_bytes)
    one = kept_activation_bytes(tokens, layers, d, ffn, kv_dim, act_bytes, recomputed)
    again = tokens * per_layer * max(recomputed, default=0)
    total = (in_flight - 1) * one + max(one + again, deferred_grad_bytes) + tokens * per_layer
    if vocab is not None:
        total += (in_flight * tokens * (4 + 2 * act_bytes) * d
                  + loss_tokens(tokens, loss_chunk_tokens) * logit_bytes(vocab, act_bytes))
    return total


# --------------------------------------------------------------------------- pipeline layout
@dataclass(frozen=True)
class LayerLayout:
    """DeepSpeed layer indices of the pipeline's layer list for `n` decoder layers:

        0        token embedding
        1..n     decoder layers 0..n-1
        n + 1    final norm
        n + 2    LM head (or, tied, a replica of the embedding)
    """

    n: int

    embedding: int = 0

    def decoder(self, i: int) -> int:
        return 1 + i

    @property
    def decoders(self) -> range:
        return range(1, self.n + 1)

    @property
    def norm(self) -> int:
        return self.n + 1

    @property
    def head(self) -> int:
        return self.n + 2

    @property
    def count(self) -> int:
        return self.n + 3


def decoder_layers_per_stage(num_layers: int, num_stages: int) -> list[int]:
    """Decoder layers on each stage: as even as possible, earlier stages take the remainder."""
    if not 1 <= num_stages <= num_layers:
        raise ValueError(f"stage count {num_stages} must be between 1 and the {num_layers} decoder layers")
    base, extra = divmod(num_layers, num_stages)
    return [base + (1 if s < extra else 0) for s in range(num_stages)]


def stage_parts(num_layers: int, num_stages: int) -> list[int]:
    """Layer-index boundaries of each stage in the pipeline's layer list (`LayerLayout`): the
    embedding on the first stage, the decoder layers split by `decoder_layers_per_stage`, the
    norm and head on the last. Stage s holds layers [parts[s], parts[s + 1])."""
    layout = LayerLayout(num_layers)
    parts = [layout.embedding]
    first = 0
    for n in decoder_layers_per_stage(num_layers, num_stages):
        first += n
        parts.append(layout.decoder(first))  # one past the stage's last decoder layer
    parts[-1] = layout.count
    return parts


def block_parts(num_layers: int, replica_stages: Sequence[int]) -> list[int]:
    """Layer-index boundaries of the outer sync's blocks for replicas of these pipeline depths:
    the finest common partition of their `stage_parts`, so each block [parts[b], parts[b + 1]) is
    held whole by one stage of every replica. With one depth S the blocks are the stages."""
    cuts: set[int] = set()
    for stages in set(replica_stages):
        cuts.update(stage_parts(num_layers, stages))
    return sorted(cuts)


# --------------------------------------------------------------------------- mixed pipeline depths
def replica_ranks(replica_stages: Sequence[int]) -> list[list[int]]:
    """Global ranks of each replica's stages in one static world (`hetloco.replica_stages`).

    Equal depths keep DeepSpeed's PipeDataParallelTopology layout (rank = stage * M + replica);
    mixed depths number each replica's ranks contiguously, replica 0's first ([1, 2]: [[0], [1, 2]]).
    Either way a group holding one rank of every replica, sorted by rank, is in replica order."""
    stages = list(replica_stages)
    M = len(stages)
    if len(set(stages)) == 1:
        return [[s * M + m for s in range(stages[0])] for m in range(M)]
    first = [sum(stages[:m]) for m in range(M)]
    return [[first[m] + s for s in range(stages[m])] for m in range(M)]


def stage_blocks(num_layers: int, stages: int, stage: int, blocks: Sequence[int]) -> list[int]:
    """Indices of the outer-sync blocks (`block_parts`) that stage `stage` of a depth-`stages`
    replica holds whole."""
    parts = stage_parts(num_layers, stages)
    lo, hi = parts[stage], parts[stage + 1]
    return [b for b in range(len(blocks) - 1) if lo <= blocks[b] and blocks[b + 1] <= hi]


def params_by_block(layer_indices: Sequence[int], held: Sequence[int], blocks: Sequence[int]) -> list[list[int]]:
    """Indices of parameters (given by the layer-list index each belongs to, in the stage's
    parameter order) in each outer-sync block of `held` (`blocks`: `block_parts`' boundaries)."""
    out: dict[int, list[int]] = {b: [] for b in held}
    for i, layer in enumerate(layer_indices):
        out[bisect.bisect_right(blocks, layer) - 1].append(i)
    return [out[b] for b in held]


def block_ranks(num_layers: int, replica_stages: Sequence[int]) -> list[list[int]]:
    """For each outer-sync block, the global rank of every replica that holds it (replica order)."""
    blocks = block_parts(num_layers, replica_stages)
    out: list[list[int]] = [[] for _ in range(len(blocks) - 1)]
    for ranks, stages in zip(replica_ranks(replica_stages), replica_stages):
        for s, rank in enumerate(ranks):
            for b in stage_blocks(num_layers, stages, s, blocks):
                out[b].append(rank)
    return out
