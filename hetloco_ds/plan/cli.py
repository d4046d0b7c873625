"""`hetloco-ds plan`: print a prediction or a fleet plan (tables and one explaining paragraph)."""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any, Sequence

from ..config import OUTER_STATE_DEVICE
from ..presets import DEFAULT_VOCAB
from ..sizes import OPTIMIZER_STATES, QUANT_BITS
from .fleet import FleetPlan, plan_fleet
from .memory import format_largest, largest_table
from .model import TERMS, Prediction, Settings, fmt_bytes, fmt_rate, fmt_time, parse_rate, predict
from .shapes import PRESETS, ModelShape, resolve_model
from .outer_step import OuterStep, predict_outer_step


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
        ("stage link", f"{fmt_rate(i['stage_bw'])}, latency {fmt_time(i['stage_latency'])}, "
                       f"k/d = {p.k}/{p.model.d} (ratio {p.model.d / p.k:.4g}), schedule "
                       f"{'overlapped' if i['overlap'] else 'blocking'}"),
        ("replica link", f"{fmt_rate(i['replica_bw'])}, latency {fmt_time(i['replica_latency'])}"),
        ("compute / micro-batch", f"{fmt_time(max(p.compute_time_microbatch))} (slowest stage)"),
        ("boundary / micro-batch", f"fwd {fmt_bytes(p.fwd_bytes_microbatch)} ({fmt_time(p.link_time_fwd)}), "
                                   f"bwd {fmt_bytes(p.bwd_bytes_microbatch)} ({fmt_time(p.link_time_bwd)})"),
        ("stage link / step", f"{fmt_bytes(p.stage_link_bytes_per_step)} activations; control "
                              f"{fmt_bytes(p.control_bytes_per_step)}; embedding sync <= "
                              f"{fmt_bytes(p.embedding_sync_bytes_per_outer_step)} per outer step"),
        ("outer payload / rank", f"{fmt_bytes(max(p.outer_payload_bytes))} (dense fp32: "
                                 f"{fmt_bytes(max(p.dense_outer_bytes))}); per replica "
                                 f"{fmt_bytes(p.outer_bytes_per_replica)}"),
        ("outer sync", f"{fmt_time(p.outer_sync_time)} per outer step, "
                       f"{fmt_time(p.breakdown['outer sync'])} per inner step"),
        ("inner step", f"{fmt_time(p.total_time)} (schedule {fmt_time(p.schedule_time)})"),
    ]
    rows += [(f"  {t}", f"{fmt_time(p.breakdown[t])} ({p.breakdown[t] / p.total_time:.1%})") for t in TERMS]
    rows += [("compute utilisation", f"{p.utilisation:.2%} (steady state {p.steady_state_utilisation:.2%})"),
             ("dominant term", p.dominant)]
    w = max(len(r[0]) for r in rows)
    return "\n".join(f"{a:<{w}}  {b}" for a, b in rows) + "\n\n" + p.explanation


