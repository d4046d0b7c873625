"""The paper's Figure 2 on two GPUs: stage and replica links at internet rates, measured against `plan`.

    OUT=... bash bench/gpu.sh --gpus 2 --timeout 550 gpu_links.py              # carry .whl and .netbin
    python bench/gpu_links.py --cpu-smoke --out /tmp/x                          # the same path on this CPU (root)
    python bench/gpu_links.py --plot bench/results/gpu_links_h200x2.json        # redraw the figure from the JSON

Every rank is a real `python -m hetloco_ds.cli train` process in its own network namespace
(`hetloco_ds.netlab`: a veth pair per rank into a bridge, htb on each rank's egress at the link's
rate, no GSO burst, TCP ACKs ahead of data; as bench/shaped_links.py on the CPU), one GPU each
(LOCAL_RANK = rank). NCCL is kept off every path but that link: NCCL_P2P_DISABLE, NCCL_SHM_DISABLE,
NCCL_IB_DISABLE and NCCL_NET=Socket, NCCL_SOCKET_IFNAME = the namespace's veth (netlab sets it), and
our overlapped schedule's stage-link messages on `process_group` (NCCL), not the copy engines (which
would move them over NVLink, unshaped). The GPU machine has no iproute2: `.netbin/` carries the
build machine's `ip` and `tc` with their libraries (bench/netbin.sh makes it; it goes on PATH here).

Model: the 512M preset (d 1536, 12 layers; the larger of the two the issue names, and the one whose
width 96 divides), vocabulary 8192 (the default stdlib BPE and corpus), seq 2048, bf16 (activations and
their gradients cross as bf16; a compressed boundary also sends the int16 token ids), micro-batch 1,
8 micro-batches a step, AdamW, SparseLoCo with H beyond the run in (a).

(a) Stage link: S = 2, M = 1, ratio 96, 8 and 1 (1: `compressed_replicas: "none"`), each under both
    schedules (`hetloco.pipeline.schedule` "blocking": DeepSpeed's 1F1B, each transfer stalls the
    stage; "overlapped": receives posted ahead, sends in the background). One training run per
    (ratio, schedule); the link's rate changes during it (`ShapedNetwork.set_rate`): unshaped,
    1 Gbit/s, 300 Mbit/s, 100 Mbit/s, unshaped. A step counts for a visit only if it started
    MARGIN_S after the rate was in place. Reported per point: the median step (metrics `seconds`,
    taken once the host holds the step's loss) with its spread.
(b) Replica link: M = 2, S = 1, SparseLoCo H = 2 (one micro-batch a step): per outer step the
    smaller of the two replicas' `outer` rows' seconds (error feedback, top-k, packing, the exchange
    -- NCCL's all_gather --, decoding, the outer SGD), at the same rates.
Link probe (p): NCCL alone between the two namespaces, one-way sends of each ratio's message, per
    rate: what the link itself moves, and the "unshaped" rate given to plan (the htb class is
    10 Gbit/s, but one TCP stream of one frame per skb moves far less).
Send probe (s): at 100 Mbit/s, when a blocking send of 64 KB to 12 MB ends on its sender (a device
    sync after it), with the receive posted at once and 0.3 s late: what plan's blocking schedule
    assumes of the transport (a rendezvous) against what NCCL's net transport does.

Predictions: `plan.predict` with the run's shapes, schedule (overlap = schedule == "overlapped"),
bf16 (act_bytes 2), link_efficiency 1448/1514 (TCP over Ethernet frames with timestamps). One
device speed for every point: FLOP/s calibrated on the first ratio's (96's) blocking run's unshaped
visits (plan's step there, on the probe's unshaped rate, equals the measured one; at ratio 96 a
transfer is under 1% of a step), so the unshaped points of ratio 8 and 1 are predictions too. Measured compute
utilisation = plan's link-free step for that (ratio, schedule) / measured step; predicted = plan's
link-free step / plan's step at the rate (the paper's Figure 2: the share of link-free speed that
survives the link). Also recorded: the prediction calibrated on that run's own unshaped visits.
(b): plan's outer-sync (link) time + the measured unshaped outer step less plan's unshaped link time.

Writes gpu_links.json after every run (card, command, settings, probes, points, agreement, and
`hidden_transfers`: how much of each micro-batch's transfers a step did not pay) and gpu_links.png.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
for p in (str(REPO), str(BENCH)):
    if p not in sys.path:
        sys.path.insert(0, p)

import shaped_links as sl  # noqa: E402
from hetloco_ds import netlab, plan, rehearse  # noqa: E402
from hetloco_ds.presets import PRESETS  # noqa: E402

LINK_EFF = sl.LINK_EFF
UNSHAPED = sl.UNLIMITED
RATES = (1e9, 300e6, 100e6)
SCHEDULES = ("blocking", "overlapped")
KILL = signal.SIGKILL
"""How a run is stopped: at once, as a SIGTERM asks the engine for a preemption save nothing here reads."""
NCCL_SOCKETS = {**rehearse.NCCL_SOCKETS, "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                "NVSHMEM_DISABLE_NVLS": "1"}


class Setup:
    """What one invocation measures: the GPU shape, or (`--cpu-smoke`) a tiny CPU stand-in."""

    def __init__(self, smoke: bool, micro: int | None = None, ratios: tuple[int, ...] | None = None,
                 compile: bool = False):
        self.smoke, self.compile = smoke, compile
        if smoke:
            self.model = dict(sl.MODEL, max_position_embeddings=128)
            self.name, self.vocab, self.seq, self.micro, self.n_mb = "d256", 1024, 128, 4, 4
            self.ratios, self.rates, self.bf16 = (8, 1), (20e6, 5e6), False
        else:
            self.model = dict(PRESETS["512M"])
            self.name, self.vocab, self.seq, self.micro, self.n_mb = "512M", 8192, 2048, 1, 8
            self.ratios, self.rates, self.bf16 = (96, 8, 1), RATES, True
        self.micro = micro or self.micro
        self.ratios = tuple(ratios or self.ratios)
        self.act_bytes = 2 if self.bf16 else 4

    @classmethod
    def of(cls, result: dict) -> "Setup":
        """The setup a result's JSON was measured with."""
        st = result["settings"]
        return cls(st["smoke"], st["micro_batch"], tuple(st["ratios"]), st.get("compile", False))

    def shape(self) -> plan.ModelShape:
        return sl.model_shape(self.model, self.vocab, self.seq)

    def config(self, stages: int, replicas_h: int | None, ratio: int, schedule: str) -> dict:
        """DeepSpeed JSON: (a) S = stages with H beyond the run, (b) S = 1 with H = replicas_h."""
        n_mb = self.n_mb if replicas_h is None else 1
        cfg = sl.ds_config(stages, n_mb, ratio, inner_steps=replicas_h or 10**6, micro=self.micro, seq=self.seq,
                           vocab=self.vocab, schedule=schedule)
        cfg["bf16"] = {"enabled": self.bf16}
        cfg["hetloco"]["train"]["compile"] = self.compile
        cfg["hetloco"]["pipeline"]["link_transport"] = "process_group"  # NCCL over the shaped veth, never NVLink
        return cfg

    def predict(self, ratio: int, bw: float, schedule: str, tflops: float) -> plan.Prediction:
        return plan.predict(self.shape(), stages=2, replicas=1, stage_bw=bw, replica_bw=1e9, tflops=tflops, mfu=1.0,
                            micro_batch=self.micro, n_mb=self.n_mb, H=10**6, ratio=ratio, act_bytes=self.act_bytes,
                            overlap=schedule == "overlapped", link_efficiency=LINK_EFF)

    def predict_replica(self, bw: float) -> plan.Prediction:
        return plan.predict(self.shape(), stages=1, replicas=2, stage_bw=1e9, replica_bw=bw, tflops=1.0, mfu=1.0,
                            micro_batch=self.micro, n_mb=1, H=2, topk=32, chunk=4096, act_bytes=self.act_bytes,
                            overlap=False, link_efficiency=LINK_EFF)

    def calibrate(self, ratio: int, schedule: str, bw: float, step_s: float) -> float:
        """The TFLOP/s at which plan's step for (ratio, schedule) on `bw` is `step_s` (bisection in log space)."""
        lo, hi = 1e-6, 1e5
        for _ in range(200):
            mid = math.sqrt(lo * hi)
            if self.predict(ratio, bw, schedule, mid).total_time > step_s:
                lo = mid
            else:
                hi = mid
        return math.sqrt(lo * hi)


