"""Elastic replicas through a torchft lighthouse, each on its own GPUs: one killed mid-run and
restarted. What a fault costs the survivor, and how long a replica takes to come back.

By default two replicas of S = 1 on 2 GPUs; `--replica-stages 1,2` a fleet of mixed depths
(`hetloco.replica_stages`, README "Mixed topologies"): replica 0 whole on GPU 0, replica 1 in two
stages on GPUs 1 and 2 (needs sum(depths) GPUs, one per rank). Each replica is the user's command, a
job of its own, each rank started with the environment torchrun gives it:

    hetloco-ds train --lighthouse ADDR --replica-id m --secret-file F --out OUT/run ...

(RANK r of WORLD_SIZE = replica m's depth, LOCAL_RANK r, the job's own MASTER_PORT; the job sees its
own GPUs, CUDA_VISIBLE_DEVICES = replica m's, and rank r takes the r-th: `LOCAL_RANK`, as the product
maps it). This script is the lighthouse (in-process), the launcher of each job and the operator, in
phases, each bounded:

  together  both replicas train; after `--together` outer steps with 2 members ...
  kill      the deepest replica (replica 1 when the depths are equal) loses its last rank, SIGKILLed in
            the middle of an inner step (half an outer period after a boundary); its other ranks are
            then stopped as a launcher stops them (SIGTERM, SIGKILL after a grace period)
  alone     the survivor goes on; after `--alone` outer steps with 1 member ...
  restart   the killed replica is started again, fresh (--overwrite: no checkpoint, its own data shard
            from 0; checkpoints would be the whole fleet's config, and writing them would cost the
            survivor time in every phase, while a heal replaces the parameters anyway); it builds its
            model, trains H inner steps, and at the next outer boundary is healed (receives the synced
            state from the survivor, block by block in a mixed fleet); after `--together` more outer
            steps with 2 members, both stop.

Everything is read back from the replicas' metrics.jsonl (rows carry wall-clock times, one host; the
killed replica's rows before the kill are read before its restart, which clears its directory).
`replicas` holds, per replica id: its stages, GPUs and role (survivor or killed), and

  tokens_per_s            its step rows: tokens / seconds over the inner steps (outer-step rows out), and
                          over all steps of the phase (outer steps in), together before the kill, alone
                          (the survivor), together after the rejoin
  outer_step_s            the engine's outer-step time (begin: the quorum; exchange; finish; checksums), median
                          over outer rows with 2 members and (the survivor) with 1 member, the first, fault
                          and rejoin steps left out; also the quorum part (`quorum_seconds`, from begin to
                          the commit)
  fault_cost_s            (the survivor) its first outer step without the killed replica: its quorum_seconds
                          (the lighthouse notices the dead replica by its missing heartbeats,
                          `--heartbeat-timeout`)
  recovery_s              (the killed replica) restart -> its first step row (process start, imports, model,
                          CUDA), -> its healed outer row, -> the survivor's first outer row with 2 members again

and `checksums`: at every outer step both replicas logged, before the kill and from the heal on, the
survivor's and the killed replica's checksums compared (`block_checksums`, the model cut by outer-sync
block, in a mixed fleet, where stage checksums cannot be compared; `params_checksum` otherwise); equal
only where at least one step was compared. (gpu_elastic_h100.json, written before `replicas`, has
replica 0's numbers at the top level: `tokens_per_s_replica0`, `outer_step_s`, `fault_cost_s`,
`recovery_s`, `checksums_equal_after_heal`.)

    OUT=... bash bench/gpu.sh --gpus 2 gpu_elastic.py                              # 2 x S = 1, 2 GPUs
    OUT=... bash bench/gpu.sh --gpus 3 gpu_elastic.py --replica-stages 1,2         # S = 1 and S = 2, 3 GPUs
    python bench/gpu_elastic.py --cpu-smoke [--replica-stages 1,2]   # tiny model on this CPU, gloo, 1.5-3.5 min

`--model DIR --data PATH` fine-tune a checkpoint on the user's data; `--checkpoint-interval N` has each
replica save every N outer steps (`checkpoints` in the JSON: each replica's newest, verified);
`--share-gpu` puts both one-stage replicas on one GPU (tests/gpu's elastic test).
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
    p.add_argument("--replica-stages", default="1,1",
                   help="the two replicas' pipeline depths, e.g. 1,2 (one GPU per rank; the deeper one is killed)")
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
    p.add_argument("--model", default=None, help="fine-tune this HF directory instead of a fresh --model-config")
    p.add_argument("--data", default=None, help="as `hetloco-ds train --data` (default: the embedded default data)")
    p.add_argument("--checkpoint-interval", type=int, default=0,
                   help="hetloco.train.checkpoint_interval: each replica saves every N outer steps (0: never)")
    p.add_argument("--share-gpu", action="store_true",
                   help="every replica on the first visible GPU (one-stage replicas: each its own job and NCCL world)")
    p.add_argument("--out", default=None, help="JSON path (default $OUT/gpu_elastic.json)")
    p.add_argument("--work", default=None, help="scratch directory (default: a temp dir)")
    p.add_argument("--cpu-smoke", action="store_true", help="tiny model, seq 64, micro 2, H 2, gloo")
    args = p.parse_args(argv)
    try:
        args.depths = [int(x) for x in args.replica_stages.split(",")]
    except ValueError:
        p.error(f"--replica-stages {args.replica_stages}: give two depths, e.g. 1,2")
    if len(args.depths) != 2 or min(args.depths) < 1:
        p.error(f"--replica-stages {args.replica_stages}: give two depths of at least 1, e.g. 1,2 (the bench kills "
                "one of two replicas)")
    if args.share_gpu and max(args.depths) > 1:
        p.error(f"--share-gpu needs one-stage replicas (one GPU holds one rank of a job), got --replica-stages "
                f"{args.replica_stages}")
    if args.cpu_smoke:
        args.model_config, args.seq, args.micro, args.gas, args.inner_steps = "tiny", 64, 2, 1, 2
        args.bf16, args.heartbeat_timeout, args.join_timeout = False, 2.0, 30.0
    return args


def roles(depths: list[int]) -> tuple[int, int]:
    """(the survivor, the killed replica): the deeper one is killed, replica 1 when the depths are equal."""
    killed = 0 if depths[0] > depths[1] else 1
    return 1 - killed, killed


def gpus(depths: list[int], m: int, visible: str | None = None, share: bool = False) -> list[str]:
    """Replica m's GPUs: one per rank, the replicas' ranks laid out in replica order, numbered as this
    process sees them (`visible`: its CUDA_VISIBLE_DEVICES, if set); `share`: the first one for all."""
    if share:
        return [visible.split(",")[0] if visible else "0"] * depths[m]
    first = sum(depths[:m])
    mine = range(first, first + depths[m])
    return [visible.split(",")[i] for i in mine] if visible else [str(i) for i in mine]


def write_config(path: str, args) -> None:
    with open(os.path.join(REPO, "hetloco_ds", "configs", "cpu_tiny.json")) as f:
        cfg = json.load(f)
    cfg.update(train_micro_batch_size_per_gpu=args.micro, gradient_accumulation_steps=args.gas)
    mixed = len(set(args.depths)) > 1
    cfg["pipeline"] = {"stages": args.depths[0]}
    cfg["bf16"] = {"enabled": bool(args.bf16)}
    cfg["scheduler"]["params"]["total_num_steps"] = 100000
    cfg["hetloco"] = {
        "sparseloco": {"inner_steps": args.inner_steps},
        "subspace": {"compressed_replicas": "none"},
        "train": {"seq_len": args.seq, "eval_interval": 0, "checkpoint_interval": args.checkpoint_interval,
                  "watchdog_timeout": 300},
        "elastic": {"max_replicas": 2, "timeout": 30, "quorum_timeout": 300},
        **({"replica_stages": args.depths} if mixed else {}),
    }
    with open(path, "w") as f:
        json.dump(cfg, f, indent=1)


class Job:
    """One replica: `depth` ranks of `python -m hetloco_ds.cli *argv`, each with torchrun's environment
    (its own process group, so a signal reaches what the rank started)."""

    def __init__(self, m: int, depth: int, argv: list[str], env: dict, devices: list[str] | None, log: str):
        from hetloco_ds.launch import die_with_parent, free_port

        self.m, self.log = m, log
        self.started = time.time()
        port = str(free_port())
        job = dict(env, WORLD_SIZE=str(depth), LOCAL_WORLD_SIZE=str(depth), MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
        if devices is not None:
            job["CUDA_VISIBLE_DEVICES"] = ",".join(devices)
        self.procs = []
        with open(log, "ab") as f:
            for r in range(depth):
                self.procs.append(subprocess.Popen([sys.executable, "-m", "hetloco_ds.cli", *argv],
                                                   env=dict(job, RANK=str(r), LOCAL_RANK=str(r)), stdout=f,
                                                   stderr=subprocess.STDOUT, start_new_session=True,
                                                   preexec_fn=die_with_parent))  # not outliving this bench

    def failed(self) -> int | None:
        """The first nonzero exit code of a rank, if any."""
        return next((p.returncode for p in self.procs if p.poll() not in (None, 0)), None)

    def kill_rank(self, r: int) -> None:
        """SIGKILL to rank r, then the others stopped as a launcher stops a job whose rank died."""
        from hetloco_ds.launch import signal_group, stop_ranks

        signal_group(self.procs[r], signal.SIGKILL)
        self.procs[r].wait()
        stop_ranks(self.procs)

    def stop(self) -> None:
        from hetloco_ds.launch import stop_ranks

        stop_ranks(self.procs)


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
    from hetloco_ds.train import TrainArgs, plan_run

    depths = args.depths
    survivor, victim = roles(depths)
    cuda = torch.cuda.is_available() and not args.cpu_smoke
    if cuda and torch.cuda.device_count() < (1 if args.share_gpu else sum(depths)):
        sys.exit(f"gpu_elastic.py: --replica-stages {args.replica_stages} needs {sum(depths)} GPUs (one per rank), "
                 f"found {torch.cuda.device_count()}")
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
              "torch": torch.__version__, "args": vars(args), "replica_stages": depths, "survivor": survivor,
              "killed": victim, "phases": {}}
    if cuda:
        report["gpus"] = {str(m): gpus(depths, m, os.environ.get("CUDA_VISIBLE_DEVICES"), args.share_gpu)
                          for m in (0, 1)}
    stamps = report["phases"]
    t0 = time.time()

    def stamp(name: str) -> None:
        stamps[name] = round(time.time() - t0, 2)
        print(f"[gpu_elastic] {stamps[name]:7.1f} s: {name}", flush=True)

    # The tokenizer and token caches, built once here (not timed as part of any replica).
    os.environ["HETLOCO_CACHE"] = os.path.join(work, "cache")
    model = ["--model", args.model] if args.model else ["--model-config", args.model_config]
    common = ["--config", cfg, *model, *(["--data", args.data] if args.data else []), "--steps", "1000000"]
    probe = FleetArgs(lighthouse="http://127.0.0.1:0", replica=0, secret_file=secret)  # port 0: not dialled
    plan_run(TrainArgs(config=cfg, model=args.model, model_config=None if args.model else args.model_config,
                       data=args.data, out=os.path.join(work, "probe"), fleet=probe), depths[0], owned=True)
    stamp("data and tokenizer ready")

    lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=1, join_timeout_ms=int(args.join_timeout * 1000),
                                  heartbeat_timeout_ms=int(args.heartbeat_timeout * 1000))
    addr = "http://127.0.0.1:" + lighthouse.address().rpartition(":")[2]
    gate = os.path.join(work, "gate")
    os.makedirs(gate, exist_ok=True)
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    base = dict(os.environ, HETLOCO_QUIET="1", TQDM_DISABLE="1", HETLOCO_FLEET_GATE=gate,
                OMP_NUM_THREADS="1" if args.cpu_smoke else "4")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_PORT", "HETLOCO_FLEET_SECRET",
              "CUDA_VISIBLE_DEVICES"):
        base.pop(k, None)

    def start(m: int) -> Job:  # fresh: --overwrite (module docstring)
        argv = ["train", "--out", run, "--lighthouse", addr, "--replica-id", str(m), "--secret-file", secret, *common,
                "--overwrite"]
        devices = gpus(depths, m, visible, args.share_gpu) if cuda else None
        return Job(m, depths[m], argv, base, devices, os.path.join(work, f"replica{m}.log"))

    def outer(m: int) -> list[dict]:
        return [r for r in rows(run, m) if r["kind"] == "outer"]

    def wait(cond, what: str, jobs) -> None:
        end = time.monotonic() + args.phase_timeout
        while not cond():
            for j in jobs:
                if (rc := j.failed()) is not None:
                    raise RuntimeError(f"replica {j.m} exited with {rc} while waiting for {what}; see {j.log}")
            if time.monotonic() > end:
                raise RuntimeError(f"timed out after {args.phase_timeout:.0f} s waiting for {what}")
            time.sleep(0.1)

    both = [0, 1]
    jobs = [start(0), start(1)]
    t_kill = t_restart = None
    before: list[dict] = []
    rc = 1
    try:
        wait(lambda: len([f for f in os.listdir(gate) if f.startswith("ready-")]) == sum(depths), "every rank up",
             jobs)
        open(os.path.join(gate, "go"), "w").close()
        stamp("every rank up (gate open)")
        wait(lambda: len([r for r in outer(survivor) if r["members"] == both]) >= args.together + 1,
             f"{args.together + 1} outer steps together", jobs)
        stamp("together")
        # The kill lands mid-inner-step: half an outer period after the replica's last boundary.
        last = max(r["step"] for r in rows(run, victim) if r["kind"] == "step")
        target = last - last % args.inner_steps + args.inner_steps // 2 + 1
        wait(lambda: max(r["step"] for r in rows(run, victim) if r["kind"] == "step") >= target, "mid-period", jobs)
        jobs[victim].kill_rank(depths[victim] - 1)
        t_kill = time.time()
        before = rows(run, victim)  # the restart's --overwrite clears them
        report["killed_after_step"] = max(r["step"] for r in before if r["kind"] == "step")
        report["killed_rank"] = depths[victim] - 1
        stamp(f"replica {victim} killed" + (f" (rank {depths[victim] - 1}; its other ranks stopped)"
                                            if depths[victim] > 1 else ""))
        wait(lambda: len([r for r in outer(survivor) if r["time"] > t_kill and r["members"] == [survivor]])
             >= args.alone, f"{args.alone} outer steps alone", [jobs[survivor]])
        stamp("alone")
        t_restart = time.time()
        jobs.append(start(victim))
        wait(lambda: any(r["healed"] for r in outer(victim)), f"replica {victim} healed", [jobs[survivor], jobs[2]])
        stamp(f"replica {victim} healed")
        wait(lambda: len([r for r in outer(survivor) if r["time"] > t_restart and r["members"] == both])
             >= args.together, f"{args.together} outer steps together again", [jobs[survivor], jobs[2]])
        stamp("together again")
        rc = 0
    except RuntimeError as err:
        report["error"] = str(err)
        print(f"[gpu_elastic] error: {err}", flush=True)
    finally:
        for j in jobs:
            j.stop()
        lighthouse.shutdown()

    if args.checkpoint_interval:
        report["checkpoints"] = checkpoints(run, depths)
    if rc == 0:
        report.update(summarize(rows(run, survivor), before, rows(run, victim), survivor, victim, t_kill, t_restart,
                                args))
    logs = sorted({j.log for j in jobs})
    report["logs_tail"] = {os.path.basename(log): open(log, errors="replace").read()[-1500:] for log in logs}
    with open(out_json, "w") as f:
        json.dump(report, f, indent=1)
    print(json.dumps({k: v for k, v in report.items() if k not in ("logs_tail", "args")}, indent=1), flush=True)
    print(f"[gpu_elastic] wrote {out_json}", flush=True)
    return rc


def checkpoints(run: str, depths: list[int]) -> dict:
    """Each replica's newest committed checkpoint (`latest`) and whether it verifies (every file of its
    manifest present, of its size and checksum): None, or why not."""
    from hetloco_ds import checkpoint

    out = {}
    for m, depth in enumerate(depths):
        ckpt_dir = os.path.join(run, f"replica-{m}", "checkpoints")
        tag = checkpoint.latest_tag(ckpt_dir)
        out[str(m)] = {"latest": tag, "problem": checkpoint.verify(ckpt_dir, tag, depth) if tag else "no checkpoint"}
    return out


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


def _outer_times(outer: list[dict]) -> dict:
    return {"median": _median([r["seconds"] for r in outer]), "n": len(outer),
            "quorum_median": _median([r["quorum_seconds"] for r in outer])}


def _steps(rows_: list[dict]) -> list[dict]:
    """The step rows, each with its outer row (None for an inner step)."""
    by_step = {r["step"]: r for r in rows_ if r["kind"] == "outer"}
    return [dict(r, outer=by_step.get(r["step"])) for r in rows_ if r["kind"] == "step"]


def _checksums(a: list[dict], b: list[dict], field: str) -> tuple[list[int], bool]:
    """(the outer steps both logged, whether `field` was equal at each; False when none was)."""
    theirs = {r["step"]: r[field] for r in b}
    steps = [r["step"] for r in a if r["step"] in theirs]
    return steps, bool(steps) and all(r[field] == theirs[r["step"]] for r in a if r["step"] in theirs)


def _at(step: int, a: list[dict], b: list[dict], m: int, n: int, field: str) -> dict:
    """`field` of replicas m (rows a) and n (rows b) at outer step `step`."""
    return {"step": step, str(m): next(r[field] for r in a if r["step"] == step),
            str(n): next(r[field] for r in b if r["step"] == step)}


def summarize(rs: list[dict], before: list[dict], after: list[dict], survivor: int, victim: int, t_kill: float,
              t_restart: float, args) -> dict:
    """The module docstring's numbers from the survivor's rows `rs`, and the killed replica's rows
    `before` its kill and `after` its restart."""
    both = [0, 1]
    outer_s = [r for r in rs if r["kind"] == "outer"]
    outer_before = [r for r in before if r["kind"] == "outer"]
    outer_after = [r for r in after if r["kind"] == "outer"]
    healed = next(r for r in outer_after if r["healed"])
    first_alone = next(r for r in outer_s if r["time"] > t_kill)
    back = next(r for r in outer_s if r["time"] > t_restart and r["members"] == both)
    first_step_back = next(r for r in after if r["kind"] == "step" and r["time"] > t_restart)
    warm = outer_s[0]["step"]  # the first outer step: start-up skew between the replicas
    steps_s, steps_before, steps_after = _steps(rs), _steps(before), _steps(after)
    # Phases: after the first outer step, up to the kill; alone (the fault's outer step out, the
    # heal's in: one member); from the first outer step with both members again.
    mine = {
        "together": [r for r in steps_s if r["time"] <= t_kill and r["step"] > warm],
        "alone": [r for r in steps_s if first_alone["time"] < r["time"] < back["time"]],
        "together_again": [r for r in steps_s if r["time"] > back["time"]],
    }
    theirs = {
        "together": [r for r in steps_before if r["step"] > warm],
        "together_again": [r for r in steps_after if r["time"] > back["time"]],
    }
    field = "block_checksums" if "block_checksums" in outer_s[-1] else "params_checksum"
    compared_before, equal_before = _checksums([r for r in outer_s if r["time"] <= t_kill], outer_before, field)
    compared_after, equal_after = _checksums([r for r in outer_s if r["step"] >= healed["step"]],
                                             [r for r in outer_after if r["step"] >= healed["step"]], field)
    depths = args.depths
    return {
        "payload_bytes": outer_s[-1]["payload_bytes"],
        "tokens_per_step": steps_s[-1]["tokens"],
        "replicas": {
            str(survivor): {
                "stages": depths[survivor], "role": "survivor",
                "tokens_per_s": {k: _rate(v) for k, v in mine.items()},
                "outer_step_s": {
                    "two_members": _outer_times([r for r in outer_s if r["members"] == both
                                                 and r["step"] not in (warm, back["step"])]),
                    "one_member": _outer_times([r for r in outer_s if r["members"] == [survivor]
                                                and r is not first_alone]),
                },
                "fault_cost_s": {"first_outer_step_alone_quorum_s": first_alone["quorum_seconds"],
                                 "its_outer_step_s": first_alone["seconds"], "its_members": first_alone["members"],
                                 "heartbeat_timeout_s": args.heartbeat_timeout},
            },
            str(victim): {
                "stages": depths[victim], "role": "killed",
                "tokens_per_s": {k: _rate(v) for k, v in theirs.items()},
                "outer_step_s": {
                    "two_members": _outer_times([r for r in outer_before + outer_after if r["members"] == both
                                                 and r["step"] not in (warm, back["step"])]),
                },
                "recovery_s": {"restart_to_first_step": first_step_back["time"] - t_restart,
                               "restart_to_healed": healed["time"] - t_restart,
                               "restart_to_two_members_again": back["time"] - t_restart,
                               "healed_step": healed["step"], "healed_quorum_s": healed["quorum_seconds"]},
            },
        },
        "checksums": {"field": field, "equal_before_kill": equal_before, "steps_before_kill": compared_before,
                      "equal_after_heal": equal_after, "steps_after_heal": compared_after,
                      "at_last_step_compared": _at(compared_after[-1], outer_s, outer_after, survivor, victim, field)
                      if compared_after else None},
    }


if __name__ == "__main__":
    sys.exit(main())
