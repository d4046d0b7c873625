"""Elastic training end to end: real `hetloco-ds train` replicas (DeepSpeed pipelines of 2 stages
on CPU, gloo) meeting through a torchft lighthouse, killed and stopped with real signals.

The model, data and tokenizer are tests/test_cli.py's tiny ones (hidden 32, 4 layers, a 96-token
tokenizer, 16-token blocks), SparseLoCo H = 2. The no-fault test runs the user's command `--nproc 6 --elastic`, its
launcher and ranks forked from a server that has imported the libraries once (tests/distributed.launch_job); the static
reference and the fault tests start every rank as torchrun would (RANK, WORLD_SIZE, MASTER_ADDR/PORT), forked from that
server too (tests/elastic_ranks.py), with a lighthouse in this process. A rank that dies
takes its replica's other rank down, as a launcher does. Faults: tests/fault_inject's AdamW-step
kill and stop; a fleet is held at an outer boundary while a late replica starts (`holdsync`).
"""
from __future__ import annotations

import glob
import json
import math
import os
import re
import shutil
import signal
import stat
import time

import pytest
import torch

os.environ.setdefault("RUST_LOG", "warn")  # torchft's extension reads it once, at import
pytest.importorskip("torchft", reason="elastic mode needs the optional extra: pip install 'hetloco_ds[elastic]'")

import runs  # noqa: E402
from distributed import fork_job, job_stderr, start_launcher  # noqa: E402
from test_cli import save_tiny_hf_with_tokenizer, write_config, write_text_folder  # noqa: E402

SECRET = "fleet-secret-for-tests-0123456789"
STAGES = 2
HEARTBEAT_S, JOIN_S, TIMEOUT_S = 2.0, 10.0, 5.0
SLACK_S = 6.0  # a loaded 2-core machine: process scheduling, gloo set-up, the lighthouse's 100 ms tick
BASE = {"pipeline.stages": STAGES, "hetloco.sparseloco.inner_steps": 2, "hetloco.train.watchdog_timeout": 60,
        "hetloco.elastic.timeout": TIMEOUT_S, "hetloco.elastic.quorum_timeout": 120}


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    root = tmp_path_factory.mktemp("elastic_job")
    return {"hf": save_tiny_hf_with_tokenizer(root / "hf"), "data": write_text_folder(root / "data"),
            "cache": root / "cache", "root": root}


