"""The overlapped schedule against DeepSpeed's blocking one on tc-shaped stage links (CPU, gloo), vs the plan.

    python bench/overlap_links.py [--out bench/results] [--quick] [--stages 2,4] [--ratios 1,8]   # as root

Every rank is a real `python -m hetloco_ds.cli train` process in its own network namespace
(`hetloco_ds.netlab`, as bench/shaped_links.py: htb per link, no GSO burst, ACKs first), gloo over
TCP, OMP_NUM_THREADS=1, under `nice -n 10`. Model: bench/shaped_links.py's (d 256, 4 layers, 4
heads, SwiGLU 688, vocab 1024, seq 128, micro-batch 4, fp32 on the wire, token ids int16),
n_mb = 8 micro-batches per step, M = 1 replica, SparseLoCo with H beyond the run (no outer step).

For each S in --stages and ratio in --ratios (1: uncompressed, 8: subspace on every boundary), one
run per schedule (`hetloco.pipeline.schedule` blocking, then overlapped), each visiting the same
stage-link rates while it trains (`ShapedNetwork.set_rate`): unlimited, then r* x 2, r* and r* / 2,
twice, where r* is the rate at which one micro-batch's activation transfer takes as long as the
busiest stage's compute of one micro-batch (forward + backward), measured on the blocking run's
unlimited visit: the regime where hiding transfers matters most. A step counts for a visit if
it started MARGIN_S after the rate was in place.

Per visit and point: the median step time (metrics `seconds`) and the median of the busiest
stage's compute seconds per step (the engine times its forward and backward passes; step rows'
`compute_seconds`). Prediction: `plan.predict` for the same model, S, n_mb, ratio, rate, schedule
(overlap = schedule == overlapped), link efficiency 1448/1514 (TCP over Ethernet), act_bytes 4,
with the device speed calibrated from that point's measured compute (the busiest stage's FLOPs per
micro-batch / its measured seconds per micro-batch, as `hetloco-ds train --link` does). On this
2-core machine an S = 4 run has 4 single-threaded ranks on 2 cores, so a stage's compute is
slower when the other stages compute at the same time, which the overlapped schedule makes
them do: calibrating per point keeps that CPU effect out of what is compared (links and
schedule). Also recorded: the prediction from the unlimited visit's compute alone.

The plan's blocking schedule holds a sender until its receiver has posted the receive and,
since each tensor of a message is its own rendezvous, until every tensor but the last has
arrived. `blocking_send_probe` measures what that rests on: on a shaped link, gloo's blocking
send of one tensor returns as soon as the receive is posted (the kernel takes the data), and the
data arrive one transfer time after the receive is posted, not before (a rendezvous).

Pass criteria (`agreement`): at every point where the plan predicts overlapped >= 1.8x blocking,
each schedule's measured step within 15% of its prediction, and the measured speed-up
(blocking / overlapped step) >= 0.85x the predicted one. The machine's load average is recorded
at the start and at every visit (other jobs share the 2 cores).

Writes overlap_links.json and overlap_links.png.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
for p in (str(REPO), str(BENCH)):
    if p not in sys.path:
        sys.path.insert(0, p)

import shaped_links as sl  # noqa: E402
from hetloco_ds import checkpoint, netlab, plan  # noqa: E402

N_MB = 8
FACTORS = (2.0, 1.0, 0.5)
SCHEDULES = ("blocking", "overlapped")
LINK_EFF = sl.LINK_EFF


def model_for(stages: int) -> dict:
    return dict(sl.MODEL, num_hidden_layers=max(sl.MODEL["num_hidden_layers"], stages))


def predict(stages: int, ratio: int, bw: float, schedule: str, compute_mb: float) -> plan.Prediction:
    """plan.predict with the busiest stage's compute per micro-batch = `compute_mb` seconds."""
    shape = sl.model_shape(model_for(stages))
    kw = dict(stages=stages, replicas=1, stage_bw=bw, replica_bw=1e9, mfu=1.0, micro_batch=sl.MICRO, n_mb=N_MB,
              H=10**6, ratio=ratio, act_bytes=4, overlap=schedule == "overlapped", link_efficiency=LINK_EFF)
    flops = max(plan.predict(shape, tflops=1.0, **kw).flops_per_microbatch)
    return plan.predict(shape, tflops=flops / compute_mb / 1e12, **kw)


