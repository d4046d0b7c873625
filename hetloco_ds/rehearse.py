"""`hetloco-ds train ... --nproc N --link stage=RATE --link replica=RATE`: a rehearsal on emulated links.

The job runs as usual, except that each rank runs in its own network namespace and the links
between ranks are shaped with tc (`netlab`): "stage" links join adjacent stages of a replica,
"replica" links one stage across replicas; other pairs (non-adjacent stages of different
replicas, which only DeepSpeed's start-up traffic uses) stay unshaped, as does a class not
given. It ends with one line comparing what the run measured with what `hetloco-ds plan`
predicts for the same setting:

    [hetloco] rehearsal (stage 100 Mbit/s, replica 1 Gbit/s, overlapped schedule, M=2 x S=2):
    step 0.82 s measured vs 0.79 s planned (x1.04); compute utilisation 41% measured vs 43% planned

Measured: the mean step time (metrics.jsonl `seconds`, outer steps included, the first step
left out as warm-up) and the compute utilisation = the busiest stage's compute seconds per step
(the engine times its forward and backward passes) / that step time. Planned: `plan.predict`
with this run's model, batch, H, compression, schedule and link rates, TCP's goodput over
Ethernet (1448 / 1514 of the rate) and the device speed calibrated from the measured compute
(the busiest stage's FLOPs per micro-batch / its measured seconds per micro-batch), so the
comparison is about the links and the schedule, not the device. With heterogeneous replicas
the slowest replica's prediction counts: replicas wait for each other at every outer step.

Needs Linux, root, `ip` and `tc`: without them it stops with one line naming what is missing,
before any rank starts. The shaping applies to TCP through each namespace's veth: gloo always;
NCCL only over sockets, so the ranks get NCCL_P2P_DISABLE, NCCL_SHM_DISABLE and NCCL_IB_DISABLE and
NCCL_NET=Socket, and each namespace counts as a host of its own (netlab's HETLOCO_HOST), so the
engine runs what it would run across hosts: "auto" is the overlapped schedule over process groups,
never the copy engines (on GPUs the engine's compute seconds are host launch time, so the measured
utilisation is only meaningful on CPU; bench/gpu_links.py measures GPUs on shaped links).
"""
from __future__ import annotations

import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time

from . import launch, netlab
from .pipe.order import links_plan
from .plan import model as plan
from .plan.shapes import ModelShape

LINK_CLASSES = ("stage", "replica")
NCCL_SOCKETS = {"NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1", "NCCL_IB_DISABLE": "1", "NCCL_NET": "Socket"}
"""NCCL kept to TCP sockets, the one path tc shapes."""
TCP_GOODPUT = 1448 / 1514
"""TCP/IPv4 payload per 1514-byte Ethernet frame with timestamps (tests/test_netlab.py)."""


def parse_links(specs: list[str]) -> dict[str, float]:
    """{"stage": bits/s, "replica": bits/s} from ["stage=100mbit", "replica=1G"]; ValueError naming a bad one."""
    rates: dict[str, float] = {}
    for spec in specs:
        name, sep, rate = spec.partition("=")
        if not sep or name not in LINK_CLASSES:
            raise ValueError(f"--link {spec!r}: expected CLASS=RATE with CLASS one of {', '.join(LINK_CLASSES)}, "
                             "e.g. stage=100mbit")
        if name in rates:
            raise ValueError(f"--link {name} given twice")
        bps = plan.parse_rate(rate)
        if not bps > 0:
            raise ValueError(f"--link {spec!r}: the rate must be > 0")
        rates[name] = bps
    return rates


def problem(specs: list[str], launched: bool = False) -> str | None:
    """Why a rehearsal cannot run here (bad --link, under a launcher, no root, no tc), or None."""
    try:
        parse_links(specs)
    except ValueError as err:
        return str(err)
    if launched:
        return "--link starts its own ranks, one per network namespace: run it without a launcher (use --nproc)"
    ok, why = netlab.available()
    return None if ok else f"--link needs shaped network namespaces: {why}"


def run(nproc: int, argv: list[str], specs: list[str], out: str, stages: int, env: dict | None = None) -> int:
    """Run `python -m hetloco_ds.cli *argv` as `nproc` ranks on shaped links (environment `env`,
    default ours), then print the summary line."""
    rates = parse_links(specs)
    replicas = nproc // stages
    env = dict(os.environ if env is None else env, **NCCL_SOCKETS)
    start = time.time()
    with netlab.ShapedNetwork(nproc, netlab.replica_coords([stages] * replicas), rates.get("stage"),
                              rates.get("replica")) as net, tempfile.TemporaryDirectory(prefix="hl-rehearse-") as tmp:
        code = _run_ranks(net, [sys.executable, "-m", "hetloco_ds.cli", *argv], env, tmp)
    if code != 0:
        return code
    print(summary(out, rates, nproc, stages, since=start), flush=True)
    return 0