def _rows(out, kind: str) -> dict:
    with open(os.path.join(out, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f if line.endswith("\n")]
    return {r["step"]: r for r in rows if r["kind"] == kind}


# ---------------------------------------------------------------------- no faults: the static run, bit for bit
def test_elastic_fleet_without_faults_and_resumed_reproduces_the_static_run(job, tmp_path):
    """`hetloco-ds train --nproc 6 --elastic` (a lighthouse and 3 replica jobs of 2 stages, heterogeneous
    subspace ratios, the default median clip) for 4 steps, then the whole fleet resumed with `--elastic --resume` to
    step 6, gives every replica bitwise the losses of a static world of 6 ranks
    (as torchrun starts it), replica 0 the same validation loss, and every replica the same exported weights, every outer step with all three
    replicas in one attempt. Breaks if replica ids and data shards, the payload order, the split
    basis or the seeds differed from the static mode's, if the fleet's first quorum missed a replica, or if a
    resumed replica lost any of its state."""
    cfg = write_config(tmp_path / "cfg.json", {
        **BASE, "hetloco.subspace.compressed_replicas": [1, 2],
        "hetloco.subspace.ratio": 2, "hetloco.subspace.replica_ratios": {"2": 4},
        "hetloco.elastic.join_timeout": 60, "hetloco.elastic.heartbeat_timeout": 10})
    inputs = ["--model", job["hf"], "--data", job["data"], "--config", cfg]
    # The static world as torchrun starts it (test_launchers: the same job as --nproc 6), forked: fast.
    static = fork_job(tmp_path / "static", 6, ["train", "--steps", 6, *inputs, "--out", tmp_path / "static"],
                      runs.env(job["cache"]))
    # The fleet stops after 4 steps (a checkpoint per replica) and the whole fleet is resumed to 6.
    first = runs.launched(tmp_path / "first", "train", "--steps", 4, *inputs, "--nproc", 6, "--out", tmp_path / "fleet",
                          "--elastic", cache=job["cache"])
    assert first.returncode == 0, runs.explain(first)
    fleet = runs.launched(tmp_path / "resumed", "train", "--steps", 6, "--out", tmp_path / "fleet", "--elastic",
                          "--resume", cache=job["cache"])
    for p in static:
        p.join(240)
    assert [p.exitcode for p in static] == [0] * 6, job_stderr(tmp_path / "static", 6)[-3000:]
    assert fleet.returncode == 0, runs.explain(fleet)

    want = runs.keyed(tmp_path / "static", "step")
    got = {}
    for m in range(3):
        got.update(runs.keyed(tmp_path / "fleet" / f"replica-{m}", "step"))
    assert {k: r["loss"] for k, r in got.items()} == {k: r["loss"] for k, r in want.items()}
    # Every replica validates the synced model through its own pipeline (the compressed ones through
    # their subspace boundaries): the static row holds all three losses, each elastic replica its own.
    static_val = runs.keyed(tmp_path / "static", "validation")[(6, 0)]["replica_losses"]
    assert [_rows(tmp_path / "fleet" / f"replica-{m}", "validation")[6]["loss"] for m in range(3)] == static_val
    reference = runs.hf_tensors(tmp_path / "static" / "hf")
    checksums = set()
    for m in range(3):
        out = tmp_path / "fleet" / f"replica-{m}"
        exported = runs.hf_tensors(out / "hf")
        assert exported.keys() == reference.keys() and all(torch.equal(exported[k], reference[k]) for k in reference)
        outer = _rows(out, "outer")
        assert sorted(outer) == [2, 4, 6]
        assert all(r["members"] == r["contributors"] == [0, 1, 2] and r["attempts"] == 1 and not r["healed"]
                   for r in outer.values()), outer
        checksums.add(json.dumps([outer[s]["params_checksum"] for s in (2, 4, 6)]))
    assert len(checksums) == 1
    fleet_dir = tmp_path / "fleet"
    assert json.loads((fleet_dir / "fleet_config.json").read_text())["hetloco"]["elastic"]["max_replicas"] == 3
    assert stat.S_IMODE(os.stat(fleet_dir / ".hetloco" / "fleet_secret").st_mode) == 0o600


# ---------------------------------------------------------------------- faults: a fleet of forked ranks
class Fleet:
    """A lighthouse in this process; replicas of 2 ranks forked from a preloaded server."""

    def __init__(self, tmp, job, join_timeout=JOIN_S, heartbeat_timeout=HEARTBEAT_S):
        from torchft._torchft import LighthouseServer

        self.tmp, self.job = tmp, job
        self.lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=1, join_timeout_ms=int(join_timeout * 1000),
                                           heartbeat_timeout_ms=int(heartbeat_timeout * 1000))
        self.addr = "http://127.0.0.1:" + self.lighthouse.address().rpartition(":")[2]
        self.secret_file = tmp / "secret"
        self.secret_file.write_text(SECRET + "\n")
        self.secret_file.chmod(0o600)
        self.gate = tmp / "gate"
        self.gate.mkdir()
        self.out = tmp / "fleet"
        self.replicas: dict[str, list] = {}
        self.exits: dict[str, list] = {}

    def start(self, name, replica, cfg, steps, fault=None, resume=False, out=None, secret="file", launcher=False):
        """Replica `replica` as job `name` (both ranks); `secret`: "file", "none" or another secret (env).
        `launcher`: the user's multi-host command instead, `hetloco-ds train --lighthouse ... --nproc 2`, a
        launcher that starts its ranks itself (tests/distributed.start_launcher)."""
        out = out or self.out
        argv = ["train", "--out", str(out), "--lighthouse", self.addr, "--replica-id", str(replica), "--steps", str(steps)]
        argv += ["--resume"] if resume else ["--model", str(self.job["hf"]), "--data", str(self.job["data"]),
                                             "--config", str(cfg)]
        env = runs.env(self.job["cache"])
        env.pop("HETLOCO_FLEET_SECRET", None)
        if secret == "file":
            argv += ["--secret-file", str(self.secret_file)]
        elif secret != "none":
            env["HETLOCO_FLEET_SECRET"] = secret
        env["HETLOCO_FLEET_GATE"] = str(self.gate)
        if launcher:  # its stderr (and its ranks') in NAME.rank0.err
            open(self.tmp / f"{name}.rank1.err", "w").close()
            proc = start_launcher(self.tmp / f"{name}.rank0", [*argv, "--nproc", str(STAGES)], env, runs.REPO)
            self.replicas[name] = [proc] * STAGES
        else:
            self.replicas[name] = fork_job(self.tmp / name, STAGES, argv, env, fault)
        return name

    def stderr(self, name) -> str:
        return job_stderr(self.tmp / name, STAGES)

    def poll(self) -> None:
        """A launcher's job: when a rank of a replica has failed, stop its other rank (one that stopped
        after saving, EXIT_PREEMPTED, has peers finishing the same save: they end by themselves)."""
        from hetloco_ds.launch import EXIT_PREEMPTED

        for name, procs in self.replicas.items():
            if name in self.exits:
                continue
            if any(p.exitcode not in (None, 0, EXIT_PREEMPTED) for p in procs):
                for p in procs:
                    if p.exitcode is None:
                        p.kill()
                        p.join(10)
            if all(p.exitcode is not None for p in procs):
                self.exits[name] = [p.exitcode for p in procs]

    def wait(self, cond, timeout, what, expect_exit=()):
        end = time.monotonic() + timeout
        while not cond():
            self.poll()
            failed = {n: c for n, c in self.exits.items() if n not in expect_exit and c != [0] * STAGES}
            if failed:
                raise AssertionError(f"{failed} exited: " + "".join(self.stderr(n)[-3000:] for n in failed))
            if time.monotonic() > end:
                raise AssertionError(f"timed out after {timeout} s waiting for {what}")
            time.sleep(0.05)

    def open_gate(self, ranks: int, expect_exit=()) -> None:
        self.wait(lambda: len(glob.glob(str(self.gate / "ready-*"))) >= ranks, 120, f"{ranks} ranks up", expect_exit)
        (self.gate / "go").touch()

    def rows(self, replica, kind="outer", out=None) -> dict:
        path = os.path.join(out or self.out, f"replica-{replica}")
        return _rows(path, kind) if os.path.exists(os.path.join(path, "metrics.jsonl")) else {}

    def where(self, replica, out=None) -> str:
        """Where rank 0 of the replica's newest job says it is (its watchdog heartbeat)."""
        run = os.path.join(out or self.out, f"replica-{replica}")
        beats = glob.glob(os.path.join(run, ".hetloco", "heartbeat", "*", "rank00000.json"))
        if not beats:
            return ""
        try:
            with open(max(beats, key=os.path.getmtime)) as f:
                return json.load(f)["where"]
        except (OSError, ValueError):
            return ""

    def done(self, names, timeout=120, expect_exit=()) -> None:
        self.wait(lambda: all(n in self.exits for n in names), timeout, f"{names} to finish", expect_exit)

    def close(self) -> None:
        for procs in self.replicas.values():
            for p in procs:
                if p.is_alive():
                    p.kill()
                p.join(5)
        self.lighthouse.shutdown()


