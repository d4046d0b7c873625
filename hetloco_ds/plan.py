"""Cost model: how long an inner step and an outer sync take on given links and devices.

Pure Python (no torch), so it runs anywhere and is testable on its own. Three layers:

* byte counts, exact: stage-boundary tensors (`boundary_bytes`) and the SparseLoCo outer-sync
  payload (`outer_payload_bytes`, `stage_tensors`), following METHOD.md's chunking, top-k,
  12-bit index packing and optional quantisation;
* times, modelled: `predict` turns bytes and FLOPs into a pipeline-schedule time per inner step,
  an outer-sync time per outer step, a compute utilisation and the term that dominates;
* `plan_fleet`: given heterogeneous device groups, the stage count, which groups run
  uncompressed, and the least subspace ratio that reaches a target utilisation.

Model of one inner step (one optimizer step of one replica, n_mb micro-batches of b x L tokens)
-------------------------------------------------------------------------------------------------
* compute per micro-batch on stage s: (6 * P_s + 12 * layers_s * d * L) * b * L FLOPs divided by
  (peak FLOP/s x MFU). P_s counts the matmul weights on the stage (the LM head included, the
  embedding table excluded: a gather is no FLOPs); the attention term is PaLM's convention (QK^T
  and AV, forward + backward, no discount for causality). Subspace projections (X U, 2dk FLOPs a
  token per boundary and direction) are left out: < 0.1% of a stage for the shapes here.
* boundary bytes per micro-batch: forward b*L*k*act_bytes (+ b*L*ids_bytes token ids when the
  boundary is compressed, for T_perp[x]; an uncompressed boundary drops the ids), backward
  b*L*k*act_bytes. k = d / ratio.
* links are full duplex (forward tensors go down one direction, gradients up the other), each
  transfer pays `latency` once.
* schedule (1F1B or GPipe, same count): (n_mb + S - 1) slots of the slowest stage.
  - overlap=True: a transfer runs while the stage computes the next micro-batch, so
    slot = max(t_compute, t_link) with t_link = max(fwd, bwd) bytes * 8 / bw + latency.
    This is what a schedule with asynchronous send/recv achieves at best.
  - overlap=False: every transfer blocks the stage (DeepSpeed's PipelineEngine issues blocking
    p2p inside its instruction stream): n_mb transfers each way on the critical path,
    time = (n_mb + S - 1) * t_compute + n_mb * (t_fwd + t_bwd).
* outer sync every H inner steps: each stage group all-gathers its compact payloads, every rank
  sending its payload to the M - 1 others (NCCL: `all_gather`, a ring; gloo: the engine's
  receive-first pairwise exchange, `hetloco_ds.exchange`), (M - 1) * (payload * 8 / bw + latency),
  receiving at the same time (full duplex). This assumes each rank's outgoing bytes share one
  link of rate bw (a ring hop, a site's uplink). Where every pair of ranks has a link of its own
  (netlab's per-peer shaping), the exchange's M - 1 sends run side by side and take one payload
  time: the formula then over-predicts by up to (M - 1)x for M > 2 (the shaped-link benchmark
  measures M = 2, where the two agree). The S stage groups use disjoint links and run at the
  same time, so the slowest stage group sets the time. It blocks (no overlap with the inner
  loop) and is amortised as sync / H per inner step.
* compute utilisation = compute time of the busiest stage / total time, with
  total = (n_mb + S - 1) * slot + sync / H = compute + bubble + link stall + outer sync.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

# ----------------------------------------------------------------------------- model shapes


@dataclass(frozen=True)
class ModelShape:
    """A LLaMA-style decoder (SwiGLU MLP, RMSNorm, rotary, untied embedding and LM head)."""

    d: int
    """Hidden size d_model."""
    n_layers: int
    """Number of decoder layers."""
    n_heads: int
    """Attention (query) heads."""
    ffn: int
    """SwiGLU intermediate size."""
    vocab: int
    """Vocabulary size."""
    seq_len: int
    """Sequence length L."""
    n_kv_heads: int | None = None
    """Key/value heads (grouped-query attention); None = n_heads."""
    name: str = "custom"
    """Label used in reports."""

    @property
    def kv_heads(self) -> int:
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

    @property
    def kv_dim(self) -> int:
        return self.d // self.n_heads * self.kv_heads

    def layer_tensors(self, i: int) -> list[tuple[str, tuple[int, ...]]]:
        """Parameter tensors of decoder layer i, as (HF-style name, shape)."""
        d, f, kv = self.d, self.ffn, self.kv_dim
        p = f"layers.{i}."
        return [
            (p + "self_attn.q_proj.weight", (d, d)),
            (p + "self_attn.k_proj.weight", (kv, d)),
            (p + "self_attn.v_proj.weight", (kv, d)),
            (p + "self_attn.o_proj.weight", (d, d)),
            (p + "mlp.gate_proj.weight", (f, d)),
            (p + "mlp.up_proj.weight", (f, d)),
            (p + "mlp.down_proj.weight", (d, f)),
            (p + "input_layernorm.weight", (d,)),
            (p + "post_attention_layernorm.weight", (d,)),
        ]

    def n_params(self) -> int:
        return sum(_numel(s) for stage in stage_tensors(self, 1) for _, s in stage)


PRESETS: dict[str, ModelShape] = {
    # The paper's Tables 6/9 (d, layers, heads, FFN multiplier), vocabulary 32K.
    "178M": ModelShape(d=1024, n_layers=9, n_heads=8, ffn=2688, vocab=32000, seq_len=2048, name="178M"),
    "512M": ModelShape(d=1536, n_layers=12, n_heads=12, ffn=3904, vocab=32000, seq_len=2048, name="512M"),
    "1B": ModelShape(d=2048, n_layers=16, n_heads=8, ffn=8192, vocab=32000, seq_len=1024, name="1B"),
    # LLaMA-2-70B-like, for the paper's Figure 2.
    "70B": ModelShape(d=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn=28672, vocab=32000,
                      seq_len=4096, name="70B"),
}


def resolve_model(model: str | ModelShape) -> ModelShape:
    """A preset name or a ModelShape, validated."""
    if isinstance(model, str):
        if model not in PRESETS:
            raise ValueError(f"unknown model preset {model!r}; known: {', '.join(PRESETS)}")
        return PRESETS[model]
    if not isinstance(model, ModelShape):
        raise ValueError(f"model must be a preset name or a ModelShape, got {model!r}")
    for f in ("d", "n_layers", "n_heads", "ffn", "vocab", "seq_len"):
        v = getattr(model, f)
        if not isinstance(v, int) or v <= 0:
            raise ValueError(f"model.{f} must be a positive integer, got {v!r}")
    if model.d % model.n_heads:
        raise ValueError(f"n_heads={model.n_heads} does not divide d={model.d}")
    if model.n_heads % model.kv_heads:
        raise ValueError(f"n_kv_heads={model.kv_heads} does not divide n_heads={model.n_heads}")
    return model


def _numel(shape: Sequence[int]) -> int:
    return math.prod(shape)


def layers_per_stage(n_layers: int, stages: int) -> list[int]:
    """Decoder layers on each stage: as even as possible, earlier stages take the remainder."""
    if stages > n_layers:
        raise ValueError(f"stages={stages} exceeds n_layers={n_layers}: a stage needs a layer")
    base, extra = divmod(n_layers, stages)
    return [base + (1 if s < extra else 0) for s in range(stages)]


def stage_tensors(model: ModelShape, stages: int) -> list[list[tuple[str, tuple[int, ...]]]]:
    """Trainable parameter tensors on each stage.

    Stage 0 holds the token embedding (T_S on a compressed replica: same shape; T_perp is a
    buffer, never synced), the last stage the final norm and the LM head.
    """
    out: list[list[tuple[str, tuple[int, ...]]]] = []
    first = 0
    for s, n in enumerate(layers_per_stage(model.n_layers, stages)):
        ts: list[tuple[str, tuple[int, ...]]] = []
        if s == 0:
            ts.append(("embed_tokens.weight", (model.vocab, model.d)))
        for i in range(first, first + n):
            ts.extend(model.layer_tensors(i))
        if s == stages - 1:
            ts.append(("norm.weight", (model.d,)))
            ts.append(("lm_head.weight", (model.vocab, model.d)))
        first += n
        out.append(ts)
    return out


def _matmul_params(tensors: list[tuple[str, tuple[int, ...]]]) -> int:
    """Weights that take part in a matmul: 2-D tensors except the embedding table."""
    return sum(_numel(s) for n, s in tensors if len(s) == 2 and not n.startswith("embed_tokens"))


# ----------------------------------------------------------------------------- outer-sync bytes


def _largest_divisor_at_most(n: int, cap: int) -> int:
    for c in range(min(n, cap), 0, -1):
        if n % c == 0:
            return c
    return 1


def chunk_layout(shape: Sequence[int], chunk: int = 4096) -> tuple[int, int]:
    """(number of chunks, elements per chunk) for one tensor, as METHOD.md cuts it.

    A 2-D tensor is cut into tiles of at most t x t (t = isqrt(chunk), 64 for 4096), per
    dimension the largest divisor <= t; any other tensor is flattened and cut into chunks of the
    largest divisor of its size that is <= chunk.
    """
    if len(shape) == 2:
        t = math.isqrt(chunk)
        a, b = (_largest_divisor_at_most(n, t) for n in shape)
        size = a * b
    else:
        size = _largest_divisor_at_most(_numel(shape), chunk)
    return _numel(shape) // size, size


# The wire format of sparseloco.outer / sparseloco.compress (a test checks they agree).
PAYLOAD_HEADER = 16
PAYLOAD_ALIGN = 4


def chunk_topk(chunk_elems: int, topk: int = 32, chunk: int = 4096) -> int:
    """Values kept in one chunk: topk per `chunk` elements, scaled and rounded to nearest, in
    [1, chunk_elems] (the rule of sparseloco.compress.topk_per_chunk)."""
    return min(chunk_elems, max(1, round(topk * chunk_elems / chunk)))


def tensor_payload_bytes(shape: Sequence[int], topk: int = 32, chunk: int = 4096,
                         quant_bits: int | None = None, value_bytes: int = 4,
                         index_bits: int = 12) -> int:
    """Wire bytes for one tensor's compressed pseudo-gradient, as sparseloco.compress lays it out.

    values: n_sel * value_bytes unquantised, else n_sel codes bit-packed (ceil(n_sel*q/8)) plus a
    lookup table of 2**q fp32 floats; indices: 12-bit, two in three bytes (an odd count padded);
    the tensor's section padded to a multiple of 4 bytes.
    """
    n_chunks, size = chunk_layout(shape, chunk)
    n_sel = n_chunks * chunk_topk(size, topk, chunk)
    idx = math.ceil(n_sel / 2) * 3 if index_bits == 12 else math.ceil(n_sel * index_bits / 8)
    if quant_bits is None:
        body = n_sel * value_bytes + idx
    else:
        body = math.ceil(n_sel * quant_bits / 8) + (2 ** quant_bits) * 4 + idx
    return -(-body // PAYLOAD_ALIGN) * PAYLOAD_ALIGN


def outer_payload_bytes(tensors: Sequence[tuple[str, Sequence[int]]], **kw: Any) -> int:
    """One stage's payload: a 16-byte header plus `tensor_payload_bytes` of each of its tensors."""
    return PAYLOAD_HEADER + sum(tensor_payload_bytes(s, **kw) for _, s in tensors)