def _run_ranks(net: netlab.ShapedNetwork, cmd: list[str], env: dict, tmp: str) -> int:
    """`cmd` as every rank of `net`. Rank 0 writes to this terminal, the others to log files (shown
    if they fail). `launch.supervise`, as for `launch.spawn`: the first failing rank (or Ctrl-C) stops
    the rest, SIGTERM to each rank's process group, then SIGKILL after `launch.STOP_GRACE_S` for any
    still running, so a rank stuck in a collective with a dead peer cannot hold the rehearsal."""
    port = random.randrange(20000, 32768)  # any port is free in namespaces just made
    procs, logs = [], []
    for rank in range(net.world):
        rank_env = net.env_for(rank, port, env)
        if rank == 0:
            procs.append(net.popen(rank, cmd, rank_env))
            logs.append(None)
            continue
        rank_env["HETLOCO_QUIET"] = "1"
        log = open(os.path.join(tmp, f"rank{rank}.log"), "w+")
        logs.append(log)
        procs.append(net.popen(rank, cmd, rank_env, stdout=log, stderr=subprocess.STDOUT))
    failed, code = launch.supervise(procs)
    if failed is not None and logs[failed] is not None:
        logs[failed].seek(0)
        print(f"[hetloco] rank {failed} failed ({code}); its log ends:\n{logs[failed].read()[-3000:]}",
              file=sys.stderr, flush=True)
    for log in logs:
        if log is not None:
            log.close()
    return code


def _run_settings(out: str) -> dict:
    with open(os.path.join(out, "run_config.json")) as f:
        return json.load(f)


def summary(out: str, rates: dict[str, float], nproc: int, stages: int, since: float = 0.0) -> str:
    """The one line comparing this run's metrics.jsonl with plan's prediction."""
    rc = _run_settings(out)
    rows = []
    with open(os.path.join(out, "metrics.jsonl")) as f:
        for line in f:
            row = json.loads(line)
            if row["kind"] == "step" and row["time"] >= since:
                rows.append(row)
    timed = [r for r in rows if r["step"] > 1]
    where = (f"stage {plan.fmt_rate(rates['stage']) if 'stage' in rates else 'unshaped'}, replica "
             f"{plan.fmt_rate(rates['replica']) if 'replica' in rates else 'unshaped'}, "
             f"{links_plan(rc['hetloco']['pipeline']['schedule'], 'process_group', 'cpu')[0]} schedule, M={rc['replicas']} x S={rc['stages']}")
    if not timed or not all(r.get("compute_seconds") for r in timed):
        return f"[hetloco] rehearsal ({where}): too few steps to compare with the plan (run more than 1 step)"
    step = statistics.fmean(r["seconds"] for r in timed)
    compute = statistics.fmean(max(r["compute_seconds"]) for r in timed)
    predicted = predict(rc, rates, compute)
    return (f"[hetloco] rehearsal ({where}): step {step:.3g} s measured vs {predicted.total_time:.3g} s planned "
            f"(x{step / predicted.total_time:.2f}); compute utilisation {compute / step:.0%} measured vs "
            f"{predicted.utilisation:.0%} planned")


def predict(rc: dict, rates: dict[str, float], compute_per_step: float) -> plan.Prediction:
    """plan.predict for the run described by run_config.json (the slowest replica's), with the
    device speed calibrated so that the busiest stage's compute per step is `compute_per_step`."""
    model, ds, het = rc["model"], rc["ds"], rc["hetloco"]
    shape = ModelShape(d=model["hidden_size"], n_layers=model["num_hidden_layers"],
                       n_heads=model["num_attention_heads"], n_kv_heads=model.get("num_key_value_heads"),
                       ffn=model["intermediate_size"], vocab=model["vocab_size"], seq_len=het["train"]["seq_len"],
                       name="run", tied=bool(model.get("tie_word_embeddings")))
    sl, sub = het["sparseloco"], het["subspace"]
    M, S = rc["replicas"], rc["stages"]
    unshaped = 1e12  # netlab leaves the class unshaped: far faster than anything modelled here
    base = plan.Settings(
        stages=S, replicas=M, stage_bw=rates.get("stage", unshaped), replica_bw=rates.get("replica", unshaped),
        micro_batch=ds.get("train_micro_batch_size_per_gpu", 1), n_mb=ds.get("gradient_accumulation_steps", 1),
        H=sl["inner_steps"] if sl["enabled"] else 1, topk=sl["topk"], chunk=sl["chunk_size"],
        quant_bits=sl["quant_bits"], act_bytes=2 if (ds.get("bf16") or {}).get("enabled") else 4,
        overlap=links_plan(het["pipeline"]["schedule"], "process_group", "cpu")[0] == "overlapped", link_efficiency=TCP_GOODPUT,
        tied_embeddings=sl["tied_embeddings"] if sl["enabled"] else "every_step", mfu=1.0,
        embedding_sync=_any_compressed(sub, M) and sub["embedding_adaptation"])
    ratios = {_ratio(sub, m, M) for m in range(M)}
    # Calibrate on the link-free prediction: FLOPs per micro-batch of the busiest stage / its time.
    probe = plan.predict(shape, base, ratio=max(ratios), tflops=1.0)
    flops = max(probe.flops_per_microbatch)
    tflops = flops / (compute_per_step / base.n_mb) / 1e12
    return max((plan.predict(shape, base, ratio=r, tflops=tflops) for r in ratios), key=lambda p: p.total_time)


def _any_compressed(sub: dict, M: int) -> bool:
    return any(_ratio(sub, m, M) > 1 for m in range(M))


def _ratio(sub: dict, m: int, M: int) -> int:
    c = sub["compressed_replicas"]
    compressed = c == "all" or (isinstance(c, list) and m in c)
    return int({int(k): v for k, v in sub["replica_ratios"].items()}.get(m, sub["ratio"])) if compressed else 1