# ----------------------------------------------------------------------------- the link probe

def link_probe(setup: Setup, tmp: str, env: dict, log) -> list[dict]:
    sizes = sorted({setup.predict(r, 1e9, "blocking", 1.0).fwd_bytes_microbatch for r in setup.ratios})
    out = []
    for bw in (UNSHAPED, *setup.rates):
        rows = sl.probe_sends(tmp, env, bw, sizes, 5 if bw >= 300e6 else 3, 0.0)
        for n in sizes:
            secs = [r["recv_done"] for r in rows if r["bytes"] == n]
            med = statistics.median(secs)
            model = n * 8 / (bw * LINK_EFF) if bw != UNSHAPED else None
            out.append({"label": sl.label(bw), "rate_bps": None if bw == UNSHAPED else bw, "bytes": n,
                        "one_way_seconds": sl.summary(secs), "goodput_bps": n * 8 / med,
                        "link_model_seconds": model, "measured_over_link_model": med / model if model else None})
            log(f"probe {sl.label(bw):>14} {n:>9} B: {med * 1e3:8.2f} ms, {n * 8 / med / 1e6:8.1f} Mbit/s"
                + (f" ({med / model:.3f}x bytes / (rate x {LINK_EFF:.3f}))" if model else ""))
    return out


def send_probe(setup: Setup, tmp: str, env: dict, log, rate: float = 100e6) -> list[dict]:
    """When does a blocking send end on the sender's stream (host after a device sync), with the
    receive posted at once or 0.3 s late? plan's blocking schedule holds a sender until its receive
    is posted and, per tensor, the data are across; a transport that buffers lets it go sooner."""
    sizes = sorted({setup.predict(r, 1e9, "blocking", 1.0).fwd_bytes_microbatch for r in setup.ratios}
                   | {2**20, 2 * 2**20, 4 * 2**20, 2 * setup.predict(1, 1e9, "blocking", 1.0).fwd_bytes_microbatch})
    out = []
    for late in (0.0, 0.3):
        rows = sl.probe_sends(tmp, env, rate, sizes, 3, late)
        for n in sizes:
            mine = [r for r in rows if r["bytes"] == n]
            T = n * 8 / (rate * LINK_EFF)
            row = {"rate_bps": rate, "bytes": n, "receive_posted_late_s": late, "transfer_s": T,
                   "send_done_s": statistics.median(r["send_done"] for r in mine),
                   "recv_done_s": statistics.median(r["recv_done"] for r in mine)}
            out.append(row)
            log(f"send probe {n:>9} B @ {sl.label(rate)}, receive {late} s late: send done {row['send_done_s']:.4f} s, "
                f"data in {row['recv_done_s']:.4f} s (transfer {T:.4f} s)")
    return out