# ----------------------------------------------------------------------------- boundary bytes


def subspace_k(d: int, ratio: int) -> int:
    """k = d / ratio; the ratio must divide d."""
    if not isinstance(ratio, int) or ratio < 1:
        raise ValueError(f"subspace ratio must be an integer >= 1, got {ratio!r}")
    if d % ratio:
        raise ValueError(f"subspace ratio {ratio} does not divide d={d}")
    return d // ratio


def boundary_bytes(b: int, seq_len: int, d: int, ratio: int = 1, act_bytes: int = 2,
                   ids_bytes: int = 2, k: int | None = None) -> tuple[int, int]:
    """(forward, backward) bytes one micro-batch puts on one stage boundary.

    Forward: b*L*k activations, plus the token ids when compressed (k < d: the receiver needs
    T_perp[x]). Backward: b*L*k activation gradients. `k` overrides k = d / ratio.
    """
    k = subspace_k(d, ratio) if k is None else k
    act = b * seq_len * k * act_bytes
    ids = b * seq_len * ids_bytes if k < d else 0
    return act + ids, act


# ----------------------------------------------------------------------------- predict

_RATE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([kmgt]?)(bit|bps|b/s|bit/s)?\s*$", re.I)
_MULT = {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}


def parse_rate(text: str | float | int) -> float:
    """Bits per second from 1e8, '100M', '100mbit', '1Gbps', '10 Gbit/s' (SI multipliers, as tc)."""
    if isinstance(text, (int, float)):
        return float(text)
    m = _RATE_RE.match(text)
    if not m:
        raise ValueError(f"cannot read a bit rate from {text!r} (try 100mbit, 1G, 1e9)")
    return float(m.group(1)) * _MULT[m.group(2).lower()]


