"""Our engine on tc-shaped links (CPU, gloo over TCP) against the cost model in `hetloco_ds.plan`.

    python bench/shaped_links.py [--out bench/results] [--quick] [--parts ab]    # as root

Needs root, `ip` and `tc` (`hetloco_ds.netlab`: one network namespace per rank, htb per link,
no GSO burst, TCP ACKs ahead of data inside each link's rate; netlab's docstring says why).
Every rank is a real `python -m hetloco_ds.cli train` process (the `hetloco-ds train` CLI in
its launcher mode: RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT / LOCAL_RANK from netlab) in
its own namespace, gloo over TCP on the namespace's veth (GLOO_SOCKET_IFNAME as netlab sets
it), OMP_NUM_THREADS=1, under `nice -n 10`.

Model: a fresh LLaMA (d 256, 4 layers, 4 heads, SwiGLU 688, untied head; 3.69M parameters),
the default BPE tokenizer at vocabulary 1024 (`hetloco.train.vocab_size`) on the default corpus
(the Python standard library), seq 128, micro-batch 4, fp32 (bf16 off: activations cross the
wire as fp32, token ids as int16).

(a) Stage links. S = 2 stages x M = 1 replica (2 ranks), 4 micro-batches per step, SparseLoCo
    with inner_steps far beyond the run (no outer step among the timed steps), subspace ratio
    1 (`compressed_replicas: "none"`), 8 and 64 (`"all"`). One training run per ratio; the stage
    link's rate changes *during* the run (`ShapedNetwork.set_rate`: `tc class change`), in two
    rounds, unlimited, 1000, 100, 20, 5 Mbit/s, twice, then unlimited once more, so that a load
    burst from a neighbour on this shared machine hits one visit of a rate, not all of it. A step
    counts for a visit only if it started at least MARGIN_S after that rate was in place (start =
    its metrics row's `time` - `seconds`), so the step in flight at a change is dropped; start-up
    (model build, T_perp set-up, tensor-meta exchange) happens once, on the unlimited link.
    "Unlimited" is the same htb class at 10 Gbit/s, far above what gloo moves here.
    Reported per rate: the median of the step rows' `seconds` over both visits (with min, max,
    every value, and each visit's median). Compute utilisation, measured = median step time on
    the unlimited link (all three visits) / median step time at the rate: the fraction of the
    link-free speed that survives the link (the pipeline bubble is part of the link-free time).
(b) Replica links. M = 2 replicas x S = 1 (2 ranks), one micro-batch per step, SparseLoCo with
    inner_steps 2; the replica link's rate changes as in (a) (unlimited, 100, 20, 5 Mbit/s,
    twice). Ours: per outer step, the smaller of the two replicas' `kind: outer` row `seconds`
    (the whole outer step: error feedback, top-k, packing, the exchange of the payloads -- on
    gloo `hetloco_ds.transport.static.all_gather_payloads`, every receive posted before any send --,
    decode, average, outer SGD), median over the outer steps that started inside a visit. The
    replica that reaches the exchange last does not wait for its peer, so the smaller time is
    the outer step's own cost; the larger one also holds the inner-step skew between the two
    replicas (recorded too, as `outer_seconds_slower_replica`).
    Dense DiLoCo-style baselines, *not the engine*: an fp32 vector with the model's parameter
    count (DiLoCo's wire format: the dense fp32 pseudo-gradient), in the same namespaces on the
    same shaped replica link, after the engine run, synced two ways: gloo's own `all_reduce`
    (what a DiLoCo user on gloo gets; `dense`) and the engine's exchange followed by the mean
    (`dense_exchange`, the same code path as our outer sync). (Setting `sparseloco.topk` =
    chunk size would send every value at 4 + 1.5 bytes, 1.375x DiLoCo's bytes, and time a full
    top-k sort: not an honest stand-in.) The same probe program also times, on each rate, a
    one-way send, gloo's all_gather and the engine's exchange of our payload's size (link only,
    no compression compute), which separates link behaviour from the engine.

Predictions: `plan.predict` with the same shapes and settings, `overlap=False` (DeepSpeed's p2p
sends and receives block), `link_efficiency` = 1448/1514 (TCP/IPv4 payload per 1514-byte
Ethernet frame with timestamps; tests/test_netlab.py checks it), act_bytes 4 (fp32), ids 2 bytes,
latency 0 (netlab applies none). Device throughput is calibrated per ratio on that run's
unlimited visits: the plan's link-free step is (n_mb + S - 1) * t_c, so
t_c = T_unlimited / (n_mb + S - 1) and FLOP/s = the busiest stage's FLOPs per micro-batch / t_c
(given to plan as tflops with mfu 1). Predicted utilisation uses the measured definition,
T_plan(link-free) / T_plan(bw); plan's own `utilisation` (n_mb * t_c / total, the bubble counted
as overhead) is recorded too. Next to plan's step time the JSON gives a diagnostic built from
plan's own terms, "n_mb transfers": (n_mb + S - 1) * t_c + n_mb * (t_f + t_b), i.e. each link
carries n_mb transfers per direction per step, where plan's no-overlap schedule charges
(n_mb + S - 1) of them. For (b), plan's outer-sync time is link only (it does not model the
compression compute), so the JSON also gives plan + the measured unlimited-link outer step. The
dense prediction is plan's all-gather formula on plan's `dense_outer_bytes`:
(M - 1) * 4P * 8 / (bw * eff), the exchange's per-rank volume, which at M = 2 is also a ring
all-reduce's (2 (M - 1) / M * 4P).

Writes shaped_links.json (machine, command, settings, every point with its prediction and
measured/predicted) and shaped_links.png. About 8 minutes on 2 cores.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from hetloco_ds import checkpoint, netlab, plan  # noqa: E402

MODEL = dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4,
             intermediate_size=688, max_position_embeddings=128)
VOCAB = 1024
SEQ = 128
MICRO = 4
N_MB_A = 4  # micro-batches per step in (a)
N_MB_B = 1  # in (b): the inner steps are only the filler between outer steps
H_B = 2
LINK_EFF = 1448 / 1514
UNLIMITED = 10e9
MARGIN_S = 0.1
STAGE_RATES = (1000e6, 100e6, 20e6, 5e6)
REPLICA_RATES = (100e6, 20e6, 5e6)
RATIOS = (1, 8, 64)
NICE = ["nice", "-n", "10"]


# ----------------------------------------------------------------------------- configs


def model_shape(model: dict = MODEL, vocab: int = VOCAB, seq: int = SEQ) -> plan.ModelShape:
    return plan.ModelShape(d=model["hidden_size"], n_layers=model["num_hidden_layers"],
                           n_heads=model["num_attention_heads"],
                           n_kv_heads=model.get("num_key_value_heads"), ffn=model["intermediate_size"],
                           vocab=vocab, seq_len=seq, name=f"d{model['hidden_size']}")


def ds_config(stages: int, n_mb: int, ratio: int, inner_steps: int, micro: int = MICRO, seq: int = SEQ,
              vocab: int = VOCAB, schedule: str = "blocking") -> dict:
    """A DeepSpeed JSON with our section: fp32, AdamW, ratio on every replica (1 = none), the
    pipeline `schedule` (this benchmark measured DeepSpeed's blocking one; overlap_links.py both)."""
    return {
        "train_micro_batch_size_per_gpu": micro,
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
            "pipeline": {"schedule": schedule},
            "train": {"seq_len": seq, "eval_interval": 0, "eval_batches": 1, "checkpoint_interval": 0,
                      "vocab_size": vocab},
        },
    }


