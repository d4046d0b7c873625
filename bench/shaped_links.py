"""Our engine on tc-shaped links (CPU, gloo over TCP) against the cost model in `hetloco_ds.plan`.

    sudo python bench/shaped_links.py [--out bench/results] [--quick]

Needs root, `ip` and `tc` (network namespaces; `hetloco_ds.netlab`). Every rank is a real
`python -m hetloco_ds.cli train` process (the `hetloco-ds train` CLI under a launcher
environment) in its own network namespace, gloo over TCP on the namespace's veth
(GLOO_SOCKET_IFNAME as netlab sets it), OMP_NUM_THREADS=1, under `nice`.

Model: a fresh LLaMA (d 256, 4 layers, 4 heads, SwiGLU 688, untied head), the default BPE
tokenizer at vocabulary 1024 on the default corpus (the Python standard library), seq 128,
micro-batch 4, fp32 (bf16 off, so activations cross the wire as fp32, ids as int16).

(a) stage links: S = 2 stages x M = 1 replica (2 ranks), 4 micro-batches per step, SparseLoCo
    with inner_steps larger than the run (no outer step inside the timed steps), subspace
    compression on every replica at ratio 8 and 64 (`compressed_replicas: "all"`) or none (ratio 1).
    One training run per ratio; the stage link's rate is changed *during* the run, between
    phases (unlimited, 1000, 100, 20, 5 Mbit/s): `tc class change` on the htb class netlab made.
    A step counts for a phase only if it started after that phase's rate was in place (start =
    its metrics row's `time` - `seconds`, with a margin), so the step in flight at a change is
    dropped. Startup (model build, T_perp set-up, tensor-meta exchange) happens once, at the
    unlimited rate. "unlimited" is the same htb class at 10 Gbit/s, far above what gloo moves
    here. Reported per phase: median `seconds` of the step rows.
    Compute utilisation (measured) = median step time of the unlimited phase / median step
    time of the phase (so it folds the pipeline bubble into "compute": it is the fraction of
    the link-free speed that survives the link).
(b) replica links: M = 2 replicas x S = 1 (2 ranks), one micro-batch per step, SparseLoCo with
    inner_steps 2; the replica link's rate changes between phases (unlimited, 100, 20, 5 Mbit/s)
    as in (a). Ours: median `seconds` of the `kind: outer` rows whose step started inside the
    phase (the whole outer step: error feedback, top-k, packing, the gloo all_gather of the
    payload, decode, average, outer SGD). Dense DiLoCo-style baseline: *not the engine* -- a
    direct gloo `all_reduce` of an fp32 vector with the model's parameter count (what DiLoCo
    sends: the dense fp32 pseudo-gradient), run in the same namespaces on the same shaped
    replica link after the engine run. (Setting `sparseloco.topk` = chunk size would send every
    value at 4 + 1.5 bytes, 1.375x DiLoCo's bytes, and time a full sort; the direct all-reduce
    is the honest dense baseline.)

Predictions: `plan.predict` with the same shapes and settings, `overlap=False` (DeepSpeed's
p2p sends and receives block), `link_efficiency` = 1448/1514 (TCP/IPv4 payload per Ethernet
frame at MTU 1500 with timestamps; tests/test_netlab.py measures it), act_bytes 4 (fp32), ids
2 bytes, latency 0 (netlab applies none). Device throughput is calibrated per ratio from that
run's unlimited phase: the plan's unlimited step is (n_mb + S - 1) * t_c, so
t_c = T_unlimited / (n_mb + S - 1) and FLOP/s = FLOPs of the busiest stage per micro-batch / t_c
(passed as tflops with mfu 1). Predicted utilisation uses the measured definition,
predicted T(inf) / predicted T(bw); plan's own `utilisation` (n_mb * t_c / total, bubble counted
as overhead) is recorded too. For (b) the plan's outer-sync time is link-only (it does not model
the compression compute), so the JSON also gives plan + the measured unlimited-phase outer time.
The dense prediction is the plan's ring formula, (M - 1) * dense fp32 bytes * 8 / (bw * eff),
which at M = 2 is also the per-rank wire volume of a ring all-reduce (2 (M-1)/M * N).

Writes shaped_links.json (machine, command, every point with its prediction and
measured/predicted) and shaped_links.png. About 5-6 minutes on 2 cores.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import platform
import random
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from hetloco_ds import netlab, plan  # noqa: E402

MODEL = dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4,
             intermediate_size=688, max_position_embeddings=128)
VOCAB = 1024
SEQ = 128
MICRO = 4
N_MB_A = 4  # micro-batches per step in (a)
N_MB_B = 1  # in (b): inner steps are filler between outer steps
H_B = 2
LINK_EFF = 1448 / 1514
UNLIMITED = 10e9
MARGIN_S = 0.1  # a step counts for a phase if it started this long after the rate change
STAGE_RATES = (1000e6, 100e6, 20e6, 5e6)
REPLICA_RATES = (100e6, 20e6, 5e6)
RATIOS = (1, 8, 64)
NICE = ["nice", "-n", "10"]


# ----------------------------------------------------------------------------- configs


def shape() -> plan.ModelShape:
    return plan.ModelShape(d=MODEL["hidden_size"], n_layers=MODEL["num_hidden_layers"],
                           n_heads=MODEL["num_attention_heads"], n_kv_heads=MODEL["num_key_value_heads"],
                           ffn=MODEL["intermediate_size"], vocab=VOCAB, seq_len=SEQ, name="bench-d256")


def ds_config(stages: int, n_mb: int, ratio: int, inner_steps: int) -> dict:
    return {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": n_mb,
        "gradient_clipping": 1.0,
        "steps_per_print": 10**9,
        "pipeline": {"stages": stages},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "betas": [0.9, 0.95], "eps": 1e-8,
                                                  "weight_decay": 0.1}},
        "bf16": {"enabled": False},
        "hetloco": {
            "sparseloco": {"inner_steps": inner_steps, "topk": 32, "chunk_size": 4096},
            "subspace": {"ratio": ratio, "compressed_replicas": "all" if ratio > 1 else "none"},
            "train": {"seq_len": SEQ, "eval_interval": 0, "eval_batches": 1, "checkpoint_interval": 0,
                      "vocab_size": VOCAB},
        },
    }


def prepare_cache(env: dict) -> None:
    """Tokenizer and token cache built once here, outside every timed run."""
    code = ("from hetloco_ds import data; t = data.default_tokenizer(vocab_size=%d, progress=False); "
            "data.load_corpus(None, t, %d)" % (VOCAB, SEQ))
    subprocess.run([sys.executable, "-c", code], env=env, check=True, cwd=REPO,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


# ----------------------------------------------------------------------------- shaping


def set_rate(net: netlab.ShapedNetwork, bps: float) -> float:
    """Change every htb class on every rank's hl0 to `bps`; returns the time it was in place."""
    for ns in net.namespaces:
        text = subprocess.run(["tc", "-n", ns, "class", "show", "dev", netlab.IFACE],
                              capture_output=True, text=True, check=True).stdout
        for cid in re.findall(r"class htb (\d+:[0-9a-f]+)", text):
            r = f"{int(bps)}bit"
            subprocess.run(["tc", "-n", ns, "class", "change", "dev", netlab.IFACE, "parent", "1:",
                            "classid", cid, "htb", "rate", r, "ceil", r], check=True,
                           capture_output=True, text=True)
    return time.time()