def _fmt_rate(bps: float) -> str:
    for unit, m in (("Gbit/s", 1e9), ("Mbit/s", 1e6), ("kbit/s", 1e3)):
        if bps >= m:
            return f"{bps / m:.3g} {unit}"
    return f"{bps:g} bit/s"


def _fmt_bytes(n: float) -> str:
    for unit, m in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= m:
            return f"{n / m:.3g} {unit}"
    return f"{n:.0f} B"


def _fmt_time(t: float) -> str:
    if t == 0:
        return "0 s"
    if t >= 3600:
        return f"{t / 3600:.3g} h"
    if t >= 1:
        return f"{t:.3g} s"
    if t >= 1e-3:
        return f"{t * 1e3:.3g} ms"
    return f"{t * 1e6:.3g} us"


def _check_positive(name: str, v: Any, *, allow_zero: bool = False, integer: bool = False) -> None:
    ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
    if integer:
        ok = ok and float(v).is_integer()
    if not ok or v < 0 or (v == 0 and not allow_zero):
        need = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"{name} must be {'an integer ' if integer else ''}{need}, got {v!r}")


TERMS = ("compute", "pipeline bubble", "stage-link stall", "outer sync")


@dataclass
class Prediction:
    """What `predict` returns. Times in seconds, bytes in bytes, per inner step unless named."""

    model: ModelShape
    inputs: dict[str, Any]
    """The arguments `predict` was called with (rates in bits/s)."""
    params_total: int
    params_per_stage: list[int]
    layers_per_stage: list[int]
    k: int
    """Subspace width d / ratio on the stage boundaries."""
    tokens_per_microbatch: int
    tokens_per_step: int
    """Tokens one replica processes per inner step (b * L * n_mb)."""
    flops_per_microbatch: list[float]
    """Forward + backward FLOPs per micro-batch, per stage."""
    compute_time_microbatch: list[float]
    fwd_bytes_microbatch: int
    bwd_bytes_microbatch: int
    link_time_fwd: float
    """One forward transfer on a stage link, latency included (0 when S = 1)."""
    link_time_bwd: float
    slot_time: float
    """One schedule slot: max(compute, link) with overlap, compute + fwd + bwd without."""
    schedule_time: float
    """(n_mb + S - 1) * slot."""
    stage_link_bytes_per_step: int
    """Bytes one stage link carries per inner step, both directions together."""
    outer_payload_bytes: list[int]
    """Compressed outer-sync payload one rank contributes, per stage."""
    dense_outer_bytes: list[int]
    """Dense DiLoCo equivalent (fp32 pseudo-gradient), per stage."""
    outer_bytes_per_replica: int
    """Sum of the payloads over a replica's stages (what one replica sends per outer step)."""
    outer_sync_time: float
    """Per outer step: slowest stage group's all-gather, (M - 1) payloads over each rank's link."""
    breakdown: dict[str, float]
    """Per inner step: compute (busiest stage), pipeline bubble, stage-link stall, outer sync / H."""
    total_time: float
    utilisation: float
    steady_state_utilisation: float
    """Utilisation without fill/drain (n_mb -> infinity), outer sync still counted."""
    dominant: str
    """Largest term of `breakdown`."""
    dominant_overhead: str
    """Largest term of `breakdown` other than compute."""
    stage_bw_for_compute_bound: float | None
    """Stage-link bandwidth at which a transfer hides under (overlap) or equals (no overlap)
    one micro-batch of compute; None when S = 1 or latency alone exceeds the compute time."""
    explanation: str = ""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def predict(
    model: str | ModelShape = "512M",
    *,
    stages: int = 4,
    replicas: int = 8,
    stage_bw: float | str = 1e9,
    stage_latency: float = 0.0,
    replica_bw: float | str = 1e9,
    replica_latency: float = 0.0,
    tflops: float = 989.0,
    mfu: float = 0.45,
    micro_batch: int = 1,
    n_mb: int = 32,
    H: int = 50,
    topk: int = 32,
    chunk: int = 4096,
    quant_bits: int | None = None,
    value_bytes: int = 4,
    index_bits: int = 12,
    ratio: int = 1,
    act_bytes: int = 2,
    ids_bytes: int | None = None,
    overlap: bool = True,
    seq_len: int | None = None,
    k: int | None = None,
    link_efficiency: float = 1.0,
) -> Prediction:
    """Predict one replica's inner step and the outer sync (see the module docstring).

    Args (rates in bits/s, or strings such as "100mbit"; latencies in s):
        model: preset name ("178M", "512M", "1B", "70B") or a ModelShape.
        stages, replicas: S pipeline stages, M SparseLoCo replicas.
        stage_bw, stage_latency: each link between adjacent stages (per direction).
        replica_bw, replica_latency: each rank's link to its stage group's ring neighbour.
        tflops, mfu: peak dense FLOP/s of one stage (in TFLOP/s) and the fraction achieved.
        micro_batch, n_mb: b sequences per micro-batch, micro-batches per inner step.
        H: inner steps per outer step.
        topk, chunk, quant_bits, value_bytes, index_bits: SparseLoCo payload (values are
            `value_bytes` each unquantised; quant_bits in {2, 4, 8} packs codes + a LUT).
        ratio: subspace ratio d / k on the stage boundaries (1 = uncompressed).
        act_bytes: bytes per activation element (2 = bf16).
        ids_bytes: bytes per token id; None = 2 for vocab <= 65536 else 4.
        overlap: whether transfers overlap compute (see module docstring).
        seq_len: override the model's sequence length.
        link_efficiency: goodput / link rate on every link. 1.0 = bytes move at the nominal
            rate; TCP/IPv4 over Ethernet at MTU 1500 gives ~0.957 (1448 payload bytes per
            1514-byte frame), which is what `netlab` measures under tc shaping.
        k: subspace width given directly (1 <= k <= d), for ratios that do not divide d
            (e.g. k/d ~ 1/24 at d = 8192); leave ratio at 1 when using it.
    """
    m = resolve_model(model)
    L = m.seq_len if seq_len is None else seq_len
    stage_bw, replica_bw = parse_rate(stage_bw), parse_rate(replica_bw)
    if not (isinstance(link_efficiency, (int, float)) and 0 < link_efficiency <= 1):
        raise ValueError(f"link_efficiency must be in (0, 1], got {link_efficiency!r}")
    inputs = dict(model=m.name, stages=stages, replicas=replicas, stage_bw=stage_bw,
                  stage_latency=stage_latency, replica_bw=replica_bw,
                  replica_latency=replica_latency, tflops=tflops, mfu=mfu,
                  micro_batch=micro_batch, n_mb=n_mb, H=H, topk=topk, chunk=chunk,
                  quant_bits=quant_bits, value_bytes=value_bytes, index_bits=index_bits,
                  ratio=ratio, act_bytes=act_bytes, ids_bytes=ids_bytes, overlap=overlap,
                  seq_len=L, link_efficiency=link_efficiency)
    for name in ("stages", "replicas", "micro_batch", "n_mb", "H", "topk", "chunk",
                 "value_bytes", "index_bits", "act_bytes", "seq_len"):
        _check_positive(name, inputs[name], integer=True)
    for name in ("stage_bw", "replica_bw", "tflops"):
        _check_positive(name, inputs[name])
    for name in ("stage_latency", "replica_latency"):
        _check_positive(name, inputs[name], allow_zero=True)
    if not (isinstance(mfu, (int, float)) and 0 < mfu <= 1):
        raise ValueError(f"mfu must be in (0, 1], got {mfu!r}")
    if quant_bits not in (None, 1, 2, 4, 8):
        raise ValueError(f"quant_bits must be None, 1, 2, 4 or 8, got {quant_bits!r}")
    if topk > chunk:
        raise ValueError(f"topk={topk} exceeds chunk={chunk}")
    if ids_bytes is None:
        ids_bytes = 2 if m.vocab <= 65536 else 4
    _check_positive("ids_bytes", ids_bytes, integer=True)
    if k is None:
        k = subspace_k(m.d, ratio)
    elif ratio != 1:
        raise ValueError(f"give either ratio={ratio} or k={k}, not both")
    elif not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= m.d:
        raise ValueError(f"k must be an integer in [1, d={m.d}], got {k!r}")
    inputs["k"] = k

    tensors = stage_tensors(m, stages)
    n_layers = layers_per_stage(m.n_layers, stages)
    tok_mb = micro_batch * L
    flops = [(6 * _matmul_params(ts) + 12 * nl * m.d * L) * tok_mb for ts, nl in zip(tensors, n_layers)]
    rate = tflops * 1e12 * mfu
    t_mb = [f / rate for f in flops]
    t_c = max(t_mb)

    fwd, bwd = boundary_bytes(micro_batch, L, m.d, act_bytes=act_bytes, ids_bytes=ids_bytes, k=k)
    if stages == 1:
        fwd = bwd = 0
        t_f = t_b = 0.0
    else:
        t_f = fwd * 8 / (stage_bw * link_efficiency) + stage_latency
        t_b = bwd * 8 / (stage_bw * link_efficiency) + stage_latency
    if overlap:
        slot = max(t_c, t_f, t_b)
        bubble, stall = (stages - 1) * slot, n_mb * (slot - t_c)
    else:
        # Blocking sends: each of the n_mb micro-batches crosses the link once each way on the
        # critical path; fill and drain add S - 1 compute slots (checked against shaped-link
        # runs at S = 2, bench/results/shaped_links.json).
        slot = t_c + t_f + t_b
        bubble, stall = (stages - 1) * t_c, n_mb * (t_f + t_b)
    schedule = n_mb * t_c + bubble + stall

    pay_kw = dict(topk=topk, chunk=chunk, quant_bits=quant_bits, value_bytes=value_bytes,
                  index_bits=index_bits)
    payload = [outer_payload_bytes(ts, **pay_kw) for ts in tensors]
    dense = [4 * sum(_numel(s) for _, s in ts) for ts in tensors]
    sync = 0.0
    if replicas > 1:
        sync = max((replicas - 1) * (p * 8 / (replica_bw * link_efficiency) + replica_latency)
                   for p in payload)

    breakdown = {
        "compute": n_mb * t_c,
        "pipeline bubble": bubble,
        "stage-link stall": stall,
        "outer sync": sync / H,
    }
    total = sum(breakdown.values())
    util = breakdown["compute"] / total
    steady = t_c / (slot + sync / H / n_mb)
    dominant = max(TERMS, key=lambda t: breakdown[t])
    dominant_overhead = max(TERMS[1:], key=lambda t: breakdown[t])

    bw_needed: float | None = None
    if stages > 1:
        budget = t_c - stage_latency if overlap else t_c - 2 * stage_latency
        sent = max(fwd, bwd) if overlap else fwd + bwd
        bw_needed = sent * 8 / budget / link_efficiency if budget > 0 else None

    p = Prediction(
        model=m, inputs=inputs, params_total=m.n_params(),
        params_per_stage=[sum(_numel(s) for _, s in ts) for ts in tensors],
        layers_per_stage=n_layers, k=k, tokens_per_microbatch=tok_mb,
        tokens_per_step=tok_mb * n_mb, flops_per_microbatch=flops, compute_time_microbatch=t_mb,
        fwd_bytes_microbatch=fwd, bwd_bytes_microbatch=bwd, link_time_fwd=t_f, link_time_bwd=t_b,
        slot_time=slot, schedule_time=schedule, stage_link_bytes_per_step=n_mb * (fwd + bwd),
        outer_payload_bytes=payload, dense_outer_bytes=dense,
        outer_bytes_per_replica=sum(payload), outer_sync_time=sync, breakdown=breakdown,
        total_time=total, utilisation=util, steady_state_utilisation=steady, dominant=dominant,
        dominant_overhead=dominant_overhead, stage_bw_for_compute_bound=bw_needed,
    )
    p.explanation = explain(p)
    return p