def format_fleet(plan: FleetPlan) -> str:
    """A readable table of a FleetPlan: the groups, who waits for whom, the config to use."""
    if plan.stages is not None:
        topology = f"S = {plan.stages} stages ({plan.settings['stage_memory_gb']:.1f} GB per stage)"
    else:
        by_s: dict[int, list[str]] = {}
        for g in plan.groups:
            if g.stages is not None:
                by_s.setdefault(g.stages, []).append(g.name)
        topology = "replicas of " + ", ".join(f"S = {s} ({', '.join(n)})" for s, n in sorted(by_s.items()))
    head = (f"model {plan.model}: {topology}, M = {plan.replicas} replicas, target utilisation "
            f"{plan.target_utilisation:.0%}\nouter sync {fmt_time(plan.outer_sync_time)} in "
            f"{len(plan.block_parts) - 1} block exchange(s) on a ring of "
            + (fmt_rate(plan.replica_ring_bw) if plan.replica_ring_bw else "-")
            + f"; outer step {fmt_time(plan.outer_step_time)}; "
              f"{plan.tokens_per_second:,.0f} tokens/s fleet-wide\n")
    cols = ("group", "devices", "S_need", "S", "replicas", "ranks", "role", "ratio", "inner step", "util", "fleet util",
            "wait")
    rows = [cols]
    for g in plan.groups:
        hosted = g.stages is not None
        rows.append((g.name, str(g.devices), str(g.stages_needed), str(g.stages) if hosted else "-",
                     f"{g.replicas} ({_span(g.first_replica, g.replicas)})" if hosted else "0",
                     _span(g.first_rank, g.replicas * g.stages) if hosted and g.first_rank is not None else "-", g.role,
                     "-" if g.ratio is None else f"1/{g.ratio}" if g.ratio > 1 else "1",
                     fmt_time(g.inner_step_time) if hosted else "-",
                     "-" if g.utilisation is None else f"{g.utilisation:.1%}",
                     "-" if g.fleet_utilisation is None else f"{g.fleet_utilisation:.1%}",
                     fmt_time(g.wait_time) if hosted else "-"))
    w = [max(len(r[i]) for r in rows) for i in range(len(cols))]
    table = "\n".join("  ".join(c.ljust(w[i]) for i, c in enumerate(r)).rstrip() for r in rows)
    why = "\n".join(f"- {g.name}: {g.reason}" for g in plan.groups)
    notes = "\n".join(f"note: {n}" for n in plan.notes)
    return (head + "\n" + table + "\n\n" + why + "\n\n" + _fleet_waits(plan) + "\n\n"
            + "config (DeepSpeed JSON; " + ("ranks replica by replica, as numbered above" if plan.stages is None
                                           else "rank = stage x M + replica") + "):\n"
            + "\n".join(f"  {k} = {v}" for k, v in _dotted(plan.config)) + ("\n" + notes if notes else ""))


def _fleet_waits(plan: FleetPlan) -> str:
    """Who waits for whom at the outer step."""
    slow = next(g for g in plan.groups if g.name == plan.slowest)
    H = plan.settings["H"]
    waits = [f"{g.name} {fmt_time(g.wait_time)}" for g in plan.groups if g.stages is not None and g.wait_time > 0]
    return (f"outer step = H x the slowest inner step + outer sync = {H} x {fmt_time(slow.inner_step_time)} "
            f"({slow.name}) + {fmt_time(plan.outer_sync_time)} = {fmt_time(plan.outer_step_time)}; "
            + (f"waiting for {slow.name} each outer step: " + ", ".join(waits) if waits else "nobody waits") + ".")


def format_outer_step(step: OuterStep) -> str:
    """A readable table of an OuterStep: each replica's inner phase, its wait, who waits for whom."""
    cols = ("replica", "S", "k", "inner step", f"x H = {step.H}", "wait", "exchange / rank", "util")
    rows = [cols]
    for r in step.replicas:
        rows.append((str(r.replica), str(r.stages), str(r.k), fmt_time(r.inner_step_time), fmt_time(r.inner_phase_time),
                     fmt_time(r.wait_time), fmt_bytes(max(r.exchange_bytes)), f"{r.utilisation:.1%}"))
    w = [max(len(x[i]) for x in rows) for i in range(len(cols))]
    table = "\n".join("  ".join(c.ljust(w[i]) for i, c in enumerate(x)).rstrip() for x in rows)
    slow = step.replicas[step.slowest]
    runs: list[list[Any]] = []  # [first, last, wait] over consecutive replicas that wait alike
    for r in step.replicas:
        if runs and runs[-1][2] == r.wait_time and runs[-1][1] == r.replica - 1:
            runs[-1][1] = r.replica
        else:
            runs.append([r.replica, r.replica, r.wait_time])
    waits = [f"replica{'s' if a < b else ''} {_span(a, b - a + 1)} {fmt_time(t)}" for a, b, t in runs if t > 0]
    return (f"model {step.model}: M = {len(step.replicas)} replicas, replica_stages = {step.replica_stages}, "
            f"H = {step.H}\nouter sync by {len(step.block_payload_bytes)} block(s) (layer-list cuts "
            f"{step.block_parts}, payload per rank "
            + ", ".join(fmt_bytes(b) for b in step.block_payload_bytes)
            + f"): exchange {fmt_time(step.exchange_time)}, with embedding shares {fmt_time(step.outer_sync_time)}\n\n"
            + table + f"\n\nouter step = {step.H} x {fmt_time(slow.inner_step_time)} (replica {slow.replica}, "
            f"the slowest inner step) + {fmt_time(step.outer_sync_time)} sync = {fmt_time(step.outer_step_time)}; "
            + ("waiting for replica " + str(slow.replica) + " each outer step: " + ", ".join(waits) if waits
               else "nobody waits") + f".\n{step.tokens_per_second:,.0f} tokens/s over all replicas.")


