"""Device memory and outer-step time with the SparseLoCo outer state on the GPU or on the host.

`sparseloco.outer_state_device` "gpu" keeps theta at the last sync and the error feedback (8 B per
parameter, fp32) on the stage's device; "cpu" keeps them in pinned host memory between outer steps.
For each placement, in fresh processes (one per GPU, spawned here), our engine trains the preset in
bf16 with the benches' AdamW and SparseLoCo every `--inner-steps` H, on random tokens, for `--steps`
steps (outer steps inside steps H, 2H, ...); M = world / stages replicas, replica 1 compressed at
`--ratio` when M > 1 (as ../shared/anchors/het_1b.json). Per rank:

  build_gib            allocated once the engine is built (weights; the outer state under "gpu")
  train_peak_gib       peak allocated in each step's forward, backward and AdamW (reset before the step)
  outer_peak_gib       peak allocated inside engine.outer_step (reset when it starts)
  peak_gib             the larger of the two over the run: what is compared with stock DeepSpeed
  max_reserved_gib, alloc_retries   the caching allocator's peak reserved bytes and cudaMalloc retries
  outer_s              engine.outer_step's seconds (prepare, all-gather, finish, embedding resync) between a
                       device sync before and after; under "cpu" the last copies back to the host can
                       run on past it, beside the next step, so `after_outer_s` is reported too
  inner_s              median seconds of the steps without an outer step (step = train_step between syncs)
  after_outer_s        median seconds of the steps right after an outer step
  state_gib            sizes.stage_state_bytes of the rank's parameters (activations aside), to read the
                       peaks by; `stock_state_gib` stock DeepSpeed's bf16 state for the same parameters
  param_sha256         the stage's parameters after the last step: equal across placements when the
                       kernels are deterministic (`--deterministic`; flash attention's backward is not)
  snapshot             with `--snapshot-step N`: the allocator's history over step N (the outer step's
                       when N is a multiple of H), dumped to --snapshot-dir as <placement>_rank<r>.pickle
                       for https://pytorch.org/memory_viz: which tensors make each peak

The summary per placement takes the max over ranks; `saved_gib` is gpu - cpu of peak_gib per rank (max),
`outer_s_added` the median outer step's cpu - gpu, `same_bits` whether every rank's hash agrees.

    python bench/outer_state.py --shape 1B --vocab 8192 --world 1 --stages 1            # one GPU
    python bench/outer_state.py --shape 1B --vocab 8192 --world 4 --stages 2            # M = 2 x S = 2
    python bench/outer_state.py --shape 8B --vocab 128256 --world 4 --stages 4 --micro 1 --seq 2048
    python bench/outer_state.py --cpu-smoke                                              # tiny, gloo, CPU

From Python (bench/scale.py): `measure_outer_state(shape="1B", vocab=8192, world=4, stages=2)` returns the
report as a dict (and writes it to `out` when given).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

BENCH = os.path.dirname(os.path.abspath(__file__))
if BENCH not in sys.path:
    sys.path.insert(0, BENCH)

from _common import (  # noqa: E402 - stdlib-only at import; torch / deepspeed are imported inside
    CollectiveCounter, add_model_args, batches, build_ours, config_row, deterministic_kernels, driver_setup,
    finish_report, mem_gib, new_report, ours_config, ours_part_info, run_main, run_worker, spawn_workers,
    stage_hash, sync, timed_call, versions_line, worker_argv, write_report,
)

PLACEMENTS = ("gpu", "cpu")
COUNTER = CollectiveCounter()


def stock_bf16_state_bytes(params: int, replicas: int) -> float:
    """Stock DeepSpeed 0.19.8's bf16 pipeline state for `params` parameters of a stage (BF16_Optimizer,
    ZeRO 0, immediate_grad_update off): bf16 weights 2 + their bf16 gradients 2 + the fp32 gradient
    accumulation buffer 4 per parameter, and the fp32 master weights 4 + Adam's moments 8 partitioned
    over the `replicas` data-parallel ranks (runtime/bf16_optimizer.py)."""
    return params * (2 + 2 + 4 + 12 / replicas)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p)
    p.set_defaults(shape="1B", vocab=8192, seq=1024)
    p.add_argument("--world", type=int, default=1, help="processes (GPUs)")
    p.add_argument("--stages", type=int, default=1, help="pipeline stages S; replicas M = world / S")
    p.add_argument("--ratio", type=int, default=8, help="d/k of replica 1 when M > 1 (1: none compressed)")
    p.add_argument("--inner-steps", type=int, default=3, help="H")
    p.add_argument("--steps", type=int, default=0, help="steps per placement (0: 2H + 1, two outer steps)")
    p.add_argument("--placements", default=",".join(PLACEMENTS), help="comma-separated subset of gpu,cpu")
    p.add_argument("--deterministic", action="store_true",
                   help="deterministic kernels (math attention), so the placements' parameter hashes can agree")
    p.add_argument("--snapshot-step", type=int, default=0, help="record the allocator's history over this step")
    p.add_argument("--snapshot-dir", default=None, help="where the snapshots go (default $OUT or the --out folder)")
    p.add_argument("--timeout", type=float, default=1200.0, help="seconds per placement (all ranks)")
    p.add_argument("--out", default=None, help="JSON path (default $OUT/outer_state.json or bench/results/)")
    p.add_argument("--cpu-smoke", action="store_true", help="preset tiny, vocab 256, seq 32, micro 2, gas 2, "
                                                            "world 2, H 2, gloo on the CPU")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--part", default=None, help=argparse.SUPPRESS)
    if "--cpu-smoke" in (sys.argv[1:] if argv is None else argv):  # defaults only: explicit flags win
        p.set_defaults(shape="tiny", vocab=256, seq=32, micro=2, gas=2, world=2, inner_steps=2)
    args = p.parse_args(argv)
    if args.steps <= 0:
        args.steps = 2 * args.inner_steps + 1
    if args.world % args.stages:
        p.error(f"--world {args.world} is not a multiple of --stages {args.stages}")
    if args.snapshot_step and args.snapshot_dir is None:
        args.snapshot_dir = os.environ.get("OUT") or os.path.dirname(os.path.abspath(args.out or "outer_state.json"))
    if args.steps < args.inner_steps + 1:
        p.error(f"--steps {args.steps} must reach past the first outer step at step H = {args.inner_steps}")
    bad = [x for x in args.placements.split(",") if x not in PLACEMENTS]
    if bad or not args.placements:
        p.error(f"--placements {args.placements!r}: choose from {','.join(PLACEMENTS)}")
    return args


# ============================================================================ worker side
def run_placement(cfg, args, part) -> None:
    """One rank under placement args.worker: build, train args.steps steps, record memory and times."""
    import torch

    from hetloco_ds import sizes

    cuda = torch.cuda.is_available()
    replicas = args.world // args.stages
    compressed = replicas > 1 and args.ratio > 1
    subspace = {"ratio": args.ratio, "compressed_replicas": [1]} if compressed else {}
    raw = ours_config(args.micro, args.gas, args.stages, True, args.inner_steps, subspace, args.seq,
                      max(256, cfg.vocab_size))
    raw["hetloco"]["sparseloco"]["outer_state_device"] = args.worker
    part["ds_config"] = raw
    module, engine = build_ours(raw, cfg, args.seq, source="bench/outer_state.py")
    part.update(ours_part_info(engine, module, cfg), on_host=engine.algorithm.outer.on_host)
    params = part["n_params_local"]
    part.update(state_gib=sizes.stage_state_bytes(params, outer_state_device=args.worker) / 2**30,
                stock_state_gib=stock_bf16_state_bytes(params, replicas) / 2**30, build_gib=mem_gib("now"))
    data = batches(cfg, args.micro, args.seq, seed=1234 + engine.replica)

    def reset_peak():
        if cuda:
            torch.cuda.reset_peak_memory_stats()

    train_peak = []
    outer_step = engine.outer_step

    def measured_outer_step():  # the step's train part ends here: its peak, then the outer step's own
        sync()
        train_peak.append(mem_gib("peak"))
        reset_peak()
        start = time.perf_counter()
        out = outer_step()
        sync()
        return {**out, "synced_s": time.perf_counter() - start, "peak_gib": mem_gib("peak")}

    engine.outer_step = measured_outer_step
    steps = []
    for i in range(1, args.steps + 1):
        train_peak.clear()
        reset_peak()
        snapshot = cuda and i == args.snapshot_step
        if snapshot:
            torch.cuda.memory._record_memory_history(max_entries=200_000)
        rec, dt, _ = timed_call(lambda: engine.train_step(data), COUNTER, count=False)
        if snapshot:
            part["snapshot"] = os.path.join(args.snapshot_dir, f"{args.worker}_rank{part['rank']}.pickle")
            torch.cuda.memory._dump_snapshot(part["snapshot"])
            torch.cuda.memory._record_memory_history(enabled=None)
        outer = rec.outer
        steps.append({"step": i, "s": dt, "loss": rec.loss,
                      "train_peak_gib": train_peak[0] if train_peak else mem_gib("peak"),
                      "outer_peak_gib": outer["peak_gib"] if outer else None,
                      "outer_s": outer["synced_s"] if outer else None})
    part["steps"] = steps
    part["param_sha256"] = stage_hash(engine.trainable_params())["sha256"]
    if cuda:
        part.update(max_reserved_gib=round(torch.cuda.max_memory_reserved() / 2**30, 3),
                    alloc_retries=torch.cuda.memory_stats().get("num_alloc_retries"))


def worker_main(args) -> int:
    if args.deterministic:
        deterministic_kernels()
    return run_worker(args, COUNTER, lambda cfg, part: run_placement(cfg, args, part), system="ours")


# ============================================================================ driver side
def _median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def summarize(name: str, parts: list[dict], args) -> dict:
    """One placement's row: per rank memory and times, and their max over ranks."""
    ranks = []
    for p in sorted(parts, key=lambda p: p["rank"]):
        steps = p["steps"]
        outer_at = [s["step"] for s in steps if s["outer_s"] is not None]
        peaks = [s["train_peak_gib"] for s in steps] + [s["outer_peak_gib"] for s in steps]
        peaks = [x for x in peaks if x is not None]
        ranks.append({
            "rank": p["rank"], "stage": p["stage"], "replica": p["replica"], "n_params_local": p["n_params_local"],
            "on_host": p["on_host"], "build_gib": p.get("build_gib"), "state_gib": p["state_gib"],
            "stock_state_gib": p["stock_state_gib"],
            "train_peak_gib": max((s["train_peak_gib"] or 0) for s in steps) or None,
            "outer_peak_gib": max((s["outer_peak_gib"] or 0) for s in steps) or None,
            "peak_gib": max(peaks) if peaks else None,
            "max_reserved_gib": p.get("max_reserved_gib"), "alloc_retries": p.get("alloc_retries"),
            "outer_s": _median([s["outer_s"] for s in steps]),
            "inner_s": _median([s["s"] for s in steps if s["outer_s"] is None and s["step"] - 1 not in outer_at
                                and s["step"] > 1]),
            "after_outer_s": _median([s["s"] for s in steps if s["step"] - 1 in outer_at]),
            "losses": [s["loss"] for s in steps], "param_sha256": p["param_sha256"],
        })

    def top(key):
        values = [r[key] for r in ranks if r[key] is not None]
        return max(values) if values else None

    return {"config": name, "placement": name, "ranks": ranks,
            **{k: top(k) for k in ("peak_gib", "train_peak_gib", "outer_peak_gib", "state_gib", "stock_state_gib",
                                   "max_reserved_gib", "outer_s", "inner_s", "after_outer_s")}}