def wire_bytes(net: netlab.ShapedNetwork) -> int:
    return sum(net.link_bytes().values())


# ----------------------------------------------------------------------------- engine runs


class EngineRun:
    """`hetloco-ds train` on every rank of `net`, started now; rows read from metrics.jsonl."""

    def __init__(self, net: netlab.ShapedNetwork, cfg_path: str, model_path: str, out: str, env: dict,
                 steps: int = 100000):
        self.net, self.out = net, out
        self.metrics = os.path.join(out, "metrics.jsonl")
        port = random.randrange(20000, 32768)
        self.logs = []
        self.procs = []
        for r in range(net.world):
            log = open(os.path.join(out, f"rank{r}.log"), "w")
            self.logs.append(log)
            cmd = [*NICE, sys.executable, "-m", "hetloco_ds.cli", "train", "--config", cfg_path,
                   "--model-config", model_path, "--out", out, "--steps", str(steps)]
            self.procs.append(net.popen(r, cmd, net.env_for(r, port, env), stdout=log,
                                        stderr=subprocess.STDOUT, cwd=str(REPO)))

    def rows(self, kind: str) -> list[dict]:
        if not os.path.exists(self.metrics):
            return []
        with open(self.metrics) as f:
            lines = f.read().split("\n")[:-1]  # a line is complete once its newline is there
        return [r for r in map(json.loads, lines) if r["kind"] == kind]

    def check(self) -> None:
        for r, p in enumerate(self.procs):
            if p.poll() is not None:
                self.logs[r].flush()
                tail = Path(self.logs[r].name).read_text()[-3000:]
                raise RuntimeError(f"rank {r} exited ({p.returncode}) before the benchmark ended:\n{tail}")

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                netlab._signal_group(p, 15)
        for p in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                netlab._signal_group(p, 9)
                p.wait()
        for log in self.logs:
            log.close()


