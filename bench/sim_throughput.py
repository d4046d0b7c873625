"""Simulator tokens/s per GPU against our engine's, for the same model, in one process.

Systems (one after another, memory freed in between; `--systems` picks):
  engine               HetlocoEngine, S = 1, M = 1: one GPU trains one replica's whole model on
                       micro x gas x seq tokens a step (SparseLoCo on, H out of reach, bf16 autocast),
                       timed as bench/gpu_throughput.py times `ours`.
  sim_batched          sim.batched.BatchedSimulation: M replicas x S virtual stages on the same GPU,
                       each replica on micro x gas x seq tokens a step, row `--variant`.
  sim_batched_compile  the same with its stage functions, codec and loss torch.compile'd.
  sim_per_replica      sim.replica.Simulation, one module set and optimizer per replica (the reference).

tokens/s per GPU = tokens every replica on the GPU trains in a step / step seconds (median of
`--steps` timed steps after `--warmup`, each between device synchronisations). Each simulator's
outer step (all M x S stage algorithms, with the per-sync diagnostics) is timed on its own
(`--outer-repeats`) and amortised over H in `tokens_per_s_with_outer`. `vs_engine` divides by
the engine's tokens/s (the target: >= 0.7). MFU uses gpu_throughput.py's convention
(6 N + 12 L d seq FLOPs a token, 989e12 peak). `--profile` adds one profiled step per system: on a
GPU its kernel launches (the count batching divides by about M) and where its device time goes
(milliseconds by kernel category, the top kernels, idle gaps), on the CPU its aten ops.

    python bench/sim_throughput.py --out $OUT/sim_throughput.json      # 20M, M = 8, S = 4, 32 x 2 x 256
    python bench/sim_throughput.py --cpu-smoke                         # tiny shapes on the CPU
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import statistics
import sys
import time
import traceback
import warnings

BENCH = os.path.dirname(os.path.abspath(__file__))
if BENCH not in sys.path:
    sys.path.insert(0, BENCH)

from _common import (build_ours, close_process_group, default_out, device, llama_config, mem_gib, ours_config,  # noqa: E402
                     profiled, sync, versions)
from gpu_throughput import (PEAK_FLOPS, card, flops_per_token, free_memory, profile_line, profile_step,  # noqa: E402
                            setup_process_group)

ALL_SYSTEMS = ("engine", "sim_batched", "sim_batched_compile", "sim_per_replica")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="20M", help="hetloco_ds.presets name")
    p.add_argument("--vocab", type=int, default=8192, help="the paper-table corpus' BPE vocabulary")
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--micro", type=int, default=32)
    p.add_argument("--gas", type=int, default=2, help="micro-batches per optimizer step (32 x 2 x 256 = 16K tokens)")
    p.add_argument("--replicas", type=int, default=8)
    p.add_argument("--stages", type=int, default=4)
    p.add_argument("--inner-steps", type=int, default=50, help="H, to amortise the outer step")
    p.add_argument("--variant", default="het:8", help="sim.rows.parse_variants row the simulators run")
    p.add_argument("--systems", default="engine,sim_batched,sim_batched_compile,sim_per_replica",
                   help=f"comma-separated subset of {ALL_SYSTEMS}, run in this order")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first (compilation happens here)")
    p.add_argument("--steps", type=int, default=10, help="timed steps (median reported)")
    p.add_argument("--outer-repeats", type=int, default=3)
    p.add_argument("--time-budget", type=float, default=420.0, help="seconds; a system that would start later is skipped")
    p.add_argument("--profile", action="store_true", help="one profiled step per system: launches / ops a step")
    p.add_argument("--no-bf16", action="store_true", help="fp32 everywhere (the CPU smoke)")
    p.add_argument("--out", default=None, help="JSON path (default $OUT/sim_throughput.json or bench/results/)")
    p.add_argument("--cpu-smoke", action="store_true",
                   help="preset tiny, vocab 1024, seq 64, micro 2, gas 1, M 4, S 2, 1 + 3 steps, fp32, on the CPU")
    if "--cpu-smoke" in (sys.argv[1:] if argv is None else argv):  # defaults only: explicit flags win
        p.set_defaults(shape="tiny", vocab=1024, seq=64, micro=2, gas=1, replicas=4, stages=2, warmup=1, steps=3,
                       outer_repeats=2, no_bf16=True, systems="engine,sim_batched,sim_per_replica")
    return p.parse_args(argv)


def step_stats(timed: list[float], warm: list[float], tokens: int, flops: float) -> dict:
    step = statistics.median(timed)
    return {"step_s_median": step, "step_s_min": min(timed), "step_s_max": max(timed),
            "step_s_all": [round(x, 6) for x in timed], "warmup_s_all": [round(x, 4) for x in warm],
            "tokens_per_step": tokens, "tokens_per_s": tokens / step, "mfu": flops * tokens / step / PEAK_FLOPS}


def time_steps(fn, warmup: int, steps: int) -> tuple[list[float], list[float]]:
    warm, timed = [], []
    for i in range(warmup + steps):
        sync()
        t = time.perf_counter()
        fn()
        sync()
        (warm if i < warmup else timed).append(time.perf_counter() - t)
    return warm, timed


def profile_count(fn, step_s: float) -> dict:
    """One call of fn profiled: on a GPU where its device time goes (gpu_throughput.profile_step:
    kernel launches, milliseconds by kernel category, the top kernels, idle gaps), on the CPU its
    aten op calls."""
    import torch

    if torch.cuda.is_available():
        return profile_step(fn, step_s)
    prof, _ = profiled(fn)
    return {"aten_ops": sum(e.count for e in prof.key_averages() if e.key.startswith("aten::"))}


def run_engine(cfg, args, result) -> None:
    raw = ours_config(args.micro, args.gas, 1, not args.no_bf16, 10**9, {"compressed_replicas": "none"}, args.seq,
                      max(256, cfg.vocab_size))
    module, engine = build_ours(raw, cfg, args.seq, source="bench/sim_throughput.py")
    from _common import batches

    data = batches(cfg, args.micro, args.seq)
    n_params = sum(p.numel() for p in engine.trainable_params())

    def step():
        engine.train_step(data)

    warm, timed = time_steps(step, args.warmup, args.steps)
    tokens = args.micro * args.gas * args.seq
    result.update(step_stats(timed, warm, tokens, flops_per_token(cfg, args.seq, n_params)))
    result.update(n_params=n_params, replicas_on_gpu=1, peak_mem_gib=mem_gib("peak"))
    if args.profile:
        result["profile"] = profile_count(step, result["step_s_median"])
    with contextlib.suppress(Exception):
        engine.destroy()


def run_sim(cfg, args, result, system: str) -> None:
    import torch

    from hetloco_ds.config import parse_config
    from hetloco_ds.sim.replica import Simulation
    from hetloco_ds.sim.rows import parse_variants
    from hetloco_ds.sim.batched import BatchedSimulation

    dev = device()
    run = parse_config({
        "train_micro_batch_size_per_gpu": args.micro, "gradient_accumulation_steps": args.gas,
        "gradient_clipping": 1.0, "bf16": {"enabled": not args.no_bf16},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "betas": [0.9, 0.95], "weight_decay": 0.1}},
        "hetloco": {"sparseloco": {"inner_steps": args.inner_steps}, "train": {"seq_len": args.seq}}})
    variant = parse_variants([args.variant], args.replicas, [0])[0]
    hetloco = variant.hetloco(run.hetloco, args.replicas)
    torch.manual_seed(0)
    if system == "sim_per_replica":
        sim = Simulation(run, hetloco, cfg, args.replicas, args.stages, dev)
    else:
        sim = BatchedSimulation(run, hetloco, cfg, args.replicas, args.stages, dev,
                                compile=system == "sim_batched_compile")
    g = torch.Generator().manual_seed(1234)
    data = [torch.randint(0, cfg.vocab_size, (args.replicas, args.gas, args.micro, args.seq), generator=g).to(dev)
            for _ in range(4)]
    feed = [[[(ids[m, a], ids[m, a]) for a in range(args.gas)] for m in range(args.replicas)] for ids in data]
    it = iter(range(10**9))

    def step():
        sim.train_step(feed[next(it) % len(feed)])

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warm, timed = time_steps(step, args.warmup, args.steps)
    # An op without a vmap batching rule runs once per replica in a Python loop: name any.
    result["vmap_fallbacks"] = sorted({str(w.message).split("batching rule for ")[-1].split(".")[0]
                                       for w in caught if "batching rule" in str(w.message)})
    tokens = args.replicas * args.micro * args.gas * args.seq
    n_params = sum(p.numel() for p in sim.replicas[0].params)
    result.update(step_stats(timed, warm, tokens, flops_per_token(cfg, args.seq, n_params)))
    result.update(n_params=n_params, replicas_on_gpu=args.replicas, stages=args.stages, variant=variant.name,
                  peak_mem_gib=mem_gib("peak"))
    if args.profile:
        result["profile"] = profile_count(step, result["step_s_median"])
    outer = []
    # A plain data-parallel row (AdamW) has no outer step to time: its replicas average every step.
    for _ in range(args.outer_repeats if hetloco.sparseloco.enabled else 0):
        step()  # a fresh pseudo-gradient for each outer step
        sync()
        t = time.perf_counter()
        diag = sim.outer_step()
        sync()
        outer.append(time.perf_counter() - t)
    if outer:
        steady = statistics.median(outer[1:] or outer)
        result.update(outer_step_s_all=[round(x, 6) for x in outer], outer_step_s_median=steady,
                      tokens_per_s_with_outer=tokens / (result["step_s_median"] + steady / args.inner_steps),
                      last_outer_diagnostics=diag)
    result["peak_mem_gib_incl_outer"] = mem_gib("peak")
    del sim, data, feed


def main(argv=None) -> int:
    args = parse_args(argv)
    t0 = time.perf_counter()
    import torch

    from hetloco_ds import checkpoint

    if args.cpu_smoke:
        torch.set_num_threads(1)  # 2 shared cores here: oversubscribed OpenMP is far slower
    if torch.cuda.is_available():
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    out_path = args.out or default_out("sim_throughput.json")
    os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
    systems = [s for s in args.systems.split(",") if s]
    bad = [s for s in systems if s not in ALL_SYSTEMS]
    if bad:
        raise SystemExit(f"unknown systems {bad}; choose from {ALL_SYSTEMS}")
    if "engine" in systems:
        setup_process_group()
    cfg = llama_config(args.shape, args.vocab, args.seq)
    report = {"card": card(), "versions": versions(nccl=False),
              "command": " ".join(shlex.quote(a) for a in [sys.executable] + sys.argv),
              "settings": vars(args), "model": cfg.to_dict(),
              "conventions": "tokens/s per GPU: every replica's tokens of a step / median step seconds; MFU: "
                             "6*N + 12*L*d*seq FLOPs a token over 989e12", "results": []}
    for system in systems:
        result = {"system": system}
        elapsed = time.perf_counter() - t0
        if elapsed > args.time_budget:
            result["skipped"] = f"time budget: {elapsed:.0f} s elapsed > {args.time_budget:.0f} s"
            report["results"].append(result)
            print(f"[sim_throughput] skip {system}: {result['skipped']}", flush=True)
            continue
        free_memory()
        start = time.perf_counter()
        print(f"[sim_throughput] {system} ...", flush=True)
        try:
            run_engine(cfg, args, result) if system == "engine" else run_sim(cfg, args, result, system)
        except Exception as err:  # noqa: BLE001 - one failing system must not lose the others
            result["error"] = f"{type(err).__name__}: {err}"
            result["traceback"] = traceback.format_exc()[-4000:]
            print(result["traceback"], flush=True)
        result["wall_s"] = time.perf_counter() - start
        free_memory()
        report["results"].append(result)
        engine = next((r for r in report["results"] if r["system"] == "engine" and "tokens_per_s" in r), None)
        for r in report["results"]:
            if engine and "tokens_per_s" in r:
                r["vs_engine"] = r["tokens_per_s"] / engine["tokens_per_s"]
                if "tokens_per_s_with_outer" in r:
                    r["vs_engine_with_outer"] = r["tokens_per_s_with_outer"] / engine["tokens_per_s"]
        report["elapsed_s"] = time.perf_counter() - t0
        checkpoint.replace_text(out_path, json.dumps(report, indent=2, default=str))
        if "tokens_per_s" in result:
            print(f"[sim_throughput] {system}: {result['tokens_per_s'] / 1e3:.1f}K tok/s per GPU, step "
                  f"{result['step_s_median'] * 1e3:.1f} ms, MFU {100 * result['mfu']:.1f}%, "
                  f"x{result.get('vs_engine', float('nan')):.2f} engine, peak {result['peak_mem_gib']} GiB, "
                  f"wall {result['wall_s']:.0f} s", flush=True)

    print(f"\n{report['card']['name']}  torch {report['versions']['torch']}  {args.shape}  M {args.replicas} x S "
          f"{args.stages}  {args.micro} x {args.gas} x {args.seq} tokens per replica step  row {args.variant}")
    print(f"{'system':20} {'tok/s/GPU':>10} {'step ms':>9} {'MFU':>6} {'x engine':>9} {'w/ outer':>9} {'outer ms':>9}")
    for r in report["results"]:
        if "tokens_per_s" not in r:
            print(f"{r['system']:20} -- {(r.get('skipped') or r.get('error', '?'))[:90]}")
            continue
        outer = f"{r['outer_step_s_median'] * 1e3:9.1f}" if "outer_step_s_median" in r else f"{'':9}"
        with_outer = f"{r['vs_engine_with_outer']:9.2f}" if "vs_engine_with_outer" in r else f"{'':9}"
        print(f"{r['system']:20} {r['tokens_per_s']:10.0f} {r['step_s_median'] * 1e3:9.1f} {100 * r['mfu']:5.1f}% "
              f"{r.get('vs_engine', float('nan')):9.2f} {with_outer} {outer}")
    for r in report["results"]:
        if line := profile_line(r):
            print(f"profile {r['system']}: {line}")
    print(f"[sim_throughput] wrote {out_path} ({report['elapsed_s']:.0f} s)", flush=True)
    close_process_group()
    return 0 if all("error" not in r for r in report["results"]) else 1


if __name__ == "__main__":
    sys.exit(main())
