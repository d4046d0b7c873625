"""Elastic mode: each replica is its own DeepSpeed job, and the replicas meet at the outer sync
through torchft (`transport/elastic.py`). This module makes one pipeline job one replica of a
fleet, and starts a whole fleet on one machine (`hetloco-ds train --nproc N --elastic`).

Identity and data. A fleet has a fixed size N (`hetloco.elastic.max_replicas`); a replica's id is
its index m in 0..N-1, given as `--replica-id m`. The id is everything that differs between
replicas: replica m trains on data shard m of N (`data.ReplicaBatches(blocks, m, N)`, the static
run's replica m when N = M), compresses its stage boundaries as the config says for replica m
(`hetloco.subspace.compressed_replicas` / `replica_ratios`), and its payloads are summed in id
order, as the static exchange sums in replica order: the transport sorts members by name, and a
replica's name is its id zero-padded to the width of N - 1. So a fleet without faults reproduces
the static run of the same config bit for bit.

What a replica shares, and what it keeps. At an outer boundary a replica behind the fleet (a
late or restarted one, or one whose attempt the others committed without it) is healed by
torchft with a live peer's copy of what every replica holds alike: each stage's synced
parameters, T_perp, outer momentum and outer-step count (`StageAlgorithm.global_state_dict`),
plus the step counter and the learning-rate schedule. It keeps what is its own: its error
feedback restarts at zero, its AdamW moments and data position stay as they are (a fresh
replica starts its shard at 0; a restarted one resumes its own checkpoint's position). The H
inner steps a replica ran before it was healed are discarded, once.

Agreement beyond the payload header. The payload fingerprint covers the outer-step config and
the parameter shapes. What else must agree - the fleet size (disjoint shards), H, the model's
sizes and the basis T_S lives in (the split basis: the smallest subspace of the config's
compressed replicas, `subspace.split_basis`) - is the fleet identity. It seeds the transport's
chain, so a replica with another identity never contributes and falls behind; when it is then
healed, it compares the donor's identity with its own and refuses itself in one line naming
the difference. So a replica may join with another compression ratio than the fleet's config
gave its id as long as the split basis stays the fleet's (its own subspace contains T_S); one
whose ratio would change the split basis is refused.

Where replicas write. `--out OUT` names the fleet's directory; replica m owns OUT/replica-m/, a
complete run directory (record, lock, metrics.jsonl, checkpoints/ with the transport's state,
hf/). Any replica's checkpoint exports the synced model. `--elastic` also writes
OUT/fleet_config.json (the config with max_replicas filled in) and OUT/.hetloco/fleet_secret
(a generated secret, mode 600) so that a replica can be restarted by hand.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import secrets
import shutil
import stat
import sys
import time
from typing import Callable

import torch

from .config import ConfigError, RunConfig

GATE_ENV = "HETLOCO_FLEET_GATE"
"""Directory of the start gate (set by `--elastic`): every rank writes ready-<replica>-<rank> there once
its transport is up and waits for `go`, so that the fleet's first quorum has every replica in it."""
FLEET_CONFIG = "fleet_config.json"
SECRET_FILE = "fleet_secret"
EXIT_REFUSED = 5


@dataclasses.dataclass(frozen=True)
class FleetArgs:
    """How one replica joins its fleet (from the command line)."""

    lighthouse: str
    """torchft lighthouse, http://HOST:PORT."""
    replica: int
    """This replica's id m in 0..max_replicas-1."""
    secret_file: str | None = None
    """File holding the fleet secret (mode 600); None: $HETLOCO_FLEET_SECRET."""
    bind: str = "127.0.0.1"
    """Address this replica's servers listen on (state transfer, torchft's ManagerServer, its store)."""
    advertise: str | None = None
    """Address peers reach this replica at (default: bind; required when bind is a wildcard)."""


def replica_dir(out: str, replica: int) -> str:
    return os.path.join(out, f"replica-{replica}")


def replica_name(replica: int, fleet_size: int) -> str:
    """The transport's name of replica `replica`: zero-padded so that names sort as ids do."""
    return str(replica).zfill(len(str(fleet_size - 1)))


