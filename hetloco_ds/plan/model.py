"""The byte and time model: what one inner step and one outer sync cost on given links and devices.

Pure Python (no torch). Byte counts are exact and come from `hetloco_ds.sizes`, the rules the
engine itself follows; times are modelled.

One inner step (one optimizer step of one replica, n_mb micro-batches of b x L tokens)
-------------------------------------------------------------------------------------
* compute per micro-batch on stage s: (6 * P_s + 12 * layers_s * d * L) * b * L FLOPs divided by
  (peak FLOP/s x MFU). P_s counts the matmul weights on the stage (the LM head included, the
  embedding table excluded: a gather is no FLOPs); the attention term is PaLM's convention (QK^T
  and AV, forward + backward, no discount for causality). Subspace projections (X U, 2dk FLOPs a
  token per boundary and direction) are left out: < 0.1% of a stage for the shapes here.
* boundary bytes per micro-batch (`sizes.boundary_nbytes`): forward b*L*k*act_bytes (+ the token
  ids when the boundary is compressed, for T_perp[x]), backward b*L*k*act_bytes. k = d / ratio.
* links are full duplex (forward tensors go down one direction, gradients up the other), each
  transfer pays `latency` once; transfers on one link direction go one at a time, in order.
* schedule: the engine's own instruction lists (`pipe.order.link_ops`), timed by an event
  simulation (`simulate_schedule`): each stage runs its operations in order, a forward takes
  1/3 and a backward 2/3 of its micro-batch compute, and a transfer starts once its sender has
  sent, its receiver has posted the receive (gloo and NCCL are rendezvous transports) and the
  link direction is free.
  - overlap=True, the overlapped schedule (`hetloco.pipeline.schedule: overlapped`): sends and
    posted receives do not block; a stage waits only for a message it needs that has not
    arrived. With 3(S-1-s)+1 micro-batches in flight the steady state is one micro-batch per
    max(t_compute, t_link), t_link = max(fwd, bwd) bytes * 8 / bw + latency; fill and drain
    carry the transfers of the first and last micro-batch.
  - overlap=False, DeepSpeed's TrainSchedule (`blocking`): a receive holds its stage until the
    message has arrived; a send until the receiver has posted its receive, and then, because
    each tensor of a message is its own rendezvous, until every tensor but the last has arrived:
    a compressed boundary's forward message is [activations, ids], so its sender waits out the
    activations; a one-tensor message lets its sender go once the transport has taken the data
    (gloo over TCP: probed on shaped links, a blocking send returns as soon as the receive is
    posted). At S = 2 either way gives (n_mb + 1) * t_compute + n_mb * (t_fwd + t_bwd);
    bench/results/overlap_links.json checks S = 2 and 4, compressed and not.
* outer sync every H inner steps: each stage group all-gathers its compact payloads
  (`sizes.stage_payload_nbytes`), every rank sending its payload to the M - 1 others,
  (M - 1) * (payload * 8 / bw + latency), receiving at the same time (full duplex). This assumes
  each rank's outgoing bytes share one link of rate bw (a ring hop, a site's uplink). Where every
  pair of ranks has a link of its own (netlab's per-peer shaping), the M - 1 sends run side by
  side and take one payload time: the formula then over-predicts by up to (M - 1)x for M > 2
  (the shaped-link benchmark measures M = 2, where the two agree). The S stage groups use
  disjoint links and run at the same time, so the slowest stage group sets the time. It blocks
  (no overlap with the inner loop) and is amortised as sync / H per inner step. Replicas with
  different S (`hetloco.replica_stages`) exchange by parameter block instead, each replica timed
  with its own S and links, and the outer step waits for the slowest: `plan.outer_step`.
* compute utilisation = compute time of the busiest stage / total time, with
  total = schedule + sync / H = compute + bubble + link stall + outer sync, where the bubble is
  the schedule's time on infinitely fast links less the compute, and the stall the rest.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import re
from dataclasses import dataclass
from typing import Any, Sequence

from .. import sizes
from ..pipe.order import link_ops
from .shapes import ModelShape, resolve_model, stage_tensors


# ----------------------------------------------------------------------------- bytes and FLOPs of tensors
def _matmul_params(tensors: list[tuple[str, tuple[int, ...]]]) -> int:
    """Weights that take part in a matmul: 2-D tensors except the embedding table."""
    return sum(math.prod(s) for n, s in tensors if len(s) == 2 and not n.startswith("embed_tokens"))


def outer_payload_bytes(tensors: Sequence[tuple[str, Sequence[int]]], topk: int = 32, chunk: int = 4096,
                        quant_bits: int | None = None, value_bytes: int = 4) -> int:
    """One stage's outer-sync payload, as the engine lays it out (`sizes.stage_payload_nbytes`)."""
    return sizes.stage_payload_nbytes([s for _, s in tensors], chunk, topk, quant_bits, value_bytes)


