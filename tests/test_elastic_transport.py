"""Elastic replicas (torchft) at the outer sync: faults, joins and strangers, with real processes.

Every replica stage is its own process (forked from a server that has imported torch and torchft
once, so a start costs milliseconds), driven by tests/elastic_replica.py: a tiny pure-tensor model
synced by SparseLoCoState through ElasticTransport. Faults are real signals. The reference is the
same model replayed in one process with the payload list handed to `finish` directly, i.e. what
the static all-gather hands it, for the membership each step actually had.
"""
from __future__ import annotations

import io
import json
import multiprocessing as mp
import os
import signal
import socket
import threading
import time
import types
from datetime import timedelta

import pytest
import torch

os.environ.setdefault("RUST_LOG", "warn")  # torchft's extension reads it once, at import
pytest.importorskip("torchft", reason="elastic mode needs the optional extra: pip install 'hetloco_ds[elastic]'")

import elastic_replica as er  # noqa: E402
from distributed import fork_context  # noqa: E402
from hetloco_ds.config import SparseLoCoConfig  # noqa: E402
from hetloco_ds.sparseloco.outer import SparseLoCoState  # noqa: E402
from hetloco_ds.sparseloco.payload import FLAG_FINITE, HEADER  # noqa: E402
from hetloco_ds.transport import rounds  # noqa: E402
from hetloco_ds.transport.auth import FleetRefused, read_fleet_secret, tag  # noqa: E402
from hetloco_ds.transport.state_transfer import AuthenticatedStateTransport, StateTransferError  # noqa: E402

SECRET = b"fleet-secret-for-tests-0123456789"
HEARTBEAT_S, JOIN_S, TIMEOUT_S = 2.0, 4.0, 5.0
SLACK_S = 4.0  # a loaded 2-core CI box: process scheduling, gloo setup, the lighthouse's 100 ms tick


class Fleet:
    """A lighthouse in this process and replica stage processes forked from a preloaded server."""

    def __init__(self, tmp, join_timeout=JOIN_S, heartbeat_timeout=HEARTBEAT_S):
        from torchft._torchft import LighthouseServer

        self.tmp = tmp
        self.lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=1, join_timeout_ms=int(join_timeout * 1000),
                                           heartbeat_timeout_ms=int(heartbeat_timeout * 1000))
        self.addr = "http://127.0.0.1:" + self.lighthouse.address().rpartition(":")[2]
        self.secret_file = tmp / "secret"
        self.secret_file.write_bytes(SECRET + b"\n")
        self.secret_file.chmod(0o600)
        self.ctx = fork_context()  # one server per process, preloaded with torch and torchft: the slow imports
        self.procs: dict[tuple[str, int], mp.Process] = {}
        self.starts: dict[str, int] = {}

    def log(self, name, stage=0, start=None):
        start = self.starts.get(name, 1) if start is None else start
        return str(self.tmp / f"{name}.{start}.s{stage}.jsonl")

    def start(self, name, steps, stages=1, go=None, **kw):
        self.starts[name] = self.starts.get(name, 0) + 1
        kw.setdefault("secret_file", str(self.secret_file))
        for s in range(stages):
            p = self.ctx.Process(target=er.run_replica, daemon=True, kwargs=dict(
                lighthouse=self.addr, name=name, port_file=self.log(name, 0) + ".port", steps=steps,
                log=self.log(name, s), stage=s, stages=stages, go=go, timeout=TIMEOUT_S, **kw))
            p.start()
            self.procs[(name, s)] = p

    def start_together(self, names, steps, stages=1, options=None):
        """Start replicas and let them begin only once all heartbeat, so the first quorum has them all.
        `options`: name -> extra keyword arguments of run_replica."""
        go = str(self.tmp / "go")
        for n in names:
            self.start(n, steps, stages, go=go, **(options or {}).get(n, {}))
        self.wait(lambda: all(os.path.exists(self.log(n, s) + ".ready") for n in names for s in range(stages)), 60)
        open(go, "w").close()

    def rows(self, name, stage=0, start=None):
        try:
            with open(self.log(name, stage, start)) as f:
                return [json.loads(line) for line in f if line.endswith("\n")]
        except FileNotFoundError:
            return []

    def wait(self, cond, timeout, what="condition"):
        end = time.monotonic() + timeout
        while not cond():
            failed = [k for k, p in self.procs.items() if p.exitcode not in (None, 0, -signal.SIGKILL)]
            if failed:
                raise AssertionError(f"{failed} exited with {[self.procs[k].exitcode for k in failed]}: "
                                     + "".join(open(self.log(n, s) + ".err").read()[-3000:] for n, s in failed))
            if time.monotonic() > end:
                raise AssertionError(f"timed out after {timeout}s waiting for {what}")
            time.sleep(0.02)

    def join(self, names, stages=1, timeout=60):
        for n in names:
            for s in range(stages):
                p = self.procs[(n, s)]
                p.join(timeout)
                assert p.exitcode == 0, (n, s, p.exitcode, open(self.log(n, s) + ".err").read()[-3000:])

    def signal(self, name, sig, stage=0):
        os.kill(self.procs[(name, stage)].pid, sig)

    def close(self):
        for p in self.procs.values():
            if p.is_alive():
                os.kill(p.pid, signal.SIGKILL)
            p.join(5)
        self.lighthouse.shutdown()