def started_after(row: dict, t: float) -> bool:
    return row["time"] - row["seconds"] >= t + MARGIN_S


def collect_phase(run: EngineRun, t0: float, want: int, kind: str, max_s: float) -> list[dict]:
    """Rows of `kind` whose step started after t0, until `want` of them (or max_s passes)."""
    deadline = time.time() + max_s
    while True:
        run.check()
        steps = {(r["step"], r["replica"]): r for r in run.rows("step")}
        rows = [r for r in run.rows(kind)
                if (r["step"], r["replica"]) in steps and started_after(steps[r["step"], r["replica"]], t0)]
        if len(rows) >= want or time.time() > deadline:
            return rows
        time.sleep(0.05)


def wait_steps(run: EngineRun, n: int, max_s: float = 300) -> None:
    deadline = time.time() + max_s
    while len(run.rows("step")) < n:
        run.check()
        if time.time() > deadline:
            raise RuntimeError(f"no {n} steps after {max_s} s")
        time.sleep(0.05)


def summary(xs: list[float]) -> dict:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs),
            "values": [round(x, 5) for x in xs]}


# ----------------------------------------------------------------------------- (a) stage links


def predict_a(ratio: int, bw: float, tflops: float) -> plan.Prediction:
    return plan.predict(shape(), stages=2, replicas=1, stage_bw=bw, replica_bw=1e9, tflops=tflops,
                        mfu=1.0, micro_batch=MICRO, n_mb=N_MB_A, H=10**6, ratio=ratio, act_bytes=4,
                        ids_bytes=2, overlap=False, link_efficiency=LINK_EFF)


