"""An elastic fleet of replicas of their own depths (`hetloco.replica_stages` in elastic mode, issue 29):
real `hetloco-ds train` replica jobs (a depth-1 and a depth-2 replica of tests/test_cli.py's tiny LLaMA,
gloo on CPU, H = 2) meeting through a real torchft lighthouse, their ranks forked from the preloaded
server as test_elastic_training.py forks them. The outer sync runs by block (`sizes.block_parts`), one
torchft group per block; a restarted replica heals block by block from a peer of another depth.
"""
from __future__ import annotations

import glob
import json
import os
import signal
import time

import pytest
import torch

os.environ.setdefault("RUST_LOG", "warn")  # torchft's extension reads it once, at import
pytest.importorskip("torchft", reason="elastic mode needs the optional extra: pip install 'hetloco_ds[elastic]'")

import runs  # noqa: E402
from conftest import save_tiny_llama  # noqa: E402
from distributed import fork_job, job_stderr  # noqa: E402
from test_cli import tiny_tokenizer, write_config, write_text_folder  # noqa: E402
from test_elastic_training import Fleet  # noqa: E402

DEPTHS = [1, 2]
BASE = {"hetloco.replica_stages": DEPTHS, "hetloco.sparseloco.inner_steps": 2, "hetloco.train.watchdog_timeout": 60,
        "hetloco.elastic.timeout": 5.0, "hetloco.elastic.quorum_timeout": 120,
        "hetloco.subspace.compressed_replicas": [1], "hetloco.subspace.ratio": 2}


@pytest.fixture(scope="module")
def tied_job(tmp_path_factory):
    root = tmp_path_factory.mktemp("elastic_mixed_job")
    save_tiny_llama(root / "hf", tied=True)
    tiny_tokenizer().save_pretrained(root / "hf")
    return {"hf": root / "hf", "data": write_text_folder(root / "data"), "cache": root / "cache", "root": root}


class MixedFleet(Fleet):
    """test_elastic_training's fleet, replica m a job of DEPTHS[m] forked ranks."""

    def start(self, name, replica, cfg, steps, fault=None, resume=False, out=None, secret="file", launcher=False):
        argv = ["train", "--out", str(self.out), "--lighthouse", self.addr, "--replica-id", str(replica), "--steps",
                str(steps), "--secret-file", str(self.secret_file)]
        argv += ["--resume"] if resume else ["--model", str(self.job["hf"]), "--data", str(self.job["data"]),
                                             "--config", str(cfg)]
        env = runs.env(self.job["cache"])
        env.pop("HETLOCO_FLEET_SECRET", None)
        env["HETLOCO_FLEET_GATE"] = str(self.gate)
        self.replicas[name] = fork_job(self.tmp / name, DEPTHS[replica], argv, env, fault)
        return name

    def stderr(self, name) -> str:
        return job_stderr(self.tmp / name, len(self.replicas[name]))

    def wait(self, cond, timeout, what, expect_exit=()):
        end = time.monotonic() + timeout
        while not cond():
            self.poll()
            failed = {n: c for n, c in self.exits.items() if n not in expect_exit and any(c)}
            if failed:
                raise AssertionError(f"{failed} exited: " + "".join(self.stderr(n)[-3000:] for n in failed))
            if time.monotonic() > end:
                raise AssertionError(f"timed out after {timeout} s waiting for {what}")
            time.sleep(0.05)


@pytest.fixture
def fleet(tied_job, tmp_path):
    f = MixedFleet(tmp_path, tied_job)
    yield f
    f.close()


def _assert_replicas_equal(fleet, steps, members=(0, 1)) -> None:
    """At each outer step in `steps`: every replica's block checksums (the whole model, cut by block)
    are the same, and so are the members."""
    rows = [fleet.rows(m) for m in range(len(DEPTHS))]
    for s in steps:
        assert rows[0][s]["block_checksums"] == rows[1][s]["block_checksums"], (s, rows[0][s], rows[1][s])
        assert len(rows[0][s]["block_checksums"]) == 2


def test_depth_1_and_depth_2_elastic_replicas_reproduce_the_static_mixed_run(fleet, tied_job, tmp_path):
    """A tied model, replica 0 whole on one rank (its head a copy of its own) and replica 1 in two
    stages, compressed (ratio 2): each its own `hetloco-ds train --lighthouse` job. After every outer
    step both replicas' block checksums are equal; every step's loss of each replica, and the exported
    weights of both, are bitwise those of the static world of the same config (3 ranks, replica_stages
    [1, 2]). Each rank's outer-sync bytes are its blocks' exchanges. Breaks if the fleet's blocks were
    cut by stage, if a depth-1 rank's two block exchanges met the wrong peers, if the tied head of
    the one-stage replica were treated unlike the static mode's, or if the payload order differed."""
    cfg = write_config(tmp_path / "cfg.json", BASE)
    inputs = ["--model", tied_job["hf"], "--data", tied_job["data"], "--config", cfg]
    static = fork_job(tmp_path / "static", 3, ["train", "--steps", 4, *inputs, "--out", tmp_path / "static"],
                      runs.env(tied_job["cache"]))
    for m in range(2):
        fleet.start(f"r{m}", m, cfg, 4)
    fleet.open_gate(3)
    fleet.done(["r0", "r1"])
    for p in static:
        p.join(240)
    assert [p.exitcode for p in static] == [0] * 3, job_stderr(tmp_path / "static", 3)[-3000:]
    assert fleet.exits == {"r0": [0], "r1": [0, 0]}, fleet.exits

    want = runs.keyed(tmp_path / "static", "step")
    got = {}
    for m in range(2):
        got.update(runs.keyed(fleet.out / f"replica-{m}", "step"))
    assert sorted(got) == sorted(want) and len(want) == 8
    assert {k: r["loss"] for k, r in got.items()} == {k: r["loss"] for k, r in want.items()}
    for m in range(2):
        outer = fleet.rows(m)
        assert sorted(outer) == [2, 4]
        assert all(r["members"] == [0, 1] and r["attempts"] == 1 and not r["healed"] for r in outer.values()), outer
    _assert_replicas_equal(fleet, (2, 4))
    reference = runs.hf_tensors(tmp_path / "static" / "hf")
    for m in range(2):
        exported = runs.hf_tensors(fleet.out / f"replica-{m}" / "hf")
        assert exported.keys() == reference.keys() and all(torch.equal(exported[k], reference[k]) for k in reference)


