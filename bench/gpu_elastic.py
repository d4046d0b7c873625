"""Two GPUs, two elastic replicas (S = 1 each) through a torchft lighthouse: one killed mid-run and
restarted. What a fault costs the survivor, and how long a replica takes to come back.

The replicas are the user's command, one process each on its own GPU, as torchrun starts a rank:

    hetloco-ds train --lighthouse ADDR --replica-id m --secret-file F --out OUT/run ...

(RANK 0 of WORLD_SIZE 1, CUDA_VISIBLE_DEVICES=m). This script is the lighthouse (in-process) and the
operator, in phases, each bounded:

  together  both replicas train; after `--together` outer steps with 2 members ...
  kill      replica 1 is SIGKILLed in the middle of an inner step (half an outer period after a boundary)
  alone     replica 0 goes on; after `--alone` outer steps with 1 member ...
  restart   replica 1 is started again, fresh (--overwrite: no checkpoint, its own data shard from 0); it
            builds its model, trains H inner steps, and at the next outer boundary is healed (receives the
            synced state from replica 0); after `--together` more outer steps with 2 members, both stop.

Everything is read back from the replicas' metrics.jsonl (rows carry wall-clock times, one host):

  tokens_per_s            replica 0's step rows: tokens / seconds over the inner steps (outer-step rows out),
                          and over all steps of the phase (outer steps in), together before the kill, alone,
                          together after the rejoin
  outer_step_s            the engine's outer-step time (begin: the quorum; exchange; finish; checksums), median
                          over outer rows with 2 members and with 1 member, the fault and heal steps left out;
                          also the quorum part (`quorum_seconds`, from begin to the commit)
  fault_cost_s            replica 0's first outer step without replica 1: its quorum_seconds (the lighthouse
                          notices the dead replica by its missing heartbeats, `--heartbeat-timeout`)
  recovery                restart -> replica 1's first step row (process start, imports, model, CUDA), ->
                          its healed outer row, -> replica 0's first outer row with 2 members again

    OUT=... bash bench/gpu.sh --gpus 2 gpu_elastic.py              # 2 GPUs
    python bench/gpu_elastic.py --cpu-smoke                      # tiny model on this CPU, gloo, ~2 min
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time

BENCH = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(BENCH)
if REPO not in sys.path:
    sys.path.insert(0, REPO)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-config", default="178M", help="preset (tiny, 20M, 178M, ...)")
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--micro", type=int, default=8)
    p.add_argument("--gas", type=int, default=2)
    p.add_argument("--inner-steps", type=int, default=10, help="H")
    p.add_argument("--together", type=int, default=3, help="outer steps with 2 members before the kill and after the rejoin")
    p.add_argument("--alone", type=int, default=4, help="outer steps of the survivor alone before the restart")
    p.add_argument("--heartbeat-timeout", type=float, default=3.0)
    p.add_argument("--join-timeout", type=float, default=60.0)
    p.add_argument("--phase-timeout", type=float, default=150.0, help="seconds any one phase may take")
    p.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--out", default=None, help="JSON path (default $OUT/gpu_elastic.json)")
    p.add_argument("--work", default=None, help="scratch directory (default: a temp dir)")
    p.add_argument("--cpu-smoke", action="store_true", help="tiny model, seq 64, micro 2, H 2, gloo")
    args = p.parse_args(argv)
    if args.cpu_smoke:
        args.model_config, args.seq, args.micro, args.gas, args.inner_steps = "tiny", 64, 2, 1, 2
        args.bf16, args.heartbeat_timeout, args.join_timeout = False, 2.0, 30.0
    return args


def write_config(path: str, args) -> None:
    with open(os.path.join(REPO, "hetloco_ds", "configs", "cpu_tiny.json")) as f:
        cfg = json.load(f)
    cfg.update(train_micro_batch_size_per_gpu=args.micro, gradient_accumulation_steps=args.gas)
    cfg["pipeline"] = {"stages": 1}
    cfg["bf16"] = {"enabled": bool(args.bf16)}
    cfg["scheduler"]["params"]["total_num_steps"] = 100000
    cfg["hetloco"] = {
        "sparseloco": {"inner_steps": args.inner_steps},
        "subspace": {"compressed_replicas": "none"},
        "train": {"seq_len": args.seq, "eval_interval": 0, "checkpoint_interval": 0, "watchdog_timeout": 300},
        "elastic": {"max_replicas": 2, "timeout": 30, "quorum_timeout": 300},
    }
    with open(path, "w") as f:
        json.dump(cfg, f, indent=1)


class Replica:
    def __init__(self, m: int, argv: list[str], env: dict, log: str):
        self.m, self.log = m, log
        self.started = time.time()
        with open(log, "ab") as f:
            self.proc = subprocess.Popen([sys.executable, "-m", "hetloco_ds.cli", *argv], env=env, stdout=f,
                                         stderr=subprocess.STDOUT, start_new_session=True)

    def kill(self, sig=signal.SIGKILL) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, sig)
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


def rows(run: str, m: int) -> list[dict]:
    path = os.path.join(run, f"replica-{m}", "metrics.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.endswith("\n")]


def main(argv=None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("RUST_LOG", "warn")
    import tempfile

    import torch
    from torchft._torchft import LighthouseServer

    from hetloco_ds.elastic.replica import FleetArgs
    from hetloco_ds.launch import free_port
    from hetloco_ds.train import TrainArgs, plan_run

    cuda = torch.cuda.is_available() and not args.cpu_smoke
    if cuda and torch.cuda.device_count() < 2:
        sys.exit(f"need 2 GPUs, found {torch.cuda.device_count()}")
    work = args.work or tempfile.mkdtemp(prefix="gpu_elastic_")
    os.makedirs(work, exist_ok=True)
    out_json = args.out or os.path.join(os.environ.get("OUT", BENCH + "/results"), "gpu_elastic.json")
    os.makedirs(os.path.dirname(os.path.abspath(out_json)), exist_ok=True)
    cfg = os.path.join(work, "config.json")
    write_config(cfg, args)
    secret = os.path.join(work, "secret")
    fd = os.open(secret, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.write(fd, os.urandom(32).hex().encode())
    os.close(fd)
    run = os.path.join(work, "run")
    report = {"bench": "gpu_elastic", "card": torch.cuda.get_device_name(0) if cuda else "cpu",
              "torch": torch.__version__, "args": vars(args), "phases": {}}
    stamps = report["phases"]
    t0 = time.time()

    def stamp(name: str) -> None:
        stamps[name] = round(time.time() - t0, 2)
        print(f"[gpu_elastic] {stamps[name]:7.1f} s: {name}", flush=True)

    # The tokenizer and token caches, built once here (not timed as part of any replica).
    os.environ["HETLOCO_CACHE"] = os.path.join(work, "cache")
    common = ["--config", cfg, "--model-config", args.model_config, "--steps", "1000000"]
    probe = FleetArgs(lighthouse="http://127.0.0.1:1", replica=0, secret_file=secret)
    plan_run(TrainArgs(config=cfg, model_config=args.model_config, out=os.path.join(work, "probe"), fleet=probe), 1,
             owned=True)
    stamp("data and tokenizer ready")

    lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=1, join_timeout_ms=int(args.join_timeout * 1000),
                                  heartbeat_timeout_ms=int(args.heartbeat_timeout * 1000))
    addr = "http://127.0.0.1:" + lighthouse.address().rpartition(":")[2]
    gate = os.path.join(work, "gate")
    os.makedirs(gate, exist_ok=True)
    base = dict(os.environ, HETLOCO_QUIET="1", TQDM_DISABLE="1", HETLOCO_FLEET_GATE=gate, OMP_NUM_THREADS="4")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT", "HETLOCO_FLEET_SECRET"):
        base.pop(k, None)

    def start(m: int, fresh: bool) -> Replica:
        env = dict(base, RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(free_port()))
        if cuda:
            env["CUDA_VISIBLE_DEVICES"] = str(m)
        argv = ["train", "--out", run, "--lighthouse", addr, "--replica-id", str(m), "--secret-file", secret, *common]
        return Replica(m, argv + (["--overwrite"] if fresh else []), env, os.path.join(work, f"replica{m}.log"))

    def outer(m: int) -> list[dict]:
        return [r for r in rows(run, m) if r["kind"] == "outer"]

    def wait(cond, what: str, reps) -> None:
        end = time.monotonic() + args.phase_timeout
        while not cond():
            for r in reps:
                if r.proc.poll() not in (None,) and r.proc.returncode != 0 and r not in killed:
                    raise RuntimeError(f"replica {r.m} exited with {r.proc.returncode} while waiting for {what}; "
                                       f"see {r.log}")
            if time.monotonic() > end:
                raise RuntimeError(f"timed out after {args.phase_timeout:.0f} s waiting for {what}")
            time.sleep(0.1)

    killed: list = []
    reps = [start(0, True), start(1, True)]
    rc = 1
    try:
        wait(lambda: len([f for f in os.listdir(gate) if f.startswith("ready-")]) == 2, "both replicas up", reps)
        open(os.path.join(gate, "go"), "w").close()
        stamp("both replicas up (gate open)")
        wait(lambda: len([r for r in outer(0) if r["members"] == [0, 1]]) >= args.together + 1,
             f"{args.together + 1} outer steps together", reps)
        stamp("together")
        # The kill lands mid-inner-step: half an outer period after replica 1's last boundary.
        last = max(r["step"] for r in rows(run, 1) if r["kind"] == "step")
        target = last - last % args.inner_steps + args.inner_steps // 2 + 1
        wait(lambda: max(r["step"] for r in rows(run, 1) if r["kind"] == "step") >= target, "mid-period", reps)
        reps[1].kill()
        killed.append(reps[1])
        t_kill = time.time()
        report["killed_after_step"] = max(r["step"] for r in rows(run, 1) if r["kind"] == "step")
        stamp("replica 1 killed")
        wait(lambda: len([r for r in outer(0) if r["time"] > t_kill and r["members"] == [0]]) >= args.alone,
             f"{args.alone} outer steps alone", reps[:1])
        stamp("alone")
        t_restart = time.time()
        reps.append(start(1, True))
        wait(lambda: any(r["healed"] for r in outer(1)), "replica 1 healed", [reps[0], reps[2]])
        stamp("replica 1 healed")
        wait(lambda: len([r for r in outer(0) if r["time"] > t_restart and r["members"] == [0, 1]]) >= args.together,
             f"{args.together} outer steps together again", [reps[0], reps[2]])
        stamp("together again")
        rc = 0
    except RuntimeError as err:
        report["error"] = str(err)
        print(f"[gpu_elastic] error: {err}", flush=True)
    finally:
        for r in reps:
            r.kill(signal.SIGTERM)
        lighthouse.shutdown()

    r0, r1 = rows(run, 0), rows(run, 1)
    if rc == 0:
        report.update(summarize(r0, r1, t_kill, t_restart, args))
    report["logs_tail"] = {os.path.basename(r.log): open(r.log, errors="replace").read()[-1500:] for r in reps[:2]}
    with open(out_json, "w") as f:
        json.dump(report, f, indent=1)
    print(json.dumps({k: v for k, v in report.items() if k not in ("logs_tail", "args")}, indent=1), flush=True)
    print(f"[gpu_elastic] wrote {out_json}", flush=True)
    return rc


def _rate(steps: list[dict]) -> dict:
    inner = [r for r in steps if r["outer"] is None]
    out = {"steps": len(steps)}
    if inner:
        out["inner_tokens_per_s"] = sum(r["tokens"] for r in inner) / sum(r["seconds"] for r in inner)
    if steps:
        out["tokens_per_s"] = sum(r["tokens"] for r in steps) / sum(r["seconds"] for r in steps)
    return out


def _median(xs):
    return statistics.median(xs) if xs else None


def summarize(r0: list[dict], r1: list[dict], t_kill: float, t_restart: float, args) -> dict:
    outer0 = [r for r in r0 if r["kind"] == "outer"]
    by_step = {r["step"]: r for r in outer0}
    steps0 = [dict(r, outer=by_step.get(r["step"])) for r in r0 if r["kind"] == "step"]
    healed = next(r for r in r1 if r["kind"] == "outer" and r["healed"])
    first_alone = next(r for r in outer0 if r["time"] > t_kill)
    back = next(r for r in outer0 if r["time"] > t_restart and r["members"] == [0, 1])
    warm = outer0[0]["step"]  # the first outer step: start-up skew between the replicas
    two = [r for r in outer0 if r["members"] == [0, 1] and r["step"] not in (warm, back["step"])]
    one = [r for r in outer0 if r["members"] == [0] and r is not first_alone]
    first_step_back = next(r for r in r1 if r["kind"] == "step" and r["time"] > t_restart)
    phase = {  # replica 0's steps: after the first outer step, up to the kill; alone (the fault's outer step
        # out, the heal's in: one member); from the first outer step with both members again
        "together": [r for r in steps0 if r["time"] <= t_kill and r["step"] > warm],
        "alone": [r for r in steps0 if first_alone["time"] < r["time"] < back["time"]],
        "together_again": [r for r in steps0 if r["time"] > back["time"]],
    }
    return {
        "payload_bytes": outer0[-1]["payload_bytes"],
        "tokens_per_step": steps0[-1]["tokens"],
        "tokens_per_s_replica0": {k: _rate(v) for k, v in phase.items()},
        "outer_step_s": {
            "two_members": {"median": _median([r["seconds"] for r in two]), "n": len(two),
                            "quorum_median": _median([r["quorum_seconds"] for r in two])},
            "one_member": {"median": _median([r["seconds"] for r in one]), "n": len(one),
                           "quorum_median": _median([r["quorum_seconds"] for r in one])},
        },
        "fault_cost_s": {"first_outer_step_alone_quorum_s": first_alone["quorum_seconds"],
                         "its_outer_step_s": first_alone["seconds"], "heartbeat_timeout_s": args.heartbeat_timeout},
        "recovery_s": {"restart_to_first_step": first_step_back["time"] - t_restart,
                       "restart_to_healed": healed["time"] - t_restart,
                       "restart_to_two_members_again": back["time"] - t_restart,
                       "healed_step": healed["step"], "healed_quorum_s": healed["quorum_seconds"]},
        "checksums_equal_after_heal": all(
            a["params_checksum"] == b["params_checksum"]
            for a in outer0 for b in r1 if b["kind"] == "outer" and b["step"] == a["step"] and a["step"] >= healed["step"]),
    }


if __name__ == "__main__":
    sys.exit(main())