def predict_stage(ratio: int, bw: float, tflops: float, shape: plan.ModelShape | None = None,
                  micro: int = MICRO, n_mb: int = N_MB_A) -> plan.Prediction:
    """plan.predict for S = 2, M = 1 on a stage link of `bw` (fp32 activations, int16 ids)."""
    return plan.predict(shape or model_shape(), stages=2, replicas=1, stage_bw=bw, replica_bw=1e9,
                        tflops=tflops, mfu=1.0, micro_batch=micro, n_mb=n_mb, H=10**6, ratio=ratio,
                        act_bytes=4, overlap=False, link_efficiency=LINK_EFF)


def calibrated_tflops(t_unlimited: float, ratio: int, shape: plan.ModelShape | None = None,
                      micro: int = MICRO, n_mb: int = N_MB_A) -> float:
    """Plan's link-free step is (n_mb + S - 1) * t_c: the FLOP/s that makes it `t_unlimited`."""
    flops = max(predict_stage(ratio, UNLIMITED, 1.0, shape, micro, n_mb).flops_per_microbatch)
    return flops / (t_unlimited / (n_mb + 2 - 1)) / 1e12


def n_mb_transfers_time(p: plan.Prediction) -> float:
    """Diagnostic from plan's terms: (n_mb + S - 1) t_c + n_mb (t_f + t_b)."""
    i = p.inputs
    return (i["n_mb"] + i["stages"] - 1) * max(p.compute_time_microbatch) + i["n_mb"] * (p.link_time_fwd + p.link_time_bwd)


# ----------------------------------------------------------------------------- shaping


def set_rate(net: netlab.ShapedNetwork, bps: float) -> float:
    """Change every shaped link of `net` to `bps` (`ShapedNetwork.set_rate`); returns when it was in place."""
    net.set_rate(bps)
    return time.time()


def wire_bytes(net: netlab.ShapedNetwork) -> int:
    """L2 bytes tc counted on all shaped links so far."""
    return sum(net.link_bytes().values())


# ----------------------------------------------------------------------------- a blocking send, probed

SEND_PROBE = r"""
import json, os, sys, time, torch, torch.distributed as dist
sizes, reps, late = [int(x) for x in sys.argv[1].split(",")], int(sys.argv[2]), float(sys.argv[3])
cuda = torch.cuda.is_available()
dev = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if cuda else torch.device("cpu")
if cuda:
    torch.cuda.set_device(dev)
dist.init_process_group("nccl" if cuda else "gloo", **({"device_id": dev} if cuda else {}))
rank = dist.get_rank()
sync = torch.cuda.synchronize if cuda else (lambda: None)
for n in sizes:
    x = torch.zeros(n // 2, dtype=torch.bfloat16, device=dev)
    for _ in range(2):  # connection up, out of slow start
        dist.send(x, 1) if rank == 0 else dist.recv(x, 0)
    for _ in range(reps):
        dist.barrier()
        sync()
        t0 = time.perf_counter()
        if rank == 0:
            dist.send(x, 1)
        else:
            time.sleep(late)
            dist.recv(x, 0)
        sync()
        dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64, device=dev)
        both = [torch.zeros_like(dt) for _ in range(2)]
        dist.all_gather(both, dt)
        if rank == 0:
            print(json.dumps({"bytes": n, "send_done": float(both[0]), "recv_done": float(both[1])}), flush=True)
dist.destroy_process_group()
"""


def probe_sends(tmp: str, env: dict, rate: float, sizes: list[int], reps: int, late: float) -> list[dict]:
    """SEND_PROBE between two namespaces on a stage link of `rate` (gloo on the CPU, NCCL on GPUs): per
    one-way blocking send of each size, `reps` times, when it ended on the sender and when its data
    were in (seconds from a barrier, each side after a device sync), with the receive posted `late`
    seconds after the send; rows {"bytes", "send_done", "recv_done"} in order."""
    prog = os.path.join(tmp, "send_probe.py")
    Path(prog).write_text(SEND_PROBE)
    with netlab.ShapedNetwork(2, netlab.replica_coords([2]), stage_rate_bps=rate) as net:
        res = net.run(lambda r: [sys.executable, prog, ",".join(map(str, sizes)), str(reps), str(late)], timeout=300,
                      env=dict(env, PYTHONPATH=str(REPO)))
    for r in res:
        if r.returncode != 0:
            raise RuntimeError(f"probe rank {r.rank} failed ({r.returncode}):\n{r.stderr[-3000:]}")
    return [json.loads(x) for x in res[0].stdout.splitlines() if x.startswith("{")]


# ----------------------------------------------------------------------------- engine runs


def train_cmd(cfg_path: str, model_path: str, out: str, steps: int = 100000, data: str | None = None,
              nice: bool = True) -> list[str]:
    cmd = [sys.executable, "-m", "hetloco_ds.cli", "train", "--config", cfg_path, "--model-config",
           model_path, "--out", out, "--steps", str(steps)]
    if data is not None:
        cmd += ["--data", data]
    return [*NICE, *cmd] if nice else cmd