def unshaped_bps(probe: list[dict]) -> float:
    """The rate plan is given for the unshaped link: the largest message's one-way goodput / link efficiency."""
    rows = [p for p in probe if p["rate_bps"] is None]
    return max(rows, key=lambda p: p["bytes"])["goodput_bps"] / LINK_EFF


# ----------------------------------------------------------------------------- engine runs


def engine_run(setup: Setup, tmp: str, name: str, cfg: dict, coords, link: str, schedule_rates: list[float],
               want, kind: str, replicas: int, env: dict, log) -> list[dict]:
    path = os.path.join(tmp, f"{name}.json")
    Path(path).write_text(json.dumps(cfg))
    out = os.path.join(tmp, name)
    os.makedirs(out)
    model_path = os.path.join(tmp, "model.json")
    Path(model_path).write_text(json.dumps(dict(setup.model, vocab_size=setup.vocab)))
    t0 = time.time()
    with netlab.ShapedNetwork(2, coords, **{f"{link}_rate_bps": UNSHAPED}) as net:
        run = sl.EngineRun(net, sl.train_cmd(path, model_path, out, nice=setup.smoke), out, env)
        try:
            sl.wait_steps(run, 3 if kind == "step" else 6, max_s=420)  # start-up, first allocations, NCCL groups
            log(f"{name}: up after {time.time() - t0:.0f} s")
            visits = sl.run_visits(net, run, schedule_rates, want, kind, replicas, log, name)
        except BaseException:
            run.stop(KILL)
            for r in range(2):
                log(f"{name} rank {r} log tail:\n" + Path(out, f"rank{r}.log").read_text()[-3000:])
            raise
        run.stop(KILL)
    log(f"{name}: {time.time() - t0:.0f} s")
    return visits