def _span(first: int | None, n: int) -> str:
    return f"{first}" if n == 1 else f"{first}-{first + n - 1}"


def _dotted(d: dict[str, Any], prefix: str = "") -> list[tuple[str, str]]:
    """A nested config as (dotted key, JSON value) pairs, leaves only."""
    out = []
    for k, v in d.items():
        if isinstance(v, dict) and v and k != "replica_ratios":
            out += _dotted(v, f"{prefix}{k}.")
        else:
            out.append((f"{prefix}{k}", json.dumps(v)))
    return out


def build_parser(prog: str = "hetloco-ds plan") -> argparse.ArgumentParser:
    """Options named after `Settings` fields default to Settings' own defaults (not restated here)."""
    ap = argparse.ArgumentParser(prog=prog, description=(
        "Predict step time, bytes and compute utilisation for SparseLoCo + subspace-compressed "
        "pipelines, or plan a heterogeneous fleet (--fleet). Rates accept 100mbit, 1G, 1e9 (bits/s)."))
    ap.add_argument("--model", default="512M", help=f"preset ({', '.join(PRESETS)}); --d etc. override it")
    for name in ("d", "layers", "heads", "kv-heads", "ffn", "vocab", "seq-len"):
        ap.add_argument(f"--{name}", type=int, default=None, help="override the preset's value")
    ap.add_argument("--stages", "-S", type=int, default=None, help="pipeline stages (default 4; fleet: chosen)")
    ap.add_argument("--replicas", "-M", type=int, default=argparse.SUPPRESS)
    ap.add_argument("--stage-bw", type=parse_rate, default=argparse.SUPPRESS, help="bits/s per stage link")
    ap.add_argument("--stage-latency", type=float, default=argparse.SUPPRESS, help="seconds")
    ap.add_argument("--replica-bw", type=parse_rate, default=argparse.SUPPRESS, help="bits/s per replica link")
    ap.add_argument("--replica-latency", type=float, default=argparse.SUPPRESS, help="seconds")
    ap.add_argument("--tflops", type=float, default=argparse.SUPPRESS, help="peak TFLOP/s of one stage")
    ap.add_argument("--mfu", type=float, default=argparse.SUPPRESS)
    ap.add_argument("--micro-batch", "-b", type=int, default=argparse.SUPPRESS)
    ap.add_argument("--n-mb", type=int, default=argparse.SUPPRESS, help="micro-batches per inner step")
    ap.add_argument("-H", "--inner-steps", dest="H", type=int, default=argparse.SUPPRESS)
    ap.add_argument("--topk", type=int, default=argparse.SUPPRESS)
    ap.add_argument("--chunk", type=int, default=argparse.SUPPRESS)
    ap.add_argument("--quant-bits", type=int, default=argparse.SUPPRESS, choices=QUANT_BITS)
    ap.add_argument("--value-bytes", type=int, default=argparse.SUPPRESS, help="bytes per unquantised value (4 fp32, 2 bf16)")
    ap.add_argument("--ratio", type=int, default=argparse.SUPPRESS, help="subspace ratio d/k (1 = uncompressed)")
    ap.add_argument("--act-bytes", type=int, default=argparse.SUPPRESS)
    ap.add_argument("--no-overlap", dest="overlap", action="store_false", default=argparse.SUPPRESS,
                    help="transfers block compute (DeepSpeed's blocking p2p); same as --schedule blocking")
    ap.add_argument("--schedule", choices=("overlapped", "blocking"), default=None,
                    help="the pipeline schedule modelled (hetloco.pipeline.schedule; default overlapped, what "
                         "the engine's \"auto\" runs over slow links; --largest: blocking, what it runs on GPUs of one host)")
    ap.add_argument("--tied", action="store_true", help="the model ties its embedding and LM head")
    ap.add_argument("--tied-embeddings", choices=("outer_step", "every_step"), default=argparse.SUPPRESS,
                    help="how a tied model keeps its copies equal (hetloco.sparseloco.tied_embeddings)")
    ap.add_argument("--fleet", default=None, help="fleet JSON: plan it instead of predicting (each group its own "
                    "pipeline depth; --stages S: one S for all)")
    ap.add_argument("--config", default=None, help="a DeepSpeed JSON with a hetloco section: predict one outer step "
                    "of its replicas (hetloco.replica_stages, or pipeline.stages x --replicas), each with its own S "
                    "and ratio, and who waits for whom; it sets H, top-k, the batch, seq_len, bf16, the schedule, "
                    "and options given here override those")
    ap.add_argument("--largest", action="store_true", help="print the largest preset one replica trains on 1, 2, 4, "
                    "8 GPUs of 24, 40, 80, 141 GB, with the outer state on the GPU and on the host (--vocab, --seq-len, "
                    "--micro-batch, --n-mb, --schedule apply to every preset)")
    ap.add_argument("--activation-checkpoint-interval", type=int, default=0, metavar="N",
                    help="--largest: DeepSpeed's pipeline.activation_checkpoint_interval (runs of N decoder layers keep "
                         "only their input and are recomputed in the backward; default 0, off)")
    ap.add_argument("--optimizer-state", choices=OPTIMIZER_STATES, default="fp32",
                    help="--largest: AdamW's state (hetloco.train.optimizer_state): fp32, bf16 or 8-bit moments, "
                         "or moments on the host (cpu_offload)")
    ap.add_argument("--loss-chunk-tokens", type=int, default=0, metavar="N",
                    help="--largest: hetloco.train.loss_chunk_tokens (the last stage's loss N tokens at a time, "
                         "without a micro-batch's logits; default 0, off)")
    ap.add_argument("--outer-state-device", choices=("gpu", "cpu"), default=OUTER_STATE_DEVICE,
                    help="fleet: where the outer state waits between outer steps (hetloco.sparseloco.outer_state_device)")
    ap.add_argument("--target", type=float, default=0.9, help="fleet: target compute utilisation")
    ap.add_argument("--json", default=None, metavar="PATH", help="also write the result as JSON ('-' = stdout)")
    return ap