@pytest.fixture
def fleet(job, tmp_path):
    f = Fleet(tmp_path, job)
    yield f
    f.close()


def _finite_losses(f, replica, steps) -> None:
    rows = f.rows(replica, "step")
    assert all(s in rows and math.isfinite(rows[s]["loss"]) for s in steps), sorted(rows)


def test_killed_replica_costs_the_others_one_heartbeat_timeout_and_rejoins_when_restarted(fleet, tmp_path):
    """3 replicas x 2 stages. Rank 1 of replica 2 is SIGKILLed inside its 5th training step (the launcher
    stops its other rank). Replicas 0 and 1 finish the next outer step (step 6) without it within the
    lighthouse's heartbeat timeout plus one exchange timeout, with 2 contributors, and train on. Replica
    2, restarted with --resume from its own checkpoint (step 4), is behind the fleet: at its next outer
    boundary it receives the synced state from a live peer (healed), and from that step on every
    stage's parameter checksum equals the others' and all three contribute. Then the fleet is resumed from
    checkpoints of different steps (replica 2's newest is gone): replica 2 is healed again. Breaks if a dead
    replica stalled the fleet, if survivors lost their state, if a rejoining replica's parameters differed,
    or if a checkpoint did not keep the transport's step and history (a stale replica would be summed in)."""
    cfg = write_config(tmp_path / "cfg.json", {**BASE, "hetloco.elastic.max_replicas": 3,
                                               "hetloco.train.checkpoint_interval": 1})
    (tmp_path / "hold-4").touch()
    for m in (0, 1):  # held at their 4th outer boundary (step 8), in the outer sync, until replica 2 is back
        fleet.start(f"r{m}", m, cfg, 12, fault=f"0:holdsync:4:{tmp_path}")
    fleet.start("r2", 2, cfg, 12, fault="1:step:5")
    fleet.open_gate(6)
    fleet.wait(lambda: 6 in fleet.rows(0) and 6 in fleet.rows(1), 120, "the survivors' outer step at 6",
               expect_exit={"r2"})
    assert fleet.exits.get("r2") and -signal.SIGKILL in fleet.exits["r2"], fleet.exits
    for m in (0, 1):
        rows = fleet.rows(m)
        assert rows[4]["members"] == [0, 1, 2]
        r = rows[6]
        assert r["members"] == r["contributors"] == [0, 1] and r["left"] == [2], r
        assert r["quorum_seconds"] < HEARTBEAT_S + TIMEOUT_S + SLACK_S, r

    fleet.start("r2-again", 2, cfg, 12, resume=True)
    fleet.wait(lambda: "(quorum)" in fleet.where(2), 120, "replica 2 back at an outer boundary", expect_exit={"r2"})
    (tmp_path / "hold-4").unlink()
    fleet.done(["r0", "r1", "r2-again"], expect_exit={"r2"})
    assert fleet.exits["r0"] == fleet.exits["r1"] == fleet.exits["r2-again"] == [0, 0], fleet.exits
    ref = fleet.rows(0)
    back = {s: r for s, r in fleet.rows(2).items() if s > 4}
    joined = min(back)
    assert back[joined]["healed"] and back[joined]["members"] == [0, 1], back[joined]
    for s in range(joined, 13, 2):
        assert back[s]["params_checksum"] == ref[s]["params_checksum"] == fleet.rows(1)[s]["params_checksum"], s
        if s > joined:
            assert back[s]["members"] == ref[s]["members"] == [0, 1, 2], (s, back[s], ref[s])
    for m in (0, 1):
        _finite_losses(fleet, m, range(1, 13))

    # The whole fleet stopped at 12; replica 2's newest checkpoint is lost, so it resumes from step 10 and
    # the others from 12. Its checkpoint's transport state says it is a step behind: it is healed, it does
    # not contribute its stale pseudo-gradient, and from then on its parameters are the others'.
    shutil.rmtree(fleet.out / "replica-2" / "checkpoints" / "global_step12")
    (fleet.gate / "go").unlink()
    for f in glob.glob(str(fleet.gate / "ready-*")):
        os.unlink(f)
    for m in range(3):
        fleet.start(f"r{m}-resumed", m, cfg, 14, resume=True)
    fleet.open_gate(6, expect_exit={"r2"})
    fleet.done(["r0-resumed", "r1-resumed", "r2-resumed"], expect_exit={"r2"})
    assert all(fleet.exits[f"r{m}-resumed"] == [0, 0] for m in range(3)), fleet.exits
    rows = [fleet.rows(m) for m in range(3)]
    assert rows[2][14]["healed"] and rows[0][14]["members"] == rows[2][14]["members"] == [0, 1], rows[2][14]
    assert rows[0][14]["params_checksum"] == rows[1][14]["params_checksum"] == rows[2][14]["params_checksum"]


