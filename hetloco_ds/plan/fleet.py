"""The fleet planner: given heterogeneous device groups, the stage count, which groups run
uncompressed, and the least subspace ratio that reaches a target utilisation."""
from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from .. import sizes
from .model import ModelShape, Prediction, Settings, check_positive, fmt_rate, parse_rate, predict, resolve_model, stage_tensors


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
            check_positive(f"group {name!r} {key}", vals[key], integer=(key == "devices"))
        for key in ("intra_latency_s", "inter_latency_s"):
            check_positive(f"group {name!r} {key}", vals.get(key, 0.0), allow_zero=True)
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
    for s, (ts, nl) in enumerate(zip(stage_tensors(model, stages), sizes.decoder_layers_per_stage(model.n_layers, stages))):
        params = sum(math.prod(x) for _, x in ts)
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
    settings: Settings | None = None,
    *,
    stages: int | None = None,
    ratios: Sequence[int] = DEFAULT_RATIOS,
    bytes_per_param: int = 16,
    outer_state_bytes_per_param: int = 8,
    activation_checkpointing: bool = False,
    memory_headroom: float = 0.9,
    tolerance: float = 0.005,
    **overrides: Any,
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
    try:
        base = dataclasses.replace(settings or Settings(), **overrides)
    except TypeError as err:
        raise ValueError(f"plan_fleet: {err}") from None
    groups = load_fleet(fleet)
    valid_ratios = _checked_ratios(m, target_utilisation, memory_headroom, ratios)
    mem_kw = dict(micro_batch=base.micro_batch, bytes_per_param=bytes_per_param,
                  outer_state_bytes_per_param=outer_state_bytes_per_param,
                  activation_checkpointing=activation_checkpointing)
    notes: list[str] = []
    need = {g.name: min_stages(m, g.memory_gb * 1e9 * memory_headroom, **mem_kw) for g in groups}
    stages = _fleet_stages(m, groups, need, stages, notes)
    stage_mem = max(stage_memory_bytes(m, stages, **mem_kw))

    hosts = [g for g in groups if g.devices >= stages
             and stage_mem <= g.memory_gb * 1e9 * memory_headroom]
    M = sum(g.devices // stages for g in hosts)
    if M == 0:
        raise ValueError(f"no group can host a replica of {stages} stages")
    ring_bw, ring_lat = _replica_ring(hosts, stages)

    plans: list[GroupPlan] = []
    preds: dict[str, Prediction] = {}
    for g in groups:
        if g not in hosts:
            why = (f"{g.devices} device(s) < S = {stages}" if g.devices < stages else
                   f"a stage needs {stage_mem / 1e9:.1f} GB > {memory_headroom:g} x {g.memory_gb:g} GB")
            plans.append(GroupPlan(g.name, g.devices, need[g.name], need[g.name] == 1, 0, "excluded", None,
                                   None, None, None, None, None, None, f"excluded: {why}"))
            continue
        group = dataclasses.replace(base, stages=stages, replicas=M, stage_bw=g.intra_bandwidth_bps,
                                    stage_latency=g.intra_latency_s, replica_bw=ring_bw or 1.0,
                                    replica_latency=ring_lat, tflops=g.tflops, mfu=g.mfu or base.mfu, k=None)
        plan, preds[g.name] = _group_plan(m, g, group, need[g.name], valid_ratios, target_utilisation, tolerance)
        plans.append(plan)

    sync = max(p.outer_sync_time for p in preds.values())
    slowest = max(p.schedule_time for p in preds.values())
    H = base.H
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
    used = {f: getattr(base, f) for f in ("mfu", "micro_batch", "n_mb", "H", "topk", "chunk", "quant_bits",
                                          "value_bytes", "act_bytes", "overlap")}
    used.update(bytes_per_param=bytes_per_param, outer_state_bytes_per_param=outer_state_bytes_per_param,
                activation_checkpointing=activation_checkpointing, memory_headroom=memory_headroom,
                ratios=list(valid_ratios), stage_memory_gb=stage_mem / 1e9)
    return FleetPlan(m.name, stages, M, target_utilisation, ring_bw, ring_lat, sync, outer_step,
                     tokens / outer_step, plans, used, notes)


def _checked_ratios(m: ModelShape, target_utilisation: float, memory_headroom: float,
                    ratios: Sequence[int]) -> list[int]:
    """The ratios to try (those dividing d, and 1), after plan_fleet's arguments are checked."""
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
    return valid_ratios


def _fleet_stages(m: ModelShape, groups: list, need: dict[str, int | None], stages: int | None,
                  notes: list[str]) -> int:
    """The fleet's one S: `stages` if given (checked), else the most any group that can hold a replica needs."""
    if stages is not None:
        check_positive("stages", stages, integer=True)
        stage_tensors(m, stages)
        return stages
    feasible = [n for g in groups if (n := need[g.name]) is not None and n <= g.devices]
    if not feasible:
        raise ValueError("no group can hold a replica: every group has fewer devices than "
                         f"stages it needs ({need})")
    stages = max(feasible)
    notes.append(f"S = {stages}: the most stages any group that can hold a replica needs "
                 "(one S for all replicas, as the engine's M x S topology requires).")
    return stages


def _replica_ring(hosts: list, stages: int) -> tuple[float | None, float]:
    """Bandwidth and latency of the outer sync's ring: its slowest hop (intra links between a
    group's replicas, inter links between groups); None where no replica link is crossed."""
    hops_bw, hops_lat = [], []
    for g in hosts:
        if g.devices // stages > 1:
            hops_bw.append(g.intra_bandwidth_bps)
            hops_lat.append(g.intra_latency_s)
        if len(hosts) > 1:
            hops_bw.append(g.inter_bandwidth_bps)
            hops_lat.append(g.inter_latency_s)
    return (min(hops_bw) if hops_bw else None), (max(hops_lat) if hops_lat else 0.0)


def _group_plan(m: ModelShape, g, group: Settings, need: int | None, valid_ratios: list[int],
                target_utilisation: float, tolerance: float) -> tuple[GroupPlan, Prediction]:
    """A hosting group's least ratio reaching the target (or the least within `tolerance` of its best)."""
    stages = group.stages
    cand = {r: predict(m, group, ratio=r) for r in valid_ratios}
    util = {r: p.utilisation for r, p in cand.items()}
    ok = [r for r in valid_ratios if util[r] >= target_utilisation]
    if ok:
        r = ok[0]
        reason = (f"ratio {r} is the least that reaches {target_utilisation:.0%} on "
                  f"{fmt_rate(g.intra_bandwidth_bps)} stage links")
    else:
        best = max(util.values())
        r = next(x for x in valid_ratios if util[x] >= best - tolerance)
        reason = (f"target {target_utilisation:.0%} unreachable: best {best:.1%} at ratio {r}, "
                  f"limited by {cand[r].dominant_overhead}")
    if stages == 1:
        reason = "one device holds a replica: no stage links"
    p = cand[r]
    return GroupPlan(
        g.name, g.devices, need, need == 1, g.devices // stages,
        "uncompressed" if r == 1 else "compressed", r, p.k, p.utilisation, None,
        bool(ok), p.schedule_time, p.dominant_overhead, reason,
        {x: round(u, 6) for x, u in util.items()}), p