def _model_from_args(a: argparse.Namespace) -> ModelShape:
    m = resolve_model(a.model)
    over = {"d": a.d, "n_layers": a.layers, "n_heads": a.heads, "n_kv_heads": a.kv_heads,
            "ffn": a.ffn, "vocab": a.vocab, "seq_len": a.seq_len}
    over = {k: v for k, v in over.items() if v is not None}
    if a.tied:
        over["tied"] = True
    if over:
        m = resolve_model(dataclasses.replace(m, name=f"{m.name}*", **over))
    return m


def settings_from_args(a: argparse.Namespace) -> Settings:
    """The Settings fields the parser defines (its dest names are Settings' field names)."""
    return Settings(**_given(a))


def _given(a: argparse.Namespace) -> dict[str, Any]:
    """The Settings fields given on the command line."""
    given = {f.name: getattr(a, f.name) for f in dataclasses.fields(Settings) if hasattr(a, f.name)}
    for name in ("stages", "seq_len"):  # None: not given (the model's own sequence length)
        if given.get(name) is None:
            given.pop(name, None)
    if a.schedule is not None:
        given["overlap"] = a.schedule == "overlapped"
    return given


def replicas_from_config(path: str, a: argparse.Namespace) -> list[Settings]:
    """One Settings per replica of the run `path` configures (read and checked by `config.load_config`,
    as `train` reads it): its S (hetloco.replica_stages, else pipeline.stages or --stages for each
    of --replicas), its ratio (hetloco.subspace), and the run's H, codec, batch, sequence length,
    activation width (bf16: 2 bytes) and schedule; options given on the command line win."""
    from ..config import load_config

    run = load_config(path)
    h = run.hetloco
    sl, sub = h.sparseloco, h.subspace
    given = _given(a)
    if "ratio" in given or "k" in given:
        raise ValueError(f"--ratio: {path} sets each replica's ratio (hetloco.subspace)")
    if h.replica_stages is not None:
        if "stages" in given:
            raise ValueError(f"--stages: {path} sets hetloco.replica_stages = {h.replica_stages}")
        if given.get("replicas", len(h.replica_stages)) != len(h.replica_stages):
            raise ValueError(f"--replicas {given['replicas']}: {path} sets {len(h.replica_stages)} "
                             f"(hetloco.replica_stages = {h.replica_stages})")
        stages = list(h.replica_stages)
    else:
        stages = [given.get("stages", run.stages)] * given.get("replicas", Settings.replicas)
    M = len(stages)
    named = sorted({*(sub.compressed_replicas if isinstance(sub.compressed_replicas, list) else []), *sub.replica_ratios})
    if named and named[-1] >= M:
        raise ValueError(f"{path}: hetloco.subspace names replica {named[-1]}, but the run has replicas 0..{M - 1}")
    from_config = dict(H=sl.inner_steps, topk=sl.topk, chunk=sl.chunk_size, quant_bits=sl.quant_bits,
                       micro_batch=run.micro_batch, n_mb=run.grad_accum, seq_len=h.train.seq_len,
                       act_bytes=2 if run.bf16 else 4, overlap=h.pipeline.schedule != "blocking",
                       tied_embeddings=sl.tied_embeddings, embedding_sync=sub.any_compressed and sub.embedding_adaptation)
    base = Settings(**{**from_config, **given, "replicas": M})
    return [dataclasses.replace(base, stages=S, ratio=sub.ratio_for(r, M)) for r, S in enumerate(stages)]