def check_replica(fleet: FleetArgs, run: RunConfig) -> None:
    """The replica id and the addresses, before any rank starts."""
    n = run.hetloco.elastic.max_replicas
    if not 0 <= fleet.replica < n:
        raise ConfigError(f"--replica-id {fleet.replica} is not in 0..{n - 1} (hetloco.elastic.max_replicas = {n} "
                          f"in {run.source})")
    if not fleet.lighthouse.startswith(("http://", "https://")) or not fleet.lighthouse.rpartition(":")[2].isdigit():
        raise ConfigError(f"--lighthouse {fleet.lighthouse!r} must look like http://HOST:PORT "
                          "(`hetloco-ds lighthouse` prints it)")
    if fleet.bind.strip("[]") in ("", "0.0.0.0", "::") and not fleet.advertise:
        raise ConfigError(f"--bind {fleet.bind} listens on every interface: give --advertise, the address peers "
                          "reach this host at")


LIGHTHOUSE_CONNECT_S = 5.0


def check_lighthouse(fleet: FleetArgs) -> None:
    """Something listens at --lighthouse, asked once with a bounded TCP connect: torchft's own
    client, started inside every rank, reports an address with nothing there only after tens of
    seconds of C++ frames. Port 0: `--elastic` plans its replicas before its lighthouse exists."""
    import socket
    from urllib.parse import urlsplit

    where = urlsplit(fleet.lighthouse)
    if where.port == 0:
        return
    try:
        socket.create_connection((where.hostname, where.port), timeout=LIGHTHOUSE_CONNECT_S).close()
    except OSError as err:
        why = "no answer" if isinstance(err, TimeoutError) else (err.strerror or type(err).__name__)
        raise ConfigError(f"--lighthouse {fleet.lighthouse}: nothing answers at {where.hostname}:{where.port} "
                          f"({why} within {LIGHTHOUSE_CONNECT_S:g} s); start `hetloco-ds lighthouse` there first, "
                          "or pass the address it printed") from None


def read_secret(fleet: FleetArgs) -> bytes:
    from .transport.auth import read_fleet_secret

    try:
        return read_fleet_secret(fleet.secret_file)
    except ValueError as err:
        raise ConfigError(str(err).replace("give a secret file", "give --secret-file")) from None


# ------------------------------------------------------------------------------ the fleet identity


MODEL_SHAPE = ("hidden_size", "num_hidden_layers", "vocab_size", "intermediate_size", "num_attention_heads",
               "num_key_value_heads", "tie_word_embeddings")


def identity(run: RunConfig, llama_config) -> dict:
    """What every replica of the fleet must agree on beyond the payload header (module docstring)."""
    from . import subspace

    sub, n = run.hetloco.subspace, run.hetloco.elastic.max_replicas
    ratios = [sub.ratio_for(m, n) for m in range(n) if sub.compressed(m, n)]
    d = llama_config.hidden_size
    split = None
    if ratios:
        split = {"k": subspace.subspace_dim(d, max(ratios)), "ratio": max(ratios), "seed": sub.seed,
                 "embedding_adaptation": sub.embedding_adaptation}
    return {
        "max_replicas": n,
        # Every field that shapes a parameter: a joiner that differs in any is refused in one line
        # before the donor's state would fail to load into it.
        "model": {k: getattr(llama_config, k) for k in MODEL_SHAPE},
        "split_basis": split,
        "sparseloco": json.loads(run.hetloco.sparseloco.model_dump_json()),
    }


def fleet_key(ident: dict) -> bytes:
    return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).digest()


def mismatch(mine: dict, theirs: dict) -> str | None:
    """One line naming the first difference between this replica's identity and the fleet's."""
    if mine.get("max_replicas") != theirs.get("max_replicas"):
        return (f"hetloco.elastic.max_replicas = {mine.get('max_replicas')} here, {theirs.get('max_replicas')} in the "
                "fleet: replica ids and data shards would overlap")
    a, b = mine.get("model") or {}, theirs.get("model") or {}
    key = next((k for k in MODEL_SHAPE if a.get(k) != b.get(k)), None)
    if key is not None:
        return f"the model's {key} = {a.get(key)} here, {b.get(key)} in the fleet"
    a, b = mine.get("split_basis"), theirs.get("split_basis")
    if a != b:
        def say(s):
            return "none (no replica compresses)" if s is None else (
                f"k = {s['k']} (largest compressed ratio {s['ratio']}, subspace seed {s['seed']}, "
                f"embedding_adaptation {s['embedding_adaptation']})")
        return (f"the split basis T_S lives in is {say(a)} here and {say(b)} in the fleet: a replica may use its own "
                "compression ratio only if the fleet's hetloco.subspace split stays the same (its ratio at most the "
                "fleet's largest)")
    for key in sorted(set(mine.get("sparseloco", {})) | set(theirs.get("sparseloco", {}))):
        x, y = mine["sparseloco"].get(key), theirs["sparseloco"].get(key)
        if x != y:
            return f"hetloco.sparseloco.{key} = {json.dumps(x)} here, {json.dumps(y)} in the fleet"
    return None