class EngineRun:
    """`cmd` on every rank of `net`, started now; metrics rows read from OUT/metrics.jsonl.

    The run is meant to outlast the measurement (a large --steps): `stop` ends it.
    """

    def __init__(self, net: netlab.ShapedNetwork, cmd: list[str], out: str, env: dict):
        self.net = net
        self.metrics = os.path.join(out, "metrics.jsonl")
        port = random.randrange(20000, 32768)
        self.logs, self.procs = [], []
        for r in range(net.world):
            log = open(os.path.join(out, f"rank{r}.log"), "w")
            self.logs.append(log)
            self.procs.append(net.popen(r, cmd, net.env_for(r, port, env), stdout=log,
                                        stderr=subprocess.STDOUT, cwd=str(REPO)))

    def rows(self, kind: str) -> list[dict]:
        if not os.path.exists(self.metrics):
            return []
        with open(self.metrics) as f:
            lines = f.read().split("\n")[:-1]  # each row is one O_APPEND write ending in "\n"
        return [r for r in map(json.loads, lines) if r["kind"] == kind]

    def check(self) -> None:
        for r, p in enumerate(self.procs):
            if p.poll() is not None:
                self.logs[r].flush()
                tail = Path(self.logs[r].name).read_text()[-4000:]
                raise RuntimeError(f"rank {r} exited ({p.returncode}) during the measurement:\n{tail}")

    def stop(self, first_signal: int = 15) -> None:
        """`first_signal` to every rank's group, SIGKILL to any still running 10 s later."""
        for p in self.procs:
            if p.poll() is None:
                netlab._signal_group(p, first_signal)
        for p in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                netlab._signal_group(p, 9)
                p.wait()
        for log in self.logs:
            log.close()


def started_after(step_row: dict, t: float) -> bool:
    return step_row["time"] - step_row["seconds"] >= t + MARGIN_S


def collect(run: EngineRun, t0: float, want: int, kind: str = "step", replicas: int = 1,
            max_s: float = 120.0) -> dict[int, list[dict]]:
    """{step: rows of `kind`, one per replica} for the first `want` steps that started after t0
    and have a row from each of `replicas` replicas (fewer if max_s passes first)."""
    deadline = time.time() + max_s
    while True:
        run.check()
        starts = {(r["step"], r["replica"]): r for r in run.rows("step")}
        got: dict[int, list[dict]] = {}
        for r in run.rows(kind):
            s = starts.get((r["step"], r["replica"]))
            if s is not None and started_after(s, t0):
                got.setdefault(r["step"], []).append(r)
        done = {k: v for k, v in got.items() if len(v) == replicas}
        if len(done) >= want or time.time() > deadline:
            return dict(sorted(done.items())[:want])
        time.sleep(0.05)


def wait_steps(run: EngineRun, n: int, max_s: float = 300.0) -> None:
    deadline = time.time() + max_s
    while len(run.rows("step")) < n:
        run.check()
        if time.time() > deadline:
            raise RuntimeError(f"fewer than {n} steps after {max_s:.0f} s")
        time.sleep(0.05)


def summary(xs: list[float]) -> dict:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs),
            "values": [round(x, 5) for x in xs]}


def label(bps: float | None) -> str:
    return "unlimited" if not bps or bps >= UNLIMITED else f"{bps / 1e6:g} Mbit/s"


# ----------------------------------------------------------------------------- (a) stage links


def run_visits(net: netlab.ShapedNetwork, run: EngineRun, schedule: list[float],
               want: Callable[[float, list[dict]], tuple[int, float]], kind: str, replicas: int,
               log: Callable[[str], None], tag: str) -> list[dict]:
    """Visit the rates of `schedule` in order on a running engine; per visit, the rows of the
    first `want(bw, visits so far)[0]` steps that started after the rate was in place."""
    visits: list[dict] = []
    for bw in schedule:
        n, max_s = want(bw, visits)
        t0 = set_rate(net, bw)
        b0 = wire_bytes(net)
        got = collect(run, t0, n, kind, replicas, max_s)
        visits.append({"bw": bw, "steps": got, "wire": wire_bytes(net) - b0, "loadavg_1min": os.getloadavg()[0]})
        vals = [min(r["seconds"] for r in v) for v in got.values()]
        log(f"{tag} {label(bw):>12}: median {statistics.median(vals):.3f} s over {len(vals)} "
            f"(load {visits[-1]['loadavg_1min']:.2f})")
    return visits