@pytest.fixture
def fleet(tmp_path):
    f = Fleet(tmp_path)
    yield f
    f.close()


@pytest.fixture
def patient_fleet(tmp_path):
    """For runs without faults: timeouts no busy CI machine reaches, so nobody is left out by accident."""
    f = Fleet(tmp_path, join_timeout=60, heartbeat_timeout=20)
    yield f
    f.close()


def _schedule(f, names, steps, stage=0):
    """Members of each outer step as the survivors logged them (all survivors must agree)."""
    logs = {n: {r["outer"]: tuple(r["members"]) for s in range(1, f.starts[n] + 1) for r in f.rows(n, stage, s)}
            for n in names}
    sched = []
    for k in range(steps):
        seen = {logs[n][k] for n in names if k in logs[n]}
        assert len(seen) == 1, f"replicas disagree on the members of outer step {k}: {seen}"
        sched.append(seen.pop())
    return sched


def _assert_matches_reference(f, names, steps, stages=1):
    """Every digest logged for outer steps < `steps` equals the one-process replay of the logged membership."""
    for s in range(stages):
        ref = er.simulate(_schedule(f, names, steps, s), names, s)
        for n in names:
            for start in range(1, f.starts[n] + 1):
                for r in f.rows(n, s, start):
                    if r["outer"] < steps:
                        assert r["digest"] == ref[r["outer"]], (n, s, start, r["outer"], r["members"])


# ---------------------------------------------------------------------- whole fleets, real processes
def test_no_fault_elastic_run_is_bitwise_the_static_run(patient_fleet):
    """3 replicas x 2 stages, 3 outer steps: every stage's parameters after every outer step are bitwise
    those of the static run. Breaks if members are ordered differently, a payload is altered or
    dropped on the way, or a stage's sync uses another stage's peers."""
    names = ["r0", "r1", "r2"]
    patient_fleet.start_together(names, steps=3, stages=2)
    patient_fleet.join(names, stages=2)
    for s in range(2):
        ref = er.simulate([tuple(names)] * 3, names, s)
        for n in names:
            rows = patient_fleet.rows(n, s)
            assert [r["members"] for r in rows] == [names] * 3 and [r["attempts"] for r in rows] == [1, 1, 1]
            assert [r["digest"] for r in rows] == ref, (n, s)


