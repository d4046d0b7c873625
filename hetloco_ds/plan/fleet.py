"""The fleet planner: given heterogeneous device groups, each group's pipeline depth (its own, or
one for all), which groups run uncompressed, the least subspace ratio that reaches a target
utilisation, who waits for whom at the outer step, and the config that runs it."""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from .. import sizes
from ..config import OUTER_STATE_DEVICE
from .memory import MEMORY_HEADROOM, min_stages, stage_memory_bytes
from .model import Settings, check_positive, fmt_rate, parse_rate, predict
from .shapes import ModelShape, resolve_model, stage_tensors
from .outer_step import OuterStep, exchange_times, predict_outer_step


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


@dataclass
class GroupPlan:
    name: str
    devices: int
    stages_needed: int | None
    """Smallest S for this group's device memory (None: a stage does not fit at all)."""
    fits_on_one_device: bool
    """A full replica fits in one device (S = 1 would do)."""
    replicas: int
    """Replicas this group hosts at its S (devices // S)."""
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
    stages: int | None = None
    """Pipeline depth of each of its replicas (None: excluded)."""
    first_replica: int | None = None
    """Its replicas are first_replica .. first_replica + replicas - 1; their ranks follow each other
    in that order (replica 0's ranks first)."""
    first_rank: int | None = None
    """Mixed S (hetloco.replica_stages): its ranks are first_rank .. first_rank + replicas * stages - 1.
    None with one S: DeepSpeed's layout, rank = stage x M + replica."""
    wait_time: float | None = None
    """Per outer step, idle until the slowest replica has run its H inner steps."""
    stage_memory_gb: float | None = None
    """Memory its busiest stage needs at its S."""