def explain(p: Prediction) -> str:
    """One paragraph: which term dominates and what would change it."""
    i, b = p.inputs, p.breakdown
    t_c = max(p.compute_time_microbatch)
    share = {t: v / p.total_time for t, v in b.items()}
    lines = [f"Compute utilisation {p.utilisation:.1%}: " + ", ".join(
        f"{t} {share[t]:.1%}" for t in TERMS) + "."]
    over = p.dominant_overhead
    if over == "stage-link stall" and b[over] > 0:
        t_link = max(p.link_time_fwd, p.link_time_bwd) if i["overlap"] else p.link_time_fwd + p.link_time_bwd
        lines.append(
            f"The stage links are the bottleneck: a micro-batch needs {_fmt_time(t_link)} on a "
            f"{_fmt_rate(i['stage_bw'])} link against {_fmt_time(t_c)} of compute.")
        if p.stage_bw_for_compute_bound:
            lines.append(f"About {_fmt_rate(p.stage_bw_for_compute_bound)} per stage link (or a "
                         f"larger subspace ratio) would hide it.")
        else:
            lines.append("Link latency alone exceeds one micro-batch of compute: use larger micro-batches.")
    elif over == "pipeline bubble":
        lines.append(f"Pipeline fill/drain costs (S-1)/(n_mb+S-1) = {i['stages'] - 1}/"
                     f"{i['n_mb'] + i['stages'] - 1} of the schedule: more micro-batches per step "
                     f"or fewer stages reduce it; bandwidth or compression do not.")
    elif over == "outer sync":
        lines.append(f"The outer sync ({_fmt_bytes(max(p.outer_payload_bytes))} per rank, "
                     f"{i['replicas'] - 1} ring steps on {_fmt_rate(i['replica_bw'])}) takes "
                     f"{_fmt_time(p.outer_sync_time)} every {i['H']} inner steps: a faster replica "
                     f"link, larger H or quantisation reduce it.")
    if p.dominant == "compute":
        lines.append("The step is compute-bound.")
    return " ".join(lines)