def test_replica_killed_mid_exchange_survivors_resend_same_payloads_within_one_timeout(fleet):
    """r2 is SIGKILLed inside outer step 1's exchange (after its hello, before its payload). r0 and r1
    finish step 1 between themselves, bounded by the exchange timeout plus the lighthouse noticing
    r2's death, and their parameters are bitwise the replay in which step 1 applied r0's and r1's
    payloads. Breaks if a retry re-prepared (the error buffer would absorb delta twice), if the
    survivors waited longer than the timeouts, or hung."""
    fleet.start_together(["r0", "r1", "r2"], steps=4, options={"r2": dict(die_in_exchange=1)})
    fleet.join(["r0", "r1"])
    assert fleet.procs[("r2", 0)].exitcode == -signal.SIGKILL
    for n in ["r0", "r1"]:
        rows = fleet.rows(n)
        assert [r["members"] for r in rows] == [["r0", "r1", "r2"]] + [["r0", "r1"]] * 3
        assert rows[1]["attempts"] >= 2 and rows[1]["left"] == ["r2"]
        assert rows[1]["t_end"] - rows[1]["t_begin"] < TIMEOUT_S + HEARTBEAT_S + SLACK_S
    _assert_matches_reference(fleet, ["r0", "r1", "r2"], 4)


def _first_without(f, name, survivors, stages=1):
    """Per survivor and stage, the log row of the first outer step `name` was not a member of."""
    return {(n, s): next(r for r in f.rows(n, s) if name not in r["members"]) for n in survivors for s in range(stages)}


def test_replica_killed_between_boundaries_is_left_out_then_rejoins_bitwise(fleet):
    """r2 is SIGKILLed during the inner steps of outer step 2: r0 and r1 finish their next step with
    2 contributors within the heartbeat timeout. r2 is restarted (a fresh process): it joins at a
    later boundary by receiving the synced state from a live peer, contributes nothing that step, and
    its parameters then equal the others' bitwise; from the next step on it contributes. Breaks if a
    dead replica held the fleet beyond the timeout, if healing sent other state than the synced one,
    or if a healed replica's (zero) pseudo-gradient diluted the average."""
    names = ["r0", "r1", "r2"]
    fleet.start_together(names, steps=9)
    fleet.wait(lambda: len(fleet.rows("r2")) == 2, 60, "r2's outer step 1")
    time.sleep(0.1)  # inside the 0.2 s of inner steps of outer step 2 (or, on a slow box, a bit later)
    fleet.signal("r2", signal.SIGKILL)
    killed = time.time()
    fleet.wait(lambda: len(fleet.rows("r0")) >= 4, 60, "the survivors' outer step 3")
    fleet.start("r2", steps=9)
    fleet.join(names)
    for (n, _), row in _first_without(fleet, "r2", ["r0", "r1"]).items():
        assert row["members"] == ["r0", "r1"] and row["left"] == ["r2"], (n, row)
        # a kill inside the exchange is noticed sooner (the connection resets), then as here
        assert row["t_end"] - killed < HEARTBEAT_S + SLACK_S, (n, row["t_end"] - killed)
    back = fleet.rows("r2", start=2)
    assert back and back[0]["healed"] and back[0]["members"] == ["r0", "r1"]
    assert back[0]["outer"] >= 4 and back[-1]["outer"] == 8
    assert all(r["members"] == names for r in back[1:])
    assert fleet.rows("r0")[back[0]["outer"]]["digest"] == back[0]["digest"]
    _assert_matches_reference(fleet, names, 9)