def test_a_replica_told_to_stop_saves_its_own_state_leaves_and_rejoins_from_it(fleet, tmp_path):
    """2 replicas x 2 stages. Replica 1 is held inside its step 3 (between outer steps) and SIGTERM
    reaches its rank 0 alone: both its ranks agree on step 3, commit their own mid-round state and
    exit 75 (the elastic leave), while replica 0 finishes its outer step at 4 without it. Replica 1
    restarted with --resume continues from its step-3 checkpoint and is healed at its next outer
    boundary, from which its parameters are the fleet's. Breaks if a replica told to stop saves
    nothing, waits for the fleet to save, takes the fleet down with it, or leaves a checkpoint
    that cannot rejoin."""
    from hetloco_ds import checkpoint
    from hetloco_ds.launch import EXIT_PREEMPTED

    cfg = write_config(tmp_path / "cfg.json", {**BASE, "hetloco.elastic.max_replicas": 2,
                                               "hetloco.train.checkpoint_interval": 1})
    hold = tmp_path / "hold"
    hold.mkdir()
    (hold / "hold").touch()
    (tmp_path / "hold-3").touch()  # replica 0 waits at its third outer boundary (step 6) for replica 1's return
    fleet.start("r0", 0, cfg, 8, fault=f"0:holdsync:3:{tmp_path}")
    fleet.start("r1", 1, cfg, 8, fault=f"1:holdstep:3:{hold}")
    fleet.open_gate(4)
    fleet.wait(lambda: (hold / "held").exists(), 120, "replica 1 inside its step 3")
    os.kill(fleet.replicas["r1"][0].pid, signal.SIGTERM)
    fleet.wait(lambda: (hold / "agreed-stop").exists(), 60, "replica 1's ranks agreeing where to save")
    assert (hold / "agreed-stop").read_text() == "3"
    (hold / "hold").unlink()
    fleet.done(["r1"], expect_exit={"r1"})
    assert fleet.exits["r1"] == [EXIT_PREEMPTED] * STAGES, fleet.stderr("r1")[-3000:]
    ckpt_dir = fleet.out / "replica-1" / "checkpoints"
    assert checkpoint.latest_tag(str(ckpt_dir)) == "global_step3"
    assert checkpoint.verify(str(ckpt_dir), "global_step3", STAGES) is None
    fleet.wait(lambda: 4 in fleet.rows(0), 120, "replica 0's outer step at 4", expect_exit={"r1"})
    assert fleet.rows(0)[4]["members"] == [0], fleet.rows(0)[4]

    fleet.start("r1-again", 1, cfg, 8, resume=True)
    fleet.wait(lambda: "(quorum)" in fleet.where(1), 120, "replica 1 back at an outer boundary", expect_exit={"r1"})
    (tmp_path / "hold-3").unlink()
    fleet.done(["r0", "r1-again"], expect_exit={"r1"})
    assert fleet.exits["r0"] == fleet.exits["r1-again"] == [0, 0], fleet.exits
    ref, back = fleet.rows(0), {s: r for s, r in fleet.rows(1).items() if s > 3}
    joined = min(back)
    assert back[joined]["healed"], back[joined]
    for s in range(joined, 9, 2):
        assert back[s]["params_checksum"] == ref[s]["params_checksum"], s