def part_a(tmp: str, model_path: str, env: dict, quick: bool, log) -> list[dict]:
    points = []
    for ratio in RATIOS:
        cfg = os.path.join(tmp, f"a_r{ratio}.json")
        Path(cfg).write_text(json.dumps(ds_config(2, N_MB_A, ratio, inner_steps=100000)))
        out = os.path.join(tmp, f"a_r{ratio}")
        os.makedirs(out)
        with netlab.ShapedNetwork(2, netlab.deepspeed_coords(1), stage_rate_bps=UNLIMITED) as net:
            run = EngineRun(net, cfg, model_path, out, env)
            try:
                t_start = time.time()
                wait_steps(run, 2)  # warm-up: tensor-meta exchange, first allocations
                flops = max(predict_a(ratio, UNLIMITED, 1.0).flops_per_microbatch)
                tflops = None
                t_unl = None
                for bw in (UNLIMITED, *STAGE_RATES):
                    t0 = set_rate(net, bw)
                    b0 = wire_bytes(net)
                    if tflops is None:
                        want, max_s = (6 if quick else 12), 60
                    else:
                        est = predict_a(ratio, bw, tflops).total_time
                        budget = 10 if quick else 24
                        want = max(3, min(12, math.ceil(budget / est)))
                        max_s = want * est * 3 + 30
                    rows = collect_phase(run, t0, want, "step", max_s)
                    b1 = wire_bytes(net)
                    secs = [r["seconds"] for r in rows]
                    med = statistics.median(secs)
                    if tflops is None:  # calibrate on the unlimited phase
                        t_unl = med
                        t_c = med / (N_MB_A + 2 - 1)
                        tflops = flops / t_c / 1e12
                    p = predict_a(ratio, bw, tflops)
                    p_inf = predict_a(ratio, 1e15, tflops)
                    act = [r["bytes"]["activation"]["sent"] + r["bytes"]["activation_grad"]["sent"] for r in rows]
                    pt = {
                        "part": "a", "ratio": ratio, "stage_bw_bps": None if bw == UNLIMITED else bw,
                        "label": "unlimited" if bw == UNLIMITED else f"{bw / 1e6:g} Mbit/s",
                        "step_seconds": summary(secs),
                        "utilisation_measured": t_unl / med,
                        "stage_link_payload_bytes_per_step": statistics.median(act),
                        "tc_wire_bytes_per_step": (b1 - b0) / max(1, len(rows)) if rows else None,
                        "predicted": {
                            "step_seconds": p.total_time, "utilisation": p_inf.total_time / p.total_time,
                            "plan_utilisation": p.utilisation, "stage_link_bytes_per_step": p.stage_link_bytes_per_step,
                            "link_time_fwd": p.link_time_fwd, "link_time_bwd": p.link_time_bwd,
                            "compute_time_microbatch": max(p.compute_time_microbatch),
                            "breakdown": p.breakdown,
                        },
                        "measured_over_predicted": med / p.total_time,
                        "calibrated_gflops": tflops * 1e3,
                    }
                    points.append(pt)
                    log(f"(a) ratio {ratio:>2} {pt['label']:>12}: step {med:.3f} s (n={len(secs)}, "
                        f"{min(secs):.3f}-{max(secs):.3f}), predicted {p.total_time:.3f} s, "
                        f"x{med / p.total_time:.2f}; util {t_unl / med:.2f} (pred {p_inf.total_time / p.total_time:.2f}); "
                        f"bytes {statistics.median(act):.0f} (pred {p.stage_link_bytes_per_step})")
                log(f"(a) ratio {ratio}: run took {time.time() - t_start:.0f} s after start")
            finally:
                run.stop()
    return points


# ----------------------------------------------------------------------------- (b) replica links

DENSE_PROGRAM = r"""
import json, sys, time
import torch
import torch.distributed as dist
n, reps = int(sys.argv[1]), int(sys.argv[2])
dist.init_process_group("gloo")
warm = torch.zeros(1024)
dist.all_reduce(warm)
vec = torch.randn(n)
for i in range(reps):
    dist.barrier()
    t0 = time.perf_counter()
    dist.all_reduce(vec)
    dt = time.perf_counter() - t0
    vec.div_(dist.get_world_size())
    if dist.get_rank() == 0:
        print(json.dumps({"rep": i, "seconds": dt}), flush=True)
dist.barrier()
dist.destroy_process_group()
"""


def predict_b(bw: float) -> plan.Prediction:
    return plan.predict(shape(), stages=1, replicas=2, stage_bw=1e9, replica_bw=bw, tflops=1.0, mfu=1.0,
                        micro_batch=MICRO, n_mb=N_MB_B, H=H_B, topk=32, chunk=4096, act_bytes=4,
                        overlap=False, link_efficiency=LINK_EFF)