def main(argv: Sequence[str] | None = None) -> int:
    """`hetloco-ds plan ...`: print a prediction (or a fleet plan); --json writes it."""
    a = build_parser().parse_args(argv)
    try:
        m = _model_from_args(a)
        settings = settings_from_args(a)
        if sum(map(bool, (a.fleet, a.config, a.largest))) > 1:
            raise ValueError("give one of --fleet (plan a fleet), --config (predict a configured run), --largest")
        if a.largest:
            return _print_largest(a, settings)
        if a.fleet:
            res: Any = plan_fleet(a.fleet, m, a.target, settings, stages=a.stages, outer_state_device=a.outer_state_device)
            text = format_fleet(res)
        elif a.config:
            res = predict_outer_step(m, replicas_from_config(a.config, a))
            text = format_outer_step(res)
        else:
            res = predict(m, settings)
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


def largest_text(a: argparse.Namespace, settings: Settings) -> str:
    """The `--largest` table for the batch, sequence length, schedule and vocabulary given."""
    vocab = a.vocab or DEFAULT_VOCAB
    # One replica on the GPUs of one host: "auto" runs blocking there (pipe.order.links_plan).
    named = a.schedule is not None or "overlap" in vars(a)
    schedule = ("overlapped" if settings.overlap else "blocking") if named else "blocking"
    interval = a.activation_checkpoint_interval
    if interval < 0:
        raise ValueError(f"--activation-checkpoint-interval {interval} must be >= 0 (0: off)")
    if a.loss_chunk_tokens < 0:
        raise ValueError(f"--loss-chunk-tokens {a.loss_chunk_tokens} must be >= 0 (0: off)")
    table = largest_table(vocab, micro_batch=settings.micro_batch, n_mb=settings.n_mb, seq_len=settings.seq_len,
                          schedule=schedule, bf16=settings.act_bytes == 2, activation_checkpoint_interval=interval,
                          optimizer_state=a.optimizer_state, loss_chunk_tokens=a.loss_chunk_tokens)
    return format_largest(table, vocab, settings.micro_batch, settings.n_mb, settings.seq_len, schedule, interval,
                          a.optimizer_state, a.loss_chunk_tokens)


def _print_largest(a: argparse.Namespace, settings: Settings) -> int:
    for name in ("d", "layers", "heads", "kv_heads", "ffn"):
        if getattr(a, name) is not None:
            raise ValueError(f"--largest compares the presets; --{name.replace('_', '-')} does not apply")
    if a.json:
        raise ValueError("--largest prints a table; --json does not apply")
    print(largest_text(a, settings))
    return 0