def part_a(tmp: str, model_path: str, env: dict, quick: bool, log: Callable[[str], None]) -> list[dict]:
    points = []
    # Two rounds over the rates and a closing unlimited visit: a load burst from a neighbour on
    # this shared machine then hits one visit of a rate, not the whole of it.
    schedule = [UNLIMITED, *STAGE_RATES] * 2 + [UNLIMITED]
    for ratio in RATIOS:
        cfg = os.path.join(tmp, f"a_r{ratio}.json")
        Path(cfg).write_text(json.dumps(ds_config(2, N_MB_A, ratio, inner_steps=100000)))
        out = os.path.join(tmp, f"a_r{ratio}")
        os.makedirs(out)
        t_start = time.time()

        def want(bw: float, visits: list[dict]) -> tuple[int, float]:
            unl = [v[0]["seconds"] for x in visits if x["bw"] == UNLIMITED for v in x["steps"].values()]
            if bw == UNLIMITED or not unl:
                return (3 if quick else 6), 90
            est = n_mb_transfers_time(predict_stage(ratio, bw, calibrated_tflops(statistics.median(unl), ratio)))
            n = max(2 if quick else 3, min(4 if quick else 8, math.ceil((5 if quick else 12) / est)))
            return n, n * est * 3 + 30

        with netlab.ShapedNetwork(2, netlab.replica_coords([2]), stage_rate_bps=UNLIMITED) as net:
            run = EngineRun(net, train_cmd(cfg, model_path, out), out, env)
            try:
                wait_steps(run, 2)  # warm-up: tensor-meta exchange, first allocations
                visits = run_visits(net, run, schedule, want, "step", 1, log, f"(a) ratio {ratio:>2}")
            finally:
                run.stop()
        # Calibrate on every unlimited visit pooled; then every rate (both visits pooled) against the plan.
        rows_by = {bw: [v[0] for x in visits if x["bw"] == bw for v in x["steps"].values()]
                   for bw in (UNLIMITED, *STAGE_RATES)}
        t_unl = statistics.median(r["seconds"] for r in rows_by[UNLIMITED])
        tflops = calibrated_tflops(t_unl, ratio)
        p_inf = predict_stage(ratio, 1e15, tflops)
        for bw in (UNLIMITED, *STAGE_RATES):
            rows = rows_by[bw]
            secs = [r["seconds"] for r in rows]
            med = statistics.median(secs)
            p = predict_stage(ratio, bw if bw != UNLIMITED else 1e15, tflops)
            alt = n_mb_transfers_time(p)
            act = [r["bytes"]["activation"]["sent"] + r["bytes"]["activation_grad"]["sent"] for r in rows]
            mine = [x for x in visits if x["bw"] == bw]
            pt = {
                "part": "a", "ratio": ratio, "stage_bw_bps": None if bw == UNLIMITED else bw, "label": label(bw),
                "step_seconds": summary(secs),
                "visit_medians": [round(statistics.median(v[0]["seconds"] for v in x["steps"].values()), 4)
                                  for x in mine],
                "visit_loadavg_1min": [round(x["loadavg_1min"], 2) for x in mine],
                "utilisation_measured": t_unl / med,
                "stage_link_payload_bytes_per_step": statistics.median(act),
                "tc_wire_bytes_in_visits": [x["wire"] for x in mine],
                "predicted": {
                    "step_seconds": p.total_time, "utilisation": p_inf.total_time / p.total_time,
                    "plan_utilisation": p.utilisation, "stage_link_bytes_per_step": p.stage_link_bytes_per_step,
                    "compute_time_microbatch": max(p.compute_time_microbatch),
                    "link_time_fwd": p.link_time_fwd, "link_time_bwd": p.link_time_bwd,
                    "breakdown": p.breakdown, "n_mb_transfers_step_seconds": alt,
                },
                "measured_over_predicted": med / p.total_time,
                "measured_over_n_mb_transfers": med / alt,
                "calibration": {"t_unlimited_pooled": t_unl, "tflops": tflops, "gflops": tflops * 1e3},
            }
            points.append(pt)
            log(f"(a) ratio {ratio:>2} {label(bw):>12}: {med:.3f} s (n={len(secs)}, {min(secs):.3f}-{max(secs):.3f}, "
                f"visits {pt['visit_medians']}) plan {p.total_time:.3f} (x{med / p.total_time:.2f}), n_mb-transfers "
                f"{alt:.3f} (x{med / alt:.2f}); util {t_unl / med:.2f} vs plan {p_inf.total_time / p.total_time:.2f}; "
                f"bytes/step {statistics.median(act):.0f} vs plan {p.stage_link_bytes_per_step}")
        log(f"(a) ratio {ratio}: {time.time() - t_start:.0f} s; calibrated {tflops * 1e3:.1f} GFLOP/s "
            f"(t_c {t_unl / (N_MB_A + 1) * 1e3:.1f} ms per micro-batch)")
    return points


# ----------------------------------------------------------------------------- (b) replica links

PROBE = r"""
import json, sys, time
import torch
import torch.distributed as dist
from hetloco_ds.transport.static import all_gather_payloads  # the engine's outer-sync exchange
n_dense, n_payload, reps_dense, reps_small = (int(x) for x in sys.argv[1:5])
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
dist.all_reduce(torch.zeros(1024))  # connections up
small = torch.zeros(n_payload // 4)
parts = [torch.zeros_like(small) for _ in range(world)]
dense = torch.randn(n_dense)

def timed(kind, fn):
    dist.barrier()
    t0 = time.perf_counter()
    fn()
    dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
    dist.all_reduce(dt, op=dist.ReduceOp.MAX)  # the slower rank's time
    if rank == 0:
        print(json.dumps({"kind": kind, "seconds": float(dt)}), flush=True)

def one_way():
    if rank == 0:
        dist.send(small, 1)
    elif rank == 1:
        dist.recv(small, 0)

for _ in range(reps_small):
    timed("payload_one_way", one_way)
for _ in range(reps_small):
    timed("payload_all_gather", lambda: dist.all_gather(parts, small))
for _ in range(reps_small):
    timed("payload_exchange", lambda: all_gather_payloads(small))
for _ in range(reps_dense):
    timed("dense_all_reduce", lambda: dist.all_reduce(dense))
for _ in range(reps_dense):  # DiLoCo's dense fp32 sync through the engine's exchange, then the mean
    timed("dense_exchange", lambda: torch.stack(all_gather_payloads(dense)).mean(0))
dist.barrier()
dist.destroy_process_group()
"""


def predict_replica(bw: float, shape: plan.ModelShape | None = None) -> plan.Prediction:
    return plan.predict(shape or model_shape(), stages=1, replicas=2, stage_bw=1e9, replica_bw=bw, tflops=1.0,
                        mfu=1.0, micro_batch=MICRO, n_mb=N_MB_B, H=H_B, topk=32, chunk=4096, act_bytes=4,
                        overlap=False, link_efficiency=LINK_EFF)


def dense_time(bw: float, shape: plan.ModelShape | None = None) -> float:
    """Plan's ring formula on plan's dense fp32 bytes, M = 2."""
    return (2 - 1) * predict_replica(bw, shape).dense_outer_bytes[0] * 8 / (bw * LINK_EFF)


