"""The rows of `hetloco-ds simulate`: a `Variant` per row, each trained and validated by
`simulate_variant` on either simulator, and the table of their degradation against the
uncompressed row.

Per-step losses go to metrics.jsonl with the bytes each link would carry (computed from the
shapes that would cross it, not measured), and the outer steps' diagnostics as
`"kind": "outer"` rows.
"""
from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import math
import os
import time
from dataclasses import asdict, dataclass, field

import torch

from .. import safe_load
from ..config import ConfigError, HetlocoConfig, RunConfig, SparseLoCoConfig
from ..batches import ReplicaBatches, validation_batches
from ..sparseloco.attacks import ATTACKS, Attack
from .batched import BatchedSimulation
from .replica import Simulation
from .sharded import Shards


@dataclass
class Variant:
    """One row of a sweep."""

    name: str
    mode: str = "sparseloco"  # or "adamw" (H = 1, dense gradient averaging every step)
    ratio: int = 1
    compressed: int = 0  # how many replicas compress (the last ones)
    embedding_adaptation: bool = True
    project_residual_weights: bool = False
    project_embedding_every_step: bool = False
    embedding_weight_decay: str = "table"
    seed: int = 0
    lr: float | None = None
    """Inner AdamW lr of this row (None: the run's)."""
    sparseloco: dict = field(default_factory=dict)
    """`hetloco.sparseloco` fields this row sets (e.g. aggregation, outer_lr), validated by the config."""
    attack: str | None = None
    """One replica's payloads corrupted at every outer step (`sparseloco.attacks.ATTACKS`), or None."""
    attacker: int = -1
    """The attacking replica (negative: from the end, -1 the last)."""
    optimizer_state: str | None = None
    """`hetloco.train.optimizer_state` of this row, how the inner AdamW holds its moments (None: the run's)."""

    def attack_of(self, replicas: int) -> Attack | None:
        """The row's attack on a row of `replicas`, or None."""
        if self.attack is None:
            return None
        if not -replicas <= self.attacker < replicas:
            raise ConfigError(f"row {self.name}: attacker {self.attacker} is not one of the {replicas} replicas")
        return Attack(self.attack, self.attacker % replicas, self.seed)

    def hetloco(self, base: HetlocoConfig, replicas: int) -> HetlocoConfig:
        cfg = base.model_copy(deep=True)
        cfg.sparseloco.enabled = self.mode == "sparseloco"
        ids = list(range(replicas - self.compressed, replicas))
        cfg.subspace.compressed_replicas = ids if (self.ratio > 1 and ids) else "none"
        cfg.subspace.ratio = self.ratio
        cfg.subspace.embedding_adaptation = self.embedding_adaptation
        cfg.subspace.project_residual_weights = self.project_residual_weights
        cfg.subspace.project_embedding_every_step = self.project_embedding_every_step
        cfg.subspace.embedding_weight_decay = self.embedding_weight_decay
        cfg.train.seed = self.seed
        try:
            if self.optimizer_state is not None:
                cfg.train.optimizer_state = self.optimizer_state
        except ValueError as err:  # pydantic's ValidationError is a ValueError
            raise ConfigError(f"row {self.name}: optimizer_state = {self.optimizer_state!r}: "
                              f"{str(err).splitlines()[-1].strip()}") from None
        if self.sparseloco:
            # Validated as a whole, so a `preset` expands; what the base config set explicitly
            # stays unless the row overrides it (a field written next to a preset wins).
            merged = {**cfg.sparseloco.model_dump(exclude_unset=True), **self.sparseloco}
            try:
                # Lax, unlike a config file's section: --variants values are command-line strings.
                cfg.sparseloco = SparseLoCoConfig.model_validate(merged, strict=False)
            except ValueError as err:  # pydantic's ValidationError is a ValueError
                raise ConfigError(f"row {self.name}: sparseloco {self.sparseloco}: "
                                  f"{str(err).splitlines()[-1].strip()}") from None
        return cfg

    def run(self, run: RunConfig) -> RunConfig:
        """The run's settings with this row's inner lr."""
        if self.lr is None:
            return run
        return dataclasses.replace(run, optimizer=dataclasses.replace(run.optimizer, lr=self.lr))

    @property
    def base_key(self) -> tuple:
        """What a row shares with the uncompressed row it is measured against: mode, seed, inner lr,
        outer-step settings, optimizer state (so 'het:8' is against 'sparseloco', 'adamw-het:8' against 'adamw')."""
        return (self.mode, self.seed, self.lr, tuple(sorted(self.sparseloco.items())), self.attack, self.attacker,
                self.optimizer_state)