def crossover_rate(stages: int, ratio: int, compute_mb: float) -> float:
    """The rate at which one activation transfer takes `compute_mb` seconds."""
    fwd = predict(stages, ratio, 1e9, "blocking", compute_mb).fwd_bytes_microbatch
    return fwd * 8 / compute_mb / LINK_EFF


def blocking_send_probe(tmp: str, env: dict, log) -> list[dict]:
    """gloo's blocking send on a shaped link: when does it return, when does the data arrive, with
    the receive posted at once or 0.1 s late? (The plan's blocking-send semantics rest on this.)"""
    out = []
    for nbytes, rate in ((67584, 4.65e6), (524288, 34.2e6)):  # one compressed / uncompressed message
        for late in (0.0, 0.1):
            rows = sl.probe_sends(tmp, env, rate, [nbytes], 8, late)[1:]
            T = nbytes * 8 / (rate * LINK_EFF)
            row = {"bytes": nbytes, "rate_bps": rate, "receive_posted_late_s": late, "transfer_s": T,
                   "send_returns_s": statistics.median(r["send_done"] for r in rows),
                   "recv_done_s": statistics.median(r["recv_done"] for r in rows)}
            out.append(row)
            log(f"send probe {nbytes} B @ {rate / 1e6:g} Mbit/s, receive posted {late} s late: send returns "
                f"{row['send_returns_s']:.4f} s, data in {row['recv_done_s']:.4f} s (transfer {T:.4f} s)")
    return out


def one_run(tmp: str, stages: int, ratio: int, schedule: str, rates: list[float] | None, env: dict, quick: bool,
            log) -> tuple[list[dict], list[float]]:
    """Train under `schedule`, visiting unlimited then `rates` (from this run's calibration when None)."""
    name = f"s{stages}_r{ratio}_{schedule}"
    model_path = os.path.join(tmp, f"{name}.model.json")
    Path(model_path).write_text(json.dumps(model_for(stages)))
    cfg = os.path.join(tmp, f"{name}.json")
    Path(cfg).write_text(json.dumps(sl.ds_config(stages, N_MB, ratio, inner_steps=10**6, schedule=schedule)))
    out = os.path.join(tmp, name)
    os.makedirs(out)
    n = 3 if quick else 5
    visits = []
    with netlab.ShapedNetwork(stages, netlab.replica_coords([stages]), stage_rate_bps=sl.UNLIMITED) as net:
        run = sl.EngineRun(net, sl.train_cmd(cfg, model_path, out), out, env)
        try:
            sl.wait_steps(run, 2, max_s=300)  # start-up and the first step

            def visit(bw: float) -> None:
                t0 = sl.set_rate(net, bw)
                rows = [v[0] for v in sl.collect(run, t0, n, max_s=60 + n * 20).values()]
                visits.append({"bw": bw, "rows": rows, "loadavg_1min": os.getloadavg()[0]})
                log(f"{name} {sl.label(bw):>14}: step median {statistics.median(r['seconds'] for r in rows):.3f} s "
                    f"(n={len(rows)}), busiest compute {statistics.median(max(r['compute_seconds']) for r in rows):.3f} s "
                    f"(load {visits[-1]['loadavg_1min']:.1f})")

            visit(sl.UNLIMITED)
            if rates is None:
                unl = statistics.median(max(r["compute_seconds"]) / N_MB for r in visits[0]["rows"])
                rates = [crossover_rate(stages, ratio, unl) * f for f in FACTORS]
            for _ in range(1 if quick else 2):
                for bw in rates:
                    visit(bw)
        finally:
            run.stop()
    return visits, rates