# ----------------------------------------------------------------------------- units
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


def fmt_rate(bps: float) -> str:
    for unit, m in (("Gbit/s", 1e9), ("Mbit/s", 1e6), ("kbit/s", 1e3)):
        if bps >= m:
            return f"{bps / m:.3g} {unit}"
    return f"{bps:g} bit/s"


def fmt_bytes(n: float) -> str:
    for unit, m in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= m:
            return f"{n / m:.3g} {unit}"
    return f"{n:.0f} B"


def fmt_time(t: float) -> str:
    if t == 0:
        return "0 s"
    if t >= 3600:
        return f"{t / 3600:.3g} h"
    if t >= 1:
        return f"{t:.3g} s"
    if t >= 1e-3:
        return f"{t * 1e3:.3g} ms"
    return f"{t * 1e6:.3g} us"


def check_positive(name: str, v: Any, *, allow_zero: bool = False, integer: bool = False) -> None:
    ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
    if integer:
        ok = ok and float(v).is_integer()
    if not ok or v < 0 or (v == 0 and not allow_zero):
        need = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"{name} must be {'an integer ' if integer else ''}{need}, got {v!r}")


# ----------------------------------------------------------------------------- settings
@dataclass(frozen=True)
class Settings:
    """Everything a prediction depends on besides the model shape (rates in bits/s, or strings
    such as "100mbit"; latencies in s). `predict` and `plan_fleet` take one of these, and any
    field as a keyword override."""

    stages: int = 4
    """S pipeline stages."""
    replicas: int = 8
    """M SparseLoCo replicas."""
    stage_bw: float | str = 1e9
    """Each link between adjacent stages (per direction)."""
    stage_latency: float = 0.0
    replica_bw: float | str = 1e9
    """Each rank's link to its stage group's ring neighbour."""
    replica_latency: float = 0.0
    tflops: float = 989.0
    """Peak dense FLOP/s of one stage, in TFLOP/s."""
    mfu: float = 0.45
    """Fraction of peak the compute achieves."""
    micro_batch: int = 1
    """b sequences per micro-batch."""
    n_mb: int = 32
    """Micro-batches per inner step."""
    H: int = 50
    """Inner steps per outer step."""
    topk: int = 32
    chunk: int = 4096
    quant_bits: int | None = None
    """None sends `value_bytes` values; 2/4/8 packs codes plus a lookup table."""
    value_bytes: int = 4
    """Bytes per unquantised outer-sync value (4 fp32, 2 bf16)."""
    ratio: int = 1
    """Subspace ratio d / k on the stage boundaries (1 = uncompressed)."""
    k: int | None = None
    """Subspace width given directly (1 <= k <= d), for ratios that do not divide d; leave ratio at 1."""
    act_bytes: int = 2
    """Bytes per activation element on a stage link (2 = bf16)."""
    overlap: bool = True
    """Whether stage-link transfers overlap compute (see the module docstring)."""
    seq_len: int | None = None
    """Override the model's sequence length."""
    link_efficiency: float = 1.0
    """Goodput / link rate on every link; TCP/IPv4 over Ethernet at MTU 1500 gives ~0.957."""
    tied_embeddings: str = "outer_step"
    """For a tied model: "outer_step" (the copies meet at outer steps, sparse) or "every_step"
    (the dense V x d gradient all-reduced between the first and last stage every step)."""
    embedding_sync: bool | None = None
    """Whether outer steps share the sparse T_S aggregate (any replica compressed, embedding
    adaptation on); None: when ratio > 1 or k < d."""

    def resolved(self, model: ModelShape) -> "Settings":
        """Rates parsed, every field checked (one error naming the bad value), k filled in."""
        s = dataclasses.replace(self, stage_bw=parse_rate(self.stage_bw), replica_bw=parse_rate(self.replica_bw),
                                seq_len=model.seq_len if self.seq_len is None else self.seq_len)
        for name in ("stages", "replicas", "micro_batch", "n_mb", "H", "act_bytes", "seq_len"):
            check_positive(name, getattr(s, name), integer=True)
        for name in ("stage_bw", "replica_bw", "tflops"):
            check_positive(name, getattr(s, name))
        for name in ("stage_latency", "replica_latency"):
            check_positive(name, getattr(s, name), allow_zero=True)
        if not (isinstance(s.mfu, (int, float)) and 0 < s.mfu <= 1):
            raise ValueError(f"mfu must be in (0, 1], got {s.mfu!r}")
        if not (isinstance(s.link_efficiency, (int, float)) and 0 < s.link_efficiency <= 1):
            raise ValueError(f"link_efficiency must be in (0, 1], got {s.link_efficiency!r}")
        if s.tied_embeddings not in ("outer_step", "every_step"):
            raise ValueError(f"tied_embeddings must be 'outer_step' or 'every_step', got {s.tied_embeddings!r}")
        sizes.check_codec(s.chunk, s.topk, s.quant_bits, s.value_bytes)
        if s.k is None:
            try:
                k = sizes.subspace_dim(model.d, s.ratio)
            except ValueError:
                raise ValueError(f"subspace ratio {s.ratio} does not divide d={model.d}") from None
        elif s.ratio != 1:
            raise ValueError(f"give either ratio={s.ratio} or k={s.k}, not both")
        elif not isinstance(s.k, int) or isinstance(s.k, bool) or not 1 <= s.k <= model.d:
            raise ValueError(f"k must be an integer in [1, d={model.d}], got {s.k!r}")
        else:
            k = s.k
        return dataclasses.replace(s, k=k)