# ------------------------------------------------------------------------------ one stage's transport


def params_checksum(params) -> int:
    """A 64-bit checksum of the parameters' bits (position-weighted sum mod 2^64, on their device):
    equal on every replica whose synced parameters are bitwise equal, cheap enough for every outer
    step (a hash would copy the model to the host). A checksum, not a cryptographic hash."""
    total = None
    offset = 1
    for p in params:
        flat = p.detach().reshape(-1)
        bits = flat.view(torch.int32) if flat.element_size() == 4 else flat.view(torch.int16)
        for start in range(0, bits.numel(), 1 << 22):
            part = bits[start: start + (1 << 22)].to(torch.int64)
            weights = torch.arange(offset + start, offset + start + part.numel(), dtype=torch.int64, device=part.device)
            s = (part * weights).sum()
            total = s if total is None else total + s
        offset += bits.numel()
    return int(total) if total is not None else 0


class FleetTransport:
    """One stage rank's outer sync in elastic mode: the torchft `ElasticTransport` with this engine's
    state callables, the watchdog told that the rank is waiting for its fleet, and the quorum in
    the outer metrics row. The engine calls `begin()` at each outer boundary, then `exchange`."""

    def __init__(self, engine, cfg, ident: dict, watchdog=None):
        from .transport.elastic import ElasticTransport

        self.engine, self.identity, self.watchdog = engine, ident, watchdog
        self.inner = ElasticTransport(cfg, self._global_state, self._load_global_state)
        self._sent = 0

    # -------------------------------------------------------------- what torchft moves to a joiner
    def _global_state(self) -> dict:
        e = self.engine
        return {"algorithm": e.algorithm.global_state_dict(), "local_steps": e.local_steps,
                "lr_scheduler": e.lr_scheduler.state_dict() if e.lr_scheduler is not None else None,
                "fleet": self.identity}

    def _load_global_state(self, state: dict) -> None:
        from .transport.auth import FleetRefused

        why = mismatch(self.identity, state["fleet"])
        if why is not None:
            raise FleetRefused(f"refused by the fleet: {why}")
        e = self.engine
        e.algorithm.load_global_state_dict(state["algorithm"])
        e.local_steps = e.global_steps = int(state["local_steps"])
        sched = e.lr_scheduler
        if sched is not None and state["lr_scheduler"] is not None:
            sched.load_state_dict(state["lr_scheduler"])
            # The optimizer's lr is set when the scheduler steps (after each optimizer step): set it
            # now for the next step, as the donor's was set after its last one.
            if hasattr(sched, "get_lr") and getattr(sched, "last_batch_iteration", 0) >= 0:
                for group, lr in zip(e.optimizer.param_groups, sched.get_lr()):
                    group["lr"] = lr

    # -------------------------------------------------------------- the engine's hooks
    def _waiting(self, where: str):
        import contextlib

        return self.watchdog.waiting(where) if self.watchdog is not None else contextlib.nullcontext()

    def begin(self) -> bool:
        with self._waiting(f"outer sync after step {self.engine.local_steps} (quorum)"):
            return self.inner.begin()

    def exchange(self, payload: torch.Tensor):
        from .meter import nbytes
        from .transport.auth import MAC_BYTES
        from .transport.elastic import _HELLO_BYTES

        with self._waiting(f"outer sync after step {self.engine.local_steps}"):
            gathered = self.inner.exchange(payload)
        # What the committed attempt put on the wire: hello, payload and vote rounds with every other
        # participant (failed attempts and state transfers are not counted).
        peers = len(self.inner.last_report.participants) - 1
        n = peers * (_HELLO_BYTES + MAC_BYTES + nbytes(payload) + MAC_BYTES + 32 + MAC_BYTES)
        self.engine.meter.add("sent", n, "outer_sync")
        self.engine.meter.add("recv", n, "outer_sync")
        return gathered

    def outer_fields(self) -> dict:
        """The quorum of the step just finished, for its metrics.jsonl outer row; every stage's
        parameter checksum (gathered over the replica's pipe group: every stage calls this)."""
        from deepspeed import comm as dist

        from .engine import _ids
        from .meter import nbytes

        r, e = self.inner.last_report, self.engine
        mine = torch.tensor([params_checksum(e.algorithm.params)], dtype=torch.int64, device=e.device)
        sums = [mine]
        if e.num_stages > 1:
            sums = [torch.zeros_like(mine) for _ in range(e.num_stages)]
            dist.all_gather(sums, mine, group=e.pipe_group)
            e.meter.add("sent", nbytes(mine) * (e.num_stages - 1), "control")
            e.meter.add("recv", nbytes(mine) * (e.num_stages - 1), "control")
        fields = {"members": _ids(r.members), "participants": _ids(r.participants), "left": _ids(r.left),
                  "joined": _ids(r.joined), "healed": r.healed, "attempts": r.attempts,
                  "quorum_seconds": r.seconds,
                  "params_checksum": [f"{int(s.item()) & (2**64 - 1):016x}" for s in sums]}
        if not r.members:  # no contributor at all (only healed replicas left): nobody was non-finite
            fields["excluded"] = []
        return fields

    # -------------------------------------------------------------- checkpoints
    def state_dict(self) -> dict:
        return self.inner.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.inner.load_state_dict(state)

    def close(self) -> None:
        self.inner.close()


