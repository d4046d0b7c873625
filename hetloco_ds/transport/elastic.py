"""Elastic replicas at the outer sync: torchft finds the live replicas, we exchange among them.

Why torchft (0.2.0). Replicas that come and go need membership (who is alive), a process group
that can be rebuilt for the new members, and a way to hand a joining replica the synced state.
torchft has all three, tested at scale: a Rust lighthouse that forms quorums from heartbeats,
a `Manager` per rank that takes a quorum, reconfigures its process group and heals a replica that
is behind by fetching a live peer's state, and `should_commit`, an all-or-nothing vote among the
ranks of one replica. We add what torchft leaves to the user: what is exchanged, who counts, and
who may take part.

Model. A replica is one pipeline job of S ranks (its own torch.distributed world and store).
torchft's replica group = one of our replicas; its group rank = the pipeline stage. Each stage rank
holds one `ElasticTransport` (one torchft `Manager`); the Managers of one replica share one
`ManagerServer` (on stage 0), so all stages of a replica get the same quorum. One depth: stage k's
process group joins stage k of every replica in the quorum, as torchft makes it.

Mixed depths (`ElasticConfig.blocks`; the fleet's config names every replica's S). Stage k means
other layers in replicas of other depths, so the exchange goes by outer-sync block
(`sizes.block_parts` over the fleet's depths): every replica has exactly one rank holding block b,
and block b's process group joins those ranks (rank = the replica's position in the quorum, world =
the quorum's size). The torchft-configured group (`torchft_adapter.BlockGroups`) builds one gloo
group per block the rank holds, at each new quorum, in block order, all at the store torchft gives
group rank 0 (torchft picks a store per group rank; every replica's stage 0 gets the same one). A
rank holding several blocks runs the rounds below once per block, in block order; each block keeps
its own chain. The replica-wide agreement (d) and torchft's `should_commit` (e) stay per replica,
so all blocks and all ranks of a replica commit together. Healing goes by block too: every rank's
checkpoint metadata is its replica's block -> address map, the healer asks the recovery source's
stage 0 for it (torchft asks the healer's own group rank, which the source may not have:
`torchft_adapter.install_source_rank_zero`, our one lasting override of torchft internals, checked
against torchft 0.2.0 at the first transport), and each rank fetches each block it holds from the
source's rank that holds it (state_transfer.py). Every up-to-date rank serves its state from its
quorum until its commit (`_quorum`), since torchft stages it only on ranks it assigns to a joiner
of their own group rank.

One elastic outer step, on every stage rank of every replica:

1. `begin()` at the outer boundary, before `prepare`: `Manager.start_quorum()` (synchronous). The
   lighthouse answers when every healthy replica has asked, or when the ones missing stop
   heartbeating (`--heartbeat-timeout`) or are late by `--join-timeout`. A replica whose step is
   below the fleet's is healed inside this call: torchft fetches a live peer's state for this stage
   (our callables: synced parameters, T_perp, outer-step counter) and loads it. A replica that
   healed is *stale* until its next commit: it sends no pseudo-gradient, it only receives.
2. `exchange(payload)` (`exchange_blocks`: a payload per block the rank holds), one attempt (its
   frames, and what every replica decides from them, in rounds.py):
   a. hello round (all-gather of 160 bytes): name, step, flags, payload length, the chain (a hash of
      every member set and payload this stage has applied), HMAC. Only replicas whose hello
      authenticates are heard from at all.
   b. payload round (recv-first pairwise all-gather, as the static gloo exchange): payload + HMAC
      bound to the sender's hello. Accepted: contributors at the fleet's step, with the fleet's
      chain, whose payload MAC verifies and whose header (magic, version, fingerprint, length) is
      the most common one. Every replica applies the same rule to the same bytes.
   c. vote round: a digest of the accepted set + HMAC; any disagreement fails the attempt.
   d. Each rank intersects the accepted sets of its blocks; S > 1: the stages of this replica
      intersect theirs through the replica's store, so all stages end the step with the same members.
   e. `Manager.should_commit()`: True on every stage of this replica only if every stage's attempt
      succeeded; then the step counts and `exchange` returns the members' payloads, sorted by name.
   Otherwise: `start_quorum()` again (the dead or hung replica is left out) and the same payload
   is sent again, never re-prepared.
3. The caller runs `SparseLoCoState.finish(params, gathered.payloads)`.

Consistency. All replicas that commit an attempt apply the same payloads in the same order, so
their parameters stay bitwise equal. A replica that failed an attempt its peers committed is one
step behind: its next quorum includes them (the lighthouse waits for healthy replicas), torchft
heals it, and it finishes that step with their payloads (a heal zeroes a replica's error buffer
like a joiner's, so what it had not yet sent is dropped: once, for one replica). If replicas at the
same step nevertheless differ (a quorum formed without a peer that had committed), their chains
differ: the most common chain wins, the others do not contribute, the winners commit without them,
and torchft heals them (now a step behind) from a winner at their next quorum.

Timeouts. A replica that dies or is stopped between boundaries costs the others at most the
lighthouse's heartbeat timeout; a replica that is alive but does not reach the boundary (one of its
ranks hung) at most the join timeout; a peer that fails during the exchange costs one `timeout`
(every collective, store wait, `should_commit` and state transfer is bounded by it; a killed peer
usually fails faster, by a closed connection) plus the quorum that leaves it out.

Who may take part (what is authenticated and how). A fleet shares one secret (file or environment
variable, see auth.py). Hellos, payloads and votes carry HMAC-SHA256 under it; a replica without it
is heard by no one, and refuses itself (one line, `FleetRefused`) when it is a minority. State
transfer uses our `AuthenticatedStateTransport` (state_transfer.py), not torchft's HTTP one: a
request without the secret gets no byte of state, and a response without it is not loaded.
Listening sockets are on `bind` (localhost by default): the state-transfer server and torchft's
ManagerServer (torchft hard-codes every interface; we pass it `bind`: torchft_adapter.py, which
holds every change we make to torchft); the gloo sockets of the cross-replica groups are on
`advertise or bind`; `replica_store` gives a replica a TCPStore on `bind` (c10d's listens
everywhere). Not covered (torchft 0.2.0 has no authentication): the lighthouse's gRPC and its HTTP
`/replica/<id>/kill`, the ManagerServer's `Kill` RPC, the replicas' TCPStores, and gloo itself (a
group member that sends more bytes than a receive expects aborts the receiver). Anyone who reaches
those ports, or who the lighthouse puts in a quorum, can stall or stop replicas, but cannot get a
payload or state accepted. Bind to localhost, or firewall them to the fleet's hosts.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Callable

# torchft's Rust extension reads RUST_LOG once, at import, and logs every quorum at INFO to stderr.
os.environ.setdefault("RUST_LOG", "warn")

import torch  # noqa: E402
from torch.distributed import TCPStore  # noqa: E402
from torch.distributed.distributed_c10d import AllgatherOptions  # noqa: E402
from torchft.manager import REPLICA_ID_KEY, Manager  # noqa: E402

from . import Gathered, ReplicaTransport  # noqa: E402
from .auth import FleetRefused, tag, verify  # noqa: E402
from .rounds import (accept, accepted_digest, excluded_copy, pack_hello, payload_fingerprint,  # noqa: E402
                     payload_frame, plan, read_hellos, refused)
from .state_transfer import AuthenticatedStateTransport  # noqa: E402
from .torchft_adapter import BlockGroups, install_source_rank_zero, manager_server_bound_to  # noqa: E402

log = logging.getLogger(__name__)

_NAME_CHARS = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._-")
_STATE_KEY = "hetloco_elastic"


@dataclass(frozen=True)
class ElasticConfig:
    """One stage rank's view of the fleet (the CLI fills it; nothing here is secret but `secret`)."""

    lighthouse: str
    """torchft lighthouse address, http://HOST:PORT (`hetloco-ds lighthouse` prints it)."""
    replica_id: str
    """This replica's name, the same on all its stages: 1-64 of [A-Za-z0-9._-]; unique in the fleet."""
    stage: int
    """This rank's pipeline stage (torchft group rank)."""
    stages: int
    """Stages per replica (torchft group world size)."""
    secret: bytes = field(repr=False)
    """The fleet's shared secret (auth.read_fleet_secret)."""
    bind: str = "127.0.0.1"
    """Address our servers listen on: state transfer and torchft's ManagerServer."""
    advertise: str | None = None
    """Address peers reach this rank at (default: bind; required when bind is a wildcard). The gloo
    sockets of the cross-replica groups listen on it: gloo binds one concrete address it can publish."""
    timeout: float = 30.0
    """Seconds: each collective of an exchange attempt, store waits, should_commit, state transfer."""
    quorum_timeout: float = 3600.0
    """Seconds to wait at an outer boundary for the quorum (peers still running inner steps)."""
    store_addr: str | None = None
    """This replica's TCPStore host (default: $MASTER_ADDR); peers rendezvous through it."""
    store_port: int | None = None
    """This replica's TCPStore port (default: $MASTER_PORT)."""
    max_attempts: int = 20
    """Failed exchange attempts in a row before the outer step gives up with an error."""
    heartbeat_interval: float = 0.1
    """Seconds between heartbeats to the lighthouse."""
    blocks: tuple[int, ...] = ()
    """The outer-sync blocks this rank holds, in block order (`sizes.block_parts` over the fleet's
    depths), when the fleet mixes depths; empty: one depth, the stage is one block (id: the stage)."""
    fleet_key: bytes = b""
    """What every replica of the fleet must agree on beyond the payload header (e.g. a digest of the
    config's subspace split and data sharding). It seeds the chain: a replica with another key never
    contributes to the fleet's steps, falls behind and is healed, where the state callables can see
    the mismatch and refuse it."""

    def __post_init__(self):
        if not (1 <= len(self.replica_id) <= 64 and set(self.replica_id) <= _NAME_CHARS):
            raise ValueError(f"replica id {self.replica_id!r} must be 1-64 characters of [A-Za-z0-9._-]")
        if not 0 <= self.stage < self.stages:
            raise ValueError(f"stage {self.stage} is not in [0, {self.stages})")
        if not self.lighthouse.startswith(("http://", "https://")):
            raise ValueError(f"lighthouse address {self.lighthouse!r} must look like http://HOST:PORT")
        for name in ("timeout", "quorum_timeout", "heartbeat_interval"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.bind.strip("[]") in ("", "0.0.0.0", "::") and not self.advertise:
            raise ValueError(f"bind {self.bind!r} listens everywhere: give advertise, "
                             "the address peers reach this host at")
        if self.max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {self.max_attempts}")
        if list(self.blocks) != sorted(set(self.blocks)) or any(b < 0 for b in self.blocks):
            raise ValueError(f"blocks {self.blocks} must be distinct block ids in increasing order")

    @property
    def block_ids(self) -> tuple[int, ...]:
        """The blocks this rank exchanges, in order (one depth: its stage)."""
        return self.blocks or (self.stage,)


@dataclass(frozen=True)
class SyncReport:
    """What the last committed exchange did, for metrics.jsonl."""

    step: int
    """Outer step (torchft's committed-step counter before this commit)."""
    members: tuple[str, ...]
    """Replicas whose payloads were applied (contributors), sorted."""
    participants: tuple[str, ...]
    """Replicas in the quorum that authenticated (contributors, joiners, excluded), sorted."""
    left: tuple[str, ...]
    """Participants of the previous committed step that are not participants now."""
    joined: tuple[str, ...]
    """Participants now that were not participants of the previous committed step."""
    attempts: int
    """Exchange attempts this step took (1 without faults)."""
    healed: bool
    """This replica received the fleet's state at this step (and did not contribute)."""
    seconds: float
    """Wall time from begin() to the commit."""


class _Retry(Exception):
    """This attempt cannot commit on this replica; take a new quorum and send the same payload again."""


class ElasticTransport(ReplicaTransport):
    """One stage rank's outer-sync transport over torchft (see the module docstring).

    `state_dict()` returns this stage's global state, the same on every up-to-date replica: synced
    parameters (theta_prev: torchft asks at the boundary, after the inner steps), T_perp, the
    outer-step counter. `load_state_dict(state)` installs a peer's: parameters and theta_prev
    (`SparseLoCoState.rebase`), error feedback zeroed in place. It must leave SparseLoCoState's
    pending flag alone (not `SparseLoCoState.load_state_dict`): a replica can be healed between
    prepare and finish. Both hold tensors, numbers, strings, lists and dicts only. In a fleet of
    mixed depths (`cfg.blocks`), what is per block goes under "blocks": {block id: ...}; a joiner
    gets each of its blocks from the donor's rank that holds it, the rest from the first of them.

    Per outer boundary: `begin()`, then `SparseLoCoState.prepare`, `exchange(payload)` (or
    `exchange_blocks`, a payload per block), `finish`.
    """

    def __init__(self, cfg: ElasticConfig, state_dict: Callable[[], dict], load_state_dict: Callable[[dict], None]):
        self.cfg = cfg
        self._blocks = cfg.block_ids
        self._user_load = load_state_dict
        self._stale = False
        self._refused: FleetRefused | None = None
        seed = hashlib.sha256(b"hetloco-elastic-chain-v1" + cfg.fleet_key).digest()
        self._chains = [seed] * len(self._blocks)
        """Per block: a hash of every member set and payload of it this rank has applied."""
        self._participants: tuple[str, ...] = ()
        self._begun_at: float | None = None
        self._warned: set[tuple[str, str]] = set()
        self._urls: dict[int, str] | None = None
        self._store = None
        self.last_report: SyncReport | None = None
        timeout = timedelta(seconds=cfg.timeout)
        store_addr = cfg.store_addr or os.environ.get("MASTER_ADDR")
        store_port = cfg.store_port or int(os.environ.get("MASTER_PORT", "0"))
        if not store_addr or not store_port:
            raise ValueError("elastic transport needs this replica's TCPStore: set store_addr/store_port or "
                             "MASTER_ADDR/MASTER_PORT")
        install_source_rank_zero()
        self._pg = BlockGroups(cfg.advertise or cfg.bind, timeout, self._blocks, bool(cfg.blocks),
                                self._rank_zero_store)
        self._ckpt = AuthenticatedStateTransport(cfg.secret, cfg.bind, cfg.advertise, timeout, cfg.replica_id,
                                                 blocks=self._blocks)
        self._ckpt.replica_urls = self._replica_urls
        applied: list = []
        try:
            with manager_server_bound_to(cfg.bind, applied):
                self._manager = Manager(
                    pg=self._pg, load_state_dict=self._load_user, state_dict=state_dict, min_replica_size=1,
                    use_async_quorum=False, timeout=timeout, quorum_timeout=timedelta(seconds=cfg.quorum_timeout),
                    connect_timeout=timeout, rank=cfg.stage, world_size=cfg.stages, store_addr=store_addr,
                    store_port=store_port, lighthouse_addr=cfg.lighthouse, replica_id=cfg.replica_id,
                    hostname=cfg.advertise or cfg.bind, heartbeat_interval=timedelta(seconds=cfg.heartbeat_interval),
                    checkpoint_transport=self._ckpt, init_sync=False)
        except BaseException:
            self._ckpt.shutdown()
            raise
        if cfg.stage == 0 and not applied:
            self.close()
            raise RuntimeError("torchft's Manager did not build its ManagerServer through "
                               "torchft.manager.ManagerServer; it would listen on every interface. "
                               "hetloco_ds supports torchft 0.2.0")
        self._manager.register_state_dict_fn(_STATE_KEY, self._load_own, self._own_state)
        if cfg.stages > 1:
            self._store = TCPStore(store_addr, store_port, is_master=False, wait_for_workers=False, timeout=timeout)
            # The ManagerServer's replica id carries a fresh uuid per start: keys of a previous
            # incarnation of this replica (same store) can never be mistaken for this one's.
            self._prefix = f"hetloco_elastic/{self._store.get(REPLICA_ID_KEY).decode()}"
            self._store.set(f"{self._prefix}/urls/{cfg.stage}", json.dumps({b: self._ckpt.url for b in self._blocks}))

    # ------------------------------------------------------------------ what the quorum thread asks
    def _replica_urls(self) -> dict[int, str]:
        """Block -> state-transfer address of every rank of this replica (stage 0; the others' own):
        the metadata torchft hands a healer (see `torchft_adapter.install_source_rank_zero`)."""
        if self._urls is None:
            urls = {b: self._ckpt.url for b in self._blocks}
            if self._store is not None and self.cfg.stage == 0:
                keys = [f"{self._prefix}/urls/{s}" for s in range(self.cfg.stages)]
                # Asked inside the quorum, which waits for every stage of the replica anyway.
                self._store.wait(keys, timedelta(seconds=self.cfg.quorum_timeout))
                for k in keys:
                    urls.update({int(b): u for b, u in json.loads(self._store.get(k)).items()})
            self._urls = urls
        return self._urls

    def _rank_zero_store(self, quorum_id: int, group_rank: int, mine: str) -> str:
        """The store address torchft gave group rank 0 of this replica for quorum `quorum_id` (the
        same in every replica): stage 0 publishes it, the others read it (`BlockGroups`)."""
        if self._store is None:
            return mine
        key = f"{self._prefix}/quorum/{quorum_id}/store"
        if group_rank == 0:
            self._store.set(key, mine)
            return mine
        self._store.wait([key], timedelta(seconds=self.cfg.timeout))
        return self._store.get(key).decode()

    # ------------------------------------------------------------------ state torchft moves
    def _load_user(self, state: dict) -> None:
        self._user_load(state)
        self._stale = True

    def _own_state(self) -> dict:
        return {"blocks": dict(zip(self._blocks, self._chains)), "participants": list(self._participants)}

    def _load_own(self, state: dict) -> None:
        self._chains = [bytes(state["blocks"][b]) for b in self._blocks]
        self._participants = tuple(state["participants"])

    def state_dict(self) -> dict:
        """For this replica's checkpoint: torchft's step counter and the chain (restore both to resume)."""
        return {"torchft": self._manager.state_dict(), "chain": b"".join(self._chains),
                "participants": list(self._participants)}

    def load_state_dict(self, state: dict) -> None:
        chain = bytes(state["chain"])
        if len(chain) != 32 * len(self._blocks):
            raise ValueError(f"the checkpointed transport state holds {len(chain) // 32} block histories, this rank "
                             f"exchanges {len(self._blocks)} blocks")
        self._manager.load_state_dict(state["torchft"])
        self._chains = [chain[i: i + 32] for i in range(0, len(chain), 32)]
        self._participants = tuple(state["participants"])

    @property
    def step(self) -> int:
        """Committed outer steps (torchft's counter)."""
        return self._manager.current_step()

    # ------------------------------------------------------------------ one outer step
    def begin(self) -> bool:
        """Take the quorum for this outer boundary; heal this stage if it is behind. Call on every stage
        rank before `prepare`. Returns whether this stage was healed (its state replaced, and it sends no
        pseudo-gradient this step). Raises FleetRefused if the fleet refused this replica."""
        self._begun_at = time.monotonic()
        self._quorum()
        if self._refused is not None:
            # Take part in this attempt without a payload, so the fleet is not left waiting for us.
            try:
                self._attempt([torch.zeros(0, dtype=torch.uint8)] * len(self._blocks), 0, self._manager.current_step())
            except Exception:  # noqa: BLE001 - the refusal is what we report
                pass
            raise self._refused
        return self._stale

    def exchange(self, payload: torch.Tensor) -> Gathered:
        """This stage's payload to the fleet; the payloads of this step's members, sorted by name.

        Retries with a new quorum until an attempt commits on every stage of this replica, re-sending
        the same payload. If the peers committed an attempt this replica failed, this stage is healed
        during a retry: `load_state_dict` replaces the synced state (the outer-step counter too: read
        it after this call) and `last_report.healed` is set.

        When no replica could contribute (e.g. only healed ones are left), the one payload is this
        replica's, marked excluded (`last_report.members` is empty), so that `finish` leaves the
        synced parameters as they are.
        """
        return self.exchange_blocks([payload])[0]

    def exchange_blocks(self, payloads: list[torch.Tensor]) -> list[Gathered]:
        """`exchange` for every block this rank holds (`cfg.block_ids`, a payload each, in order), in
        one attempt that commits all of them or none; every block's members are the step's members."""
        if self._begun_at is None:
            raise RuntimeError("exchange() before begin(): call begin() at the outer boundary, before prepare()")
        if len(payloads) != len(self._blocks):
            raise ValueError(f"{len(payloads)} payloads for the {len(self._blocks)} blocks {self._blocks} of this rank")
        for payload in payloads:
            if payload.dtype != torch.uint8 or payload.dim() != 1:
                raise ValueError(f"payload must be a 1-D uint8 tensor, got {payload.dtype} {tuple(payload.shape)}")
        own = [payload.detach().to("cpu").contiguous() for payload in payloads]
        last: Exception | None = None
        for attempt in range(self.cfg.max_attempts):
            if attempt:
                self._quorum()
            step = self._manager.current_step()  # a heal in the new quorum moves it
            outcome = None
            try:
                outcome = self._attempt(own, attempt, step)
            except FleetRefused:
                raise
            except Exception as err:  # noqa: BLE001 - any failure of the attempt means: do not commit
                last = err
                why = str(err).splitlines()[0] if str(err) else type(err).__name__
                log.warning("%s stage %d: outer step %d attempt %d failed: %s", self.cfg.replica_id,
                            self.cfg.stage, step, attempt + 1, why)
                self._manager.report_error(err)
            # The replica-wide vote: every stage of this replica commits, or none does.
            if self._manager.should_commit() and outcome is not None:
                self._forget_stage_key(step, attempt)
                return self._commit(step, attempt + 1, own, *outcome)
            self._forget_stage_key(step, attempt)
        raise RuntimeError(f"{self.cfg.replica_id} stage {self.cfg.stage}: outer step {self.step} failed "
                           f"{self.cfg.max_attempts} attempts in a row; last error: {last}")

    def close(self) -> None:
        self._manager.shutdown(wait=False)
        self._pg.shutdown()

    # ------------------------------------------------------------------ internals
    def _quorum(self) -> None:
        self._manager.start_quorum()
        err = self._manager.errored()
        if err is not None and isinstance(err.original_exception, FleetRefused):
            self._refused = err.original_exception
        if err is None:
            # Until this step commits (should_commit disallows), any joiner may fetch this rank's blocks:
            # torchft stages the state only on ranks it assigns to a joiner of their own group rank.
            self._ckpt.allow(self._manager.current_step(), self._manager._manager_state_dict)

    def _warn_once(self, who: str, why: str) -> None:
        if (who, why) not in self._warned:
            self._warned.add((who, why))
            log.warning("%s stage %d: dropped %s: %s", self.cfg.replica_id, self.cfg.stage, who, why)

    def _all_gather(self, t: torch.Tensor, rank: int, n: int, pairwise: bool) -> list[torch.Tensor]:
        """Every rank's `t`, in rank order, in the group of the block whose rounds run now
        (`self._group`). pairwise: every receive posted before any send (the reasoning of
        exchange.all_gather_payloads, for payloads on slow links)."""
        if n == 1:
            return [t]
        pg = self._group
        out = [t if i == rank else torch.empty_like(t) for i in range(n)]
        if pairwise:
            peers = [(rank + i) % n for i in range(1, n)]
            works = [pg.recv([out[i]], i, 0) for i in peers]
            works += [pg.send([t], i, 0) for i in peers]
        else:
            out = [torch.empty_like(t) for _ in range(n)]
            works = [pg.allgather([out], [t], AllgatherOptions())]
        for w in works:
            if not w.wait():
                raise RuntimeError("collective did not complete")
        return out

    def _attempt(self, own: list[torch.Tensor], attempt: int, step: int):
        try:
            return self._rounds(own, attempt, step)
        except Exception:
            # Siblings of this replica wait for this stage's accepted set: tell them now, not at their timeout.
            try:
                self._publish_stage(step, attempt, None)
            except Exception:  # noqa: BLE001 - the store is gone too; they will time out
                pass
            raise

    def _rounds(self, own: list[torch.Tensor], attempt: int, step: int):
        m = self._manager
        rank, n = m.participating_rank(), m.num_participants()
        if rank is None:
            raise _Retry("not in the quorum")
        ok = m.errored() is None and self._refused is None
        self._heard: tuple[str, ...] = ()
        # Every block's rounds, in block order, even after one failed: the other holders of a later
        # block wait for this rank there, and fail with it only if it takes part.
        done, error = [], None
        for i in range(len(self._blocks)):
            self._group = self._pg.groups[i]
            try:
                done.append(self._block_rounds(i, own[i], rank, n, ok, step))
            except Exception as err:  # noqa: BLE001 - raised once every block had its rounds
                error = error or err
        if error is not None:
            raise error

        # d. all blocks and all stages of this replica end the step with the same members
        members = self._agree_across_stages(set.intersection(*[{nm for nm, _ in acc} for acc, _, _ in done]),
                                            step, attempt)
        names, payloads, macs = None, [], []
        for accepted, frames, length in done:
            chosen = [(nm, r) for nm, r in accepted if nm in members]
            names = [nm for nm, _ in chosen]
            payloads.append([frames[r][:length].clone() for _, r in chosen])
            macs.append([frames[r][length:].numpy().tobytes() for _, r in chosen])
        return names, payloads, macs, self._heard

    def _block_rounds(self, i: int, own: torch.Tensor, rank: int, n: int, ok: bool, step: int):
        """Block i's hello, payload and vote rounds; (accepted (name, position), frames, payload length)."""
        m, secret, chain = self._manager, self.cfg.secret, self._chains[i]
        contributing = ok and not self._stale and own.numel() > 0
        hello = pack_hello(self.cfg.replica_id, step, contributing, ok, own.numel(), payload_fingerprint(own), chain)
        hello_mac = tag(secret, b"hello", hello)

        # a. hello round: who is here, and who authenticates
        got = self._all_gather(torch.frombuffer(bytearray(hello + hello_mac), dtype=torch.uint8), rank, n, False)
        heard, dropped, lengths = read_hellos(secret, [t.numpy().tobytes() for t in got])
        if refused(heard, n) and self._refused is None:
            self._refused = FleetRefused(
                f"refused by the fleet: {n - len(heard)} of the {n} replicas in the quorum do not authenticate "
                "with this replica's fleet secret")
        p = plan(heard, chain, lengths)
        self._heard = tuple(sorted(h.name for h in heard.values()))

        # b. payload round: the same bytes reach every replica, so every replica accepts the same set
        mine = own if contributing and own.numel() == p.length else None
        frames = self._all_gather(payload_frame(secret, hello_mac, mine, p.length), rank, n, True)
        accepted, more = accept(secret, p, frames)
        if self._refused is None:  # a refused replica says one thing: that it is refused
            for who, why in dropped + more:
                self._warn_once(who, why)
        digest = accepted_digest(accepted, frames, p.length)

        # c. vote round: everyone heard accepts the same set, or nobody commits
        votes = self._all_gather(torch.frombuffer(bytearray(digest + tag(secret, b"vote", hello_mac, digest)),
                                                  dtype=torch.uint8), rank, n, False)
        for r, h in heard.items():
            raw = votes[r].numpy().tobytes()
            if not verify(secret, raw[32:], b"vote", h.mac, raw[:32]):
                raise _Retry(f"vote of {h.name} does not authenticate")
            if raw[:32] != digest:
                raise _Retry(f"{h.name} accepted other payloads than this replica")
        if self._refused is not None:
            raise self._refused
        if not ok:
            raise _Retry(f"this replica's quorum failed: {m.errored()}")
        if step < p.step:
            raise _Retry(f"this replica is at step {step}, the fleet at {p.step}; it heals at the next quorum")
        if chain != p.chain:
            # Same step, other history. The others commit without this replica, which leaves it a step
            # behind them: torchft heals it from one of them at the next quorum that has them.
            raise _Retry("this replica's synced state differs from the fleet's; it heals at the next quorum")
        return accepted, frames, p.length

    def _stage_key(self, step: int, attempt: int, stage: int) -> str:
        return f"{self._prefix}/{step}/{attempt}/{stage}"

    def _publish_stage(self, step: int, attempt: int, accepted: set[str] | None) -> None:
        if self._store is not None:
            value = None if accepted is None else sorted(accepted)
            self._store.set(self._stage_key(step, attempt, self.cfg.stage), json.dumps(value))

    def _agree_across_stages(self, accepted: set[str], step: int, attempt: int) -> set[str]:
        if self._store is None:
            return accepted
        self._publish_stage(step, attempt, accepted)
        keys = [self._stage_key(step, attempt, s) for s in range(self.cfg.stages)]
        self._store.wait(keys, timedelta(seconds=self.cfg.timeout))
        for s, k in enumerate(keys):
            theirs = json.loads(self._store.get(k))
            if theirs is None:
                raise _Retry(f"stage {s} of this replica failed this attempt")
            accepted &= set(theirs)
        return accepted

    def _forget_stage_key(self, step: int, attempt: int) -> None:
        # After should_commit every stage of this replica has read every key of this attempt.
        if self._store is not None:
            self._store.delete_key(self._stage_key(step, attempt, self.cfg.stage))

    def _commit(self, step: int, attempts: int, own: list[torch.Tensor], members: list[str],
                payloads: list[list[torch.Tensor]], macs: list[list[bytes]], participants: tuple[str, ...]
                ) -> list[Gathered]:
        for i, block_macs in enumerate(macs):
            h = hashlib.sha256(self._chains[i])
            h.update(step.to_bytes(8, "little", signed=True))
            for nm, mac in zip(members, block_macs):
                h.update(nm.encode() + b"\0" + mac)
            self._chains[i] = h.digest()
        prev = set(self._participants)
        self.last_report = SyncReport(
            step=step, members=tuple(members), participants=participants,
            left=tuple(sorted(prev - set(participants))), joined=tuple(sorted(set(participants) - prev)),
            attempts=attempts, healed=self._stale, seconds=time.monotonic() - self._begun_at)
        self._participants = participants
        self._stale = False
        self._begun_at = None
        if not members:
            return [Gathered(payloads=[excluded_copy(o)], members=(self.cfg.replica_id,)) for o in own]
        return [Gathered(payloads=p, members=tuple(members)) for p in payloads]