def test_hung_replica_costs_one_join_timeout_and_fresh_or_foreign_replicas_are_judged(fleet, job, tmp_path):
    """3 replicas x 2 stages in a fleet of 5 (replica 1 compressed, ratio 4). Rank 1 of replica 2 is SIGSTOPped inside its 5th step (a hang:
    its stage 0 still heartbeats). Replicas 0 and 1 wait for it at most the lighthouse's join timeout (longer
    than their own watchdog's progress limit, which must not end them while they wait), then finish the
    outer step at 6 with 2 contributors. Then, while they are held at their next boundary: replica 3 starts fresh with a
    compression ratio of its own (2), through the multi-host command (`--lighthouse ... --nproc 2`, its own
    launcher), and joins at the next boundary (healed: checksums equal from then on,
    its own data shard, contributing after); replica 4, whose ratio (8) would change the split basis T_S
    lives in, is refused in one line naming it; a replica with another secret is refused in one line (exit 5) and a replica without one stops at its
    checks, writing nothing (exit 2); the fleet goes on. Breaks if a hang stalled the fleet past the join timeout,
    if the watchdog killed a waiting replica, or if a stranger got state or was counted."""
    sub = {"hetloco.elastic.max_replicas": 5, "hetloco.subspace.compressed_replicas": [1], "hetloco.subspace.ratio": 4}
    cfg = write_config(tmp_path / "cfg.json", {**BASE, **sub, "hetloco.train.watchdog_timeout": 3})
    # Replica 3 compresses at ratio 2, which the fleet's config does not say: its subspace contains the fleet's
    # split basis (k = 8), so it may join. Replica 4 at ratio 8 would change that basis: refused, in one line.
    finer = write_config(tmp_path / "finer.json", {**BASE, **sub, "hetloco.subspace.compressed_replicas": [1, 3],
                                                   "hetloco.subspace.replica_ratios": {"3": 2}})
    coarser = write_config(tmp_path / "coarser.json", {**BASE, **sub, "hetloco.subspace.compressed_replicas": [1, 4],
                                                       "hetloco.subspace.replica_ratios": {"4": 8}})
    # Replica 2's own watchdog ends it a little after the join timeout (a hang is not waited for forever).
    patient = write_config(tmp_path / "patient.json", {**BASE, **sub, "hetloco.train.watchdog_timeout": JOIN_S + 2})
    # The fleet is held at its boundaries at steps 8 and 10 (in the outer sync) until the late replicas are
    # there: newcomers must never outnumber it (a majority of the live replicas may form a quorum alone).
    for k in (4, 5):
        (tmp_path / f"hold-{k}").touch()
    for m in (0, 1):
        fleet.start(f"r{m}", m, cfg, 12, fault=f"0:holdsync:4:{tmp_path}")
    fleet.start("r2", 2, patient, 12, fault="1:step:5:stop")
    fleet.open_gate(6)
    fleet.wait(lambda: 6 in fleet.rows(0) and 6 in fleet.rows(1), 120, "the survivors' outer step at 6",
               expect_exit={"r2"})
    for m in (0, 1):
        r = fleet.rows(m)[6]
        assert r["members"] == [0, 1] and r["left"] == [2], r
        assert 2 * 3 < r["quorum_seconds"] < JOIN_S + TIMEOUT_S + SLACK_S, r  # longer than the progress limit

    fleet.start("r4", 4, coarser, 12)
    fleet.start("stranger", 2, cfg, 12, out=tmp_path / "stranger", secret="not-the-fleet-secret-0123456789")
    fleet.start("nosecret", 3, cfg, 12, out=tmp_path / "nosecret", secret="none")
    refused = {"r2", "r4", "nosecret", "stranger"}
    fleet.wait(lambda: all("(quorum)" in w for w in (fleet.where(4), fleet.where(2, tmp_path / "stranger"))),
               120, "replica 4 and the stranger at their first outer boundary", expect_exit=refused)
    (tmp_path / "hold-4").unlink()  # the fleet's step 8: both are judged there
    fleet.done(["r4", "stranger", "nosecret"], expect_exit=refused)
    fleet.start("r3", 3, finer, 12, launcher=True)
    fleet.wait(lambda: "(quorum)" in fleet.where(3), 120, "replica 3 at its first outer boundary", expect_exit=refused)
    (tmp_path / "hold-5").unlink()  # the fleet's step 10: replica 3 joins there
    fleet.done(["r0", "r1", "r3"], expect_exit=refused)
    assert fleet.exits["r0"] == fleet.exits["r1"] == fleet.exits["r3"] == [0, 0], fleet.exits
    assert 4 in fleet.exits["r2"], fleet.exits  # its watchdog: rank 1 stopped responding
    assert 5 in fleet.exits["stranger"], fleet.exits
    lines = runs.error_lines(fleet.stderr("stranger"))
    assert len(lines) == 1 and "refused by the fleet" in lines[0] and "fleet secret" in lines[0], lines
    assert 5 in fleet.exits["r4"], fleet.exits
    lines = runs.error_lines(fleet.stderr("r4"))
    assert len(lines) == 1 and "refused by the fleet: the split basis T_S lives in is k = 4" in lines[0], lines
    assert 2 in fleet.exits["nosecret"]
    lines = runs.error_lines(fleet.stderr("nosecret"))
    assert len(lines) == 1 and "no fleet secret" in lines[0], lines
    assert not os.path.exists(tmp_path / "nosecret" / "replica-3")  # stopped before writing anything

    ref, late = fleet.rows(0), fleet.rows(3)
    joined = min(late)
    assert late[joined]["healed"] and late[joined]["members"] == [0, 1]
    for s in range(joined, 13, 2):
        assert late[s]["params_checksum"] == ref[s]["params_checksum"], s
        assert all("stranger" not in str(r["participants"]) for r in (ref[s], late[s]))
        if s > joined:
            assert late[s]["members"] == ref[s]["members"] == [0, 1, 3]
    # replica 3 trained on its own shard from its start: the step rows before the join are its own
    first = fleet.rows(3, "step")
    assert min(first) == 1 and first[1]["loss"] != fleet.rows(0, "step")[1]["loss"]
    for m in (0, 1):
        _finite_losses(fleet, m, range(1, 13))