def transport_factory(run: RunConfig, llama_config, fleet: FleetArgs, secret: bytes,
                      watchdog=None) -> Callable:
    """engine -> FleetTransport for HetlocoEngine(transport=...)."""
    from .transport.elastic import ElasticConfig

    el = run.hetloco.elastic
    ident = identity(run, llama_config)

    def build(engine) -> FleetTransport:
        cfg = ElasticConfig(
            lighthouse=fleet.lighthouse, replica_id=replica_name(fleet.replica, el.max_replicas),
            stage=engine.stage_id, stages=engine.num_stages, secret=secret, bind=fleet.bind,
            advertise=fleet.advertise, timeout=el.timeout, quorum_timeout=el.quorum_timeout,
            max_attempts=el.max_attempts, fleet_key=fleet_key(ident))
        return FleetTransport(engine, cfg, ident, watchdog)

    return build


def wait_for_start(replica: int, rank: int, timeout: float) -> None:
    """The `--elastic` start gate (GATE_ENV); returns at once without it."""
    gate = os.environ.get(GATE_ENV)
    if not gate:
        return
    with open(os.path.join(gate, f"ready-{replica}-{rank}"), "w"):
        pass
    deadline = time.monotonic() + timeout
    while not os.path.exists(os.path.join(gate, "go")):
        if time.monotonic() > deadline:
            raise RuntimeError(f"the fleet did not start within {timeout:.0f} s (hetloco.elastic.quorum_timeout): "
                               f"no {os.path.join(gate, 'go')}")
        time.sleep(0.05)