def part_b(tmp: str, model_path: str, env: dict, quick: bool, log) -> list[dict]:
    points = []
    cfg = os.path.join(tmp, "b.json")
    Path(cfg).write_text(json.dumps(ds_config(1, N_MB_B, 1, inner_steps=H_B)))
    out = os.path.join(tmp, "b")
    os.makedirs(out)
    prog = os.path.join(tmp, "dense_allreduce.py")
    Path(prog).write_text(DENSE_PROGRAM)
    n_params = shape().n_params()
    with netlab.ShapedNetwork(2, netlab.deepspeed_coords(2), replica_rate_bps=UNLIMITED) as net:
        run = EngineRun(net, cfg, model_path, out, env)
        ours_unl = None
        try:
            t_start = time.time()
            wait_steps(run, 2 * H_B)  # start-up (incl. DeepSpeed's model broadcast) + one outer step
            for bw in (UNLIMITED, *REPLICA_RATES):
                t0 = set_rate(net, bw)
                b0 = wire_bytes(net)
                want = 3 if quick else (6 if bw >= 20e6 else 5)
                # One row per replica and outer step; an outer step is done when both are.
                rows = collect_phase(run, t0, 2 * want, "outer", 120)
                b1 = wire_bytes(net)
                by_step: dict[int, list[float]] = {}
                for r in rows:
                    by_step.setdefault(r["step"], []).append(r["seconds"])
                secs = [max(v) for v in by_step.values() if len(v) == 2]
                med = statistics.median(secs)
                if bw == UNLIMITED:
                    ours_unl = med
                p = predict_b(bw)
                pt = {
                    "part": "b", "method": "ours (SparseLoCo outer step, engine)",
                    "replica_bw_bps": None if bw == UNLIMITED else bw,
                    "label": "unlimited" if bw == UNLIMITED else f"{bw / 1e6:g} Mbit/s",
                    "outer_seconds": summary(secs),
                    "payload_bytes": rows[0]["payload_bytes"],
                    "tc_wire_bytes_per_phase_both_ranks": b1 - b0,
                    "steps_in_phase": len({r["step"] for r in run.rows("step") if started_after(r, t0)}),
                    "predicted": {"outer_sync_seconds": p.outer_sync_time,
                                  "payload_bytes": p.outer_payload_bytes[0],
                                  "plus_unlimited_outer_compute": p.outer_sync_time + ours_unl},
                    "measured_over_predicted": med / p.outer_sync_time if p.outer_sync_time > 0 else None,
                    "measured_over_predicted_plus_compute": med / (p.outer_sync_time + ours_unl),
                }
                points.append(pt)
                log(f"(b) ours  {pt['label']:>12}: outer {med:.3f} s (n={len(secs)}, {min(secs):.3f}-"
                    f"{max(secs):.3f}), plan {p.outer_sync_time:.3f} s, plan+compute "
                    f"{p.outer_sync_time + ours_unl:.3f} s; payload {rows[0]['payload_bytes']} "
                    f"(plan {p.outer_payload_bytes[0]})")
            log(f"(b) engine run took {time.time() - t_start:.0f} s after start")
        finally:
            run.stop()
        # Dense: the same namespaces, the same replica link, a plain gloo all_reduce.
        denv = dict(env)
        for bw in (UNLIMITED, *REPLICA_RATES):
            set_rate(net, bw)
            p = predict_b(bw)
            dense_bytes = p.dense_outer_bytes[0]
            pred = (2 - 1) * dense_bytes * 8 / (bw * LINK_EFF)
            reps = 5 if bw >= 100e6 else (3 if bw >= 20e6 else 1)
            if quick:
                reps = min(reps, 2)
            b0 = wire_bytes(net)
            res = net.run(lambda r: [*NICE, sys.executable, prog, str(n_params), str(reps)], timeout=300,
                          env=denv)
            b1 = wire_bytes(net)
            for r in res:
                if r.returncode != 0:
                    raise RuntimeError(f"dense all_reduce rank {r.rank} failed:\n{r.stderr[-3000:]}")
            secs = [json.loads(l)["seconds"] for l in res[0].stdout.splitlines() if l.startswith("{")]
            med = statistics.median(secs)
            pt = {
                "part": "b", "method": "dense DiLoCo-style: gloo all_reduce of the fp32 parameter vector (direct, not the engine)",
                "replica_bw_bps": None if bw == UNLIMITED else bw,
                "label": "unlimited" if bw == UNLIMITED else f"{bw / 1e6:g} Mbit/s",
                "outer_seconds": summary(secs), "payload_bytes": 4 * n_params,
                "tc_wire_bytes_in_phase_both_ranks": b1 - b0, "reps": reps,
                "predicted": {"outer_sync_seconds": pred if bw != UNLIMITED else 0.0,
                              "payload_bytes": dense_bytes},
                "measured_over_predicted": med / pred if bw != UNLIMITED else None,
            }
            points.append(pt)
            log(f"(b) dense {pt['label']:>12}: all_reduce {med:.3f} s (n={len(secs)}), plan formula "
                f"{pred if bw != UNLIMITED else 0:.3f} s")
    return points