def replica_losses(losses: torch.Tensor) -> list[list[float]]:
    """[steps, M, gas] micro-batch losses -> per step, each replica's mean (one host sync)."""
    return [[sum(mb) / len(mb) for mb in step] for step in losses.tolist()]


def step_batches(feeds, gas: int, device) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """The next `gas` micro-batches of every feed, moved to `device` in one pinned,
    non-blocking copy; ids serve as labels (the loss shifts them and never writes them)."""
    ids = torch.stack([torch.stack([next(f)[0] for _ in range(gas)]) for f in feeds])
    if device.type == "cuda":
        ids = ids.pin_memory().to(device, non_blocking=True)
    return [[(ids[m, g], ids[m, g]) for g in range(gas)] for m in range(len(feeds))]


class _RowLog:
    """A row's losses as they come off the device, its progress bar and its metrics.jsonl lines.

    Losses stay on the device until an outer step (which syncs anyway), every 50 steps or the
    end: the host never waits on the device between those, so it keeps queueing work."""

    def __init__(self, variant: Variant, sim, hetloco: HetlocoConfig, steps: int, metrics_path: str | None,
                 progress: bool, history: list, outer_rows: list, done: int):
        from tqdm import tqdm

        self.variant, self.M, self.S, self.steps = variant.name, sim.M, sim.S, steps
        self.shards = getattr(sim, "shards", None) or Shards(sim.M)
        self.enabled = hetloco.sparseloco.enabled
        self.H = hetloco.sparseloco.inner_steps if self.enabled else 1
        self.link = sim.link_bytes_per_step(hetloco.train.seq_len)
        self.tokens_per_step = sim.micro * sim.gas * hetloco.train.seq_len
        self.history, self.outer_rows = history, outer_rows
        self.pending: list[torch.Tensor] = []
        self.out = open(metrics_path, "a") if metrics_path else None
        self.bar = tqdm(total=steps, initial=done, desc=variant.name, disable=not progress, dynamic_ncols=True)

    def syncs(self, step: int) -> bool:
        return self.enabled and (step % self.H == 0 or step == self.steps)

    def flush(self) -> None:
        first = len(self.history) + 1
        # [steps, replicas held here, gas] -> every replica's (a sharded row's blocks, in replica order)
        self.history.extend(replica_losses(self.shards.gather(torch.stack(self.pending), dim=1)))
        self.pending.clear()
        self.bar.update(len(self.history) - first + 1)
        self.bar.set_postfix_str(f"loss {sum(self.history[-1]) / len(self.history[-1]):.3f}", refresh=False)
        if not self.out:
            return
        for step in range(first, len(self.history) + 1):
            for m, loss in enumerate(self.history[step - 1]):
                stage_bytes = self.link["stage_links_per_step"][m]
                sync = self.link["outer_payload_per_replica"] * self.S if self.syncs(step) else 0
                self.out.write(json.dumps({
                    "kind": "step", "variant": self.variant, "step": step, "replica": m, "loss": loss,
                    "tokens": self.tokens_per_step, "seconds": None,
                    "bytes": {"activation": {"sent": stage_bytes // 2, "recv": stage_bytes // 2},
                              "activation_grad": {"sent": stage_bytes // 2, "recv": stage_bytes // 2},
                              "outer_sync": {"sent": sync, "recv": sync * (self.M - 1)}},
                }) + "\n")
        for row in self.outer_rows:
            if first <= row["step"] <= len(self.history):  # this flush's syncs, after their steps' rows
                self.out.write(json.dumps({"kind": "outer", "variant": self.variant, **row}) + "\n")

    def close(self, validation: dict | None = None) -> None:
        """The bar, and the file after the row's validation line, if any."""
        self.bar.close()
        if self.out:
            if validation is not None:
                self.out.write(json.dumps({"kind": "validation", "variant": self.variant, **validation}) + "\n")
            self.out.close()


class _PhaseClock:
    """Wall seconds a row spends outside its training steps: outer steps, loss flushes and
    validations. The device is synchronised at each such phase's edges, where the phase
    itself would wait for it anyway (every outer step and flush reads values back), so the steps'
    queued kernels count as training, not as the phase that waited for them; "train" is the rest."""

    PHASES = ("outer", "flush", "validation")

    def __init__(self, device, spent: dict | None = None):
        self.cuda = torch.device(device).type == "cuda"
        self.device = device
        self.seconds = {k: 0.0 for k in self.PHASES} | dict(spent or {})

    def _sync(self) -> float:
        if self.cuda:
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    @contextlib.contextmanager
    def phase(self, name: str):
        t = self._sync()
        yield
        self.seconds[name] += self._sync() - t

    def breakdown(self, seconds: float) -> dict:
        """The phases and "train" (the row's `seconds` less the phases), rounded to ms."""
        train = seconds - sum(self.seconds.values())
        return {"train": round(train, 3)} | {k: round(v, 3) for k, v in self.seconds.items()}


def _resume(sim, state_path: str | None, variant: Variant, steps: int,
            device) -> tuple[list, list, list, int, float, dict]:
    """(history, outer rows, validation curve, steps done, seconds spent, seconds by phase) of the
    row's saved state at `state_path` (a sharded row: each block's own file), loaded into `sim`; an
    empty start where there is none."""
    saved = sim.shards.every(bool(state_path and os.path.exists(state_path))) if state_path else [False]
    if any(saved) and not all(saved):
        raise ConfigError(f"{variant.name}: the saved state of blocks {[g for g, s in enumerate(saved) if s]} "
                          f"of {len(saved)} exists, of the others not ({state_path}): resume on the same "
                          "--gpus-per-row, or remove the row's saved state")
    if not saved[0]:
        return [], [], [], 0, 0.0, {}
    try:
        state = safe_load.load(state_path, device, mmap=False, what="saved row state")
    except safe_load.UnreadableFile as err:
        raise ConfigError(str(err)) from None
    if Variant(**state["variant"]) != variant or state["steps"] != steps:  # fields added since default
        raise ConfigError(f"{state_path} holds row {state['variant']['name']} of {state['steps']} steps, "
                          f"not {variant.name} of {steps}")
    sim.load_state_dict(state["sim"])
    return (state["history"], state["outer"], state.get("val_curve", []), state["step"], state["seconds"],
            state.get("phase_seconds", {}))


def _build(run, hetloco, variant: Variant, llama_config, replicas: int, stages: int, device, batched: bool,
           compile: bool, state_path: str | None, shards: int):
    """The row's simulator (a sharded row's block of it) and where this process keeps its state."""
    if (state_path or shards > 1) and not batched:
        raise ConfigError("resuming a row (state_path) or sharding it needs the batched simulator")
    if not batched:
        return Simulation(run, hetloco, llama_config, replicas, stages, device), state_path
    sh = Shards.of_world(replicas, shards)
    other = state_path and (state_path if sh.count > 1 else state_path + ".g0")
    if other and os.path.exists(other):
        raise ConfigError(f"{other}: row {variant.name} was saved by a run of another number of processes a row; "
                          "resume it with that number, or remove its saved state")
    sim = BatchedSimulation(run, hetloco, llama_config, replicas, stages, device, compile=compile, shards=sh)
    return sim, sh.state_path(state_path)


def _row_result(sim, variant: Variant, log: _RowLog, val_losses: list[float], val_curve: list[dict], steps: int,
                seconds: float, phases: dict, batched: bool, compile: bool) -> dict:
    """A finished row: its losses, validation, bytes per token and per outer step, and timing."""
    history, H = log.history, log.H
    tail = max(1, min(H, steps) if log.enabled else min(10, steps))
    return {
        "status": "done",
        "variant": asdict(variant),
        "replicas": sim.M, "stages": sim.S, "steps": steps, "inner_steps": H,
        "train_losses": [sum(l) / len(l) for l in history],
        "replica_losses": history,
        "final_train_loss": sum(sum(l) / len(l) for l in history[-tail:]) / tail,
        "val_loss": sum(val_losses) / len(val_losses),
        "val_losses": val_losses,
        "val_curve": val_curve,
        "stage_link_bytes_per_token": sum(log.link["stage_links_per_step"]) / sim.M / log.tokens_per_step,
        "outer_sync_bytes_per_replica_per_outer_step": log.link["outer_payload_per_replica"],
        "seconds": seconds,
        "seconds_by_phase": phases,
        "simulator": "batched" if batched else "per_replica",
        "compile": compile,
        "tokens_per_replica_step": log.tokens_per_step,
        "n_params": sum(p.numel() for p in sim.replicas[0].params),
        "outer_steps": len(log.outer_rows),
        "outer": log.outer_rows,
    }


class _Pace:
    """Whether a row, at an outer-step boundary, can no longer end (or, saving, reach the next
    boundary) before its deadline; `simulate_variant`'s docstring says why each projection."""

    def __init__(self, t0: float, done: int, steps: int, interval: int):
        self.t0, self.done, self.steps, self.interval = t0, done, steps, interval
        self.last, self.fastest = None, float("inf")  # (step, time) of the last boundary; fastest pace since

    def past(self, step: int, deadline: float, saving: bool) -> bool:
        now = time.perf_counter()
        if saving:
            stop = time.time() + (now - self.t0) / (step - self.done) * self.interval > deadline
        elif self.last is None:
            stop = time.time() > deadline
        else:
            self.fastest = min(self.fastest, (now - self.last[1]) / (step - self.last[0]))
            stop = time.time() + self.fastest * (self.steps - step) > deadline
        self.last = (step, now)
        return stop


def _save(state_path: str, sim, state: dict) -> None:
    """The row's state (and its simulator's) at `state_path`, whole or not at all; "saved" once
    every block of a sharded row has saved."""
    tmp = state_path + ".tmp"
    torch.save(state | {"sim": sim.state_dict()}, tmp)
    os.replace(tmp, state_path)
    sim.shards.every(True)


def _divergence(history: list[list[float]], diverged: int | None, val_losses: list[float]) -> dict:
    """What a row's result says of divergence: "diverged_at_step", the first step every replica's
    loss was non-finite (or the outer step that excluded them all; None for a row that ran its
    schedule), and "ended_at_step", where the row stopped. A diverged row's validation measures whatever
    survived (a SparseLoCo row keeps its last finite sync), not a row that ran its schedule: it is
    kept aside and the row's loss is non-finite."""
    if not diverged:
        return {"diverged_at_step": None}
    first = next((s for s, losses in enumerate(history, 1) if not any(map(math.isfinite, losses))), diverged)
    nan = float("nan")
    return {"diverged_at_step": first, "ended_at_step": diverged, "val_losses_at_divergence": val_losses,
            "val_loss": nan, "val_losses": [nan] * len(val_losses)}


def simulate_variant(run: RunConfig, variant: Variant, llama_config, corpus, replicas: int, stages: int, steps: int,
                     device, metrics_path: str | None = None, progress: bool = True, batched: bool = True,
                     compile: bool = False, deadline: float | None = None, state_path: str | None = None,
                     shards: int = 1, val_every: int = 0) -> dict:
    """Train one row and validate every replica; the result's "status" is "done".

    `batched` runs the replicas as one batched computation (`batched.BatchedSimulation`), else one
    `SimReplica` each (the reference); `compile` torch.compiles the batched forward.
    `deadline` (a time.time() value): at each outer-step boundary (every 50 steps without outer
    steps) the row stops when, at this call's pace, it could not reach the next boundary before
    the deadline. With `state_path` it then saves its state there ("status": "saved") and a later
    call with the same path continues from it, ending exactly as an uninterrupted run; without,
    it stops as soon as it cannot end before the deadline ("status": "abandoned"): at the first
    boundary only if the deadline has passed, later when even its fastest interval's pace since
    that boundary projects past it. An abandoned row's steps are lost, so the projection is the
    optimistic one: the first interval holds the compile, and a later one may hold a validation
    (the first compiles its own graph) that a mean pace would carry to every step left.

    `shards` G > 1: this process is one of the G processes of the torch.distributed world that
    run the row together (sim/sharded.py), holding replicas [g M/G, (g+1) M/G); every process
    returns the whole row's result, rank 0 alone writes `metrics_path` and shows progress, and
    each saves its block's state at `state_path`.g<g>.

    `val_every` > 0: every replica also validates every `val_every` steps (a multiple of H, so a
    SparseLoCo row's replicas hold the synced model), the row's "val_curve" of {"step", "loss"}
    (the replicas' mean), ending at the final validation: a run that repeats its corpus shows where
    held-out loss turned, and the point at one epoch is the loss before any token came back.

    A row whose every replica's loss (or, at an outer step, pseudo-gradient) turns non-finite ends
    at the next flush or outer step, its "val_loss" NaN so a sweep ranks that lr worst (`_divergence`)."""
    hetloco = variant.hetloco(run.hetloco, replicas)
    run = variant.run(run)
    torch.manual_seed(hetloco.train.seed)
    sim, state_path = _build(run, hetloco, variant, llama_config, replicas, stages, device, batched, compile,
                             state_path, shards)
    sim.attack = variant.attack_of(replicas)
    if batched and not sim.shards.rank0:
        metrics_path, progress = None, False
    history, outer_rows, val_curve, done, spent, phase_spent = _resume(sim, state_path, variant, steps, device)
    clock = _PhaseClock(device, phase_spent)
    feeds = [ReplicaBatches(corpus.train, m, replicas, sim.micro, seed=hetloco.train.seed, position=done * sim.gas)
             for m in (sim.shards.ids if batched else range(replicas))]
    val_it = validation_batches(corpus.val, sim.micro)
    val_batches = [tuple(t.to(device) for t in next(val_it)) for _ in range(hetloco.train.eval_batches)]
    t0 = time.perf_counter()
    log = _RowLog(variant, sim, hetloco, steps, metrics_path, progress, history, outer_rows, done)
    if val_every < 0 or (val_every and val_every % log.H):
        raise ConfigError(f"{variant.name}: val_every {val_every} must be a multiple of the {log.H} steps between "
                          "outer steps (0: validate at the end only)")
    interval = log.H if log.enabled else 50  # steps between boundaries (nothing pending)
    pace = _Pace(t0, done, steps, interval)
    diverged = None  # the step after which every replica's loss (or pseudo-gradient) was non-finite
    for step in range(done + 1, steps + 1):
        log.pending.append(sim.train_step(step_batches(feeds, sim.gas, device)))
        if log.syncs(step):
            with clock.phase("outer"):
                outer_rows.append({"step": step, **sim.outer_step()})
            if len(outer_rows[-1].get("excluded", [])) == replicas:
                diverged = step
        if diverged or log.syncs(step) or step == steps or len(log.pending) >= 50:
            with clock.phase("flush"):
                log.flush()
            if not any(math.isfinite(x) for x in log.history[-1]):
                diverged = step
        if diverged:
            # Every step left would repeat non-finite numbers: the row ends here as what it is, a
            # diverged lr, and a sweep reads it as the worst one rather than losing it.
            break
        if val_every and step % val_every == 0 and step < steps:
            with clock.phase("validation"):
                losses = sim.validation_losses(val_batches)
            val_curve.append({"step": step, "loss": sum(losses) / len(losses)})
        if deadline is None or step == steps or step % interval:
            continue
        stop = pace.past(step, deadline, saving=bool(state_path))
        if batched:
            stop = sim.shards.first(stop)  # every block stops at the same boundary
        if stop:
            log.close()
            seconds = spent + time.perf_counter() - t0
            if state_path:
                _save(state_path, sim, {"variant": asdict(variant), "steps": steps, "step": step, "history": history,
                                        "outer": outer_rows, "val_curve": val_curve, "seconds": seconds,
                                        "phase_seconds": clock.seconds})
            return {"status": "saved" if state_path else "abandoned", "variant": asdict(variant), "step": step,
                    "steps": steps, "seconds": seconds, "seconds_by_phase": clock.breakdown(seconds)}
    log.bar.close()
    with clock.phase("validation"):
        val_losses = sim.validation_losses(val_batches)
    final = {"step": diverged or steps, "loss": sum(val_losses) / len(val_losses)}
    log.close({**final, "replica_losses": val_losses, "diverged": bool(diverged)})
    if val_every and not diverged:
        val_curve.append(final)
    if state_path and os.path.exists(state_path):
        os.remove(state_path)
    seconds = spent + time.perf_counter() - t0
    result = _row_result(sim, variant, log, val_losses, val_curve, steps, seconds, clock.breakdown(seconds), batched,
                         compile)
    return result | _divergence(log.history, diverged, val_losses)


ROW_HEADS = ("sparseloco", "pp", "het", "adamw", "adamw-pp", "adamw-het", "diloco")
ROW_FLAGS = ("noadapt", "wproj", "stepproj", "tsdecay")


def parse_variants(spec: list[str], replicas: int, seeds: list[int]) -> list[Variant]:
    """Rows HEAD[:RATIO][:FLAG...] x seeds. HEAD: sparseloco, pp (every replica compresses at
    RATIO), het (the last half do), adamw, adamw-pp, adamw-het (plain data parallelism), diloco
    (SparseLoCo's loop with `aggregation: dense`, the dense-averaging control). FLAG: noadapt
    (Table 5a), wproj (Table 5b), stepproj (T_S projected after every inner step too), tsdecay
    (weight decay on T_S alone), lr=X (this row's inner lr), optimizer_state=X (fp32, bf16, 8bit,
    cpu_offload: `hetloco.train.optimizer_state`), attack=KIND (one replica's payloads
    corrupted at every outer step, `sparseloco.attacks`) with attacker=M (default -1, the last), or
    KEY=VALUE for any `hetloco.sparseloco` field (e.g. aggregation=selected_count, outer_lr=2)."""
    variants = []
    for item, seed in itertools.product(spec, seeds):
        parts = item.split(":")
        head, rest = parts[0], parts[1:]
        ratio = int(rest.pop(0)) if rest and rest[0].isdigit() else 1
        if head not in ROW_HEADS:
            raise ConfigError(f"--variants: unknown row {item!r} (rows start with one of {', '.join(ROW_HEADS)})")
        kind = head.split("-")[-1]
        compressed = {"pp": replicas, "het": replicas // 2}.get(kind, 0)
        if compressed and ratio < 2:
            raise ConfigError(f"--variants: row {item!r} needs a ratio >= 2 (e.g. {head}:8)")
        settings = dict(f.split("=", 1) for f in rest if "=" in f)
        unknown = [f for f in rest if "=" not in f and f not in ROW_FLAGS]
        if unknown:
            raise ConfigError(f"--variants: row {item!r}: unknown flag(s) {unknown}")
        if head == "diloco":
            settings.setdefault("aggregation", "dense")
        try:
            lr = float(settings.pop("lr")) if "lr" in settings else None
            attacker = int(settings.pop("attacker", -1))
        except ValueError:
            raise ConfigError(f"--variants: row {item!r}: lr must be a number, attacker an integer") from None
        attack = settings.pop("attack", None)
        optimizer_state = settings.pop("optimizer_state", None)
        if attack is not None and attack not in ATTACKS:
            raise ConfigError(f"--variants: row {item!r}: attack must be one of {ATTACKS}, got {attack!r}")
        variants.append(Variant(name=f"{item}@seed{seed}", mode="adamw" if head.startswith("adamw") else "sparseloco",
                                ratio=ratio if compressed else 1, compressed=compressed,
                                embedding_adaptation="noadapt" not in rest, project_residual_weights="wproj" in rest,
                                project_embedding_every_step="stepproj" in rest,
                                embedding_weight_decay="t_s" if "tsdecay" in rest else "table",
                                seed=seed, lr=lr, sparseloco=settings, attack=attack, attacker=attacker,
                                optimizer_state=optimizer_state))
    return variants


def degradation_table(results: list[dict]) -> list[dict]:
    """Relative degradation of each row's validation loss (the mean over replicas) vs the
    uncompressed row it shares `Variant.base_key` with."""
    def key(r):
        return Variant(**r["variant"]).base_key

    base = {key(r): r["val_loss"] for r in results if r["variant"]["compressed"] == 0}
    rows = []
    for r in results:
        b = base.get(key(r))
        rows.append({**r, "delta_pct": None if b is None else 100.0 * (r["val_loss"] - b) / b})
    return rows


def format_table(rows: list[dict]) -> str:
    lines = [f"{'configuration':<28}{'train':>9}{'val':>9}{'delta%':>9}{'stage B/tok':>13}{'outer B/sync':>14}"]
    for r in rows:
        delta = "" if r["delta_pct"] is None else f"{r['delta_pct']:.2f}"
        lines.append(f"{r['variant']['name']:<28}{r['final_train_loss']:>9.4f}{r['val_loss']:>9.4f}{delta:>9}"
                     f"{r['stage_link_bytes_per_token']:>13.1f}{r['outer_sync_bytes_per_replica_per_outer_step']:>14,}")
    return "\n".join(lines)
