"""`hetloco-ds simulate`: M replicas x S virtual stages in one process on one device.

The paper measures loss this way. The simulator runs the same stage layers, the same
boundary codec (so compressed replicas see exactly the truncation the real pipeline
applies), the same AdamW + clipping + DeepSpeed LR schedule, the same SparseLoCoState per
(replica, stage) and the same embedding resync as HetlocoEngine, only without processes:
per-step losses match a real multi-process run with the same seeds and data (a test checks).
Bytes are not measured here but computed from the shapes that would cross each link.

Two drivers share everything but the forward/backward: `Simulation` (one `SimReplica`, i.e. one
module set and optimizer, per replica: the reference) and `simulate_batched.BatchedSimulation`
(the replicas stacked and run as one batched computation: the default, `--per-replica` picks
the reference). Both take their outer steps through `outer_step_all`, which also writes the
per-sync diagnostics into metrics.jsonl (`"kind": "outer"` rows).
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import itertools
import json
import os
import sys
import time
from dataclasses import asdict, dataclass, field

import torch
from torch import nn

from . import optim, sizes
from .algorithm import StageAlgorithm
from .config import ConfigError, HetlocoConfig, RunConfig, SparseLoCoConfig, load_config
from .model import TokenEmbedding, causal_lm_loss, layer_list
from .patches import seed_layer
from .sparseloco.outer import payload_nbytes
from .pipe.module import BoundaryCodec
from .transport import Gathered, LocalStageLink


def tied_apart(config, hetloco: HetlocoConfig, stages: int) -> bool:
    """Whether a tied model's embedding and head copies train apart between outer steps (as the
    pipeline's first and last stages hold them: StageAlgorithm.tied_apart)."""
    return (bool(config.tie_word_embeddings) and stages > 1 and hetloco.sparseloco.enabled
            and hetloco.sparseloco.tied_embeddings == "outer_step")


def build_layers(config, seed: int, apart: bool = False) -> list[nn.Module]:
    """All layers, each seeded by its index exactly as the pipeline seeds it (so the same model).

    A tied head is the embedding module itself (gradients add up: exact tying), or with `apart`
    a copy of it with parameters of its own, as the pipeline's last stage holds."""
    layers: list[nn.Module] = []
    tied: dict[str, nn.Module] = {}
    for idx, entry in enumerate(layer_list(config)):
        if entry.tied in tied:
            layers.append(copy.deepcopy(tied[entry.tied]) if apart else tied[entry.tied])
            continue
        seed_layer(seed, idx)
        module = entry.build()
        if entry.tied:
            tied[entry.tied] = module
        layers.append(module)
    return layers