@dataclass
class FleetPlan:
    model: str
    stages: int | None
    """The one S of every replica; None when groups have different S (see replica_stages)."""
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
    replica_stages: list[int] = field(default_factory=list)
    """Each replica's S, replica 0 first (hetloco.replica_stages)."""
    block_parts: list[int] = field(default_factory=list)
    """The outer sync's blocks (`sizes.block_parts`); with one S, the stages."""
    exchange_time: float = 0.0
    """The outer sync's exchange by block (outer_sync_time less the embedding shares)."""
    slowest: str | None = None
    """The group whose replicas every other waits for."""
    config: dict[str, Any] = field(default_factory=dict)
    """The DeepSpeed JSON keys to set for this fleet (nested as in the file)."""

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
    outer_state_device: str = OUTER_STATE_DEVICE,
    memory_headroom: float = MEMORY_HEADROOM,
    tolerance: float = 0.005,
    **overrides: Any,
) -> FleetPlan:
    """Plan a heterogeneous fleet.

    1. Memory: each group's smallest stage count S_g whose per-stage memory
       (`plan.memory.stage_memory_bytes`: `sizes`' rules, the schedule's micro-batches in flight,
       the outer state on the device or, `outer_state_device="cpu"`, on the host) fits
       `memory_headroom` of one device.
    2. Topology: each group's replicas get its own S_g (`hetloco.replica_stages`): a group whose
       devices hold a replica in fewer stages (one large GPU, one 8-GPU host) is not cut as deep as
       the small-memory machines' pipelines. A group with fewer devices than S_g, or whose device
       cannot hold even one layer per stage, is excluded. Each group hosts devices // S_g replicas
       whose stages sit on its devices, joined by its intra links. Where S_g leaves some of a
       group's devices idle, the least deeper S dividing its devices (within memory) is tried too,
       every combination over the groups, and the fleet with the most tokens/s is kept (ties: the
       fewest stages). `stages` given: one S for every replica instead (groups with fewer devices,
       or too little memory, excluded).
    3. Outer sync (`plan.outer_step`): by block of the replicas' common partition, each block
       exchanged among its M holders; the M replicas' ring crosses intra links between replicas of
       one group and inter links between groups, and its slowest hop sets the ring's speed. The
       outer step waits for the slowest replica's H inner steps.
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
    mem_kw = dict(micro_batch=base.micro_batch, n_mb=base.n_mb, seq_len=base.seq_len,
                  schedule="overlapped" if base.overlap else "blocking", bf16=base.act_bytes == 2,
                  outer_state_device=outer_state_device)
    notes: list[str] = []
    need = {g.name: min_stages(m, g.memory_gb * 1e9 * memory_headroom, **mem_kw) for g in groups}
    depth, why = _group_stages(m, groups, need, stages, memory_headroom, mem_kw, notes)
    if not depth:
        raise ValueError(f"no group can host a replica: {'; '.join(f'{n}: {w}' for n, w in why.items())}")
    args = (m, base, groups, need, why, valid_ratios, target_utilisation, tolerance, mem_kw, outer_state_device,
            memory_headroom)
    best = _assemble(depth, list(notes), *args)
    if stages is None:  # a deeper cut that puts a group's idle devices to work, where the fleet then trains faster
        fewest = best
        for alt in _deeper_depths(m, groups, depth, memory_headroom, mem_kw):
            candidate = _assemble(alt, list(notes), *args)
            if candidate.tokens_per_second > best.tokens_per_second * (1 + 1e-9):
                best = candidate
        for gp in best.groups:
            if gp.stages is not None and gp.stages_needed is not None and gp.stages > gp.stages_needed:
                best.notes.append(f"{gp.name}: S = {gp.stages}, deeper than its memory needs ({gp.stages_needed}): "
                                  f"every device holds a stage, {best.tokens_per_second:,.0f} tokens/s fleet-wide "
                                  f"against {fewest.tokens_per_second:,.0f} at the fewest stages")
    return best


def _deeper_depths(m: ModelShape, groups: list[DeviceGroup], depth: dict[str, int], memory_headroom: float,
                   mem_kw: dict[str, Any]) -> list[dict[str, int]]:
    """Every other choice of depths where each hosting group whose devices its least S leaves idle
    (devices % S > 0) may instead take the least deeper S that divides its devices (at most one stage
    a layer, every stage within memory)."""
    options: dict[str, list[int]] = {}
    for g in groups:
        if g.name not in depth:
            continue
        options[g.name] = [depth[g.name]]
        if g.devices % depth[g.name]:
            for d in range(depth[g.name] + 1, min(g.devices, m.n_layers) + 1):
                if g.devices % d == 0:
                    if max(stage_memory_bytes(m, d, **mem_kw)) <= g.memory_gb * 1e9 * memory_headroom:
                        options[g.name].append(d)
                    break
    out: list[dict[str, int]] = [{}]
    for name, choices in options.items():
        out = [{**o, name: d} for o in out for d in choices]
    return [o for o in out if o != depth]


def _assemble(depth: dict[str, int], notes: list[str], m: ModelShape, base: Settings, groups: list[DeviceGroup],
              need: dict[str, int | None], why: dict[str, str], valid_ratios, target_utilisation: float,
              tolerance: float, mem_kw: dict[str, Any], outer_state_device: str, memory_headroom: float) -> FleetPlan:
    """The fleet with each hosting group's replicas `depth[group]` stages deep."""
    hosts = [g for g in groups if g.name in depth]
    order = [g.name for g in hosts for _ in range(g.devices // depth[g.name])]  # each replica's group, replica 0 first
    replica_stages = [depth[name] for name in order]
    M = len(replica_stages)
    ring_bw, ring_lat = _replica_ring(hosts, depth)
    per_replica = {g.name: dataclasses.replace(base, stages=depth[g.name], replicas=M, stage_bw=g.intra_bandwidth_bps,
                                               stage_latency=g.intra_latency_s, replica_bw=ring_bw or 1.0,
                                               replica_latency=ring_lat, tflops=g.tflops, mfu=g.mfu or base.mfu,
                                               k=None) for g in hosts}
    exchange = max(exchange_times(m, [per_replica[name] for name in order])[2])  # the ratios do not change it

    plans: list[GroupPlan] = []
    for g in groups:
        if g not in hosts:
            plans.append(GroupPlan(g.name, g.devices, need[g.name], need[g.name] == 1, 0, "excluded", None,
                                   None, None, None, None, None, None, f"excluded: {why[g.name]}"))
            continue
        plan = _group_plan(m, g, per_replica[g.name], need[g.name], valid_ratios, target_utilisation, tolerance,
                           exchange)
        plan.stage_memory_gb = max(stage_memory_bytes(m, depth[g.name], **mem_kw)) / 1e9
        per_replica[g.name] = dataclasses.replace(per_replica[g.name], ratio=plan.ratio)
        plans.append(plan)
    step = predict_outer_step(m, [per_replica[name] for name in order])
    slowest = _place(plans, step, contiguous=len(set(replica_stages)) > 1)
    if len({round(r.inner_step_time, 9) for r in step.replicas}) > 1:
        notes.append("Replicas run at different speeds; SparseLoCo's outer sync waits for the "
                     "slowest, which fleet_utilisation counts.")
    used = {f: getattr(base, f) for f in ("mfu", "micro_batch", "n_mb", "H", "topk", "chunk", "quant_bits",
                                          "value_bytes", "act_bytes", "overlap")}
    used.update(outer_state_device=outer_state_device, memory_headroom=memory_headroom,
                ratios=list(valid_ratios), stage_memory_gb=max(p.stage_memory_gb for p in plans if p.stages))
    one_s = replica_stages[0] if len(set(replica_stages)) == 1 else None
    return FleetPlan(m.name, one_s, M, target_utilisation, ring_bw, ring_lat, step.outer_sync_time,
                     step.outer_step_time, step.tokens_per_second, plans, used, notes, replica_stages,
                     step.block_parts, step.exchange_time, slowest,
                     fleet_config(m, base, plans, replica_stages, one_s, outer_state_device))


def _place(plans: list[GroupPlan], step: OuterStep, contiguous: bool) -> str:
    """Each hosting group's replica numbers (and rank numbers where each replica's ranks follow each
    other: `contiguous`), its wait and fleet utilisation (from its first replica: a group's
    replicas are alike); returns the slowest group's name."""
    replica = rank = 0
    slowest = ""
    for gp in plans:
        if gp.stages is None:
            continue
        gp.first_replica, gp.first_rank = replica, rank if contiguous else None
        r = step.replicas[replica]
        gp.wait_time, gp.fleet_utilisation = r.wait_time, r.utilisation
        if step.slowest in range(replica, replica + gp.replicas):
            slowest = gp.name
        replica += gp.replicas
        rank += gp.replicas * gp.stages
    return slowest


def fleet_config(m: ModelShape, base: Settings, plans: list[GroupPlan], replica_stages: list[int],
                 stages: int | None, outer_state_device: str = OUTER_STATE_DEVICE) -> dict[str, Any]:
    """The DeepSpeed JSON keys that run the planned fleet as the plan modelled it: the topology
    (pipeline.stages when every replica has the one S `stages`, else hetloco.replica_stages), the compressed replicas and
    their ratios (the most common one as `ratio`, the others in `replica_ratios`), H, the batch,
    the sequence length, bf16 when stage links carry 2-byte activations, the schedule, the outer
    state on the host where the plan put it there."""
    ratio_of = {}
    for gp in plans:
        if gp.stages is not None and gp.ratio and gp.ratio > 1:
            ratio_of.update({r: gp.ratio for r in range(gp.first_replica, gp.first_replica + gp.replicas)})
    hetloco: dict[str, Any] = {}
    if stages is None:
        hetloco["replica_stages"] = replica_stages
    if ratio_of:
        common = max(sorted(set(ratio_of.values())), key=list(ratio_of.values()).count)
        sub: dict[str, Any] = {"ratio": common, "compressed_replicas": sorted(ratio_of)}
        odd = {r: x for r, x in ratio_of.items() if x != common}
        if odd:
            sub["replica_ratios"] = {str(r): x for r, x in sorted(odd.items())}
        hetloco["subspace"] = sub
    hetloco["sparseloco"] = {"inner_steps": base.H, "topk": base.topk, "chunk_size": base.chunk}
    if base.quant_bits is not None:
        hetloco["sparseloco"]["quant_bits"] = base.quant_bits
    if outer_state_device != OUTER_STATE_DEVICE:
        hetloco["sparseloco"]["outer_state_device"] = outer_state_device
    hetloco["train"] = {"seq_len": base.seq_len or m.seq_len}
    if not base.overlap:
        hetloco["pipeline"] = {"schedule": "blocking"}
    cfg: dict[str, Any] = {"train_micro_batch_size_per_gpu": base.micro_batch, "gradient_accumulation_steps": base.n_mb,
                           "bf16": {"enabled": base.act_bytes == 2}}
    if stages is not None:
        cfg["pipeline"] = {"stages": stages}
    cfg["hetloco"] = hetloco
    return cfg


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


def _group_stages(m: ModelShape, groups: list[DeviceGroup], need: dict[str, int | None], stages: int | None,
                  memory_headroom: float, mem_kw: dict[str, Any], notes: list[str]) -> tuple[dict[str, int], dict[str, str]]:
    """Each hosting group's S, and why each other group is excluded: its own least S (or `stages`
    for every group, checked)."""
    depth: dict[str, int] = {}
    why: dict[str, str] = {}
    if stages is not None:
        check_positive("stages", stages, integer=True)
        stage_tensors(m, stages)
        stage_mem = max(stage_memory_bytes(m, stages, **mem_kw))
        for g in groups:
            if g.devices < stages:
                why[g.name] = f"{g.devices} device(s) < S = {stages}"
            elif stage_mem > g.memory_gb * 1e9 * memory_headroom:
                why[g.name] = f"a stage needs {stage_mem / 1e9:.1f} GB > {memory_headroom:g} x {g.memory_gb:g} GB"
            else:
                depth[g.name] = stages
        return depth, why
    for g in groups:
        n = need[g.name]
        if n is None:
            least = max(stage_memory_bytes(m, m.n_layers, **mem_kw))
            why[g.name] = (f"even one layer per stage needs {least / 1e9:.1f} GB > {memory_headroom:g} x "
                           f"{g.memory_gb:g} GB")
        elif n > g.devices:
            why[g.name] = f"{g.devices} device(s) < the {n} stages a replica needs in {g.memory_gb:g} GB devices"
        else:
            depth[g.name] = n
    if len(set(depth.values())) > 1:
        notes.append("Each group's replicas have the fewest stages its devices' memory allows, or the least deeper "
                     "S that leaves none of its devices idle where the fleet then trains faster (hetloco.replica_stages, "
                     "replica 0's ranks first); --stages S puts every replica in S stages.")
    return depth, why


def _replica_ring(hosts: list[DeviceGroup], depth: dict[str, int]) -> tuple[float | None, float]:
    """Bandwidth and latency of the outer sync's ring: its slowest hop (intra links between a
    group's replicas, inter links between groups); None where no replica link is crossed."""
    hops_bw, hops_lat = [], []
    for g in hosts:
        if g.devices // depth[g.name] > 1:
            hops_bw.append(g.intra_bandwidth_bps)
            hops_lat.append(g.intra_latency_s)
        if len(hosts) > 1:
            hops_bw.append(g.inter_bandwidth_bps)
            hops_lat.append(g.inter_latency_s)
    return (min(hops_bw) if hops_bw else None), (max(hops_lat) if hops_lat else 0.0)


def _group_plan(m: ModelShape, g: DeviceGroup, group: Settings, need: int | None, valid_ratios: list[int],
                target_utilisation: float, tolerance: float, exchange: float) -> GroupPlan:
    """A hosting group's least ratio reaching the target (or the least within `tolerance` of its
    best), its replicas' outer sync being the fleet's `exchange` plus their embedding shares."""
    stages = group.stages
    cand = {r: predict(m, group, ratio=r, outer_exchange=exchange) for r in valid_ratios}
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
        {x: round(u, 6) for x, u in util.items()}, stages=stages)