def stage_prediction(setup: Setup, pt: dict, unshaped: float, cal: float, own: float) -> dict:
    """A stage-link point's prediction fields: plan at the point's rate with the common calibration
    `cal` (and with its own run's, `own`), the utilisations, and measured / predicted."""
    ratio, schedule, med = pt["ratio"], pt["schedule"], pt["step_seconds"]["median"]
    rate = pt["stage_bw_bps"] or unshaped
    p, q = setup.predict(ratio, rate, schedule, cal), setup.predict(ratio, rate, schedule, own)
    free = setup.predict(ratio, 1e15, schedule, cal).total_time
    return {"utilisation_measured": free / med,
            "predicted": {"step_seconds": p.total_time, "utilisation": free / p.total_time,
                          "plan_utilisation": p.utilisation, "link_free_step_seconds": free,
                          "stage_link_bytes_per_step": p.stage_link_bytes_per_step,
                          "compute_time_microbatch": max(p.compute_time_microbatch),
                          "link_time_fwd": p.link_time_fwd, "link_time_bwd": p.link_time_bwd,
                          "breakdown": p.breakdown, "rate_bps": rate},
            "measured_over_predicted": med / p.total_time,
            "self_calibrated": {"tflops": own, "step_seconds": q.total_time, "measured_over_predicted": med / q.total_time}}


def part_a(setup: Setup, tmp: str, env: dict, probe: list[dict], result: dict, save, log) -> None:
    unshaped = unshaped_bps(probe)
    result["unshaped_rate_bps_given_to_plan"] = unshaped
    order = [(r, s) for r in setup.ratios for s in SCHEDULES]
    cal = None  # FLOP/s from the first run (the highest ratio, blocking)
    for ratio, schedule in order:
        name = f"a_r{ratio}_{schedule}"

        def want(bw: float, visits: list[dict]) -> tuple[int, float]:
            if bw == UNSHAPED:
                return (3 if setup.smoke else 5), 120
            est = setup.predict(ratio, bw, schedule, cal or 100.0).total_time
            n = max(2, min(4, math.ceil((4 if setup.smoke else 6) / est)))
            return n, n * est * 3 + 60

        sched = [UNSHAPED, *setup.rates, UNSHAPED]
        visits = engine_run(setup, tmp, name, setup.config(2, None, ratio, schedule), netlab.replica_coords([2]),
                            "stage", sched, want, "step", 1, env, log)
        by = {bw: [v[0] for x in visits if x["bw"] == bw for v in x["steps"].values()] for bw in sched}
        t_unshaped = statistics.median(r["seconds"] for r in by[UNSHAPED])
        own = setup.calibrate(ratio, schedule, unshaped, t_unshaped)
        if cal is None:
            cal = own
            result["calibration"] = {"run": name, "tflops": cal, "t_unshaped_step": t_unshaped,
                                     "unshaped_rate_bps": unshaped}
        for bw in (UNSHAPED, *setup.rates):
            rows = by[bw]
            secs = [r["seconds"] for r in rows]
            act = [r["bytes"]["activation"]["sent"] + r["bytes"]["activation_grad"]["sent"] for r in rows]
            pt = {
                "part": "a", "ratio": ratio, "schedule": schedule, "stage_bw_bps": None if bw == UNSHAPED else bw,
                "label": sl.label(bw), "step_seconds": sl.summary(secs),
                "visit_medians": [round(statistics.median(v[0]["seconds"] for v in x["steps"].values()), 4)
                                  for x in visits if x["bw"] == bw],
                "stage_link_payload_bytes_per_step": statistics.median(act),
                "tc_wire_bytes_in_visits": [x["wire"] for x in visits if x["bw"] == bw],
                "calibration_point": name == result["calibration"]["run"] and bw == UNSHAPED,
            }
            pt.update(stage_prediction(setup, pt, unshaped, cal, own))
            result["points"].append(pt)
            log(f"{name} {sl.label(bw):>14}: {pt['step_seconds']['median']:.3f} s (n={len(secs)}, {min(secs):.3f}-"
                f"{max(secs):.3f}) plan {pt['predicted']['step_seconds']:.3f} s (x{pt['measured_over_predicted']:.3f}); "
                f"utilisation {pt['utilisation_measured']:.3f} vs plan {pt['predicted']['utilisation']:.3f}; link "
                f"bytes/step {pt['stage_link_payload_bytes_per_step']:.0f} vs plan {pt['predicted']['stage_link_bytes_per_step']}")
        save()