def format_prediction(p: Prediction) -> str:
    """A readable table of a Prediction."""
    i = p.inputs
    rows = [
        ("model", f"{p.model.name}: d={p.model.d}, layers={p.model.n_layers}, heads={p.model.n_heads}"
                  f"/{p.model.kv_heads}, ffn={p.model.ffn}, vocab={p.model.vocab}, L={i['seq_len']}"),
        ("parameters", f"{p.params_total / 1e9:.3f} B total; per stage "
                       + ", ".join(f"{x / 1e9:.3f} B" for x in p.params_per_stage)),
        ("topology", f"M={i['replicas']} replicas x S={i['stages']} stages, H={i['H']}"),
        ("device", f"{i['tflops']:g} TFLOP/s peak x MFU {i['mfu']:g} per stage"),
        ("batch", f"b={i['micro_batch']} x n_mb={i['n_mb']} micro-batches = {p.tokens_per_step} tokens/step/replica"),
        ("stage link", f"{_fmt_rate(i['stage_bw'])}, latency {_fmt_time(i['stage_latency'])}, "
                       f"k/d = {p.k}/{p.model.d} (ratio {p.model.d / p.k:.4g}), overlap={i['overlap']}"),
        ("replica link", f"{_fmt_rate(i['replica_bw'])}, latency {_fmt_time(i['replica_latency'])}"),
        ("compute / micro-batch", f"{_fmt_time(max(p.compute_time_microbatch))} (slowest stage)"),
        ("boundary / micro-batch", f"fwd {_fmt_bytes(p.fwd_bytes_microbatch)} ({_fmt_time(p.link_time_fwd)}), "
                                   f"bwd {_fmt_bytes(p.bwd_bytes_microbatch)} ({_fmt_time(p.link_time_bwd)})"),
        ("stage link / step", _fmt_bytes(p.stage_link_bytes_per_step)),
        ("outer payload / rank", f"{_fmt_bytes(max(p.outer_payload_bytes))} (dense fp32: "
                                 f"{_fmt_bytes(max(p.dense_outer_bytes))}); per replica "
                                 f"{_fmt_bytes(p.outer_bytes_per_replica)}"),
        ("outer sync", f"{_fmt_time(p.outer_sync_time)} per outer step, "
                       f"{_fmt_time(p.breakdown['outer sync'])} per inner step"),
        ("inner step", f"{_fmt_time(p.total_time)} (schedule {_fmt_time(p.schedule_time)})"),
    ]
    rows += [(f"  {t}", f"{_fmt_time(p.breakdown[t])} ({p.breakdown[t] / p.total_time:.1%})") for t in TERMS]
    rows += [("compute utilisation", f"{p.utilisation:.2%} (steady state {p.steady_state_utilisation:.2%})"),
             ("dominant term", p.dominant)]
    w = max(len(r[0]) for r in rows)
    return "\n".join(f"{a:<{w}}  {b}" for a, b in rows) + "\n\n" + p.explanation


# ----------------------------------------------------------------------------- fleet planner

DEFAULT_RATIOS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 384, 768)

_GROUP_KEYS = {"name": str, "devices": int, "memory_gb": (int, float), "tflops": (int, float),
               "intra_bandwidth_bps": (int, float, str), "intra_latency_s": (int, float),
               "inter_bandwidth_bps": (int, float, str)}
_GROUP_OPTIONAL = {"inter_latency_s": (int, float), "mfu": (int, float)}


@dataclass
class DeviceGroup:
    """One fleet group: `devices` identical devices joined by intra links."""

    name: str
    devices: int
    memory_gb: float
    """Memory of one device, GB (1e9 bytes)."""
    tflops: float
    """Peak dense FLOP/s of one device, TFLOP/s."""
    intra_bandwidth_bps: float
    """Each device's link to the others in the group (a stage link inside the group)."""
    intra_latency_s: float
    inter_bandwidth_bps: float
    """Each device's link to the other groups (carries the outer sync across groups)."""
    inter_latency_s: float = 0.0
    mfu: float | None = None
    """Per-group MFU; None = the planner's default."""