TERMS = ("compute", "pipeline bubble", "stage-link stall", "outer sync")


@dataclass
class Prediction:
    """What `predict` returns. Times in seconds, bytes in bytes, per inner step unless named."""

    model: ModelShape
    inputs: dict[str, Any]
    """The resolved Settings (rates in bits/s), as a dict."""
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
    """Steady-state time per micro-batch: max(compute, link) overlapped, compute + fwd + bwd blocking."""
    schedule_time: float
    """The schedule's simulated time (`simulate_schedule`)."""
    stage_link_bytes_per_step: int
    """Activation bytes one stage link carries per inner step, both directions together."""
    control_bytes_per_step: int
    """Other bytes a replica's ranks send per inner step, as their meters count them (S ranks'
    gradient-norm and step-record scalars; a tied model tied every step: its dense V x d gradient
    from each of the first and last stage)."""
    embedding_sync_bytes_per_outer_step: int
    """At most this many bytes the replica's sparse embedding shares send per outer step (T_S's
    aggregate when compressing, the tied head's when tied apart), each from its owner to S - 1 stages."""
    outer_payload_bytes: list[int]
    """Compressed outer-sync payload one rank contributes, per stage."""
    dense_outer_bytes: list[int]
    """Dense DiLoCo equivalent (fp32 pseudo-gradient), per stage."""
    outer_bytes_per_replica: int
    """Sum of the payloads over a replica's stages (what one replica sends per outer step)."""
    outer_sync_time: float
    """Per outer step: the replicas' exchange (`outer_exchange_time`), then the embedding shares
    over this replica's stage links."""
    outer_exchange_time: float
    """Per outer step: the replicas' exchange of payloads, by default the slowest stage group's
    all-gather, (M - 1) payloads over each rank's link; a fleet of mixed S passes its own
    (`plan.outer_step`: by block, a rank holding several blocks takes part in several exchanges)."""
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


