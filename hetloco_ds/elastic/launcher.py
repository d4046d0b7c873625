"""`hetloco-ds train --nproc N --elastic`: a whole fleet on one machine - a lighthouse on localhost
and N / S replica jobs of S local ranks each, every one as `--lighthouse ADDR --replica-id m --nproc
S` would run it. It imports `train` (each replica's checks and run directory) and the replica side
(`replica.py`); neither imports it.

`--elastic` also writes OUT/fleet_config.json (the config with max_replicas filled in) and
OUT/.hetloco/fleet_secret (a generated secret, mode 600) so that a replica can be restarted by hand.
"""
from __future__ import annotations

import dataclasses
import json
import os
import secrets
import shutil
import stat
import sys

from .. import launch as launcher
from .. import rundir
from ..checkpoint import CheckpointError, pick, replace_text
from ..config import ConfigError, default_config_path, elastic_replica, parse_config
from ..runplan import config_path, own_run, plan_run, read_config_file
from ..train import ENV_JOB, ENV_NO_BAR, ENV_OWNED, ENV_TAG
from ..transport.auth import SECRET_ENV
from .replica import GATE_ENV, FleetArgs, replica_dir

FLEET_CONFIG = "fleet_config.json"
SECRET_FILE = "fleet_secret"


def write_secret(path: str, secret: str) -> None:
    """`secret` in `path`, mode 600 from the first byte, replaced atomically."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.tmp-{os.getpid()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, stat.S_IRUSR | stat.S_IWUSR)
    try:
        os.write(fd, (secret + "\n").encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)


def fleet_config(raw: dict, replicas: int, source: str) -> dict:
    """The user's config with hetloco.elastic.max_replicas = `replicas` when unset (it must not be smaller)."""
    raw = json.loads(json.dumps(raw))
    elastic = raw.setdefault("hetloco", {}).setdefault("elastic", {})
    given = elastic.get("max_replicas")
    if given is None:
        elastic["max_replicas"] = replicas
    elif given < replicas:
        raise ConfigError(f"--elastic starts {replicas} replicas but {source} sets hetloco.elastic.max_replicas = "
                          f"{given}")
    return raw


@dataclasses.dataclass
class _Fleet:
    """A fleet checked and its directory taken, ready to start."""

    out: str
    config_file: str
    stages: list[int]
    """Each replica's pipeline depth."""
    replicas: int
    plans: list
    locks: dict
    secret_file: str | None
    el: object
    """hetloco.elastic of the fleet's config."""


def _fleet_config(targs, nproc: int | None, bind_cores: bool) -> tuple[dict, str, list[int], int]:
    """(the fleet's raw config, its source, each replica's stages, replicas), checked against --nproc."""
    out = targs.out
    config_file = os.path.join(out, FLEET_CONFIG)
    if targs.resume:
        if not os.path.exists(config_file):
            raise ConfigError(f"--resume: {out} holds no elastic fleet ({FLEET_CONFIG} not found)")
        raw, source = read_config_file(config_file), config_file
    else:
        source = config_path(targs) or default_config_path()
        raw = read_config_file(source)
    run = parse_config(raw, source)
    depths = run.hetloco.replica_stages
    if depths is not None:  # one replica per entry, replica m of depth[m] ranks
        elastic_replica(run, 0)  # max_replicas against the depths, before anything starts
        if nproc is not None and nproc != sum(depths):
            raise ConfigError(f"--nproc {nproc} does not match hetloco.replica_stages = {depths} in {source}: "
                              f"--elastic starts its {len(depths)} replicas, {sum(depths)} ranks in all")
        nproc = sum(depths)
        if bind_cores:
            launcher.core_shares(nproc)
        return fleet_config(raw, len(depths), source), source, list(depths), len(depths)
    stages = run.stages
    if nproc is None:  # two replicas; on --resume as many as the fleet's directory holds
        held = [m for m in range(parse_config(raw, source).hetloco.elastic.max_replicas or 2)
                if os.path.exists(os.path.join(replica_dir(out, m), rundir.RUN_CONFIG))] if targs.resume else []
        nproc = stages * (len(held) or 2)
    if nproc % stages:
        raise ConfigError(f"--nproc {nproc} is not a multiple of pipeline.stages = {stages} (--elastic runs "
                          f"--nproc / stages replicas of {stages} ranks each)")
    replicas = nproc // stages
    if not targs.resume:
        raw = fleet_config(raw, replicas, source)
    el = parse_config(raw, source).hetloco.elastic
    if replicas > el.max_replicas:
        raise ConfigError(f"--nproc {nproc} makes {replicas} replicas but the fleet has hetloco.elastic.max_replicas "
                          f"= {el.max_replicas}")
    if bind_cores:
        launcher.core_shares(nproc)  # too few cores: one line now, not after the lighthouse started
    return raw, source, [stages] * replicas, replicas