def load_fleet(fleet: str | Path | Sequence[dict] | dict) -> list[DeviceGroup]:
    """Fleet from a JSON file path, a JSON string, a list of group dicts or {"groups": [...]}."""
    if isinstance(fleet, Path) or (isinstance(fleet, str) and not fleet.lstrip().startswith(("[", "{"))):
        fleet = json.loads(Path(fleet).read_text())
    elif isinstance(fleet, str):
        fleet = json.loads(fleet)
    if isinstance(fleet, dict):
        if set(fleet) != {"groups"}:
            raise ValueError(f"a fleet object must have exactly the key 'groups', got {sorted(fleet)}")
        fleet = fleet["groups"]
    if not isinstance(fleet, list) or not fleet:
        raise ValueError(f"a fleet is a non-empty list of groups, got {fleet!r}")
    groups = []
    for i, g in enumerate(fleet):
        if not isinstance(g, dict):
            raise ValueError(f"fleet group {i} must be an object, got {g!r}")
        unknown = set(g) - set(_GROUP_KEYS) - set(_GROUP_OPTIONAL)
        if unknown:
            raise ValueError(f"fleet group {i}: unknown key(s) {sorted(unknown)}")
        missing = set(_GROUP_KEYS) - set(g)
        if missing:
            raise ValueError(f"fleet group {i}: missing key(s) {sorted(missing)}")
        for key, typ in {**_GROUP_KEYS, **_GROUP_OPTIONAL}.items():
            if key in g and (not isinstance(g[key], typ) or isinstance(g[key], bool)):
                raise ValueError(f"fleet group {i}: {key}={g[key]!r} has the wrong type")
        vals = dict(g)
        for key in ("intra_bandwidth_bps", "inter_bandwidth_bps"):
            vals[key] = parse_rate(vals[key])
        name = vals["name"]
        for key in ("devices", "memory_gb", "tflops", "intra_bandwidth_bps", "inter_bandwidth_bps"):
            _check_positive(f"group {name!r} {key}", vals[key], integer=(key == "devices"))
        for key in ("intra_latency_s", "inter_latency_s"):
            _check_positive(f"group {name!r} {key}", vals.get(key, 0.0), allow_zero=True)
        if vals.get("mfu") is not None and not 0 < vals["mfu"] <= 1:
            raise ValueError(f"group {name!r} mfu must be in (0, 1], got {vals['mfu']!r}")
        groups.append(DeviceGroup(**vals))
    names = [g.name for g in groups]
    if len(set(names)) != len(names):
        raise ValueError(f"fleet group names must be unique, got {names}")
    return groups


def stage_memory_bytes(model: ModelShape, stages: int, *, micro_batch: int = 1,
                       bytes_per_param: int = 16, outer_state_bytes_per_param: int = 8,
                       activation_checkpointing: bool = False, seq_len: int | None = None) -> list[int]:
    """Device memory each stage needs.

    Parameters: `bytes_per_param` (16 = fp32 master 4 + AdamW moments 8 + bf16 weights 2 + bf16
    grads 2) plus `outer_state_bytes_per_param` (8 = SparseLoCo's fp32 error feedback and fp32
    theta at the last sync; 0 if those live in host memory).
    Activations (bf16, FlashAttention so no L^2 term, Korthikanti et al. 2022): 34*d bytes per
    token and layer, or 2*d per layer plus one layer's 34*d with activation checkpointing; 1F1B
    keeps S - s micro-batches in flight on stage s. The last stage adds 6 bytes per logit (bf16
    logits + fp32 loss). Framework overhead is the planner's `memory_headroom`.
    """
    L = model.seq_len if seq_len is None else seq_len
    tok = micro_batch * L
    out = []
    for s, (ts, nl) in enumerate(zip(stage_tensors(model, stages), layers_per_stage(model.n_layers, stages))):
        params = sum(_numel(x) for _, x in ts)
        per_mb = tok * (nl * 2 * model.d + 34 * model.d) if activation_checkpointing else tok * nl * 34 * model.d
        act = (stages - s) * per_mb
        if s == stages - 1:
            act += tok * model.vocab * 6
        out.append(params * (bytes_per_param + outer_state_bytes_per_param) + act)
    return out


def min_stages(model: ModelShape, memory_bytes: float, **mem_kw: Any) -> int | None:
    """Smallest S whose every stage fits `memory_bytes`; None if even one layer per stage does not."""
    for s in range(1, model.n_layers + 1):
        if max(stage_memory_bytes(model, s, **mem_kw)) <= memory_bytes:
            return s
    return None


@dataclass
class GroupPlan:
    name: str
    devices: int
    stages_needed: int | None
    """Smallest S for this group's device memory (None: a stage does not fit at all)."""
    fits_on_one_device: bool
    """A full replica fits in one device (S = 1 would do)."""
    replicas: int
    """Replicas this group hosts at the fleet's S (devices // S)."""
    role: str
    """'uncompressed', 'compressed' or 'excluded'."""
    ratio: int | None
    k: int | None
    utilisation: float | None
    """This group's compute utilisation on its own links (outer sync included)."""
    fleet_utilisation: float | None
    """Same, also counting the wait for the slowest replica before each outer sync."""
    target_met: bool | None
    inner_step_time: float | None
    dominant_overhead: str | None
    reason: str
    candidates: dict[int, float] = field(default_factory=dict)
    """Utilisation for each ratio tried."""