def simulate_schedule(schedule: str, stages: int, n_mb: int, fwd: Sequence[float], bwd: Sequence[float],
                      t_down: float, t_up: float, hold_down: float = 0.0, hold_up: float = 0.0) -> float:
    """Seconds of one training step's pipeline schedule (the module docstring's semantics).

    `fwd[s]`, `bwd[s]`: one micro-batch's forward and backward on stage s; `t_down`, `t_up`: one
    activation / gradient transfer on any stage link; `hold_down`, `hold_up`: how long after its
    transfer starts a blocking send still holds its sender (the transfer of every tensor of the
    message but the last)."""
    return _simulate_schedule(schedule, stages, n_mb, tuple(fwd), tuple(bwd), t_down, t_up, hold_down, hold_up)


@functools.lru_cache(maxsize=4096)
def _simulate_schedule(schedule: str, stages: int, n_mb: int, fwd: tuple[float, ...], bwd: tuple[float, ...],
                       t_down: float, t_up: float, hold_down: float, hold_up: float) -> float:
    """`simulate_schedule`, once per distinct argument list: a sweep over link rates asks for the same
    link-free schedule at every point (`predict`'s bubble)."""
    S = stages
    ops = [link_ops(schedule, S, s, n_mb) for s in range(S)]
    pos, clock = [0] * S, [0.0] * S
    sent: dict = {}      # (direction, link, i) -> time the sender handed it over
    posted: dict = {}    # ... -> time the receiver posted (blocking: reached) its receive
    arrival: dict = {}   # ... -> time the transfer ended
    started: dict = {}   # ... -> time the transfer started
    free: dict = {}      # (direction, link) -> time it is free
    nxt: dict = {}       # (direction, link) -> next message index it carries

    def resolve(direction: str, link: int) -> None:
        key = (direction, link)
        while True:
            k = (direction, link, nxt.get(key, 0))
            if k not in sent or k not in posted:
                return
            started[k] = start = max(sent[k], posted[k], free.get(key, 0.0))
            arrival[k] = free[key] = start + (t_down if direction == "down" else t_up)
            nxt[key] = k[2] + 1

    where = {"isend_act": ("down", 0, "send"), "send_act": ("down", 0, "send"),
             "post_act": ("down", -1, "post"), "recv_act": ("down", -1, "post"), "wait_act": ("down", -1, None),
             "isend_grad": ("up", -1, "send"), "send_grad": ("up", -1, "send"),
             "post_grad": ("up", 0, "post"), "recv_grad": ("up", 0, "post"), "wait_grad": ("up", 0, None)}
    blocking_ops = {"send_act", "recv_act", "send_grad", "recv_grad", "wait_act", "wait_grad"}
    while True:
        progressed = False
        for s in range(S):
            while pos[s] < len(ops[s]):
                op, i = ops[s][pos[s]]
                if op == "F":
                    clock[s] += fwd[s]
                elif op == "B":
                    clock[s] += bwd[s]
                else:
                    direction, offset, role = where[op]
                    k = (direction, s + offset, i)
                    if role is not None:
                        (sent if role == "send" else posted).setdefault(k, clock[s])
                        resolve(direction, s + offset)
                    if op in blocking_ops:
                        if k not in arrival:
                            break
                        if role == "send":
                            hold = hold_down if direction == "down" else hold_up
                            clock[s] = max(clock[s], started[k] + hold)
                        else:
                            clock[s] = max(clock[s], arrival[k])
                pos[s] += 1
                progressed = True
        if all(pos[s] == len(ops[s]) for s in range(S)):
            return max(clock)
        if not progressed:
            raise RuntimeError(f"{schedule} schedule deadlocks at {[ops[s][pos[s]] for s in range(S) if pos[s] < len(ops[s])]}")


def _stage_link_times(fwd: int, bwd: int, s: Settings) -> tuple[float, float]:
    if s.stages == 1:
        return 0.0, 0.0
    rate = s.stage_bw * s.link_efficiency
    return fwd * 8 / rate + s.stage_latency, bwd * 8 / rate + s.stage_latency