def _prepare(targs, nproc: int | None, bind_cores: bool) -> _Fleet:
    """Every replica's checks before anything is written or started; then the fleet's config, its
    secret and every replica's run directory."""
    out = targs.out
    config_file = os.path.join(out, FLEET_CONFIG)
    raw, source, stages, replicas = _fleet_config(targs, nproc, bind_cores)

    # The secret: the user's file, else $HETLOCO_FLEET_SECRET, else a new one in OUT/.hetloco (mode 600).
    generated = None
    secret_file = (targs.fleet.secret_file if targs.fleet is not None else None)
    if secret_file is None and SECRET_ENV not in os.environ:
        generated = secrets.token_hex(32)
        secret_file = os.path.join(rundir.state_dir(out), SECRET_FILE)

    plans = []
    for m in range(replicas):
        fa = FleetArgs(lighthouse="http://127.0.0.1:0", replica=m, secret_file=None if generated else secret_file)
        a = dataclasses.replace(targs, out=replica_dir(out, m), fleet=fa)
        plans.append(plan_run(a, stages[m], config=None if targs.resume else (raw, config_file),
                              secret=generated.encode() if generated else None))
    os.makedirs(out, exist_ok=True)
    if not targs.resume:
        replace_text(config_file, json.dumps(raw, indent=2))
    if generated:
        write_secret(secret_file, generated)
    locks = {}
    try:
        for m, plan in enumerate(plans):
            locks[m] = own_run(plan)
    except BaseException:
        for lock in locks.values():
            lock.release()
        raise
    return _Fleet(out, config_file, stages, replicas, plans, locks, secret_file,
                  parse_config(raw, source).hetloco.elastic)


def launch(targs, nproc: int | None, argv: list[str], bind_cores: bool = False) -> int:
    """`hetloco-ds train --nproc N --elastic` (module docstring). A replica whose rank fails is stopped
    alone; the others go on, and its restart command is printed. `argv`: the training flags every
    replica gets (--steps, --model, --data, ...); `bind_cores`: every rank of the fleet on its own
    share of the cores. Returns 0 when every replica finished, else the first failed replica's exit code."""
    fleet = _prepare(targs, nproc, bind_cores)
    try:
        return _run(fleet, targs, argv, bind_cores)
    finally:
        for lock in fleet.locks.values():
            lock.release()


def _run(fleet: _Fleet, targs, argv: list[str], bind_cores: bool) -> int:
    """The lighthouse, the start gate and the replica jobs, until every job has ended."""
    out, stages, replicas, locks = fleet.out, fleet.stages, fleet.replicas, fleet.locks
    os.environ.setdefault("RUST_LOG", "warn")  # read once when torchft's extension loads; INFO logs every quorum
    from torchft._torchft import LighthouseServer

    lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=1,
                                  join_timeout_ms=int(fleet.el.join_timeout * 1000),
                                  heartbeat_timeout_ms=int(fleet.el.heartbeat_timeout * 1000))
    address = "http://127.0.0.1:" + lighthouse.address().rpartition(":")[2]
    gate = rundir.state_dir(out, "fleet_gate")
    shutil.rmtree(gate, ignore_errors=True)
    os.makedirs(gate)
    secret_note = f"secret in {fleet.secret_file}" if fleet.secret_file else f"secret from ${SECRET_ENV}"
    shape = (f"{replicas} replicas x {stages[0]} stages" if len(set(stages)) == 1
             else f"{replicas} replicas of {', '.join(map(str, stages))} stages")
    print(f"[hetloco] elastic fleet: lighthouse {address} (localhost only), {shape}, "
          f"{secret_note}; replica m writes {os.path.join(out, 'replica-m')}", flush=True)

    def command(m: int) -> list[str]:
        cmd = ["train", "--out", out, "--lighthouse", address, "--replica-id", str(m)]
        return cmd + (["--secret-file", fleet.secret_file] if fleet.secret_file else [])

    groups = {}
    for m, plan in enumerate(fleet.plans):
        env = dict(os.environ, **{ENV_OWNED: "1", ENV_JOB: os.urandom(6).hex(), GATE_ENV: gate})
        if plan.resume is not None:
            env[ENV_TAG] = plan.resume.tag
        if m != 0:  # one progress bar for the fleet
            env["HETLOCO_QUIET"] = env[ENV_NO_BAR] = "1"
        flags = (["--resume"] if targs.resume else
                 ["--config", fleet.config_file] + (["--overwrite"] if targs.overwrite else []))
        groups[m] = (stages[m], command(m) + flags + argv, env)

    def tick(running: set) -> None:
        # Open the gate once every rank is up (its transport heartbeating), or once a replica ended.
        go = os.path.join(gate, "go")
        if not os.path.exists(go):
            ready = sum(1 for f in os.listdir(gate) if f.startswith("ready-"))
            if ready == sum(stages) or len(running) < replicas:
                open(go, "w").close()

    def ended(m: int, line: str | None) -> None:
        locks.pop(m).release()  # a restart by hand takes the replica's directory
        shutil.rmtree(rundir.state_dir(replica_dir(out, m), "heartbeat"), ignore_errors=True)
        if line is None:
            return
        try:
            pick(os.path.join(replica_dir(out, m), rundir.CHECKPOINTS))
            again = "--resume"
        except CheckpointError:
            again = "--overwrite"
        tail = ["--steps", str(targs.steps)] if again == "--resume" else (["--config", fleet.config_file] + argv)
        restart = " ".join(["hetloco-ds", *command(m), "--nproc", str(stages[m]), again, *tail])
        print(f"hetloco-ds train: error: replica {m}: {line}; the fleet goes on without it; restart it with: "
              f"{restart}", file=sys.stderr, flush=True)

    try:
        # As `--nproc`'s: a replica told to stop saves within its grace; one whose rank failed stops at once.
        grace = max(plan.run.hetloco.train.preempt_grace_s for plan in fleet.plans) + launcher.STOP_GRACE_S
        codes = launcher.spawn_groups(groups, tick=tick, ended=ended, bind_cores=bind_cores, grace_s=grace,
                                      failed_grace_s=0.0)
    finally:
        lighthouse.shutdown()
        shutil.rmtree(gate, ignore_errors=True)
    failed = [codes[m] for m in sorted(codes) if codes[m] != 0]
    return failed[0] if failed else 0