@dataclass
class FleetPlan:
    model: str
    stages: int
    replicas: int
    target_utilisation: float
    replica_ring_bw: float | None
    replica_ring_latency: float
    outer_sync_time: float
    outer_step_time: float
    """H * slowest replica's inner step + outer sync."""
    tokens_per_second: float
    groups: list[GroupPlan]
    settings: dict[str, Any]
    notes: list[str]

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def plan_fleet(
    fleet: str | Path | Sequence[dict] | dict,
    model: str | ModelShape = "512M",
    target_utilisation: float = 0.9,
    *,
    stages: int | None = None,
    ratios: Sequence[int] = DEFAULT_RATIOS,
    mfu: float = 0.45,
    micro_batch: int = 1,
    n_mb: int = 32,
    H: int = 50,
    topk: int = 32,
    chunk: int = 4096,
    quant_bits: int | None = None,
    value_bytes: int = 4,
    act_bytes: int = 2,
    overlap: bool = True,
    bytes_per_param: int = 16,
    outer_state_bytes_per_param: int = 8,
    activation_checkpointing: bool = False,
    memory_headroom: float = 0.9,
    tolerance: float = 0.005,
) -> FleetPlan:
    """Plan a heterogeneous fleet.

    1. Memory: each group's smallest stage count S_g whose per-stage memory
       (`stage_memory_bytes`) fits `memory_headroom` of one device.
    2. The engine's topology is M replicas x S stages with one S for everyone, so the fleet's S is
       the largest S_g among groups that have at least S_g devices (or `stages` if given); a
       group with fewer than S devices is excluded. Each remaining group hosts devices // S
       replicas whose stages sit on its devices, joined by its intra links.
    3. Outer sync: the M replicas' ring crosses intra links between replicas of one group and
       inter links between groups; its slowest hop sets the ring's speed.
    4. For each group, the least ratio in `ratios` (dividing d) whose predicted utilisation
       reaches the target; ratio 1 = uncompressed. If none does, the least ratio within
       `tolerance` of the best reachable, with target_met False and the limiting term named.
    """
    m = resolve_model(model)
    groups = load_fleet(fleet)
    if not 0 < target_utilisation <= 1:
        raise ValueError(f"target_utilisation must be in (0, 1], got {target_utilisation!r}")
    if not 0 < memory_headroom <= 1:
        raise ValueError(f"memory_headroom must be in (0, 1], got {memory_headroom!r}")
    bad = [r for r in ratios if not isinstance(r, int) or r < 1]
    if bad:
        raise ValueError(f"ratios must be integers >= 1, got {bad}")
    valid_ratios = sorted({r for r in ratios if r <= m.d and m.d % r == 0})
    if 1 not in valid_ratios:
        valid_ratios.insert(0, 1)
    mem_kw = dict(micro_batch=micro_batch, bytes_per_param=bytes_per_param,
                  outer_state_bytes_per_param=outer_state_bytes_per_param,
                  activation_checkpointing=activation_checkpointing)
    notes: list[str] = []
    need = {g.name: min_stages(m, g.memory_gb * 1e9 * memory_headroom, **mem_kw) for g in groups}
    if stages is None:
        feasible = [n for g in groups if (n := need[g.name]) is not None and n <= g.devices]
        if not feasible:
            raise ValueError("no group can hold a replica: every group has fewer devices than "
                             f"stages it needs ({need})")
        stages = max(feasible)
        notes.append(f"S = {stages}: the most stages any group that can hold a replica needs "
                     "(one S for all replicas, as the engine's M x S topology requires).")
    else:
        _check_positive("stages", stages, integer=True)
        layers_per_stage(m.n_layers, stages)
    stage_mem = max(stage_memory_bytes(m, stages, **mem_kw))

    hosts = [g for g in groups if g.devices >= stages
             and stage_mem <= g.memory_gb * 1e9 * memory_headroom]
    M = sum(g.devices // stages for g in hosts)
    if M == 0:
        raise ValueError(f"no group can host a replica of {stages} stages")
    hops_bw, hops_lat = [], []
    for g in hosts:
        if g.devices // stages > 1:
            hops_bw.append(g.intra_bandwidth_bps)
            hops_lat.append(g.intra_latency_s)
        if len(hosts) > 1:
            hops_bw.append(g.inter_bandwidth_bps)
            hops_lat.append(g.inter_latency_s)
    ring_bw = min(hops_bw) if hops_bw else None
    ring_lat = max(hops_lat) if hops_lat else 0.0

    plans: list[GroupPlan] = []
    preds: dict[str, Prediction] = {}
    for g in groups:
        fits_one = need[g.name] == 1
        if g not in hosts:
            why = (f"{g.devices} device(s) < S = {stages}" if g.devices < stages else
                   f"a stage needs {stage_mem / 1e9:.1f} GB > {memory_headroom:g} x {g.memory_gb:g} GB")
            plans.append(GroupPlan(g.name, g.devices, need[g.name], fits_one, 0, "excluded", None,
                                   None, None, None, None, None, None, f"excluded: {why}"))
            continue
        kw = dict(stages=stages, replicas=M, stage_bw=g.intra_bandwidth_bps,
                  stage_latency=g.intra_latency_s, replica_bw=ring_bw or 1.0,
                  replica_latency=ring_lat, tflops=g.tflops, mfu=g.mfu or mfu,
                  micro_batch=micro_batch, n_mb=n_mb, H=H, topk=topk, chunk=chunk,
                  quant_bits=quant_bits, value_bytes=value_bytes, act_bytes=act_bytes,
                  overlap=overlap)
        cand = {r: predict(m, ratio=r, **kw) for r in valid_ratios}
        util = {r: p.utilisation for r, p in cand.items()}
        ok = [r for r in valid_ratios if util[r] >= target_utilisation]
        if ok:
            r = ok[0]
            reason = (f"ratio {r} is the least that reaches {target_utilisation:.0%} on "
                      f"{_fmt_rate(g.intra_bandwidth_bps)} stage links")
        else:
            best = max(util.values())
            r = next(x for x in valid_ratios if util[x] >= best - tolerance)
            reason = (f"target {target_utilisation:.0%} unreachable: best {best:.1%} at ratio {r}, "
                      f"limited by {cand[r].dominant_overhead}")
        if stages == 1:
            reason = "one device holds a replica: no stage links"
        p = cand[r]
        preds[g.name] = p
        plans.append(GroupPlan(
            g.name, g.devices, need[g.name], fits_one, g.devices // stages,
            "uncompressed" if r == 1 else "compressed", r, p.k, p.utilisation, None,
            bool(ok), p.schedule_time, p.dominant_overhead, reason,
            {x: round(u, 6) for x, u in util.items()}))

    sync = max(p.outer_sync_time for p in preds.values())
    slowest = max(p.schedule_time for p in preds.values())
    outer_step = H * slowest + sync
    tokens = 0.0
    for gp in plans:
        if gp.name in preds:
            p = preds[gp.name]
            gp.fleet_utilisation = H * p.breakdown["compute"] / outer_step
            tokens += gp.replicas * p.tokens_per_step * H
    if len({round(p.schedule_time, 9) for p in preds.values()}) > 1:
        notes.append("Replicas run at different speeds; SparseLoCo's outer sync waits for the "
                     "slowest, which fleet_utilisation counts.")
    settings = dict(mfu=mfu, micro_batch=micro_batch, n_mb=n_mb, H=H, topk=topk, chunk=chunk,
                    quant_bits=quant_bits, value_bytes=value_bytes, act_bytes=act_bytes,
                    overlap=overlap, bytes_per_param=bytes_per_param,
                    outer_state_bytes_per_param=outer_state_bytes_per_param,
                    activation_checkpointing=activation_checkpointing,
                    memory_headroom=memory_headroom, ratios=list(valid_ratios),
                    stage_memory_gb=stage_mem / 1e9)
    return FleetPlan(m.name, stages, M, target_utilisation, ring_bw, ring_lat, sync, outer_step,
                     tokens / outer_step, plans, settings, notes)


def format_fleet(plan: FleetPlan) -> str:
    """A readable table of a FleetPlan."""
    head = (f"model {plan.model}: S = {plan.stages} stages ({plan.settings['stage_memory_gb']:.1f} GB "
            f"per stage), M = {plan.replicas} replicas, target utilisation "
            f"{plan.target_utilisation:.0%}\nouter sync {_fmt_time(plan.outer_sync_time)} on a ring of "
            + (_fmt_rate(plan.replica_ring_bw) if plan.replica_ring_bw else "-")
            + f"; outer step {_fmt_time(plan.outer_step_time)}; "
              f"{plan.tokens_per_second:,.0f} tokens/s fleet-wide\n")
    cols = ("group", "devices", "S_need", "replicas", "role", "ratio", "util", "fleet util")
    rows = [cols]
    for g in plan.groups:
        rows.append((g.name, str(g.devices), str(g.stages_needed), str(g.replicas), g.role,
                     "-" if g.ratio is None else f"1/{g.ratio}" if g.ratio > 1 else "1",
                     "-" if g.utilisation is None else f"{g.utilisation:.1%}",
                     "-" if g.fleet_utilisation is None else f"{g.fleet_utilisation:.1%}"))
    w = [max(len(r[i]) for r in rows) for i in range(len(cols))]
    table = "\n".join("  ".join(c.ljust(w[i]) for i, c in enumerate(r)) for r in rows)
    why = "\n".join(f"- {g.name}: {g.reason}" for g in plan.groups)
    notes = "\n".join(f"note: {n}" for n in plan.notes)
    return head + "\n" + table + "\n\n" + why + ("\n" + notes if notes else "")


# ----------------------------------------------------------------------------- CLI


def build_parser(prog: str = "hetloco-ds plan") -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=prog, description=(
        "Predict step time, bytes and compute utilisation for SparseLoCo + subspace-compressed "
        "pipelines, or plan a heterogeneous fleet (--fleet). Rates accept 100mbit, 1G, 1e9 (bits/s)."))
    ap.add_argument("--model", default="512M", help=f"preset ({', '.join(PRESETS)}); --d etc. override it")
    for name in ("d", "layers", "heads", "kv-heads", "ffn", "vocab", "seq-len"):
        ap.add_argument(f"--{name}", type=int, default=None, help="override the preset's value")
    ap.add_argument("--stages", "-S", type=int, default=None, help="pipeline stages (default 4; fleet: chosen)")
    ap.add_argument("--replicas", "-M", type=int, default=8)
    ap.add_argument("--stage-bw", type=parse_rate, default=1e9, help="bits/s per stage link")
    ap.add_argument("--stage-latency", type=float, default=0.0, help="seconds")
    ap.add_argument("--replica-bw", type=parse_rate, default=1e9, help="bits/s per replica link")
    ap.add_argument("--replica-latency", type=float, default=0.0, help="seconds")
    ap.add_argument("--tflops", type=float, default=989.0, help="peak TFLOP/s of one stage")
    ap.add_argument("--mfu", type=float, default=0.45)
    ap.add_argument("--micro-batch", "-b", type=int, default=1)
    ap.add_argument("--n-mb", type=int, default=32, help="micro-batches per inner step")
    ap.add_argument("-H", "--inner-steps", dest="H", type=int, default=50)
    ap.add_argument("--topk", type=int, default=32)
    ap.add_argument("--chunk", type=int, default=4096)
    ap.add_argument("--quant-bits", type=int, default=None, choices=(1, 2, 4, 8))
    ap.add_argument("--value-bytes", type=int, default=4, help="bytes per unquantised value (4 fp32, 2 bf16)")
    ap.add_argument("--ratio", type=int, default=1, help="subspace ratio d/k (1 = uncompressed)")
    ap.add_argument("--act-bytes", type=int, default=2)
    ap.add_argument("--no-overlap", dest="overlap", action="store_false",
                    help="transfers block compute (DeepSpeed's blocking p2p)")
    ap.add_argument("--fleet", default=None, help="fleet JSON: plan it instead of predicting")
    ap.add_argument("--target", type=float, default=0.9, help="fleet: target compute utilisation")
    ap.add_argument("--json", default=None, metavar="PATH", help="also write the result as JSON ('-' = stdout)")
    return ap