def compare(rows: dict) -> dict:
    """gpu against cpu, where both ran: device memory saved per rank, outer-step seconds added, same bits."""
    if not {"gpu", "cpu"} <= set(rows) or any("error" in rows[k] for k in ("gpu", "cpu")):
        return {}
    gpu, cpu = rows["gpu"]["ranks"], rows["cpu"]["ranks"]
    saved = [g["peak_gib"] - c["peak_gib"] for g, c in zip(gpu, cpu)
             if g["peak_gib"] is not None and c["peak_gib"] is not None]
    added = [c["outer_s"] - g["outer_s"] for g, c in zip(gpu, cpu)
             if g["outer_s"] is not None and c["outer_s"] is not None]
    return {"saved_gib_per_rank": [round(x, 3) for x in saved], "saved_gib": max(saved) if saved else None,
            "outer_s_added": max(added) if added else None,
            "same_bits": all(g["param_sha256"] == c["param_sha256"] for g, c in zip(gpu, cpu)),
            "same_losses": all(g["losses"] == c["losses"] for g, c in zip(gpu, cpu))}


def print_tables(report: dict) -> None:
    print(versions_line(report))
    print(f"{'placement':>9} {'rank':>4} {'stage':>5} {'params':>13} {'state':>7} {'stock':>7} {'train pk':>9} "
          f"{'outer pk':>9} {'reserved':>9} {'outer s':>8} {'inner s':>8} {'after s':>8}")
    for row in report["results"]:
        for r in row.get("ranks", []):
            cells = [r["state_gib"], r["stock_state_gib"], r["train_peak_gib"], r["outer_peak_gib"],
                     r["max_reserved_gib"], r["outer_s"], r["inner_s"], r["after_outer_s"]]
            print(f"{row['placement']:>9} {r['rank']:>4} {r['stage']:>5} {r['n_params_local']:>13,} "
                  + " ".join(f"{x:>{w}.3f}" if x is not None else f"{'-':>{w}}"
                             for x, w in zip(cells, (7, 7, 9, 9, 9, 8, 8, 8))))
    if report.get("comparison"):
        print("gpu - cpu:", report["comparison"])