def points_of(stages: int, ratio: int, schedule: str, visits: list[dict]) -> list[dict]:
    out = []
    unl = [max(r["compute_seconds"]) / N_MB for v in visits if v["bw"] == sl.UNLIMITED for r in v["rows"]]
    for bw in sorted({v["bw"] for v in visits}, reverse=True):
        rows = [r for v in visits if v["bw"] == bw for r in v["rows"]]
        secs = [r["seconds"] for r in rows]
        comp = statistics.median(max(r["compute_seconds"]) for r in rows) / N_MB
        p = predict(stages, ratio, min(bw, 1e15), schedule, comp)
        p_unl = predict(stages, ratio, min(bw, 1e15), schedule, statistics.median(unl))
        step = statistics.median(secs)
        act = [r["bytes"]["activation"]["sent"] + r["bytes"]["activation_grad"]["sent"] for r in rows]
        # Diagnostic: the schedule simulation fed with each stage's own measured compute (forward
        # 1/3, backward 2/3) instead of FLOP proportions scaled to the busiest stage.
        by_stage = [statistics.median(r["compute_seconds"][s] for r in rows) / N_MB for s in range(stages)]
        sim_own = plan.simulate_schedule(schedule, stages, N_MB, [c / 3 for c in by_stage], [2 * c / 3 for c in by_stage],
                                         p.link_time_fwd, p.link_time_bwd)
        out.append({
            "stages": stages, "ratio": ratio, "schedule": schedule, "stage_bw_bps": None if bw == sl.UNLIMITED else bw,
            "label": sl.label(bw), "step_seconds": sl.summary(secs),
            "compute_seconds_per_microbatch_busiest": comp,
            "visit_medians": [round(statistics.median(r["seconds"] for r in v["rows"]), 4) for v in visits if v["bw"] == bw],
            "visit_loadavg_1min": [round(v["loadavg_1min"], 2) for v in visits if v["bw"] == bw],
            "stage_link_bytes_per_step": statistics.median(act),
            "predicted": {"step_seconds": p.total_time, "utilisation": p.utilisation,
                          "stage_link_bytes_per_step": p.stage_link_bytes_per_step,
                          "link_time_fwd": p.link_time_fwd, "link_time_bwd": p.link_time_bwd,
                          "compute_time_microbatch": max(p.compute_time_microbatch), "breakdown": p.breakdown,
                          "step_seconds_unlimited_calibration": p_unl.total_time,
                          "schedule_seconds_with_each_stages_measured_compute": sim_own},
            "compute_seconds_per_microbatch_by_stage": by_stage,
            "measured_over_predicted": step / p.total_time,
        })
    return out


def agreement(points: list[dict]) -> dict:
    """Per (S, ratio, rate) with both schedules: predicted and measured speed-ups and the criteria."""
    rows = []
    keys = sorted({(p["stages"], p["ratio"], p["stage_bw_bps"]) for p in points if p["stage_bw_bps"]})
    for S, r, bw in keys:
        by = {p["schedule"]: p for p in points if (p["stages"], p["ratio"], p["stage_bw_bps"]) == (S, r, bw)}
        if set(by) != set(SCHEDULES):
            continue
        b, o = by["blocking"], by["overlapped"]
        pred = b["predicted"]["step_seconds"] / o["predicted"]["step_seconds"]
        meas = b["step_seconds"]["median"] / o["step_seconds"]["median"]
        row = {"stages": S, "ratio": r, "stage_bw_bps": bw, "label": b["label"],
               "predicted_speedup": round(pred, 3), "measured_speedup": round(meas, 3),
               "speedup_measured_over_predicted": round(meas / pred, 3),
               "blocking_measured_over_predicted": round(b["measured_over_predicted"], 3),
               "overlapped_measured_over_predicted": round(o["measured_over_predicted"], 3)}
        if pred >= 1.8:
            row["passes"] = (abs(b["measured_over_predicted"] - 1) <= 0.15 and abs(o["measured_over_predicted"] - 1) <= 0.15
                             and meas >= 0.85 * pred)
        rows.append(row)
    judged = [r for r in rows if "passes" in r]
    return {"points": rows, "judged": len(judged), "passed": sum(r["passes"] for r in judged),
            "criteria": "where predicted speed-up >= 1.8: each schedule within 15% of its prediction and measured "
                        "speed-up >= 0.85 x predicted"}


