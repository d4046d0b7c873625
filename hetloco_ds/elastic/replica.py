"""One pipeline job as one replica of an elastic fleet (the package docstring says what a replica
shares, keeps and must agree on): its id and run directory, the fleet identity, the engine's
transport (`FleetTransport`) and the `--elastic` start gate. `train` imports this module."""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import time
from typing import Callable

import torch

from ..config import ConfigError, RunConfig
from ..transport import ReplicaTransport, member_ids

GATE_ENV = "HETLOCO_FLEET_GATE"
"""Directory of the start gate (set by `--elastic`): every rank writes ready-<replica>-<rank> there once
its transport is up and waits for `go`, so that the fleet's first quorum has every replica in it."""
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


def from_flags(elastic: bool, lighthouse: str | None, replica_id: int | None, secret_file: str | None,
               bind: str, advertise: str | None) -> FleetArgs | None:
    """The fleet flags of `hetloco-ds train` as FleetArgs (None: a static run), or ConfigError naming
    the flags that do not go together. `elastic` (--elastic): the launcher starts the lighthouse and
    names each replica, so its FleetArgs only carries the secret and addresses."""
    if elastic and (lighthouse is not None or replica_id is not None):
        raise ConfigError("--elastic starts its own lighthouse and replicas; --lighthouse / --replica-id run one "
                          "replica of a fleet: pass one or the other")
    if (lighthouse is None) != (replica_id is None) and not elastic:
        raise ConfigError("elastic mode needs both --lighthouse ADDR and --replica-id ID")
    if lighthouse is None and not elastic:
        if secret_file is not None or advertise is not None:
            raise ConfigError("--secret-file / --advertise are for elastic mode (--lighthouse or --elastic)")
        return None
    return FleetArgs(lighthouse=lighthouse or "", replica=replica_id or 0, secret_file=secret_file, bind=bind,
                     advertise=advertise)


def flags(fleet: FleetArgs) -> list[str]:
    """`from_flags`'s inverse: the flags that make a rank of this job the same replica of the same fleet."""
    argv = ["--lighthouse", fleet.lighthouse, "--replica-id", str(fleet.replica), "--bind", fleet.bind]
    for flag, value in (("--secret-file", fleet.secret_file), ("--advertise", fleet.advertise)):
        if value is not None:
            argv += [flag, value]
    return argv


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


def check_resumed(fleet: FleetArgs | None, record: dict, out: str) -> None:
    """--resume continues a replica as the same replica, and a static run as a static run: `record` is
    the run directory's (`rundir.read_record`), `fleet` this launch's (None: a static launch)."""
    then = record.get("fleet")
    if then is None and fleet is not None:
        raise ConfigError(f"--resume: {out} holds a static run; resume it without --lighthouse")
    if then is not None and fleet is None:
        raise ConfigError(f"--resume: {out} holds replica {then['replica']} of an elastic fleet; resume it with "
                          f"--lighthouse ADDR --replica-id {then['replica']}")
    if then is not None and then["replica"] != fleet.replica:
        raise ConfigError(f"--resume: {out} holds replica {then['replica']}, not --replica-id {fleet.replica}")


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
    from ..transport.auth import read_fleet_secret

    try:
        return read_fleet_secret(fleet.secret_file)
    except ValueError as err:
        raise ConfigError(str(err).replace("give a secret file", "give --secret-file")) from None


# ------------------------------------------------------------------------------ the fleet identity


MODEL_SHAPE = ("hidden_size", "num_hidden_layers", "vocab_size", "intermediate_size", "num_attention_heads",
               "num_key_value_heads", "tie_word_embeddings")


def identity(run: RunConfig, llama_config) -> dict:
    """What every replica of the fleet must agree on beyond the payload header (module docstring)."""
    from .. import subspace

    sub, n = run.hetloco.subspace, run.hetloco.elastic.max_replicas
    ratios = [sub.ratio_for(m, n) for m in range(n) if sub.compressed(m, n)]
    d = llama_config.hidden_size
    split = None
    if ratios:
        split = {"k": subspace.subspace_dim(d, max(ratios)), "ratio": max(ratios), "seed": sub.seed,
                 "embedding_adaptation": sub.embedding_adaptation}
    ident = {
        "max_replicas": n,
        # Every field that shapes a parameter: a joiner that differs in any is refused in one line
        # before the donor's state would fail to load into it.
        "model": {k: getattr(llama_config, k) for k in MODEL_SHAPE},
        "split_basis": split,
        "sparseloco": json.loads(run.hetloco.sparseloco.model_dump_json()),
    }
    if run.fleet_stages is not None:  # mixed depths: the fleet's block partition follows from them
        ident["replica_stages"] = list(run.fleet_stages)
    return ident