def driver_main(args) -> int:
    report = _drive(args)
    return 0 if report["ok"] else 1


def _drive(args) -> dict:
    t0 = time.perf_counter()
    out_path = driver_setup(args, "outer_state.json")
    report = new_report(args, "this script spawns --world processes per placement (fresh), one per GPU; "
                              "the driver writes this file", __doc__.split("The summary")[0].strip())
    passthru = worker_argv(args, ["--shape", "--vocab", "--seq", "--micro", "--gas", "--world", "--stages",
                                  "--ratio", "--inner-steps", "--steps", "--snapshot-step", "--snapshot-dir"],
                           ["--cpu-smoke", "--deterministic"])
    ok, rows = True, {}
    with tempfile.TemporaryDirectory(prefix="outer_state_") as tmp:
        for name in args.placements.split(","):
            print(f"[outer_state] {name} ...", flush=True)
            parts, error, wall = spawn_workers(__file__, name, args.world, passthru, tmp, args.timeout,
                                               args.cpu_smoke, "outer_state", tail_chars=2500)
            row, row_ok = config_row(report, name, parts, error, lambda: summarize(name, parts, args))
            row["wall_s"] = wall
            ok = ok and row_ok
            rows[name] = row
            report["results"].append(row)
            write_report(report, out_path, t0)
    report["comparison"] = compare(rows)
    report["ok"] = ok
    finish_report(report, out_path, t0, print_tables, "outer_state", ok)
    return report