# ----------------------------------------------------------------------------- plot


def plot(result: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(17, 5))
    grid = [10 ** (x / 20) * 1e6 for x in range(0, 61)]  # 1 Mbit/s .. 1 Gbit/s
    colors = {1: "tab:red", 8: "tab:blue", 64: "tab:green"}
    a = [p for p in result["points"] if p["part"] == "a"]
    for ratio in RATIOS:
        pts = [p for p in a if p["ratio"] == ratio]
        if not pts:
            continue
        gf = pts[0]["calibrated_gflops"] / 1e3
        shaped = [p for p in pts if p["stage_bw_bps"]]
        unl = [p for p in pts if not p["stage_bw_bps"]][0]
        xs = [p["stage_bw_bps"] / 1e6 for p in shaped]
        c = colors[ratio]
        lab = "ratio 1 (uncompressed)" if ratio == 1 else f"ratio {ratio}"
        axes[0].plot([g / 1e6 for g in grid], [predict_a(ratio, g, gf).total_time for g in grid], "-", color=c,
                     label=f"{lab}: plan")
        axes[0].errorbar(xs, [p["step_seconds"]["median"] for p in shaped],
                         yerr=[[p["step_seconds"]["median"] - p["step_seconds"]["min"] for p in shaped],
                               [p["step_seconds"]["max"] - p["step_seconds"]["median"] for p in shaped]],
                         fmt="o", color=c, label=f"{lab}: measured (median, min-max)")
        axes[0].axhline(unl["step_seconds"]["median"], color=c, ls=":", lw=1)
        inf = predict_a(ratio, 1e15, gf).total_time
        axes[1].plot([g / 1e6 for g in grid], [inf / predict_a(ratio, g, gf).total_time for g in grid], "-",
                     color=c, label=f"{lab}: plan")
        axes[1].plot(xs, [p["utilisation_measured"] for p in shaped], "o", color=c, label=f"{lab}: measured")
    axes[0].set(xscale="log", yscale="log", xlabel="stage-link bandwidth (Mbit/s)", ylabel="step time (s)",
                title="(a) S=2, M=1: step time vs stage link\n(dotted: unlimited link)")
    axes[1].set(xscale="log", xlabel="stage-link bandwidth (Mbit/s)", ylim=(0, 1.1),
                ylabel="compute utilisation = T(unlimited) / T(bw)", title="(a) compute utilisation")
    b = [p for p in result["points"] if p["part"] == "b"]
    ours = [p for p in b if p["method"].startswith("ours") and p["replica_bw_bps"]]
    dense = [p for p in b if p["method"].startswith("dense") and p["replica_bw_bps"]]
    pg = predict_b
    comp = [p for p in b if p["method"].startswith("ours") and not p["replica_bw_bps"]]
    comp = comp[0]["outer_seconds"]["median"] if comp else 0.0
    g2 = [g for g in grid if g <= 200e6]
    axes[2].plot([g / 1e6 for g in g2], [pg(g).outer_sync_time for g in g2], "-", color="tab:blue",
                 label="ours: plan (link only)")
    axes[2].plot([g / 1e6 for g in g2], [pg(g).outer_sync_time + comp for g in g2], "--", color="tab:blue",
                 label="ours: plan + unlimited-link outer step")
    axes[2].plot([p["replica_bw_bps"] / 1e6 for p in ours], [p["outer_seconds"]["median"] for p in ours], "o",
                 color="tab:blue", label="ours: measured outer step (engine)")
    axes[2].plot([g / 1e6 for g in g2], [pg(g).dense_outer_bytes[0] * 8 / (g * LINK_EFF) for g in g2], "-",
                 color="tab:gray", label="dense fp32: plan ring formula")
    axes[2].plot([p["replica_bw_bps"] / 1e6 for p in dense], [p["outer_seconds"]["median"] for p in dense], "s",
                 color="tab:gray", label="dense fp32 all_reduce: measured (gloo)")
    axes[2].set(xscale="log", yscale="log", xlabel="replica-link bandwidth (Mbit/s)",
                ylabel="outer-sync time (s)", title="(b) M=2, S=1: outer sync vs replica link")
    for ax in axes:
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"hetloco_ds on tc-shaped links, CPU ({result['machine']['cpu']}), gloo/TCP, "
                 f"d={MODEL['hidden_size']}, {MODEL['num_hidden_layers']} layers, seq {SEQ}, micro {MICRO}",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