def test_stopped_rank_is_left_out_within_join_timeout_and_replica_rejoins_per_stage(fleet):
    """3 replicas x 2 stages. Stage 1 of r2 is SIGSTOPped mid-inner-step (a hang: r2's stage 0 still
    heartbeats): r0 and r1 finish their next outer step, on both stages, with 2 contributors within
    the join timeout (plus the exchange timeout, should the stop land inside an exchange). Then r2 is
    killed and restarted: both its stages heal (possibly from different peers) and match the fleet
    bitwise. Breaks if a hung rank held the fleet unboundedly, if stages of one replica ended a step
    with different members, or if a stage healed from wrong state."""
    names = ["r0", "r1", "r2"]
    fleet.start_together(names, steps=8, stages=2)
    fleet.wait(lambda: len(fleet.rows("r2", 1)) == 1, 60, "r2's outer step 0")
    time.sleep(0.1)
    fleet.signal("r2", signal.SIGSTOP, stage=1)
    stopped = time.time()
    fleet.wait(lambda: len(fleet.rows("r0", 1)) >= 3, 60, "the survivors' outer step 2")
    for s in (0, 1):
        fleet.signal("r2", signal.SIGKILL, stage=s)
    fleet.start("r2", steps=8, stages=2)
    fleet.join(names, stages=2)
    first = _first_without(fleet, "r2", ["r0", "r1"], stages=2)
    assert len({row["outer"] for row in first.values()}) == 1, first
    for (n, s), row in first.items():
        assert row["members"] == ["r0", "r1"] and row["t_end"] - stopped < JOIN_S + TIMEOUT_S + SLACK_S, (n, s, row)
    for s in (0, 1):
        back = fleet.rows("r2", s, start=2)
        assert back and back[0]["healed"] and back[-1]["outer"] == 7
    _assert_matches_reference(fleet, names, 8, stages=2)


def test_replica_with_another_history_is_healed_from_the_majority(fleet):
    """At outer step 2, r2's history (chain) differs from r0's and r1's at the same step, as after a
    split brain. r2 does not contribute, lowers its step, is healed from the majority and from then
    on its parameters equal theirs bitwise. Breaks if replicas at the same step but with different
    synced states were summed together (they would silently diverge for good)."""
    names = ["r0", "r1", "r2"]
    fleet.start_together(names, steps=6, options={"r2": dict(diverge_at=2)})
    fleet.join(names)
    rows = {n: {r["outer"]: r for r in fleet.rows(n)} for n in names}
    assert [rows["r0"][k]["members"] for k in range(4)] == [names, names, ["r0", "r1"], ["r0", "r1"]]
    healed = [k for k, r in rows["r2"].items() if r["healed"]]
    assert healed == [3] and 2 not in rows["r2"]
    assert all(rows["r2"][k]["digest"] == rows["r0"][k]["digest"] == rows["r1"][k]["digest"] for k in range(3, 6))
    assert all(rows["r0"][k]["members"] == names for k in range(4, 6))
    _assert_matches_reference(fleet, names, 6)


def test_replica_without_the_secret_is_refused_in_one_line_and_fleet_goes_on(fleet):
    """A replica with a wrong secret joins a running fleet: the donor refuses to send it state, it
    stops with exactly one line on stderr and exit code 3, and r0 and r1 go on without ever counting
    it. A replica with no secret at all stops before contacting anyone, with one line. Breaks if state
    were served without the secret, if a stranger's payload were accepted, or if the fleet stalled."""
    fleet.start_together(["r0", "r1"], steps=8)
    fleet.wait(lambda: len(fleet.rows("r0")) >= 2, 60, "outer step 1")
    fleet.start("intruder", steps=8, secret_file=None, secret_env="not-the-fleet-secret-0123456789")
    fleet.start("nosecret", steps=8, secret_file=None)
    fleet.procs[("intruder", 0)].join(60)
    fleet.procs[("nosecret", 0)].join(60)
    err = open(fleet.log("intruder") + ".err").read()
    assert fleet.procs[("intruder", 0)].exitcode == 3 and err.count("\n") == 1, err
    assert err.startswith("hetloco-ds: refused by the fleet: the donor at"), err
    assert "rejected this replica's fleet secret" in err, err
    assert fleet.rows("intruder") == []
    err = open(fleet.log("nosecret") + ".err").read()
    assert fleet.procs[("nosecret", 0)].exitcode == 2 and err.count("\n") == 1, err
    assert "no fleet secret" in err
    fleet.join(["r0", "r1"])
    for n in ["r0", "r1"]:
        rows = fleet.rows(n)
        assert len(rows) == 8 and all(r["members"] == ["r0", "r1"] for r in rows)
        assert all("intruder" not in r["participants"] for r in rows)
    _assert_matches_reference(fleet, ["r0", "r1"], 8)