def measure_outer_state(shape: str | None = None, vocab: int | None = None, world: int | None = None,
                        stages: int | None = None, micro: int | None = None, gas: int | None = None,
                        seq: int | None = None, inner_steps: int | None = None, steps: int | None = None,
                        ratio: int | None = None, placements=PLACEMENTS, deterministic: bool = False,
                        snapshot_step: int | None = None, snapshot_dir: str | None = None,
                        timeout: float | None = None, out: str | None = None, cpu_smoke: bool = False) -> dict:
    """One run of this bench (module docstring), returned as a dict: `results` (a row per placement, its
    ranks under `ranks`), `comparison` (saved_gib, outer_s_added, same_bits, same_losses) and `ok`.
    Arguments left None take the command line's defaults (the smoke's under `cpu_smoke`); the JSON
    goes to `out`, or to a temporary file that is removed."""
    options = dict(shape=shape, vocab=vocab, world=world, stages=stages, micro=micro, gas=gas, seq=seq,
                   inner_steps=inner_steps, steps=steps, ratio=ratio, snapshot_step=snapshot_step,
                   snapshot_dir=snapshot_dir, timeout=timeout)
    argv = ["--cpu-smoke"] if cpu_smoke else []
    for key, value in options.items():
        if value is not None:
            argv += [f"--{key.replace('_', '-')}", str(value)]
    argv += ["--placements", ",".join(placements)] + (["--deterministic"] if deterministic else [])
    with tempfile.TemporaryDirectory(prefix="outer_state_") as tmp:
        return _drive(parse_args(argv + ["--out", out or os.path.join(tmp, "outer_state.json")]))


if __name__ == "__main__":
    sys.exit(run_main(parse_args, worker_main, driver_main))