# ----------------------------------------------------------------------------- main


def machine() -> dict:
    cpu = platform.processor() or ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    import torch
    return {"cpu": cpu, "cores": os.cpu_count(), "kernel": platform.release(), "python": platform.python_version(),
            "torch": torch.__version__, "deepspeed": __import__("deepspeed").__version__,
            "loadavg_at_start": os.getloadavg()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=str(REPO / "bench" / "results"))
    ap.add_argument("--quick", action="store_true", help="fewer steps per point (a smoke run)")
    ap.add_argument("--parts", default="ab", help="'a', 'b' or 'ab'")
    a = ap.parse_args(argv)
    ok, why = netlab.available()
    if not ok:
        print(f"shaped_links: {why}", file=sys.stderr)
        return 2
    netlab.remove_stale()
    t_begin = time.time()
    logs: list[str] = []

    def log(msg: str) -> None:
        line = f"[{time.time() - t_begin:6.1f}s] {msg}"
        logs.append(line)
        print(line, flush=True)

    env = dict(os.environ, HETLOCO_QUIET="1", TQDM_DISABLE="1", TOKENIZERS_PARALLELISM="false",
               HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    info = machine()
    tmp = tempfile.mkdtemp(prefix="shaped-links-")
    try:
        prepare_cache(env)
        model_path = os.path.join(tmp, "model.json")
        Path(model_path).write_text(json.dumps(MODEL))
        log(f"cache ready; {shape().n_params():,} parameters")
        points = []
        if "a" in a.parts:
            points += part_a(tmp, model_path, env, a.quick, log)
        if "b" in a.parts:
            points += part_b(tmp, model_path, env, a.quick, log)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    info["loadavg_at_end"] = os.getloadavg()
    result = {
        "what": "hetloco-ds train (real engine, one rank per network namespace, gloo/TCP) on tc-shaped links "
                "vs plan.predict; see bench/shaped_links.py's docstring for every definition",
        "machine": info,
        "command": "python bench/shaped_links.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "total_seconds": time.time() - t_begin,
        "settings": {
            "model": {**MODEL, "vocab_size": VOCAB, "params": shape().n_params()}, "seq_len": SEQ,
            "micro_batch": MICRO, "precision": "fp32 (activations fp32 on the wire, ids int16)",
            "a": {"stages": 2, "replicas": 1, "n_mb": N_MB_A, "ratios": list(RATIOS),
                  "stage_rates_bps": list(STAGE_RATES), "sparseloco_inner_steps": 100000,
                  "utilisation_definition": "median step time of the unlimited phase / median step time at bw",
                  "calibration": "per ratio: t_c = T_unlimited / (n_mb + S - 1); FLOP/s = busiest stage's "
                                 "FLOPs per micro-batch / t_c (plan tflops, mfu 1)"},
            "b": {"stages": 1, "replicas": 2, "n_mb": N_MB_B, "inner_steps": H_B, "topk": 32, "chunk": 4096,
                  "replica_rates_bps": list(REPLICA_RATES)},
            "unlimited": f"the same htb class at {UNLIMITED / 1e9:g} Gbit/s",
            "plan": {"overlap": False, "link_efficiency": LINK_EFF, "act_bytes": 4, "ids_bytes": 2, "latency": 0},
            "nice": NICE, "OMP_NUM_THREADS": 1,
        },
        "points": points,
        "log": logs,
    }
    os.makedirs(a.out, exist_ok=True)
    jpath = os.path.join(a.out, "shaped_links.json")
    with open(jpath, "w") as f:
        json.dump(result, f, indent=1)
    plot(result, os.path.join(a.out, "shaped_links.png"))
    log(f"wrote {jpath} and shaped_links.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