def part_b(setup: Setup, tmp: str, env: dict, result: dict, save, log) -> None:
    sched = [UNSHAPED, *setup.rates, UNSHAPED]
    visits = engine_run(setup, tmp, "b_m2", setup.config(1, 2, 1, "blocking"), netlab.replica_coords([1, 1]),
                        "replica", sched, lambda bw, v: (3, 300), "outer", 2, env, log)
    per = {bw: [v for x in visits if x["bw"] == bw for v in x["steps"].values()] for bw in sched}
    unshaped = result.get("unshaped_rate_bps_given_to_plan", 1e12)
    t_unl = statistics.median(min(r["seconds"] for r in v) for v in per[UNSHAPED])
    compute = t_unl - setup.predict_replica(unshaped).outer_sync_time  # the outer step's own work
    for bw in (UNSHAPED, *setup.rates):
        secs = [min(r["seconds"] for r in v) for v in per[bw]]
        med = statistics.median(secs)
        rate = unshaped if bw == UNSHAPED else bw
        p = setup.predict_replica(rate)
        pt = {"part": "b", "replica_bw_bps": None if bw == UNSHAPED else bw, "label": sl.label(bw),
              "outer_seconds": sl.summary(secs),
              "outer_seconds_slower_replica": sl.summary([max(r["seconds"] for r in v) for v in per[bw]]),
              "payload_bytes": per[bw][0][0]["payload_bytes"],
              "tc_wire_bytes_in_visits": [x["wire"] for x in visits if x["bw"] == bw],
              "predicted": {"outer_sync_seconds": p.outer_sync_time, "payload_bytes": p.outer_payload_bytes[0],
                            "plus_measured_outer_work": p.outer_sync_time + compute, "outer_work_seconds": compute,
                            "dense_fp32_sync_seconds": p.dense_outer_bytes[0] * 8 / (rate * LINK_EFF)},
              "measured_over_predicted": med / (p.outer_sync_time + compute)}
        result["points"].append(pt)
        log(f"b_m2 {sl.label(bw):>14}: outer step {med:.3f} s (n={len(secs)}); plan link {p.outer_sync_time:.3f} s + "
            f"measured outer work {compute:.3f} s = {p.outer_sync_time + compute:.3f} s (x{pt['measured_over_predicted']:.3f}); "
            f"payload {pt['payload_bytes']} B vs plan {p.outer_payload_bytes[0]} B")
    save()


def agreement(points: list[dict], band: float = 0.15) -> dict:
    checked = [(f"{p['ratio']}/{p['schedule']} @ {p['label']}" if p["part"] == "a" else f"replica @ {p['label']}",
                p["measured_over_predicted"]) for p in points if not p.get("calibration_point")]
    return {"band": band, "within": sum(abs(v - 1) <= band for _, v in checked), "of": len(checked),
            "outside": {k: round(v, 3) for k, v in checked if abs(v - 1) > band},
            "min": min((v for _, v in checked), default=None), "max": max((v for _, v in checked), default=None)}


def hidden_transfers(points: list[dict], n_mb: int) -> dict:
    """Per stage-link point, how much of a micro-batch's transfer pair (t_f + t_b, plan's link time at
    the point's rate) the step did not pay: exposed = (step - plan's link-free step) / n_mb, hidden =
    pair - exposed. Under the blocking schedule plan charges the whole pair; a launch-bound GPU run
    (the host takes longer to issue a micro-batch than the device to run it) hides up to the host's
    surplus, since a blocking receive waits on the device's stream, not on the host."""
    rows, full = [], []
    for p in points:
        if p["part"] != "a":
            continue
        pair = p["predicted"]["link_time_fwd"] + p["predicted"]["link_time_bwd"]
        exposed = (p["step_seconds"]["median"] - p["predicted"]["link_free_step_seconds"]) / n_mb
        rows.append({"ratio": p["ratio"], "schedule": p["schedule"], "label": p["label"], "pair_ms": pair * 1e3,
                     "exposed_ms": exposed * 1e3, "hidden_ms": (pair - exposed) * 1e3})
        if p["schedule"] == "blocking" and pair > 0.03:  # pairs longer than any slack: what a step can hide
            full.append((pair - exposed) * 1e3)
    return {"points": rows, "blocking_hidden_ms_where_the_pair_exceeds_30_ms": sorted(full),
            "blocking_hidden_ms_median": statistics.median(full) if full else None}