def predict(model: str | ModelShape = "512M", settings: Settings | None = None, *,
            outer_exchange: float | None = None, **overrides: Any) -> Prediction:
    """Predict one replica's inner step and the outer sync (see the module docstring);
    `overrides` replace fields of `settings` (default `Settings()`). `outer_exchange`: seconds
    of the replicas' exchange per outer step when the caller models it (a fleet whose replicas
    have different S, `plan.outer_step`); None: the all-gather of the module docstring."""
    m = resolve_model(model)
    try:
        s = dataclasses.replace(settings or Settings(), **overrides)
    except TypeError as err:
        raise ValueError(f"predict: {err}") from None
    s = s.resolved(m)
    L = s.seq_len

    tensors = stage_tensors(m, s.stages)
    n_layers = sizes.decoder_layers_per_stage(m.n_layers, s.stages)
    tok_mb = s.micro_batch * L
    flops = [(6 * _matmul_params(ts) + 12 * nl * m.d * L) * tok_mb for ts, nl in zip(tensors, n_layers)]
    t_mb = [f / (s.tflops * 1e12 * s.mfu) for f in flops]
    t_c = max(t_mb)

    fwd, bwd = sizes.boundary_nbytes(s.micro_batch, L, m.d, s.k, s.act_bytes, m.vocab) if s.stages > 1 else (0, 0)
    t_f, t_b = _stage_link_times(fwd, bwd, s)
    kind = "overlapped" if s.overlap else "blocking"
    # A backward pass is twice a forward's FLOPs (6P = 2P forward + 4P backward).
    f_s, b_s = [t / 3 for t in t_mb], [2 * t / 3 for t in t_mb]
    # A compressed forward message is [activations, ids]: a blocking sender waits out the activations.
    hold = t_b if (fwd > bwd and not s.overlap) else 0.0
    schedule = simulate_schedule(kind, s.stages, s.n_mb, f_s, b_s, t_f, t_b, hold_down=hold)
    link_free = simulate_schedule(kind, s.stages, s.n_mb, f_s, b_s, 0.0, 0.0)
    bubble, stall = link_free - s.n_mb * t_c, schedule - link_free
    slot = max(t_c, t_f, t_b) if s.overlap else t_c + t_f + t_b

    payload = [outer_payload_bytes(ts, s.topk, s.chunk, s.quant_bits, s.value_bytes) for ts in tensors]
    dense = [4 * sum(math.prod(x) for _, x in ts) for ts in tensors]
    sync = 0.0
    if outer_exchange is not None:
        check_positive("outer_exchange", outer_exchange, allow_zero=True)
        sync = outer_exchange
    elif s.replicas > 1:
        rate = s.replica_bw * s.link_efficiency
        sync = max((s.replicas - 1) * (p * 8 / rate + s.replica_latency) for p in payload)
    exchange = sync

    # What else crosses the stage links (see the Prediction fields).
    V, d = m.vocab, m.d
    control = s.stages * sizes.step_control_nbytes(s.stages)
    tied_apart = m.tied and s.stages > 1 and s.tied_embeddings == "outer_step"
    if m.tied and s.stages > 1 and not tied_apart:
        control += 2 * V * d * 4  # an fp32 all-reduce between the first and the last stage
        rate = s.stage_bw * s.link_efficiency
        stall += V * d * 4 * 8 / rate + s.stage_latency  # two ranks: each sends the whole tensor once
    shares = int(s.embedding_sync if s.embedding_sync is not None else s.k < m.d) + int(tied_apart)
    share = sizes.sparse_share_max_nbytes((V, d), s.replicas, s.chunk, s.topk) if s.stages > 1 else 0
    embedding_sync = shares * share * (s.stages - 1)
    if s.stages > 1:
        sync += shares * (share * 8 / (s.stage_bw * s.link_efficiency) + s.stage_latency)
    breakdown = {"compute": s.n_mb * t_c, "pipeline bubble": bubble, "stage-link stall": stall,
                 "outer sync": sync / s.H}
    total = sum(breakdown.values())
    bw_needed: float | None = None
    if s.stages > 1:
        budget = t_c - s.stage_latency if s.overlap else t_c - 2 * s.stage_latency
        sent = max(fwd, bwd) if s.overlap else fwd + bwd
        bw_needed = sent * 8 / budget / s.link_efficiency if budget > 0 else None

    p = Prediction(
        model=m, inputs=dataclasses.asdict(s), params_total=m.n_params(),
        params_per_stage=[sum(math.prod(x) for _, x in ts) for ts in tensors],
        layers_per_stage=n_layers, k=s.k, tokens_per_microbatch=tok_mb,
        tokens_per_step=tok_mb * s.n_mb, flops_per_microbatch=flops, compute_time_microbatch=t_mb,
        fwd_bytes_microbatch=fwd, bwd_bytes_microbatch=bwd, link_time_fwd=t_f, link_time_bwd=t_b,
        slot_time=slot, schedule_time=schedule, stage_link_bytes_per_step=s.n_mb * (fwd + bwd),
        control_bytes_per_step=control, embedding_sync_bytes_per_outer_step=embedding_sync,
        outer_payload_bytes=payload, dense_outer_bytes=dense,
        outer_bytes_per_replica=sum(payload), outer_sync_time=sync, outer_exchange_time=exchange,
        breakdown=breakdown,
        total_time=total, utilisation=breakdown["compute"] / total,
        steady_state_utilisation=t_c / (slot + sync / s.H / s.n_mb),
        dominant=max(TERMS, key=lambda t: breakdown[t]),
        dominant_overhead=max(TERMS[1:], key=lambda t: breakdown[t]), stage_bw_for_compute_bound=bw_needed,
    )
    p.explanation = explain(p)
    return p