def _listening(pid: int) -> set[str]:
    """Addresses the process listens on (TCP, IPv4 and IPv6), from /proc."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[8:-1])
    out = set()
    for table, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
        with open(f"/proc/{pid}/net/{table}") as f:
            for line in f.readlines()[1:]:
                cols = line.split()
                if cols[3] == "0A" and cols[9] in inodes:  # LISTEN
                    ip = bytes.fromhex(cols[1].split(":")[0])
                    # /proc prints each 32-bit word in host (little-endian) order
                    ip = b"".join(ip[i:i + 4][::-1] for i in range(0, len(ip), 4))
                    out.add(socket.inet_ntop(family, ip))
    return out


def test_replica_with_a_1000x_pseudo_gradient_moves_the_model_no_further_than_the_median(patient_fleet):
    """r2's pseudo-gradient of outer step 1 is scaled by 1000, under sparseloco.norm_clip "median" (the
    default). Every replica's synced parameters after that step are bitwise the one-process replay's
    (the clip is applied to the same payloads alike), and no tensor moved further than outer_lr times the
    median of the replicas' decoded norms, while without the clip it would have moved hundreds of times
    further. Breaks if a wild replica could drag the fleet's model by its own norm."""
    names = ["r0", "r1", "r2"]
    patient_fleet.start_together(names, steps=3, options={"r2": dict(scale_at=1, clip=True),
                                                           "r0": dict(clip=True), "r1": dict(clip=True)})
    patient_fleet.join(names)
    sched = _schedule(patient_fleet, names, 3)
    assert sched == [tuple(names)] * 3
    ref = er.simulate(sched, names, 0, cfg=er.CLIPPED, scaled=("r2", 1))
    for n in names:
        assert [r["digest"] for r in patient_fleet.rows(n)] == ref, n
    assert er.simulate(sched, names, 0, cfg=er.CFG, scaled=("r2", 1)) != ref  # the clip did something

    # The movement at step 1, replayed: each replica's decoded tensors, the median of their norms.
    def replay(cfg):
        theta = er.initial_params(0)
        reps = {n: [t.clone() for t in theta] for n in names}
        states = {n: SparseLoCoState(reps[n], cfg) for n in names}
        for k in range(2):
            payloads = {}
            for n in names:
                er.inner_steps(reps[n], n, 0, k)
                if (n, k) == ("r2", 1):
                    er.scale_delta(reps[n], states[n].theta_prev)
                payloads[n] = states[n].prepare(reps[n])
            before = [t.clone() for t in states["r0"].theta_prev]
            for n in names:
                states[n].finish(reps[n], [payloads[m] for m in names])
        decoded = []
        for n in names:  # finish on one payload alone: theta_prev - lr * (that replica's decoded tensor)
            p = [t.clone() for t in before]
            one = SparseLoCoState(p, cfg)  # one contributor: the median clip is its own norm
            one.prepare([t.clone() for t in p])
            one.finish(p, [payloads[n]])
            decoded.append([(b - a) / cfg.outer_lr for a, b in zip(p, before)])
        return before, reps["r0"], decoded

    before, after, decoded = replay(er.CLIPPED)
    for i in range(len(before)):
        norms = sorted(float(d[i].norm()) for d in decoded)
        moved = float((before[i] - after[i]).norm())
        assert moved <= er.CLIPPED.outer_lr * norms[1] * (1 + 1e-5), (i, moved, norms)
        assert norms[2] > 100 * norms[1]  # r2's is the wild one
    before, after, _ = replay(er.CFG)  # the same payloads, summed without the clip
    for i in range(len(before)):
        median = sorted(float(d[i].norm()) for d in decoded)[1]
        assert float((before[i] - after[i]).norm()) > 100 * er.CFG.outer_lr * median, i