def test_a_refused_replicas_line_starts_a_line_of_its_own_after_its_progress_bar(fleet, tmp_path):
    """A replica with another fleet secret, launched as a user launches one (`--nproc 2`: its ranks
    write to one stderr, rank 0 draws the progress bar), is refused at its first outer boundary:
    exit 5 and exactly one error line, starting a line. Breaks if the line is printed while the
    bar's line is open; it once read "train:   0%|          | 0/4 [00:00<?, ?it/s]hetloco-ds
    train: error: refused by the fleet: ..." on the terminal."""
    cfg = write_config(tmp_path / "cfg.json", {**BASE, "hetloco.elastic.max_replicas": 2})
    fleet.start("r0", 0, cfg, 4)
    fleet.start("stranger", 1, cfg, 4, out=tmp_path / "stranger", secret="not-the-fleet-secret-0123456789",
                launcher=True)
    fleet.open_gate(4)
    fleet.done(["stranger"], expect_exit={"stranger"})
    assert fleet.exits["stranger"] == [5, 5], fleet.exits
    err = (tmp_path / "stranger.rank0.err").read_text()
    assert re.search(r"train: +\d+%\|", err), err  # the bar was drawn: there was a line to be glued to
    lines = [line for line in re.split(r"[\r\n]", err) if "error:" in line]
    assert lines == ["hetloco-ds train: error: refused by the fleet: 1 of the 2 replicas in the quorum do not "
                     "authenticate with this replica's fleet secret"], err