def part_b(tmp: str, model_path: str, env: dict, quick: bool, log: Callable[[str], None]) -> list[dict]:
    points = []
    cfg = os.path.join(tmp, "b.json")
    Path(cfg).write_text(json.dumps(ds_config(1, N_MB_B, 1, inner_steps=H_B)))
    out = os.path.join(tmp, "b")
    os.makedirs(out)
    prog = os.path.join(tmp, "probe.py")
    Path(prog).write_text(PROBE)
    n_params = model_shape().n_params()
    t_start = time.time()
    with netlab.ShapedNetwork(2, netlab.replica_coords([1, 1]), replica_rate_bps=UNLIMITED) as net:
        run = EngineRun(net, train_cmd(cfg, model_path, out), out, env)
        try:
            wait_steps(run, 2 * (2 * H_B))  # start-up (DeepSpeed's model broadcast) + 2 outer steps
            visits = run_visits(net, run, [UNLIMITED, *REPLICA_RATES] * 2,
                                lambda bw, v: (2 if quick else 4, 120), "outer", 2, log, "(b) ours")
        finally:
            run.stop()
        log(f"(b) engine run: {time.time() - t_start:.0f} s")
        per = {bw: [v for x in visits if x["bw"] == bw for v in x["steps"].values()] for bw in (UNLIMITED, *REPLICA_RATES)}
        ours_unl = statistics.median(min(r["seconds"] for r in v) for v in per[UNLIMITED])
        for bw in (UNLIMITED, *REPLICA_RATES):
            secs = [min(r["seconds"] for r in v) for v in per[bw]]
            slower = [max(r["seconds"] for r in v) for v in per[bw]]
            payload = per[bw][0][0]["payload_bytes"]
            med = statistics.median(secs)
            p = predict_replica(bw if bw != UNLIMITED else 1e15)
            pt = {
                "part": "b", "method": "ours", "what": "SparseLoCo outer step in the engine (metrics `outer` rows; "
                                                      "per outer step the replica that did not wait for its peer)",
                "replica_bw_bps": None if bw == UNLIMITED else bw, "label": label(bw),
                "outer_seconds": summary(secs), "outer_seconds_slower_replica": summary(slower),
                "payload_bytes": payload,
                "tc_wire_bytes_in_visits": [x["wire"] for x in visits if x["bw"] == bw],
                "visit_loadavg_1min": [round(x["loadavg_1min"], 2) for x in visits if x["bw"] == bw],
                "predicted": {"outer_sync_seconds": p.outer_sync_time, "payload_bytes": p.outer_payload_bytes[0],
                              "plus_measured_unlimited_outer_step": p.outer_sync_time + ours_unl},
                "measured_over_predicted": med / p.outer_sync_time if bw != UNLIMITED else None,
                "measured_over_predicted_plus_compute": med / (p.outer_sync_time + ours_unl),
            }
            points.append(pt)
            log(f"(b) ours  {label(bw):>12}: outer step {med:.3f} s (n={len(secs)}, {min(secs):.3f}-{max(secs):.3f}); "
                f"plan {p.outer_sync_time:.3f} s, plan + unlimited-link outer step {p.outer_sync_time + ours_unl:.3f} s; "
                f"payload {payload} B vs plan {p.outer_payload_bytes[0]} B")
        # Link probes and the dense baseline: the same namespaces, the same replica link.
        payload = points[-1]["payload_bytes"]
        for bw in (UNLIMITED, *REPLICA_RATES):
            set_rate(net, bw)
            reps_dense = 5 if bw >= 100e6 else (3 if bw >= 20e6 else 2)
            reps_small = 7
            if quick:
                reps_dense, reps_small = min(reps_dense, 2) if bw >= 20e6 else 1, 3
            b0 = wire_bytes(net)
            res = net.run(lambda r: [*NICE, sys.executable, prog, str(n_params), str(payload), str(reps_dense),
                                     str(reps_small)], timeout=500, env=dict(env, PYTHONPATH=str(REPO)))
            b1 = wire_bytes(net)
            for r in res:
                if r.returncode != 0:
                    raise RuntimeError(f"probe rank {r.rank} failed ({r.returncode}):\n{r.stderr[-3000:]}")
            rows = [json.loads(x) for x in res[0].stdout.splitlines() if x.startswith("{")]
            by = {k: [r["seconds"] for r in rows if r["kind"] == k] for k in
                  ("payload_one_way", "payload_all_gather", "payload_exchange", "dense_all_reduce", "dense_exchange")}
            link_only = payload * 8 / (bw * LINK_EFF) if bw != UNLIMITED else 0.0
            pred_dense = dense_time(bw) if bw != UNLIMITED else 0.0
            dense_pred = {"outer_sync_seconds": pred_dense, "payload_bytes": predict_replica(1e9).dense_outer_bytes[0]}
            for method, key, what in (
                    ("dense", "dense_all_reduce", "DiLoCo-style with gloo's stock collective: all_reduce of an fp32 "
                                                  "vector of the model's parameter count (direct, not the engine)"),
                    ("dense_exchange", "dense_exchange", "DiLoCo-style through the engine's exchange: "
                                                         "exchange.all_gather_payloads of the same fp32 vector, then "
                                                         "the mean (direct, not the engine)")):
                med = statistics.median(by[key])
                points.append({
                    "part": "b", "method": method, "what": what,
                    "replica_bw_bps": None if bw == UNLIMITED else bw, "label": label(bw),
                    "outer_seconds": summary(by[key]), "payload_bytes": 4 * n_params,
                    "tc_wire_bytes_in_probe": b1 - b0, "predicted": dense_pred,
                    "measured_over_predicted": med / pred_dense if pred_dense else None,
                })
            points.append({
                "part": "b", "method": "probe", "what": "gloo alone, our payload's size: one-way send, gloo's "
                                                        "all_gather, and the engine's exchange (no compression compute)",
                "replica_bw_bps": None if bw == UNLIMITED else bw, "label": label(bw), "payload_bytes": payload,
                "one_way_seconds": summary(by["payload_one_way"]),
                "all_gather_seconds": summary(by["payload_all_gather"]),
                "exchange_seconds": summary(by["payload_exchange"]),
                "predicted_link_seconds": link_only,
            })
            med = {k: statistics.median(v) for k, v in by.items()}
            log(f"(b) dense {label(bw):>12}: gloo all_reduce {med['dense_all_reduce']:.3f} s, exchange "
                f"{med['dense_exchange']:.3f} s (n={len(by['dense_exchange'])}), plan formula {pred_dense:.3f} s; "
                f"payload-size one-way {med['payload_one_way']:.3f} s, gloo all_gather {med['payload_all_gather']:.3f} s "
                f"({min(by['payload_all_gather']):.3f}-{max(by['payload_all_gather']):.3f}), exchange "
                f"{med['payload_exchange']:.3f} s ({min(by['payload_exchange']):.3f}-{max(by['payload_exchange']):.3f}), "
                f"link model {link_only:.3f} s")
    return points