def test_replica_with_a_1000x_pseudo_gradient_is_screened_out_by_every_replica_alike(patient_fleet):
    """Elastic mode under sparseloco.screen "agreement": r2's pseudo-gradient of outer step 1 is scaled
    by 1000. Every replica's log names r2 screened at step 1 (and each step alike: its error feedback
    still holds the outlier's unsent part), and every replica's synced parameters after each step are
    bitwise the one-process replay's, which are not the unscreened run's. Breaks if the fleet's
    replicas decided differently on the same gathered bytes, or the screen did not act in elastic mode."""
    names = ["r0", "r1", "r2"]
    patient_fleet.start_together(names, steps=3, options={n: dict(screen=True, scale_at=1 if n == "r2" else -1)
                                                           for n in names})
    patient_fleet.join(names)
    sched = _schedule(patient_fleet, names, 3)
    assert sched == [tuple(names)] * 3
    ref = er.simulate(sched, names, 0, cfg=er.SCREENED, scaled=("r2", 1))
    screened = {n: [r["screened"] for r in patient_fleet.rows(n)] for n in names}
    for n in names:
        assert [r["digest"] for r in patient_fleet.rows(n)] == ref, n
        assert screened[n] == screened["r0"], screened
    assert screened["r0"][:2] == [[], ["r2"]], screened
    assert er.simulate(sched, names, 0, cfg=er.CFG, scaled=("r2", 1)) != ref  # the screen did something


@pytest.mark.skipif(not os.path.exists("/proc/self/net/tcp"), reason="reads listening sockets from Linux /proc")
def test_replica_listens_only_on_the_bind_address(fleet):
    """Every socket a replica listens on (torchft's ManagerServer, the state-transfer server, the gloo
    sockets of the cross-replica group, its store) is on the bind address, here 127.0.0.1. Breaks if
    torchft's ManagerServer went back to every interface (it hard-codes [::]) or gloo to the hostname."""
    fleet.start_together(["r0", "r1"], steps=8)
    fleet.wait(lambda: len(fleet.rows("r0")) >= 1 and len(fleet.rows("r1")) >= 1, 60, "outer step 0")
    for n in ["r0", "r1"]:
        addrs = _listening(fleet.procs[(n, 0)].pid)
        assert addrs == {"127.0.0.1"}, (n, addrs)
    fleet.join(["r0", "r1"])


# ---------------------------------------------------------------------- the pure core of an attempt
def _round(payloads, names, secret=SECRET, contributing=None, chains=None, steps=None):
    """The bytes of one attempt's hello and payload rounds as every replica receives them."""
    contributing = contributing or [True] * len(names)
    hellos, macs = [], []
    for i, (n, p) in enumerate(zip(names, payloads)):
        fp = HEADER.unpack_from(p[: HEADER.size].numpy().tobytes())[4]
        chain = (chains or [b"\0" * 32] * len(names))[i]
        h = rounds.pack_hello(n, (steps or [5] * len(names))[i], contributing[i], True, p.numel(), fp, chain)
        mac = tag(secret if isinstance(secret, bytes) else secret[i], b"hello", h)
        hellos.append(h + mac)
        macs.append(mac)
    heard, dropped, lengths = rounds.read_hellos(SECRET, hellos)
    plan = rounds.plan(heard, b"\0" * 32, lengths)
    frames = [rounds.payload_frame(secret if isinstance(secret, bytes) else secret[i], macs[i],
                                    p if contributing[i] else None, plan.length) for i, p in enumerate(payloads)]
    return heard, dropped, plan, frames


def _payloads(m, cfg=None):
    cfg = cfg or er.CFG
    out = []
    for i in range(m):
        params = er.initial_params(0)
        state = SparseLoCoState(params, cfg)
        er.inner_steps(params, f"r{i}", 0, 0)
        out.append(state.prepare(params))
    return out