def plot(result: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    combos = sorted({(p["stages"], p["ratio"]) for p in result["points"]})
    fig, axes = plt.subplots(1, len(combos), figsize=(5.5 * len(combos), 4.8), squeeze=False)
    colors = {"blocking": "tab:red", "overlapped": "tab:blue"}
    for ax, (S, r) in zip(axes[0], combos):
        pts = [p for p in result["points"] if (p["stages"], p["ratio"]) == (S, r) and p["stage_bw_bps"]]
        if not pts:
            continue
        lo, hi = min(p["stage_bw_bps"] for p in pts) / 1.5, max(p["stage_bw_bps"] for p in pts) * 1.5
        grid = [lo * (hi / lo) ** (i / 40) for i in range(41)]
        for sched in SCHEDULES:
            mine = sorted((p for p in pts if p["schedule"] == sched), key=lambda p: p["stage_bw_bps"])
            if not mine:
                continue
            comp = statistics.median(p["compute_seconds_per_microbatch_busiest"] for p in mine)
            ax.plot([g / 1e6 for g in grid], [predict(S, r, g, sched, comp).total_time for g in grid], "-",
                    color=colors[sched], lw=1, label=f"{sched}: plan (median compute of the run)")
            x = [p["stage_bw_bps"] / 1e6 for p in mine]
            ax.plot(x, [p["predicted"]["step_seconds"] for p in mine], "x", color=colors[sched], ms=8,
                    label=f"{sched}: plan (compute measured at the point)")
            ax.errorbar(x, [p["step_seconds"]["median"] for p in mine],
                        yerr=[[p["step_seconds"]["median"] - p["step_seconds"]["min"] for p in mine],
                              [p["step_seconds"]["max"] - p["step_seconds"]["median"] for p in mine]],
                        fmt="o", color=colors[sched], capsize=3, label=f"{sched}: measured (median, min-max)")
        ax.set(xscale="log", xlabel="stage-link rate (Mbit/s)", ylabel="step time (s)",
               title=f"S = {S}, {'uncompressed' if r == 1 else f'ratio {r}'}, {N_MB} micro-batches")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"hetloco-ds train on tc-shaped stage links, CPU ({result['machine']['cores']} cores), gloo/TCP: "
                 "overlapped vs blocking schedule, measured vs plan", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=str(REPO / "bench" / "results"))
    ap.add_argument("--quick", action="store_true", help="fewer steps and one round of rates (a smoke run)")
    ap.add_argument("--stages", default="2,4")
    ap.add_argument("--ratios", default="1,8")
    args = ap.parse_args(argv)
    if not sl.netlab_ready("overlap_links"):
        return 2
    log = sl.RunLog()
    env = sl.child_env(PYTHONPATH=str(REPO))
    info = sl.machine()
    tmp = tempfile.mkdtemp(prefix="overlap-links-")
    probe: list[dict] = []
    points: list[dict] = []
    rates_used: dict = {}
    try:
        sl.prepare_cache(env)
        probe = blocking_send_probe(tmp, env, log)
        for S in (int(x) for x in args.stages.split(",")):
            for r in (int(x) for x in args.ratios.split(",")):
                rates = None
                for sched in SCHEDULES:
                    visits, rates = one_run(tmp, S, r, sched, rates, env, args.quick, log)
                    points += points_of(S, r, sched, visits)
                rates_used[f"S{S}_r{r}"] = rates
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    info["loadavg_at_end"] = os.getloadavg()
    agree = agreement(points)
    for row in agree["points"]:
        log(f"S={row['stages']} ratio {row['ratio']} @ {row['label']}: speed-up measured {row['measured_speedup']} "
            f"vs plan {row['predicted_speedup']}; blocking x{row['blocking_measured_over_predicted']}, overlapped "
            f"x{row['overlapped_measured_over_predicted']}" + (f"; passes {row['passes']}" if "passes" in row else ""))
    result = {
        "what": "hetloco-ds train on tc-shaped stage links, both pipeline schedules, vs plan.predict; "
                "bench/overlap_links.py's docstring defines every number",
        "machine": info,
        "command": "python bench/overlap_links.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "total_seconds": log.elapsed(),
        "settings": {"model": {**sl.MODEL, "vocab_size": sl.VOCAB}, "seq_len": sl.SEQ, "micro_batch": sl.MICRO,
                     "n_mb": N_MB, "replicas": 1, "rates_bps": rates_used, "rate_factors_of_crossover": FACTORS,
                     "plan": {"link_efficiency": LINK_EFF, "act_bytes": 4, "latency": 0, "mfu": 1.0,
                              "calibration": "per point: busiest stage's measured compute per micro-batch"},
                     "nice": " ".join(sl.NICE), "OMP_NUM_THREADS": 1, "step_margin_s": sl.MARGIN_S},
        "agreement": agree,
        "blocking_send_probe": probe,
        "points": points,
        "log": log.lines,
    }
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "overlap_links.json")
    checkpoint.replace_text(path, json.dumps(result, indent=1) + "\n")
    plot(result, os.path.join(args.out, "overlap_links.png"))
    log(f"wrote {path} and overlap_links.png; {agree['passed']}/{agree['judged']} judged points pass")
    return 0


if __name__ == "__main__":
    sys.exit(main())