# ----------------------------------------------------------------------------- agreement


def _spread(items: list[tuple[str, float]], band: float = 0.2) -> dict:
    vals = [v for _, v in items]
    return {"min": min(vals), "max": max(vals), "within_20pct": sum(abs(v - 1) <= band for v in vals),
            "of": len(vals), "outside_20pct": {k: round(v, 3) for k, v in items if abs(v - 1) > band}}


def agreement(points: list[dict]) -> dict:
    """measured / predicted over the shaped points, computed from this run's numbers."""
    out: dict = {}
    a = [p for p in points if p["part"] == "a" and p["stage_bw_bps"]]
    if a:
        out["a_step_time"] = {
            "measured_over_plan_predict": _spread([(f"ratio {p['ratio']} @ {p['label']}", p["measured_over_predicted"]) for p in a]),
            "measured_over_plan_terms_with_n_mb_transfers": _spread(
                [(f"ratio {p['ratio']} @ {p['label']}", p["measured_over_n_mb_transfers"]) for p in a]),
            "utilisation_measured_minus_predicted": {f"ratio {p['ratio']} @ {p['label']}": round(
                p["utilisation_measured"] - p["predicted"]["utilisation"], 3) for p in a},
        }
    b = [p for p in points if p["part"] == "b" and p["replica_bw_bps"]]
    ours = [p for p in b if p["method"] == "ours"]
    dense = [p for p in b if p["method"] == "dense"]
    probe = [p for p in b if p["method"] == "probe"]
    if ours:
        out["b_ours_outer_step"] = {
            "measured_over_plan_link_only": _spread([(p["label"], p["measured_over_predicted"]) for p in ours]),
            "measured_over_plan_plus_unlimited_outer_step": _spread(
                [(p["label"], p["measured_over_predicted_plus_compute"]) for p in ours]),
            "payload_bytes_engine_over_plan": ours[0]["payload_bytes"] / ours[0]["predicted"]["payload_bytes"],
        }
    dense_x = [p for p in b if p["method"] == "dense_exchange"]
    if dense_x:
        out["b_dense_exchange"] = {"measured_over_plan_formula": _spread(
            [(p["label"], p["measured_over_predicted"]) for p in dense_x])}
    if dense:
        out["b_dense_gloo_all_reduce_not_modelled"] = {"measured_over_plan_formula": _spread(
            [(p["label"], p["measured_over_predicted"]) for p in dense])}
    if probe:
        out["b_gloo_probe_payload_size"] = {p["label"]: {
            f"{k}_over_{ref}": round(p[f"{k}_seconds"]["median"] / den, 3)
            for k in ("one_way", "all_gather", "exchange")
            for ref, den in (("link_model", p["predicted_link_seconds"]), ("one_way", p["one_way_seconds"]["median"]))
            if not (k == "one_way" and ref == "one_way")
        } for p in probe}
    return out


NOTES = [
    "(a) plan.predict(overlap=False) charges t_f + t_b in each of the n_mb + S - 1 schedule slots; the engine "
    "sends n_mb activations and n_mb gradients per step over each stage link, so on a link-bound step plan "
    "over-predicts by up to (n_mb + S - 1) / n_mb (1.25 here). `n_mb_transfers_step_seconds` is plan's own terms "
    "with n_mb transfers per direction: (n_mb + S - 1) t_c + n_mb (t_f + t_b).",
    "(b) gloo's own collectives are rendezvous-based over one TCP connection per pair: a send's data leaves only "
    "after the peer's ready-to-receive message arrives, and that message travels behind whatever bulk data the "
    "peer has already queued on the connection. In gloo's all_gather a rank often has its payload queued before "
    "it posts its receive, so the two directions of the pair run partly one after the other: the probe's "
    "`all_gather_seconds` of our payload size is 1.0x-1.5x its one-way send, race-dependent (per-rate medians in "
    "agreement.b_gloo_probe_payload_size), and the plan (full duplex) does not model it. The engine therefore does not use all_gather on gloo: "
    "hetloco_ds.transport.static.all_gather_payloads posts every irecv before any isend, so both directions move at "
    "once (probe `exchange_seconds`); on NCCL it calls all_gather.",
    "(b) For one large transfer the rendezvous costs only its start, so gloo's stock all_reduce of the dense fp32 "
    "vector (`dense`) and the engine's exchange of it (`dense_exchange`) both follow the plan's formula; plan "
    "predicts the exchange (the engine's code path), the all_reduce is recorded as what a DiLoCo user on gloo gets.",
    "netlab shaping (this run): gso_max_segs 1 on every rank's veth (with GSO on, an idle link let one 64 KB "
    "segment leave ahead of the rate: one-way sends of 160 KB ran at 0.81x bytes / rate), and TCP ACKs in a "
    "priority child of each link's htb class (with one FIFO per link, the ACKs of the data a rank receives queue "
    "behind the data it sends, and a bidirectional 160 KB exchange at 5 Mbit/s took 1.0x-1.6x a one-way send). "
    "The probe's one-way send is now ~1.0x bytes / rate (`one_way_over_link_model`). The price of one frame per "
    "skb is CPU: on this loaded 2-core machine a link moves at most ~0.4 Gbit/s, so the 'unlimited' class and "
    "the 1000 Mbit/s visits are CPU-bound rather than rate-bound (the dense fp32 sync on the unlimited link takes "
    "0.4-0.6 s, not the ~0.03 s it took with GSO on), and the uncompressed (ratio 1) run's unlimited step carries "
    "that transfer cost; plan is calibrated on it, so the 1000 Mbit/s column says little about a real 1 Gbit/s link.",
    "(b) Residual spread of the exchange at low rates: some exchanges stall for a few tens of ms (`ss -ti` shows "
    "the sender rwnd-limited: the receiver's TCP window, ~130 KB here, is below the 160 KB payload, and on this "
    "shared 2-core machine a rank is not always scheduled to drain its socket); medians are at the one-way time.",
    "(b) plan's outer-sync time is the link only; the engine's outer step also does error feedback, top-k, "
    "packing, decoding and the outer SGD (the unlimited-link outer step measures that part).",
]