def test_killed_depth_2_replica_is_healed_from_the_depth_1_one_block_by_block(fleet, tmp_path):
    """Rank 1 of the depth-2 replica is SIGKILLed inside its 5th step (its rank 0 stopped as a
    launcher does). The depth-1 replica finishes the outer step at 6 alone and trains on; it is held
    at its next boundary until the depth-2 replica, restarted with --resume from its step-4
    checkpoint, reaches one. There the restarted replica is behind: each of its ranks heals its one
    block from the depth-1 replica's one rank (torchft alone would ask a group rank 1 the donor does
    not have), contributes nothing that step, and from then on both contribute and their block
    checksums are equal after every outer step. Breaks if a heal fetched by stage instead of by block,
    if the survivor stalled, or if a healed replica's parameters differed from the fleet's."""
    cfg = write_config(tmp_path / "cfg.json", {**BASE, "hetloco.train.checkpoint_interval": 1})
    (tmp_path / "hold-4").touch()
    fleet.start("r0", 0, cfg, 10, fault=f"0:holdsync:4:{tmp_path}")  # held at its 4th quorum (step 8)
    fleet.start("r1", 1, cfg, 10, fault="1:step:5")
    fleet.open_gate(3)
    fleet.wait(lambda: 6 in fleet.rows(0), 120, "the survivor's outer step at 6", expect_exit={"r1"})
    assert fleet.exits.get("r1") and -signal.SIGKILL in fleet.exits["r1"], fleet.exits
    r = fleet.rows(0)
    assert r[4]["members"] == [0, 1] and r[6]["members"] == r[6]["contributors"] == [0] and r[6]["left"] == [1], r
    _assert_replicas_equal(fleet, (2, 4))

    fleet.start("r1-again", 1, cfg, 10, resume=True)
    fleet.wait(lambda: "(quorum)" in fleet.where(1), 120, "replica 1 back at an outer boundary", expect_exit={"r1"})
    (tmp_path / "hold-4").unlink()
    fleet.done(["r0", "r1-again"], expect_exit={"r1"})
    assert fleet.exits["r0"] == [0] and fleet.exits["r1-again"] == [0, 0], fleet.exits
    back = {s: row for s, row in fleet.rows(1).items() if s > 4}
    joined = min(back)
    assert back[joined]["healed"] and back[joined]["members"] == [0], back[joined]
    assert joined == 8 and sorted(back) == [8, 10], sorted(back)
    assert fleet.rows(1)[10]["members"] == fleet.rows(0)[10]["members"] == [0, 1]
    _assert_replicas_equal(fleet, (8, 10))


def test_a_replica_with_other_depths_has_another_fleet_identity_named_in_one_line(tmp_path):
    """The fleet's depths decide its blocks; a joiner whose config names other depths (or one depth)
    has another fleet key, so it never contributes, and once healed it is refused in one line naming
    both. Each replica's own run is one pipeline of its entry. Breaks if replicas cutting the model
    into other blocks were let into one outer step."""
    from conftest import tiny_llama_config
    from hetloco_ds.config import elastic_replica, load_config
    from hetloco_ds.elastic import replica as fleet

    def ident(depths):
        run = load_config(write_config(tmp_path / f"{depths}.json", {**BASE, "hetloco.replica_stages": depths}))
        return fleet.identity(elastic_replica(run, 0), tiny_llama_config())

    ours, other, even = ident([1, 2]), ident([1, 4]), ident([2, 2])
    assert ident([1, 2]) == ours and fleet.fleet_key(other) != fleet.fleet_key(ours)
    assert fleet.mismatch(other, ours) == ("hetloco.replica_stages = [1, 4] here, [1, 2] in the fleet: the outer "
                                           "sync's blocks would differ")
    assert fleet.mismatch(even, ours) == ("hetloco.replica_stages = none (one depth) here, [1, 2] in the fleet: the "
                                          "outer sync's blocks would differ")
    run = elastic_replica(load_config(write_config(tmp_path / "c.json", BASE)), 1)
    assert (run.stages, run.fleet_stages, run.hetloco.replica_stages, run.hetloco.elastic.max_replicas) == (2, (1, 2),
                                                                                                          None, 2)