def claim_refusal(directory: str) -> bool:
    """Whether this rank is the first of its job to report the fleet's refusal (one line per job)."""
    try:
        os.makedirs(directory, exist_ok=True)
        os.close(os.open(os.path.join(directory, "refused"), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
        return True
    except FileExistsError:
        return False
    except OSError:
        return True


# ------------------------------------------------------------------------------ `--elastic`


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


def launch(targs, nproc: int | None, argv: list[str], bind_cores: bool = False) -> int:
    """`hetloco-ds train --nproc N --elastic`: a lighthouse on localhost and N / S replica jobs of S
    local ranks each, every one as `--lighthouse ADDR --replica-id m --nproc S` would run it. A
    replica whose rank fails is stopped alone; the others go on, and its restart command is printed.
    `argv`: the training flags every replica gets (--steps, --model, --data, ...); `bind_cores`: every
    rank of the fleet on its own share of the cores. Returns 0 when every replica finished, else the
    first failed replica's exit code."""
    from . import launch as launcher
    from . import rundir
    from .checkpoint import CheckpointError, pick, replace_text
    from .config import default_config_path, parse_config
    from .train import ENV_JOB, ENV_OWNED, ENV_TAG, _read_json, config_path, own_run, plan_run
    from .transport.auth import SECRET_ENV

    out = targs.out
    config_file = os.path.join(out, FLEET_CONFIG)
    if targs.resume:
        if not os.path.exists(config_file):
            raise ConfigError(f"--resume: {out} holds no elastic fleet ({FLEET_CONFIG} not found)")
        raw, source = _read_json(config_file), config_file
    else:
        source = config_path(targs) or default_config_path()
        raw = _read_json(source)
    stages = parse_config(raw, source).stages
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

    # The secret: the user's file, else $HETLOCO_FLEET_SECRET, else a new one in OUT/.hetloco (mode 600).
    generated = None
    secret_file = (targs.fleet.secret_file if targs.fleet is not None else None)
    if secret_file is None and SECRET_ENV not in os.environ:
        generated = secrets.token_hex(32)
        secret_file = os.path.join(rundir.state_dir(out), SECRET_FILE)

    # Every replica's checks before anything is written or started.
    plans = []
    for m in range(replicas):
        fa = FleetArgs(lighthouse="http://127.0.0.1:0", replica=m, secret_file=None if generated else secret_file)
        a = dataclasses.replace(targs, out=replica_dir(out, m), fleet=fa)
        plans.append(plan_run(a, stages, config=None if targs.resume else (raw, config_file),
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

    os.environ.setdefault("RUST_LOG", "warn")  # read once when torchft's extension loads; INFO logs every quorum
    from torchft._torchft import LighthouseServer

    lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=1, join_timeout_ms=int(el.join_timeout * 1000),
                                  heartbeat_timeout_ms=int(el.heartbeat_timeout * 1000))
    address = "http://127.0.0.1:" + lighthouse.address().rpartition(":")[2]
    gate = rundir.state_dir(out, "fleet_gate")
    shutil.rmtree(gate, ignore_errors=True)
    os.makedirs(gate)
    secret_note = f"secret in {secret_file}" if secret_file else f"secret from ${SECRET_ENV}"
    print(f"[hetloco] elastic fleet: lighthouse {address} (localhost only), {replicas} replicas x {stages} stages, "
          f"{secret_note}; replica m writes {os.path.join(out, 'replica-m')}", flush=True)

    def command(m: int) -> list[str]:
        cmd = ["train", "--out", out, "--lighthouse", address, "--replica-id", str(m)]
        return cmd + (["--secret-file", secret_file] if secret_file else [])

    groups = {}
    for m, plan in enumerate(plans):
        env = dict(os.environ, **{ENV_OWNED: "1", ENV_JOB: os.urandom(6).hex(), GATE_ENV: gate})
        if plan.resume is not None:
            env[ENV_TAG] = plan.resume.tag
        if m != 0:  # one progress bar for the fleet
            env["HETLOCO_QUIET"] = "1"
        flags = ["--resume"] if targs.resume else ["--config", config_file] + (["--overwrite"] if targs.overwrite else [])
        groups[m] = (stages, command(m) + flags + argv, env)

    def tick(running: set) -> None:
        # Open the gate once every rank is up (its transport heartbeating), or once a replica ended.
        go = os.path.join(gate, "go")
        if not os.path.exists(go):
            ready = sum(1 for f in os.listdir(gate) if f.startswith("ready-"))
            if ready == replicas * stages or len(running) < replicas:
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
        tail = ["--steps", str(targs.steps)] if again == "--resume" else (["--config", config_file] + argv)
        restart = " ".join(["hetloco-ds", *command(m), "--nproc", str(stages), again, *tail])
        print(f"hetloco-ds train: error: replica {m}: {line}; the fleet goes on without it; restart it with: "
              f"{restart}", file=sys.stderr, flush=True)

    try:
        codes = launcher.spawn_groups(groups, tick=tick, ended=ended, bind_cores=bind_cores)
    finally:
        for lock in locks.values():
            lock.release()
        lighthouse.shutdown()
        shutil.rmtree(gate, ignore_errors=True)
    failed = [codes[m] for m in sorted(codes) if codes[m] != 0]
    return failed[0] if failed else 0