# ----------------------------------------------------------------------------- plot


def plot(result: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(18, 5.5))
    grid = [10 ** (x / 20) * 1e6 for x in range(0, 61)]  # 1 Mbit/s .. 1 Gbit/s
    gx = [g / 1e6 for g in grid]
    colors = {1: "tab:red", 8: "tab:blue", 64: "tab:green"}
    a = [p for p in result["points"] if p["part"] == "a"]
    for ratio in RATIOS:
        pts = [p for p in a if p["ratio"] == ratio]
        if not pts:
            continue
        tf = pts[0]["calibration"]["tflops"]
        shaped = [p for p in pts if p["stage_bw_bps"]]
        unl = pts[0]["calibration"]["t_unlimited_pooled"]
        xs = [p["stage_bw_bps"] / 1e6 for p in shaped]
        c = colors[ratio]
        name = "ratio 1 (uncompressed)" if ratio == 1 else f"ratio {ratio}"
        preds = [predict_stage(ratio, g, tf) for g in grid]
        axes[0].plot(gx, [q.total_time for q in preds], "-", color=c, label=f"{name}: plan.predict")
        axes[0].plot(gx, [n_mb_transfers_time(q) for q in preds], "--", color=c, lw=0.8,
                     label=f"{name}: plan terms, n_mb transfers")
        axes[0].errorbar(xs, [p["step_seconds"]["median"] for p in shaped],
                         yerr=[[p["step_seconds"]["median"] - p["step_seconds"]["min"] for p in shaped],
                               [p["step_seconds"]["max"] - p["step_seconds"]["median"] for p in shaped]],
                         fmt="o", color=c, capsize=3, label=f"{name}: measured (median, min-max)")
        axes[0].axhline(unl, color=c, ls=":", lw=1)
        inf = predict_stage(ratio, 1e15, tf).total_time
        axes[1].plot(gx, [inf / q.total_time for q in preds], "-", color=c, label=f"{name}: plan.predict")
        axes[1].plot(gx, [inf / n_mb_transfers_time(q) for q in preds], "--", color=c, lw=0.8)
        axes[1].plot(xs, [p["utilisation_measured"] for p in shaped], "o", color=c, label=f"{name}: measured")
    axes[0].set(xscale="log", yscale="log", xlabel="stage-link bandwidth (Mbit/s)", ylabel="step time (s)",
                title="(a) S=2, M=1, 4 micro-batches: step time\n(dotted: unlimited link, measured)")
    axes[1].set(xscale="log", xlabel="stage-link bandwidth (Mbit/s)", ylim=(0, 1.1),
                ylabel="compute utilisation = T(unlimited) / T(bw)",
                title="(a) compute utilisation\n(dashed: plan terms with n_mb transfers)")
    b = [p for p in result["points"] if p["part"] == "b"]
    ours = [p for p in b if p["method"] == "ours" and p["replica_bw_bps"]]
    dense = [p for p in b if p["method"] == "dense" and p["replica_bw_bps"]]
    dense_x = [p for p in b if p["method"] == "dense_exchange" and p["replica_bw_bps"]]
    probe = [p for p in b if p["method"] == "probe" and p["replica_bw_bps"]]
    unl = [p for p in b if p["method"] == "ours" and not p["replica_bw_bps"]]
    comp = unl[0]["outer_seconds"]["median"] if unl else 0.0
    g2 = [g for g in grid if g <= 200e6]
    x2 = [g / 1e6 for g in g2]
    if ours:
        axes[2].plot(x2, [predict_replica(g).outer_sync_time for g in g2], "-", color="tab:blue",
                     label="ours: plan (link only)")
        axes[2].plot(x2, [predict_replica(g).outer_sync_time + comp for g in g2], "--", color="tab:blue",
                     label="ours: plan + measured unlimited-link outer step")
        axes[2].errorbar([p["replica_bw_bps"] / 1e6 for p in ours], [p["outer_seconds"]["median"] for p in ours],
                         yerr=[[p["outer_seconds"]["median"] - p["outer_seconds"]["min"] for p in ours],
                               [p["outer_seconds"]["max"] - p["outer_seconds"]["median"] for p in ours]],
                         fmt="o", color="tab:blue", capsize=3, label="ours: engine outer step (median, min-max)")
    if probe:
        axes[2].plot([p["replica_bw_bps"] / 1e6 for p in probe], [p["all_gather_seconds"]["median"] for p in probe],
                     "x", color="tab:cyan", label="gloo's all_gather of our payload size alone")
        axes[2].plot([p["replica_bw_bps"] / 1e6 for p in probe], [p["exchange_seconds"]["median"] for p in probe],
                     "+", color="tab:purple", ms=9, label="the engine's exchange of our payload size alone")
    if dense:
        axes[2].plot(x2, [dense_time(g) for g in g2], "-", color="tab:gray", label="dense fp32: plan ring formula")
        axes[2].errorbar([p["replica_bw_bps"] / 1e6 for p in dense], [p["outer_seconds"]["median"] for p in dense],
                         yerr=[[p["outer_seconds"]["median"] - p["outer_seconds"]["min"] for p in dense],
                               [p["outer_seconds"]["max"] - p["outer_seconds"]["median"] for p in dense]],
                         fmt="s", color="tab:gray", capsize=3, label="dense fp32, gloo's all_reduce: measured")
    if dense_x:
        axes[2].errorbar([p["replica_bw_bps"] / 1e6 for p in dense_x], [p["outer_seconds"]["median"] for p in dense_x],
                         yerr=[[p["outer_seconds"]["median"] - p["outer_seconds"]["min"] for p in dense_x],
                               [p["outer_seconds"]["max"] - p["outer_seconds"]["median"] for p in dense_x]],
                         fmt="D", color="black", mfc="none", capsize=3, label="dense fp32, the engine's exchange: measured")
    axes[2].set(xscale="log", yscale="log", xlabel="replica-link bandwidth (Mbit/s)", ylabel="outer-sync time (s)",
                title="(b) M=2, S=1: outer sync vs replica link")
    for ax in axes:
        ax.grid(True, which="both", alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    m = result["settings"]["model"]
    fig.suptitle(f"hetloco-ds train on tc-shaped links: CPU ({result['machine']['cpu']}, "
                 f"{result['machine']['cores']} cores), gloo/TCP, fp32; d={m['hidden_size']}, "
                 f"{m['num_hidden_layers']} layers, vocab {m['vocab_size']}, seq {SEQ}, micro {MICRO}", fontsize=10)
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
    import deepspeed
    import torch
    return {"cpu": cpu, "cores": os.cpu_count(), "kernel": platform.release(), "python": platform.python_version(),
            "torch": torch.__version__, "deepspeed": deepspeed.__version__,
            "iproute2": subprocess.run(["tc", "-V"], capture_output=True, text=True).stdout.strip(),
            "loadavg_at_start": os.getloadavg(),
            "note": "shared machine (other engineers' jobs run beside this one); ranks under nice -n 10"}


def prepare_cache(env: dict) -> None:
    """Tokenizer and token cache built once, outside every timed run."""
    code = (f"from hetloco_ds import data; t = data.default_tokenizer(vocab_size={VOCAB}, progress=False); "
            f"data.load_corpus(None, t, {SEQ}, progress=False)")
    subprocess.run([sys.executable, "-c", code], env=env, check=True, cwd=REPO, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL)


def netlab_ready(tag: str) -> bool:
    """Whether this machine can shape links (root, tc, namespaces); if not, says why on stderr.
    Leftovers of an earlier, killed run are removed."""
    ok, why = netlab.available()
    if not ok:
        print(f"{tag}: {why}", file=sys.stderr)
        return False
    netlab.remove_stale()
    return True


class RunLog:
    """The run's log: each line stamped with seconds since the start, printed and kept for the JSON."""

    def __init__(self):
        self.t0, self.lines = time.time(), []

    def __call__(self, msg: str) -> None:
        line = f"[{time.time() - self.t0:6.1f}s] {msg}"
        self.lines.append(line)
        print(line, flush=True)

    def elapsed(self) -> float:
        return round(time.time() - self.t0, 1)


def child_env(**extra) -> dict:
    """Environment of the ranks a bench starts: quiet, offline, one thread each."""
    return dict(os.environ, HETLOCO_QUIET="1", TQDM_DISABLE="1", TOKENIZERS_PARALLELISM="false",
                HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", **extra)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=str(REPO / "bench" / "results"))
    ap.add_argument("--quick", action="store_true", help="fewer steps per point (a smoke run)")
    ap.add_argument("--parts", default="ab", choices=("a", "b", "ab"))
    args = ap.parse_args(argv)
    if not netlab_ready("shaped_links"):
        return 2
    log = RunLog()
    env = child_env()
    info = machine()
    tmp = tempfile.mkdtemp(prefix="shaped-links-")
    try:
        prepare_cache(env)
        model_path = os.path.join(tmp, "model.json")
        Path(model_path).write_text(json.dumps(MODEL))
        log(f"caches ready; model {model_shape().n_params():,} parameters")
        points = []
        if "a" in args.parts:
            points += part_a(tmp, model_path, env, args.quick, log)
        if "b" in args.parts:
            points += part_b(tmp, model_path, env, args.quick, log)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    info["loadavg_at_end"] = os.getloadavg()
    result = {
        "what": "hetloco-ds train (the real engine, one rank per network namespace, gloo over TCP) on tc-shaped "
                "links vs plan.predict; bench/shaped_links.py's docstring defines every number",
        "machine": info,
        "command": "python bench/shaped_links.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "total_seconds": log.elapsed(),
        "settings": {
            "model": {**MODEL, "vocab_size": VOCAB, "params": model_shape().n_params()}, "seq_len": SEQ,
            "micro_batch": MICRO, "precision": "fp32 (activations fp32 on the wire, token ids int16)",
            "a": {"stages": 2, "replicas": 1, "n_mb": N_MB_A, "ratios": list(RATIOS),
                  "stage_rates_bps": list(STAGE_RATES), "sparseloco_inner_steps": 100000,
                  "visits": "one run per ratio: (unlimited, 1000, 100, 20, 5 Mbit/s) x 2, unlimited",
                  "utilisation": "median step on the unlimited link (all unlimited visits) / median step at bw",
                  "calibration": "per ratio: t_c = T_unlimited / (n_mb + S - 1); FLOP/s = busiest stage's "
                                 "FLOPs per micro-batch / t_c, given to plan as tflops with mfu 1"},
            "b": {"stages": 1, "replicas": 2, "n_mb": N_MB_B, "inner_steps": H_B, "topk": 32, "chunk": 4096,
                  "replica_rates_bps": list(REPLICA_RATES),
                  "dense": "4 * params bytes (fp32), direct, same namespaces and link: gloo's all_reduce, and "
                           "the engine's exchange (hetloco_ds.transport.static.all_gather_payloads) + mean",
                  "outer_sync_collective": "gloo: hetloco_ds.transport.static.all_gather_payloads (every irecv posted "
                                           "before any isend)"},
            "unlimited": f"the same htb class at {UNLIMITED / 1e9:g} Gbit/s",
            "netlab": {"gso_max_segs": 1, "htb_burst": "tc default (1600 bytes at these rates)",
                       "ack_priority": "TCP segments without payload in a priority-0 child of each link's "
                                       "htb class, the rest in a priority-1 child; both share the link's rate",
                       "ack_share": netlab.ACK_SHARE},
            "step_margin_s": MARGIN_S,
            "plan": {"overlap": False, "link_efficiency": LINK_EFF, "act_bytes": 4, "ids_bytes": 2, "latency": 0},
            "nice": " ".join(NICE), "OMP_NUM_THREADS": 1,
        },
        "agreement": agreement(points),
        "notes": NOTES,
        "points": points,
        "log": log.lines,
    }
    os.makedirs(args.out, exist_ok=True)
    jpath = os.path.join(args.out, "shaped_links.json")
    checkpoint.replace_text(jpath, json.dumps(result, indent=1) + "\n")
    plot(result, os.path.join(args.out, "shaped_links.png"))
    log(f"wrote {jpath} and shaped_links.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