def test_tampered_or_foreign_payloads_are_dropped_and_the_rest_accepted():
    """A flipped byte in a payload, a payload of another config (fingerprint), and a non-contributor
    are not accepted; the rest are, in name order. Breaks if a bad payload could reach `finish`
    (which would raise on a foreign header and wreck the step, or sum a forged pseudo-gradient)."""
    payloads = _payloads(4)
    payloads[3] = _payloads(1, SparseLoCoConfig(preset="paper", chunk_size=16, topk=8, error_decay=0.5, outer_lr=0.7))[0]
    names = ["r3", "r1", "r0", "r2"]  # quorum order is torchft's, not ours
    heard, dropped, plan, frames = _round(payloads, names, contributing=[True, True, True, True])
    accepted, why = rounds.accept(SECRET, plan, frames)
    assert [n for n, _ in accepted] == ["r0", "r1", "r3"]  # r2 sent the foreign config
    assert [w[0] for w in why] == ["r2"] and "differs from the fleet's" in why[0][1]
    frames[1][10] ^= 1  # r1's payload, flipped on the wire
    accepted, why = rounds.accept(SECRET, plan, frames)
    assert [n for n, _ in accepted] == ["r0", "r3"] and ("r1", "payload does not authenticate") in why
    heard, _, plan, frames = _round(payloads, names, contributing=[True, False, True, True])
    assert [n for n, _ in rounds.accept(SECRET, plan, frames)[0]] == ["r0", "r3"]


def test_replicas_without_the_secret_are_not_heard_and_a_minority_refuses_itself():
    """Hellos signed with another secret are dropped; the replica whose secret is in the minority
    learns it is refused, the majority does not. Breaks if a stranger's hello counted."""
    payloads = _payloads(3)
    secrets = [SECRET, SECRET, b"another-secret-0123456789abcdef"]
    heard, dropped, plan, frames = _round(payloads, ["r0", "r1", "x"], secret=secrets)
    assert sorted(h.name for h in heard.values()) == ["r0", "r1"] and [d[0] for d in dropped] == ["quorum position 2"]
    assert not rounds.refused(heard, 3)
    assert [n for n, _ in rounds.accept(SECRET, plan, frames)[0]] == ["r0", "r1"]
    stranger = {2: heard[0]}  # what x hears: only itself
    assert rounds.refused(stranger, 3)


def test_behind_or_diverged_replicas_do_not_contribute():
    """Only replicas at the fleet's step and with the fleet's (most common) chain contribute. Breaks
    if a replica that missed a commit, or whose synced state diverged, had its delta summed."""
    payloads = _payloads(4)
    chains = [b"a" * 32, b"a" * 32, b"b" * 32, b"a" * 32]
    heard, _, plan, frames = _round(payloads, ["r0", "r1", "r2", "r3"], chains=chains, steps=[5, 5, 5, 4])
    assert plan.step == 5 and plan.chain == b"a" * 32
    assert [n for n, _ in rounds.accept(SECRET, plan, frames)[0]] == ["r0", "r1"]


def test_excluded_copy_leaves_the_synced_parameters_unchanged():
    """With nobody left to contribute, finish on the excluded copy of the own payload is a no-op step.
    Breaks if the copy kept the finite flag (the stale body would be applied)."""
    params = er.initial_params(0)
    state = SparseLoCoState(params, er.CFG)
    before = [t.clone() for t in state.theta_prev]
    er.inner_steps(params, "r0", 0, 0)
    payload = state.prepare(params)
    copy = rounds.excluded_copy(payload)
    assert not HEADER.unpack_from(copy[: HEADER.size].numpy().tobytes())[2] & FLAG_FINITE
    report = state.finish(params, [copy])
    assert report.contributors == () and all(torch.equal(a, b) for a, b in zip(params, before))