def _model_from_args(a: argparse.Namespace) -> ModelShape:
    m = resolve_model(a.model)
    over = {"d": a.d, "n_layers": a.layers, "n_heads": a.heads, "n_kv_heads": a.kv_heads,
            "ffn": a.ffn, "vocab": a.vocab, "seq_len": a.seq_len}
    over = {k: v for k, v in over.items() if v is not None}
    if over:
        m = resolve_model(dataclasses.replace(m, name=f"{m.name}*", **over))
    return m


def main(argv: Sequence[str] | None = None) -> int:
    """`hetloco-ds plan ...`: print a prediction (or a fleet plan); --json writes it."""
    a = build_parser().parse_args(argv)
    try:
        m = _model_from_args(a)
        if a.fleet:
            res: Any = plan_fleet(a.fleet, m, a.target, stages=a.stages, mfu=a.mfu,
                                  micro_batch=a.micro_batch, n_mb=a.n_mb, H=a.H, topk=a.topk,
                                  chunk=a.chunk, quant_bits=a.quant_bits, value_bytes=a.value_bytes,
                                  act_bytes=a.act_bytes, overlap=a.overlap)
            text = format_fleet(res)
        else:
            res = predict(m, stages=a.stages or 4, replicas=a.replicas, stage_bw=a.stage_bw,
                          stage_latency=a.stage_latency, replica_bw=a.replica_bw,
                          replica_latency=a.replica_latency, tflops=a.tflops, mfu=a.mfu,
                          micro_batch=a.micro_batch, n_mb=a.n_mb, H=a.H, topk=a.topk,
                          chunk=a.chunk, quant_bits=a.quant_bits, value_bytes=a.value_bytes,
                          ratio=a.ratio, act_bytes=a.act_bytes, overlap=a.overlap)
            text = format_prediction(res)
    except (ValueError, OSError) as e:
        print(f"hetloco-ds plan: error: {e}", file=sys.stderr)
        return 2
    payload = json.dumps(res.to_dict(), indent=2, default=str)
    if a.json == "-":
        print(payload)
    else:
        print(text)
        if a.json:
            Path(a.json).write_text(payload + "\n")
            print(f"\nwrote {a.json}")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