# ----------------------------------------------------------------------------- plot


def plot(result: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    setup = Setup.of(result)
    cal = result["calibration"]["tflops"]
    fig, axes = plt.subplots(1, 3, figsize=(18, 5.5))
    lo = min(setup.rates) / 3
    grid = [lo * (3e9 / lo) ** (i / 80) for i in range(81)]
    gx = [g / 1e6 for g in grid]
    colors = {1: "tab:red", 8: "tab:blue", 96: "tab:green", 64: "tab:green"}
    a = [p for p in result["points"] if p["part"] == "a"]
    for ratio in setup.ratios:
        for schedule, style, mark in (("blocking", "-", "o"), ("overlapped", "--", "s")):
            pts = [p for p in a if p["ratio"] == ratio and p["schedule"] == schedule]
            if not pts:
                continue
            c = colors.get(ratio, "tab:purple")
            tag = f"1/{ratio}" if ratio > 1 else "uncompressed"
            preds = [setup.predict(ratio, g, schedule, cal) for g in grid]
            free = setup.predict(ratio, 1e15, schedule, cal).total_time
            axes[0].plot(gx, [free / q.total_time for q in preds], style, color=c, lw=1.2, label=f"{tag}, {schedule}: plan")
            shaped = [p for p in pts if p["stage_bw_bps"]]
            xs = [p["stage_bw_bps"] / 1e6 for p in shaped]
            axes[0].plot(xs, [p["utilisation_measured"] for p in shaped], mark, color=c, mfc="none" if schedule == "overlapped" else c,
                         label=f"{tag}, {schedule}: measured")
            axes[1].plot(gx, [q.total_time for q in preds], style, color=c, lw=1.2)
            axes[1].errorbar(xs, [p["step_seconds"]["median"] for p in shaped],
                             yerr=[[p["step_seconds"]["median"] - p["step_seconds"]["min"] for p in shaped],
                                   [p["step_seconds"]["max"] - p["step_seconds"]["median"] for p in shaped]],
                             fmt=mark, color=c, mfc="none" if schedule == "overlapped" else c, capsize=3)
    axes[0].set(xscale="log", xlabel="stage-link bandwidth (Mbit/s)", ylabel="compute utilisation",
                title=f"{setup.name}, S = 2, {setup.n_mb} x {setup.micro} x {setup.seq} tokens a step: utilisation")
    axes[0].legend(fontsize=7, ncol=2)
    axes[1].set(xscale="log", yscale="log", xlabel="stage-link bandwidth (Mbit/s)", ylabel="step time (s)",
                title="step time: plan (lines), measured (median, min-max)")
    b = [p for p in result["points"] if p["part"] == "b" and p["replica_bw_bps"]]
    if b:
        work = b[0]["predicted"]["outer_work_seconds"]
        preds = [setup.predict_replica(g) for g in grid]
        axes[2].plot(gx, [q.outer_sync_time + work for q in preds], "-", color="k", label="plan link + measured outer work")
        axes[2].plot(gx, [q.dense_outer_bytes[0] * 8 / (g * LINK_EFF) for q, g in zip(preds, grid)], ":", color="gray",
                     label="dense fp32 pseudo-gradient (DiLoCo's bytes), link only")
        axes[2].plot([p["replica_bw_bps"] / 1e6 for p in b], [p["outer_seconds"]["median"] for p in b], "o", color="k",
                     label="measured outer step (SparseLoCo, M = 2)")
        axes[2].set(xscale="log", yscale="log", xlabel="replica-link bandwidth (Mbit/s)", ylabel="seconds",
                    title="outer sync on the replica link")
        axes[2].legend(fontsize=7)
    wire = "gloo" if result["settings"]["smoke"] else "NCCL"
    fig.suptitle(f"{result.get('card', '?')}: measured on tc-shaped links ({wire} over TCP, one namespace per rank) vs plan")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


# ----------------------------------------------------------------------------- main


def card() -> str:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=20).stdout.split("\n")
        names = [x.strip() for x in out if x.strip()]
        return f"{len(names)} x {names[0]}" if names else "cpu"
    except (OSError, subprocess.SubprocessError):
        return "cpu"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", str(BENCH / "results")))
    ap.add_argument("--cpu-smoke", action="store_true", help="the tiny CPU stand-in (gloo), same path")
    ap.add_argument("--parts", default="psab", help="p: link probe, s: send probe, a: stage link, b: replica link")
    ap.add_argument("--micro", type=int, default=None, help="sequences a micro-batch (GPU default 1: launch-bound "
                    "at 512M in eager mode; larger, or --compile, moves the run towards device-bound)")
    ap.add_argument("--ratios", default=None, help="comma-separated subspace ratios of (a) (GPU default 96,8,1)")
    ap.add_argument("--compile", action="store_true", help="hetloco.train.compile in every run")
    ap.add_argument("--plot", metavar="JSON", help="only redraw the figure beside JSON")
    a = ap.parse_args(argv)
    if "a" in a.parts and "p" not in a.parts:
        ap.error(f"--parts {a.parts}: the stage link (a) is predicted on the probe's unshaped rate; add p")
    if a.plot:
        plot(json.loads(Path(a.plot).read_text()), str(Path(a.plot).with_suffix(".png")))
        return 0
    netbin = REPO / ".netbin" / "bin"
    if netbin.is_dir():
        os.environ["PATH"] = f"{netbin}:{os.environ['PATH']}"
    ok, why = netlab.available()
    if not ok:
        print(f"gpu_links: {why}", file=sys.stderr)
        return 2
    setup = Setup(a.cpu_smoke, a.micro, tuple(int(r) for r in a.ratios.split(",")) if a.ratios else None, a.compile)
    os.makedirs(a.out, exist_ok=True)
    name = "gpu_links_cpu_smoke" if a.cpu_smoke else "gpu_links"
    t_start = time.time()
    lines: list[str] = []

    def log(msg: str) -> None:
        line = f"[{time.time() - t_start:6.0f} s] {msg}"
        print(line, flush=True)
        lines.append(line)

    env = dict(os.environ, PYTHONUNBUFFERED="1", HETLOCO_CACHE=os.environ.get("HETLOCO_CACHE", "/tmp/hetloco_cache"))
    if not a.cpu_smoke:
        env.update(NCCL_SOCKETS)
    result = {"card": card(), "machine": platform.node(), "command": " ".join([sys.executable, *sys.argv]),
              "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "settings": {"smoke": a.cpu_smoke, "model": setup.name, "model_config": setup.model, "vocab": setup.vocab,
                           "seq_len": setup.seq, "micro_batch": setup.micro, "n_mb": setup.n_mb, "bf16": setup.bf16,
                           "compile": setup.compile,
                           "ratios": list(setup.ratios), "rates_bps": list(setup.rates), "schedules": list(SCHEDULES),
                           "link_efficiency": LINK_EFF, "margin_s": sl.MARGIN_S,
                           "nccl_env": {} if a.cpu_smoke else NCCL_SOCKETS, "netlab": "gso_max_segs 1, ack_priority"},
              "points": [], "log": lines}

    def save() -> None:
        result["seconds"] = round(time.time() - t_start, 1)
        if result["points"]:
            result["agreement"] = agreement(result["points"])
            result["hidden_transfers"] = hidden_transfers(result["points"], setup.n_mb)
        path = Path(a.out, f"{name}.json")
        tmp = path.with_suffix(".json.part")
        tmp.write_text(json.dumps(result, indent=1) + "\n")
        os.replace(tmp, path)

    with tempfile.TemporaryDirectory(prefix="gpu_links_") as tmp:
        probe = result["probe"] = link_probe(setup, tmp, env, log) if "p" in a.parts else []
        if "s" in a.parts:
            result["send_probe"] = send_probe(setup, tmp, env, log)
        save()
        if "a" in a.parts:
            part_a(setup, tmp, env, probe, result, save, log)
        if "b" in a.parts:
            part_b(setup, tmp, env, result, save, log)
    save()
    log(f"agreement: {json.dumps(result.get('agreement'))}")
    try:
        if "calibration" in result:  # the figure needs the stage-link runs (part a)
            plot(result, str(Path(a.out, f"{name}.png")))
    except Exception as e:  # the JSON is the record; a figure can be redrawn from it (--plot)
        log(f"plot failed: {e!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