def fleet_key(ident: dict) -> bytes:
    return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).digest()


def mismatch(mine: dict, theirs: dict) -> str | None:
    """One line naming the first difference between this replica's identity and the fleet's."""
    if mine.get("max_replicas") != theirs.get("max_replicas"):
        return (f"hetloco.elastic.max_replicas = {mine.get('max_replicas')} here, {theirs.get('max_replicas')} in the "
                "fleet: replica ids and data shards would overlap")
    if mine.get("replica_stages") != theirs.get("replica_stages"):
        def say(d):
            return "none (one depth)" if d is None else str(d)
        return (f"hetloco.replica_stages = {say(mine.get('replica_stages'))} here, "
                f"{say(theirs.get('replica_stages'))} in the fleet: the outer sync's blocks would differ")
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


class FleetTransport(ReplicaTransport):
    """One stage rank's outer sync in elastic mode: the torchft `ElasticTransport` with this engine's
    state callables, the `--elastic` start gate, the watchdog told that the rank is waiting for its
    fleet, and the quorum in the outer metrics row. The engine calls `begin()` at each outer
    boundary, then `exchange`."""

    def __init__(self, engine, cfg, ident: dict, replica: int, start_timeout: float, watchdog=None):
        from ..transport.elastic import ElasticTransport

        self.engine, self.identity, self.watchdog = engine, ident, watchdog
        self.replica, self.start_timeout = replica, start_timeout
        self.blocks = cfg.block_ids
        """The outer-sync blocks this rank holds (the stage's `StageAlgorithm.blocks`, by global id)."""
        self.inner = ElasticTransport(cfg, self._global_state, self._load_global_state)

    # -------------------------------------------------------------- what torchft moves to a joiner
    def _global_state(self) -> dict:
        """By block, what a joiner's rank holding that block needs (a donor of another depth holds
        other blocks on this rank: the joiner takes each from the rank that holds it); the rest is the
        same on every stage of a replica."""
        e = self.engine
        algorithm = e.algorithm.global_state_dict()
        return {"blocks": dict(zip(self.blocks, algorithm.pop("blocks"), strict=True)), "algorithm": algorithm,
                "local_steps": e.local_steps,
                "lr_scheduler": e.lr_scheduler.state_dict() if e.lr_scheduler is not None else None,
                "fleet": self.identity}

    def _load_global_state(self, state: dict) -> None:
        from ..transport.auth import FleetRefused

        why = mismatch(self.identity, state["fleet"])
        if why is not None:
            raise FleetRefused(f"refused by the fleet: {why}")
        e = self.engine
        e.algorithm.load_global_state_dict({**state["algorithm"], "blocks": [state["blocks"][b] for b in self.blocks]})
        e.local_steps = e.global_steps = int(state["local_steps"])
        sched = e.lr_scheduler
        if sched is not None and state["lr_scheduler"] is not None:
            sched.load_state_dict(state["lr_scheduler"])
            # The optimizer's lr is set when the scheduler steps (after each optimizer step): set it
            # now for the next step, as the donor's was set after its last one.
            if hasattr(sched, "get_lr") and getattr(sched, "last_batch_iteration", 0) >= 0:
                for group, lr in zip(e.optimizer.param_groups, sched.get_lr()):
                    group["lr"] = lr

    # -------------------------------------------------------------- the engine's and the loop's hooks
    def _waiting(self, where: str):
        return self.watchdog.waiting(where) if self.watchdog is not None else contextlib.nullcontext()

    def _busy(self, where: str):
        return self.watchdog.busy(where) if self.watchdog is not None else contextlib.nullcontext()

    def start(self) -> None:
        with self._busy("waiting for the fleet to start"):
            wait_for_start(self.replica, self.engine.global_rank, self.start_timeout)

    def begin(self) -> bool:
        with self._waiting(f"outer sync after step {self.engine.local_steps} (quorum)"):
            return self.inner.begin()

    def exchange(self, payload: torch.Tensor):
        return self.exchange_blocks([payload])[0]

    def exchange_blocks(self, payloads: list[torch.Tensor]):
        from ..meter import nbytes
        from ..transport.rounds import committed_bytes

        with self._waiting(f"outer sync after step {self.engine.local_steps}"):
            gathered = self.inner.exchange_blocks(payloads)
        # What the committed attempt put on the wire, block by block (failed attempts and state
        # transfers are not counted).
        peers = len(self.inner.last_report.participants) - 1
        n = sum(committed_bytes(peers, nbytes(p)) for p in payloads)
        self.engine.meter.add("sent", n, "outer_sync")
        self.engine.meter.add("recv", n, "outer_sync")
        return gathered

    def waited_seconds(self, outer: dict) -> float:
        """The whole outer step: its wait for the fleet is bounded by the fleet's own timeouts, and
        would widen the watchdog's idea of a slow step."""
        return outer["seconds"]

    def outer_fields(self) -> dict:
        """The quorum of the step just finished, for its metrics.jsonl outer row; every stage's
        parameter checksum (gathered over the replica's pipe group: every stage calls this)."""
        from deepspeed import comm as dist

        from ..meter import nbytes

        r, e = self.inner.last_report, self.engine
        mine = torch.tensor([params_checksum(e.algorithm.params)], dtype=torch.int64, device=e.device)
        sums = [mine]
        if e.num_stages > 1:
            sums = [torch.zeros_like(mine) for _ in range(e.num_stages)]
            dist.all_gather(sums, mine, group=e.pipe_group)
            e.meter.add("sent", nbytes(mine) * (e.num_stages - 1), "control")
            e.meter.add("recv", nbytes(mine) * (e.num_stages - 1), "control")
        fields = {"members": member_ids(r.members), "participants": member_ids(r.participants),
                  "left": member_ids(r.left), "joined": member_ids(r.joined), "healed": r.healed,
                  "attempts": r.attempts, "quorum_seconds": r.seconds,
                  "params_checksum": [f"{int(s.item()) & (2**64 - 1):016x}" for s in sums]}
        if e.block_depths is not None:
            fields["block_checksums"] = self._block_checksums()
        if not r.members:  # no contributor at all (only healed replicas left): nobody was non-finite
            fields["excluded"] = []
        return fields

    def _block_checksums(self) -> list[str]:
        """Every outer-sync block's parameter checksum, in block order, the same on every rank: in a
        fleet of mixed depths the one thing replicas of other cuts can compare. Each block is held by
        one rank of the replica; the others add zeros (a sum over the pipe group)."""
        from deepspeed import comm as dist

        from ..meter import nbytes

        e = self.engine
        sums = torch.zeros(e.num_blocks, dtype=torch.int64, device=e.device)
        for b, held in zip(self.blocks, e.algorithm.blocks, strict=True):
            sums[b] = params_checksum([e.algorithm.params[i] for i in held])
        if e.num_stages > 1:
            dist.all_reduce(sums, group=e.pipe_group)
            e.meter.add("sent", nbytes(sums), "control")
            e.meter.add("recv", nbytes(sums), "control")
        return [f"{int(s) & (2**64 - 1):016x}" for s in sums.tolist()]

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
    from ..transport.elastic import ElasticConfig

    el = run.hetloco.elastic
    ident = identity(run, llama_config)

    def build(engine) -> FleetTransport:
        cfg = ElasticConfig(
            lighthouse=fleet.lighthouse, replica_id=replica_name(fleet.replica, el.max_replicas),
            stage=engine.stage_id, stages=engine.num_stages, secret=secret, bind=fleet.bind,
            advertise=fleet.advertise, timeout=el.timeout, quorum_timeout=el.quorum_timeout,
            max_attempts=el.max_attempts, fleet_key=fleet_key(ident),
            blocks=tuple(engine.blocks_held()) if engine.block_depths is not None else ())
        return FleetTransport(engine, cfg, ident, fleet.replica, el.quorum_timeout, watchdog)

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