# ---------------------------------------------------------------------- what a fleet must agree on (no processes)
def _run_config(tmp_path, name, edits):
    from hetloco_ds.config import load_config

    return load_config(write_config(tmp_path / f"{name}.json", {**BASE, "hetloco.elastic.max_replicas": 4, **edits}))


def test_joiner_with_another_ratio_keeps_the_fleets_split_basis_or_is_refused_naming_it(tmp_path):
    """The fleet compresses replica 1 at ratio 4, so T_S lives in the k = 8 split basis (hidden 32). A
    joiner whose own ratio is 2 (its subspace contains that basis) has the fleet's identity and key; one
    at ratio 8 would move T_S to k = 4: its identity differs, and the line names the split basis of both.
    A different fleet size or outer-step setting is named too. Breaks if replicas that cannot sum T_S in
    one basis were let into the same outer step."""
    from hetloco_ds.elastic import replica as fleet
    from conftest import tiny_llama_config

    model = tiny_llama_config()
    sub = {"hetloco.subspace.compressed_replicas": [1], "hetloco.subspace.ratio": 4}
    ours = fleet.identity(_run_config(tmp_path, "fleet", sub), model)
    finer = fleet.identity(_run_config(tmp_path, "finer", {"hetloco.subspace.compressed_replicas": [1, 3],
                                                           "hetloco.subspace.ratio": 4,
                                                           "hetloco.subspace.replica_ratios": {"3": 2}}), model)
    coarser = fleet.identity(_run_config(tmp_path, "coarser", {"hetloco.subspace.compressed_replicas": [1, 3],
                                                               "hetloco.subspace.ratio": 4,
                                                               "hetloco.subspace.replica_ratios": {"3": 8}}), model)
    assert fleet.mismatch(finer, ours) is None and fleet.fleet_key(finer) == fleet.fleet_key(ours)
    assert fleet.fleet_key(coarser) != fleet.fleet_key(ours)
    assert fleet.mismatch(coarser, ours) == (
        "the split basis T_S lives in is k = 4 (largest compressed ratio 8, subspace seed 1234, embedding_adaptation "
        "True) here and k = 8 (largest compressed ratio 4, subspace seed 1234, embedding_adaptation True) in the "
        "fleet: a replica may use its own compression ratio only if the fleet's hetloco.subspace split stays the "
        "same (its ratio at most the fleet's largest)")
    bigger = fleet.identity(_run_config(tmp_path, "bigger", {**sub, "hetloco.elastic.max_replicas": 5}), model)
    assert fleet.mismatch(bigger, ours).startswith("hetloco.elastic.max_replicas = 5 here, 4 in the fleet")
    other_h = fleet.identity(_run_config(tmp_path, "h", {**sub, "hetloco.sparseloco.inner_steps": 3}), model)
    assert fleet.mismatch(other_h, ours) == "hetloco.sparseloco.inner_steps = 3 here, 2 in the fleet"


def test_joiner_with_another_model_shape_is_refused_naming_the_field(tmp_path):
    """A replica whose model differs from the fleet's in a shape the identity once left out (the MLP
    width, the heads) had the fleet's key; healed from a donor, the donor's state failed to load into
    its parameters with a traceback. Its identity now differs, and the line names the field."""
    from hetloco_ds.elastic import replica as fleet
    from conftest import tiny_llama_config

    run = _run_config(tmp_path, "fleet", {})
    ours = fleet.identity(run, tiny_llama_config())
    for key, value in (("intermediate_size", 96), ("num_key_value_heads", 4), ("tie_word_embeddings", True)):
        model = tiny_llama_config()
        setattr(model, key, value)
        other = fleet.identity(run, model)
        assert fleet.fleet_key(other) != fleet.fleet_key(ours), key
        assert fleet.mismatch(other, ours) == f"the model's {key} = {value} here, {getattr(tiny_llama_config(), key)} in the fleet"
    assert fleet.mismatch(fleet.identity(run, tiny_llama_config()), ours) is None