@dataclass
class Variant:
    """One row of a sweep."""

    name: str
    mode: str = "sparseloco"  # or "adamw" (H = 1, dense gradient averaging every step)
    ratio: int = 1
    compressed: int = 0  # how many replicas compress (the last ones)
    embedding_adaptation: bool = True
    project_residual_weights: bool = False
    seed: int = 0
    lr: float | None = None
    """Inner AdamW lr of this row (None: the run's)."""
    sparseloco: dict = field(default_factory=dict)
    """`hetloco.sparseloco` fields this row sets (e.g. aggregation, outer_lr), validated by the config."""

    def hetloco(self, base: HetlocoConfig, replicas: int) -> HetlocoConfig:
        cfg = base.model_copy(deep=True)
        cfg.sparseloco.enabled = self.mode == "sparseloco"
        ids = list(range(replicas - self.compressed, replicas))
        cfg.subspace.compressed_replicas = ids if (self.ratio > 1 and ids) else "none"
        cfg.subspace.ratio = self.ratio
        cfg.subspace.embedding_adaptation = self.embedding_adaptation
        cfg.subspace.project_residual_weights = self.project_residual_weights
        cfg.train.seed = self.seed
        if self.sparseloco:
            # Validated as a whole, so a `preset` expands; what the base config set explicitly
            # stays unless the row overrides it (a field written next to a preset wins).
            merged = {**cfg.sparseloco.model_dump(exclude_unset=True), **self.sparseloco}
            try:
                cfg.sparseloco = SparseLoCoConfig.model_validate(merged)
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
        outer-step settings (so 'het:8' is against 'sparseloco', 'adamw-het:8' against 'adamw')."""
        return self.mode, self.seed, self.lr, tuple(sorted(self.sparseloco.items()))


def stage_params(layers, parts) -> list[list[nn.Parameter]]:
    """Each stage's trainable parameters in layer order, a tied module's once (on its first stage)."""
    out, seen = [], set()
    for s in range(len(parts) - 1):
        params = []
        for layer in layers[parts[s]:parts[s + 1]]:
            for p in layer.parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    params.append(p)
        out.append(params)
    return out


def stage_algorithms(layers, parts, hetloco: HetlocoConfig, replica: int, num_replicas: int, device):
    """Per virtual stage of one replica: the StageAlgorithm a pipeline rank of that stage holds
    (set up: T_S / T_perp split, theta snapshot) and its LocalStageLink."""
    config = layers[1].layer.self_attn.config
    params = stage_params(layers, parts)
    tied = bool(config.tie_word_embeddings) and len(parts) > 2
    algorithms = [
        StageAlgorithm(params[s], hetloco, replica=replica, num_replicas=num_replicas,
                       hidden_size=config.hidden_size, vocab_size=config.vocab_size, device=device,
                       embeddings=[m for m in layers[parts[s]:parts[s + 1]] if isinstance(m, TokenEmbedding)],
                       layers=layers[parts[s]:parts[s + 1]], tied=tied)
        for s in range(len(parts) - 1)]
    links = LocalStageLink.for_replica(len(parts) - 1)
    for alg, link in zip(algorithms, links):
        alg.setup(link)
    return params, algorithms, links


class SimReplica:
    """One replica: its own copy of every layer, optimizer and schedule, and per virtual stage
    the same StageAlgorithm and BoundaryCodec a pipeline rank of that stage holds."""

    def __init__(self, layers, run: RunConfig, hetloco: HetlocoConfig, replica: int, num_replicas: int,
                 stages: int, device):
        self.replica = replica
        self.layers = copy.deepcopy(layers)
        config = self.layers[1].layer.self_attn.config
        self.parts = sizes.stage_parts(config.num_hidden_layers, stages)
        self.forward_fns = [e.forward_fn for e in layer_list(config)]
        self.stage_params, self.algorithms, self.links = stage_algorithms(
            self.layers, self.parts, hetloco, replica, num_replicas, device)
        self.params = [p for ps in self.stage_params for p in ps]
        wire = torch.bfloat16 if run.bf16 else torch.float32
        self.codecs = [BoundaryCodec(config.hidden_size, config.vocab_size, alg.basis, wire) for alg in self.algorithms]
        for alg, codec in zip(self.algorithms, self.codecs):
            codec.perp = alg.perp
        self.bf16 = run.bf16
        self.optimizer = optim.build_optimizer(self.params, run.optimizer)
        self.scheduler = optim.build_scheduler(run.scheduler, self.optimizer)

    def stage_layers(self, s: int) -> list[nn.Module]:
        return self.layers[self.parts[s]:self.parts[s + 1]]

    def loss(self, ids, labels):
        x = ids
        stages = len(self.parts) - 1
        # As in the pipeline: the layers under autocast, the loss outside it; stage s encodes
        # with its own codec and stage s + 1 decodes with its own, as two ranks would.
        with torch.autocast(device_type=ids.device.type, dtype=torch.bfloat16, enabled=self.bf16):
            for s in range(stages):
                if s > 0:
                    x = self.codecs[s].decode(x)
                for layer, fn in zip(self.stage_layers(s), self.forward_fns[self.parts[s]:self.parts[s + 1]]):
                    x = layer(x) if fn is None else fn(layer, x)  # a tied head: its forward_fn, as the pipeline calls it
                if s < stages - 1:
                    x = self.codecs[s].encode(x)
        return causal_lm_loss(x, labels)

    def backward(self, micro_batches) -> torch.Tensor:
        """Forward and backward of every micro-batch; their losses as a float32 [gas] tensor on
        the device (no host sync, so the host can queue the next work while the device runs)."""
        losses = []
        for ids, labels in micro_batches:
            loss = self.loss(ids, labels)
            (loss / len(micro_batches)).backward()
            losses.append(loss.detach())
        return torch.stack(losses)

    def clip_and_step(self, max_norm: float) -> None:
        grads = [p.grad for p in self.params if p.grad is not None]
        optim.clip_(grads, optim.grad_sq_norm(grads), max_norm)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.scheduler is not None:
            self.scheduler.step()
        for alg, link in zip(self.algorithms, self.links):
            alg.after_inner_step(link)


class Simulation:
    """M SimReplicas meeting at outer steps, exactly as HetlocoEngine ranks do."""

    def __init__(self, run: RunConfig, hetloco: HetlocoConfig, llama_config, replicas: int, stages: int, device):
        self.run, self.hetloco, self.M, self.S, self.device = run, hetloco, replicas, stages, device
        self.micro, self.gas = run.micro_batch, run.grad_accum
        layers = [m.to(device) for m in build_layers(llama_config, hetloco.train.seed,
                                                     tied_apart(llama_config, hetloco, stages))]
        self.replicas = [SimReplica(layers, run, hetloco, m, replicas, stages, device) for m in range(replicas)]
        self.members = tuple(str(m) for m in range(replicas))
        self.step = 0
        self.outer_steps = 0

    def train_step(self, batches_per_replica) -> torch.Tensor:
        """One optimizer step of every replica; `batches_per_replica[m]` is its micro-batches.
        Returns the micro-batch losses, [M, gas] on the device; `replica_losses` reads them."""
        losses = torch.stack([r.backward(b) for r, b in zip(self.replicas, batches_per_replica)])
        if not self.hetloco.sparseloco.enabled:
            # Plain data parallelism: average the gradients, then every replica steps.
            with torch.no_grad():
                means = [torch.stack([p.grad for p in ps]).mean(0) for ps in zip(*(r.params for r in self.replicas))]
                for r in self.replicas:
                    torch._foreach_copy_([p.grad for p in r.params], means)
        for r in self.replicas:
            r.clip_and_step(self.run.clip)
        self.step += 1
        return losses

    def outer_step(self) -> dict:
        self.outer_steps += 1
        return {"outer_step": self.outer_steps, **outer_step_all(self.replicas, self.members)}

    @torch.no_grad()
    def validation_losses(self, batches) -> list[float]:
        """Every replica's mean loss over the same held-out batches, each through its own
        pipeline (a compressed replica through its compressed boundaries), as the paper averages."""
        return [float(torch.stack([r.loss(ids, labels) for ids, labels in batches]).mean()) for r in self.replicas]

    def link_bytes_per_step(self, seq_len: int) -> dict:
        return link_bytes(self, [r.codecs[0].width for r in self.replicas], seq_len)


def link_bytes(sim, widths: list[int], seq_len: int) -> dict:
    """Bytes per optimizer step and replica on stage links (forward + backward; replica m's
    boundary is `widths[m]` wide) and per outer step on replica links, from the shapes the real
    pipeline sends; `sim` is either simulator."""
    config = sim.replicas[0].layers[1].layer.self_attn.config
    rows = []
    for width in widths:
        fwd, bwd = sizes.boundary_nbytes(sim.micro, seq_len, config.hidden_size, width,
                                         2 if sim.run.bf16 else 4, config.vocab_size)
        rows.append((fwd + bwd) * sim.gas * (sim.S - 1))
    outer = sum(payload_nbytes([tuple(p.shape) for p in ps], sim.hetloco.sparseloco)
                for ps in sim.replicas[0].stage_params)
    return {"stage_links_per_step": rows, "outer_payload_per_replica": outer}


@torch.no_grad()
def outer_step_all(replicas, members: tuple[str, ...]) -> dict:
    """One outer step of every stage of every replica (`replicas[m].algorithms[s]`, `.links[s]`),
    exactly as the engine's ranks take it: per stage every replica prepares, the payloads are
    'all-gathered' (a list), all finish; then every stage of every replica syncs its embeddings
    (StageAlgorithm.sync_embeddings), after every owner of a shared aggregate (the first stage's
    T_S, a tied head's on the last stage) has offered it in its finish.

    Returns the replicas excluded and the per-sync diagnostics, computed from what the outer step
    has anyway (theta at the last sync, the replicas' parameters, the payloads, the error buffers),
    never inside inner steps:
      replicas_per_selected  entries sent / coordinates sent by anyone: 1 = no overlap, M = all agree
      update_cosine          cosine of the applied update theta_prev - theta_new (T_perp's part of
                             the embedding included) with the dense mean of the pseudo-gradients
      update_norm, dense_norm  their norms (1/M aggregation shrinks the first)
      error_norm             the error buffer's norm after this step, mean over replicas
    """
    excluded: set[str] = set()
    selected = distinct = 0
    dev = replicas[0].algorithms[0].device
    dot, applied_sq, dense_sq = (torch.zeros((), dtype=torch.float64, device=dev) for _ in range(3))
    error_sq = torch.zeros(len(replicas), dtype=torch.float64, device=dev)
    stages = range(len(replicas[0].algorithms))
    snapshots = []
    for s in stages:
        algs = [r.algorithms[s] for r in replicas]
        ref = algs[0]
        before = [t.to(dev, copy=True) for t in ref.outer.theta_prev]  # the synced theta, alike on every replica
        dense = [tp - torch.stack([a.params[i].detach().float() for a in algs]).mean(0) for i, tp in enumerate(before)]
        emb = [i for i, p in enumerate(ref.params) if any(p is e.weight for e in ref.embeddings)]
        perp = ref.perp.clone() if emb and ref.perp is not None else None
        snapshots.append((before, dense, emb, perp))
        gathered = Gathered([a.prepare() for a in algs], members)
        for m, (r, a) in enumerate(zip(replicas, algs)):
            result = a.finish(gathered, r.links[s], count_selected=m == 0)
            excluded.update(result.excluded)
            if m == 0:
                selected, distinct = selected + result.selected, distinct + result.distinct
            error_sq[m] += torch.stack(torch._foreach_norm(a.outer.error)).double().pow(2).sum()
    for r in replicas:
        for a, link in zip(r.algorithms, r.links):
            a.sync_embeddings(link)
    for s, (before, dense, emb, perp) in zip(stages, snapshots):
        ref = replicas[0].algorithms[s]
        applied = [b - p.detach().float() for b, p in zip(before, ref.params)]
        if perp is not None:
            for i in emb:
                applied[i] += perp - ref.perp
        for a, d in zip(applied, dense):
            dot += (a.double() * d.double()).sum()
            applied_sq += a.double().pow(2).sum()
            dense_sq += d.double().pow(2).sum()
    dot, applied_sq, dense_sq, error = dot.item(), applied_sq.item(), dense_sq.item(), error_sq.sqrt().mean().item()
    return {
        "excluded": sorted(int(m) for m in excluded),
        "replicas_per_selected": selected / distinct if distinct else None,
        "update_cosine": dot / (applied_sq * dense_sq) ** 0.5 if applied_sq and dense_sq else None,
        "update_norm": applied_sq ** 0.5,
        "dense_norm": dense_sq ** 0.5,
        "error_norm": error,
    }


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


def simulate_variant(run: RunConfig, variant: Variant, llama_config, corpus, replicas: int, stages: int, steps: int,
                     device, metrics_path: str | None = None, progress: bool = True, batched: bool = True,
                     compile: bool = False, deadline: float | None = None, state_path: str | None = None) -> dict:
    """Train one row and validate every replica; the result's "status" is "done".

    `batched` runs the replicas as one batched computation (`simulate_batched`), else one
    `SimReplica` each (the reference); `compile` torch.compiles the batched forward.
    `deadline` (a time.time() value): at each outer-step boundary (every 50 steps without outer
    steps) the row stops when, at this call's pace, it could not reach the next boundary before
    the deadline. With `state_path` it then saves its state there ("status": "saved") and a later
    call with the same path continues from it, ending exactly as an uninterrupted run; without,
    it stops as soon as it is projected to end after the deadline ("status": "abandoned")."""
    from tqdm import tqdm

    from .data import ReplicaBatches
    from .train import validation_batches

    hetloco = variant.hetloco(run.hetloco, replicas)
    run = variant.run(run)
    torch.manual_seed(hetloco.train.seed)
    if batched:
        from .simulate_batched import BatchedSimulation

        sim = BatchedSimulation(run, hetloco, llama_config, replicas, stages, device, compile=compile)
    else:
        sim = Simulation(run, hetloco, llama_config, replicas, stages, device)
    seq_len = hetloco.train.seq_len
    history, outer_rows, done, spent = [], [], 0, 0.0
    if state_path and not batched:
        raise ConfigError("resuming a row (state_path) needs the batched simulator")
    if state_path and os.path.exists(state_path):
        state = torch.load(state_path, map_location=device, weights_only=False)
        if state["variant"] != asdict(variant) or state["steps"] != steps:
            raise ConfigError(f"{state_path} holds row {state['variant']['name']} of {state['steps']} steps, "
                              f"not {variant.name} of {steps}")
        sim.load_state_dict(state["sim"])
        history, outer_rows, done, spent = state["history"], state["outer"], state["step"], state["seconds"]
    feeds = [ReplicaBatches(corpus.train, m, replicas, sim.micro, seed=hetloco.train.seed, position=done * sim.gas)
             for m in range(replicas)]
    val_it = validation_batches(corpus.val, sim.micro)
    val_batches = [tuple(t.to(device) for t in next(val_it)) for _ in range(hetloco.train.eval_batches)]
    H = hetloco.sparseloco.inner_steps if hetloco.sparseloco.enabled else 1
    link = sim.link_bytes_per_step(seq_len)
    tokens_per_step = sim.micro * sim.gas * seq_len
    t0 = time.perf_counter()
    out = open(metrics_path, "a") if metrics_path else None
    bar = tqdm(total=steps, initial=done, desc=variant.name, disable=not progress, dynamic_ncols=True)
    # Losses stay on the device until an outer step (which syncs anyway), every 50 steps or the
    # end: the host never waits on the device between those, so it keeps queueing work.
    pending: list[torch.Tensor] = []
    interval = H if hetloco.sparseloco.enabled else 50  # steps between boundaries (nothing pending)

    def syncs(step: int) -> bool:
        return hetloco.sparseloco.enabled and (step % H == 0 or step == steps)

    def flush() -> None:
        first = len(history) + 1
        history.extend(replica_losses(torch.stack(pending)))
        pending.clear()
        bar.update(len(history) - first + 1)
        bar.set_postfix_str(f"loss {sum(history[-1]) / len(history[-1]):.3f}", refresh=False)
        if not out:
            return
        for step in range(first, len(history) + 1):
            for m, loss in enumerate(history[step - 1]):
                stage_bytes = link["stage_links_per_step"][m]
                sync = link["outer_payload_per_replica"] * stages if syncs(step) else 0
                out.write(json.dumps({
                    "kind": "step", "variant": variant.name, "step": step, "replica": m, "loss": loss,
                    "tokens": tokens_per_step, "seconds": None,
                    "bytes": {"activation": {"sent": stage_bytes // 2, "recv": stage_bytes // 2},
                              "activation_grad": {"sent": stage_bytes // 2, "recv": stage_bytes // 2},
                              "outer_sync": {"sent": sync, "recv": sync * (replicas - 1)}},
                }) + "\n")
        for row in outer_rows:
            if first <= row["step"] <= len(history):  # this flush's syncs, after their steps' rows
                out.write(json.dumps({"kind": "outer", "variant": variant.name, **row}) + "\n")

    for step in range(done + 1, steps + 1):
        pending.append(sim.train_step(step_batches(feeds, sim.gas, device)))
        if syncs(step):
            outer_rows.append({"step": step, **sim.outer_step()})
            if len(outer_rows[-1].get("excluded", [])) == replicas:
                raise FloatingPointError(f"{variant.name}: every replica's pseudo-gradient was non-finite at the "
                                         f"outer step after step {step}; the row cannot go on")
        if syncs(step) or step == steps or len(pending) >= 50:
            flush()
        if deadline is None or step == steps or step % interval:
            continue
        pace = (time.perf_counter() - t0) / (step - done)
        stop = (time.time() + pace * interval > deadline if state_path
                else time.time() + pace * (steps - step) > deadline)
        if stop:
            bar.close()
            if out:
                out.close()
            seconds = spent + time.perf_counter() - t0
            if state_path:
                tmp = state_path + ".tmp"
                torch.save({"variant": asdict(variant), "steps": steps, "step": step, "sim": sim.state_dict(),
                            "history": history, "outer": outer_rows, "seconds": seconds}, tmp)
                os.replace(tmp, state_path)
            return {"status": "saved" if state_path else "abandoned", "variant": asdict(variant), "step": step,
                    "steps": steps, "seconds": seconds}
    bar.close()
    val_losses = sim.validation_losses(val_batches)
    val = sum(val_losses) / len(val_losses)
    if out:
        out.write(json.dumps({"kind": "validation", "variant": variant.name, "step": steps, "loss": val,
                              "replica_losses": val_losses}) + "\n")
        out.close()
    tail = max(1, min(H, steps) if hetloco.sparseloco.enabled else min(10, steps))
    final_train = sum(sum(l) / len(l) for l in history[-tail:]) / tail
    stage_bytes = sum(link["stage_links_per_step"]) / replicas
    if state_path and os.path.exists(state_path):
        os.remove(state_path)
    return {
        "status": "done",
        "variant": asdict(variant),
        "replicas": replicas, "stages": stages, "steps": steps, "inner_steps": H,
        "train_losses": [sum(l) / len(l) for l in history],
        "replica_losses": history,
        "final_train_loss": final_train,
        "val_loss": val,
        "val_losses": val_losses,
        "stage_link_bytes_per_token": stage_bytes / tokens_per_step,
        "outer_sync_bytes_per_replica_per_outer_step": link["outer_payload_per_replica"],
        "seconds": spent + time.perf_counter() - t0,
        "simulator": "batched" if batched else "per_replica",
        "compile": compile,
        "tokens_per_replica_step": tokens_per_step,
        "n_params": sum(p.numel() for p in sim.replicas[0].params),
        "outer_steps": len(outer_rows),
        "outer": outer_rows,
    }


ROW_HEADS = ("sparseloco", "pp", "het", "adamw", "adamw-pp", "adamw-het", "diloco")


def parse_variants(spec: list[str], replicas: int, seeds: list[int]) -> list[Variant]:
    """Rows HEAD[:RATIO][:FLAG...] x seeds. HEAD: sparseloco, pp (every replica compresses at
    RATIO), het (the last half do), adamw, adamw-pp, adamw-het (plain data parallelism), diloco
    (SparseLoCo's loop with `aggregation: dense`, the dense-averaging control). FLAG: noadapt
    (Table 5a), wproj (Table 5b), lr=X (this row's inner lr), or KEY=VALUE for any
    `hetloco.sparseloco` field (e.g. aggregation=selected_count, outer_lr=2)."""
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
        unknown = [f for f in rest if "=" not in f and f not in ("noadapt", "wproj")]
        if unknown:
            raise ConfigError(f"--variants: row {item!r}: unknown flag(s) {unknown}")
        if head == "diloco":
            settings.setdefault("aggregation", "dense")
        try:
            lr = float(settings.pop("lr")) if "lr" in settings else None
        except ValueError:
            raise ConfigError(f"--variants: row {item!r}: lr must be a number") from None
        variants.append(Variant(name=f"{item}@seed{seed}", mode="adamw" if head.startswith("adamw") else "sparseloco",
                                ratio=ratio if compressed else 1, compressed=compressed,
                                embedding_adaptation="noadapt" not in rest, project_residual_weights="wproj" in rest,
                                seed=seed, lr=lr, sparseloco=settings))
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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="hetloco-ds simulate", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", help="DeepSpeed JSON with a hetloco section (default: configs/cpu_tiny.json)")
    p.add_argument("--model-config", default="tiny", help="preset or JSON of LlamaConfig fields")
    p.add_argument("--data", help="as for train (default: the Python stdlib)")
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--stages", type=int, help="virtual stages (default: the config's pipeline.stages)")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--variants", default="sparseloco,pp:8,het:8",
                   help="comma-separated rows HEAD[:RATIO][:FLAG...]: sparseloco, pp:R, het:R, adamw, adamw-pp:R, "
                        "adamw-het:R, diloco; flags noadapt, wproj, lr=X, or any sparseloco field as KEY=VALUE")
    p.add_argument("--seeds", default="0")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", help="directory for results.json and metrics.jsonl")
    p.add_argument("--per-replica", action="store_true",
                   help="one module set per replica (the reference) instead of the replica-batched simulator")
    p.add_argument("--compile", action="store_true", help="torch.compile the batched simulator's stage functions")
    args = p.parse_args(argv)
    try:
        run = load_config(args.config)
        stages = args.stages or run.stages
        if args.replicas < 1 or args.steps < 1:
            raise ConfigError(f"--replicas {args.replicas} and --steps {args.steps} must be >= 1")
        seeds = [int(s) for s in args.seeds.split(",")]
        variants = parse_variants(args.variants.split(","), args.replicas, seeds)
        from . import data
        from .presets import model_config_for

        tokenizer = data.default_tokenizer(vocab_size=run.hetloco.train.vocab_size)
        llama_config = model_config_for(args.model_config, len(tokenizer))
        sizes.stage_parts(llama_config.num_hidden_layers, stages)
        for v in variants:
            if v.ratio > 1:
                sizes.subspace_dim(llama_config.hidden_size, v.ratio)
        corpus = data.load_corpus(args.data, tokenizer, run.hetloco.train.seq_len)
    except (ConfigError, ValueError, FileNotFoundError) as err:
        print(f"hetloco-ds simulate: error: {err}", file=sys.stderr)
        return 2
    metrics = None
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        metrics = os.path.join(args.out, "metrics.jsonl")
    device = torch.device(args.device)
    results = [simulate_variant(run, v, llama_config, corpus, args.replicas, stages, args.steps, device, metrics,
                                batched=not args.per_replica, compile=args.compile)
               for v in variants]
    rows = degradation_table(results)
    print(format_table(rows))
    if args.out:
        tmp = os.path.join(args.out, "results.json.tmp")
        with open(tmp, "w") as f:
            json.dump({"config": run.source, "model": llama_config.to_dict(), "device": str(device),
                       "device_name": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                       "rows": rows}, f, indent=1, default=str)
        os.replace(tmp, os.path.join(args.out, "results.json"))
    return 0