def explain(p: Prediction) -> str:
    """One paragraph: what bounds the step (the dominant term) and what would change its largest
    overhead; every sentence agrees with the breakdown above it."""
    i, b = p.inputs, p.breakdown
    share = {t: v / p.total_time for t, v in b.items()}
    lines = [f"Compute utilisation {p.utilisation:.1%}: " + ", ".join(
        f"{t} {share[t]:.1%}" for t in TERMS) + "."]
    over = p.dominant_overhead
    if p.dominant == "compute":
        lines.append("The step is compute-bound" + (f"; its largest overhead is the {over}." if b[over] > 0 else "."))
    else:
        lines.append({"stage-link stall": "The stage links are", "pipeline bubble": "The pipeline bubble is",
                      "outer sync": "The outer sync is"}[over] + " the bottleneck.")
    if b[over] <= 0:
        return " ".join(lines)
    if over == "stage-link stall":
        lines.append(_explain_stall(p))
    elif over == "pipeline bubble":
        lines.append(f"Pipeline fill/drain costs (S-1)/(n_mb+S-1) = {i['stages'] - 1}/"
                     f"{i['n_mb'] + i['stages'] - 1} of the schedule: more micro-batches per step "
                     f"or fewer stages reduce it; bandwidth or compression do not.")
    elif over == "outer sync":
        lines.append(f"The outer sync ({fmt_bytes(max(p.outer_payload_bytes))} per rank, "
                     f"{i['replicas'] - 1} ring steps on {fmt_rate(i['replica_bw'])}) takes "
                     f"{fmt_time(p.outer_sync_time)} every {i['H']} inner steps: a faster replica "
                     f"link, larger H or quantisation reduce it.")
    return " ".join(lines)


def _explain_stall(p: Prediction) -> str:
    """Why the stage links stall the step: too slow for the compute they must hide under, or (when
    they already keep up) only while the pipeline fills and drains, or a blocking schedule."""
    i = p.inputs
    t_c = max(p.compute_time_microbatch)
    overlap = i["overlap"]
    t_link = max(p.link_time_fwd, p.link_time_bwd) if overlap else p.link_time_fwd + p.link_time_bwd
    moves = f"A micro-batch needs {fmt_time(t_link)} on a {fmt_rate(i['stage_bw'])} stage link against {fmt_time(t_c)} of compute"
    if t_link > t_c:
        if p.stage_bw_for_compute_bound:
            return (f"{moves}: about {fmt_rate(p.stage_bw_for_compute_bound)} per stage link (or a larger subspace "
                    f"ratio) would let compute hide it.")
        return f"{moves}: link latency alone exceeds it; use larger micro-batches."
    if not overlap:
        return (f"{moves}; the blocking schedule waits out every transfer, where the overlapped one would hide "
                "them under compute.")
    tied = (" (and the tied embedding's gradient all-reduce, every step)"
            if p.model.tied and i["stages"] > 1 and i["tied_embeddings"] == "every_step" else "")
    return (f"{moves}, so in steady state the links keep up; the stall is the transfers on the critical path while "
            f"the pipeline fills and drains{tied}: more micro-batches per step shrink its share, a faster link or a "
            f"larger subspace ratio shortens each transfer.")