# ---------------------------------------------------------------------- state transfer and the secret
def _impostor_server(body: bytes):
    """An HTTP server without the secret that answers every state request with `body`."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("X-Hetloco-Mac", (b"\0" * 32).hex())
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *a):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def test_state_transfer_serves_only_the_fleet_and_joiner_loads_only_fleet_state():
    """Wrong secret: 403 and no state; a response not signed with the fleet secret: not loaded; the
    fleet's own request: the exact state; after the commit (disallow): nothing served. Breaks if the
    server served without checking the secret, or the joiner trusted an unsigned response."""
    state = {"user": {"default": {"theta": [torch.arange(6.0)], "outer": 3}}, "torchft": {"step": 3}}
    t = timedelta(seconds=5)
    # the donor holds a request for a state not (yet) staged this long before answering 409
    donor = AuthenticatedStateTransport(SECRET, timeout=timedelta(seconds=1))
    joiner = AuthenticatedStateTransport(SECRET, timeout=t)
    stranger = AuthenticatedStateTransport(b"another-secret-0123456789abcdef", timeout=t)
    buf = io.BytesIO()
    torch.save(state, buf)
    impostor = _impostor_server(buf.getvalue())
    try:
        donor.send_checkpoint([1], 3, state, t)
        with pytest.raises(FleetRefused, match="rejected this replica's fleet secret"):
            stranger.recv_checkpoint(0, donor.metadata(), 3, t)
        got = joiner.recv_checkpoint(0, donor.metadata(), 3, t)
        assert torch.equal(got["user"]["default"]["theta"][0], torch.arange(6.0)) and got["torchft"]["step"] == 3
        with pytest.raises(StateTransferError, match="not signed with the fleet secret"):
            joiner.recv_checkpoint(0, f"http://127.0.0.1:{impostor.server_address[1]}", 3, t)
        donor.disallow_checkpoint()
        with pytest.raises(StateTransferError, match="409"):
            joiner.recv_checkpoint(0, donor.metadata(), 3, t)
    finally:
        impostor.shutdown()
        for x in (donor, joiner, stranger):
            x.shutdown()


def test_fleet_secret_comes_from_a_private_file_or_the_environment(tmp_path, monkeypatch):
    """Breaks if a world-readable secret file, a short secret or no secret were accepted silently."""
    monkeypatch.delenv("HETLOCO_FLEET_SECRET", raising=False)
    with pytest.raises(ValueError, match="no fleet secret"):
        read_fleet_secret()
    monkeypatch.setenv("HETLOCO_FLEET_SECRET", "short")
    with pytest.raises(ValueError, match="at least 16"):
        read_fleet_secret()
    monkeypatch.setenv("HETLOCO_FLEET_SECRET", SECRET.decode() + "\n")
    assert read_fleet_secret() == SECRET
    path = tmp_path / "secret"
    path.write_bytes(b"0123456789abcdef0123\n")
    path.chmod(0o644)
    with pytest.raises(ValueError, match="chmod 600"):
        read_fleet_secret(str(path))
    path.chmod(0o600)
    assert read_fleet_secret(str(path)) == b"0123456789abcdef0123"


def test_lighthouse_command_binds_the_given_address_and_stops_cleanly():
    """`hetloco-ds lighthouse --bind 127.0.0.1:0` prints the address it listens on (the bound host, not
    the machine name) and a replica's connection succeeds there; bad --bind is one error line."""
    from hetloco_ds import cli
    from hetloco_ds.transport import lighthouse

    out, stop, rc = io.StringIO(), threading.Event(), []
    args = types.SimpleNamespace(bind="127.0.0.1:0", min_replicas=1, join_timeout=1.0, heartbeat_timeout=1.0)
    t = threading.Thread(target=lambda: rc.append(lighthouse.run(args, stop, out)))
    t.start()
    deadline = time.monotonic() + 20
    while "listening" not in out.getvalue() and time.monotonic() < deadline:
        time.sleep(0.02)
    url = out.getvalue().split()[-1]
    assert url.startswith("http://127.0.0.1:")
    with socket.create_connection(("127.0.0.1", int(url.rpartition(":")[2])), timeout=5):
        pass
    stop.set()
    t.join(10)
    assert rc == [0]
    assert cli.main(["lighthouse", "--bind", "nohostport"]) == 2
