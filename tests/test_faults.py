"""Nothing lost, nothing hangs: real SIGKILLs, SIGSTOPs and divergence in tiny 2-rank CLI runs.

Faults are injected by tests/fault_inject/sitecustomize.py (armed through PYTHONPATH and
HETLOCO_FAULT) at exact, seeded points inside the ranks: the n-th AdamW step (inside a training
step), the n-th outer-step exchange, the n-th file write or directory fsync of a checkpoint
(a file write leaves half of its bytes behind, as a crash would).
"""
from __future__ import annotations

import os
import random
import re
import time

import pytest
import torch

import runs
from distributed import fork_job, job_stderr, run_job, until_a_rank_ends
from hetloco_ds import checkpoint

WORLD = 2
H = 2
SEEDS = [0, 1]
# Checkpoint events per commit and rank. Every rank writes its state file and, on replica 0's
# ranks, its stage's layer files, in the background; rank 0 then (at the commit) the manifest,
# fsyncs the directory, renames it and fsyncs, writes `latest` and fsyncs (5 more).
# pipe: stage 0 holds layers 0-2, stage 1 layers 3-6. replicas: rank 0 holds all 7 layers,
# rank 1 (replica 1) writes its state file only.
CKPT_EVENTS = {"pipe": {0: 1 + 3 + 5, 1: 1 + 4}, "replicas": {0: 1 + 7 + 5, 1: 1}}


def _complete(ckpt_dir, tag) -> None:
    """`tag` is a committed checkpoint whose every file loads, as a resume reads it (tensors and plain
    data only): the manifest's word is not taken alone."""
    assert checkpoint.verify(str(ckpt_dir), tag, WORLD) is None, checkpoint.verify(str(ckpt_dir), tag, WORLD)
    for f in sorted((ckpt_dir / tag).glob("*.pt")):
        torch.load(f, map_location="cpu", weights_only=True)


def _draw(rng: random.Random, layout: str, kind: str, start: int) -> str:
    """A kill point of `kind` that this run (resuming at step `start`) will reach."""
    left = runs.STEPS - start
    rank = rng.randrange(WORLD)
    n = {"step": left, "sync": left // H, "ckpt": CKPT_EVENTS[layout][rank] * (left // H)}[kind]
    return f"{rank}:{kind}:{rng.randint(1, n)}"


@pytest.mark.parametrize("seed", SEEDS)
def test_random_kills_then_resume_reproduce_the_uninterrupted_run(tiny_jobs, tmp_path, seed, capsys, monkeypatch):
    """A chain of runs of one job, each but the last SIGKILLed at a seeded point, each resumed
    with a bare `--resume`. Even seeds: the "pipe" layout, one kill inside a checkpoint write and
    one inside a step; odd seeds: the "replicas" layout, inside a checkpoint write and inside an
    outer sync; the seed draws the order, the rank and the point. After every kill, `latest` names a complete checkpoint whose
    files all load (or none exists and --resume says so); the launcher names the dead rank and
    its signal. At the end, metrics.jsonl has one row per (step, replica) with the uninterrupted
    run's exact losses and validation losses, the export is bitwise the uninterrupted one, and
    the run's record, hf_meta and the two newest checkpoints are all there.

    Breaks if `latest` is written before every rank's files are durable, if --resume trusts an
    incomplete checkpoint, if any per-replica state is lost across a resume, if rows a killed run
    wrote past its checkpoint are kept (duplicates), or if a resume rewrites the run's record."""
    layout = ("pipe", "replicas")[seed % 2]
    inputs, reference = tiny_jobs.reference(layout)
    cache, out = inputs["cache"], tmp_path / "out"
    ckpt_dir = out / "checkpoints"
    rng = random.Random(seed)
    kinds = ["ckpt", ("step", "sync")[seed % 2]]
    rng.shuffle(kinds)
    fresh = runs.train_args(inputs, out, "--nproc", WORLD)
    resume = ["train", "--steps", runs.STEPS, "--out", out, "--resume"]
    log, start, record = [], None, None
    for kind in kinds:
        if start == runs.STEPS:
            break
        fault = _draw(rng, layout, kind, start or 0)
        argv = resume if start is not None else fresh + (["--overwrite"] if out.exists() else [])
        proc = runs.launched(tmp_path / f"run{len(log)}", *argv, cache=cache, fault=fault)
        log.append(f"from step {start or 0}: {fault} -> exit {proc.returncode}")
        rank = fault.split(":")[0]
        assert proc.returncode == 128 + 9, f"{log}\n{runs.explain(proc)}"
        assert runs.error_lines(proc.stderr) == [
            f"hetloco-ds train: error: rank {rank} (pid {_pid(proc.stderr)}) died with SIGKILL; stopped the other ranks"
        ], runs.explain(proc)
        if start is None:
            record = (out / "run_config.json").read_bytes()
        latest = checkpoint.latest_tag(str(ckpt_dir))
        if latest is None:
            # Killed before its first commit: --resume refuses in one line, before any rank starts (the
            # launching process's checks, run here by cli.main; a rank started would trip the wire);
            # the next run starts over.
            rc, err = _launcher_in_process(capsys, monkeypatch, cache, resume)
            assert rc == 2, err
            assert runs.error_lines(err) == [
                f"hetloco-ds train: error: --resume: {ckpt_dir} holds no complete checkpoint to resume from"]
            start = None
            continue
        _complete(ckpt_dir, latest)
        start = checkpoint.step_of(latest)
    # The last, uninterrupted run: its 2 ranks as torchrun starts them, forked (fast); the launcher's
    # part (a dead rank reported, the record's world size on a bare --resume) was each killed run's.
    final = resume if start is not None else runs.train_args(inputs, out, "--overwrite")
    try:
        run_job(tmp_path / "final", WORLD, final, runs.env(cache))
    except AssertionError as err:
        raise AssertionError(f"{log}\n{err}") from None
    if start is None:
        record = (out / "run_config.json").read_bytes()

    for kind in ("step", "outer", "validation"):
        got, want = runs.keyed(out, kind), runs.keyed(reference, kind)
        assert sorted(got) == sorted(want), (kind, log)
        if kind != "outer":
            assert {k: r["loss"] for k, r in got.items()} == {k: r["loss"] for k, r in want.items()}, (kind, log)
    got, want = runs.hf_tensors(out / "hf"), runs.hf_tensors(reference / "hf")
    assert got.keys() == want.keys()
    assert all(torch.equal(got[k], want[k]) for k in want), log
    assert (out / "run_config.json").read_bytes() == record
    assert checkpoint.latest_tag(str(ckpt_dir)) == f"global_step{runs.STEPS}"
    assert sorted(p.name for p in ckpt_dir.iterdir()) == ["global_step6", "global_step8", "hf_meta", "latest"], log
    _complete(ckpt_dir, "global_step6")
    _complete(ckpt_dir, "global_step8")
    print("\n".join(log))


def _launcher_in_process(capsys, monkeypatch, cache, argv) -> tuple[int, str]:
    """(exit code, stderr) of `hetloco-ds ARGV` run by `cli.main` in this process, as the launcher
    runs it, with a tripwire instead of starting ranks."""
    from hetloco_ds import cli, launch

    def tripwire(*args, **kwargs):
        raise AssertionError("a rank was started")

    with monkeypatch.context() as m:
        for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "HETLOCO_FAULT"):
            m.delenv(key, raising=False)
        m.setenv("HETLOCO_CACHE", str(cache))
        m.setattr(launch, "spawn", tripwire)
        m.setattr(launch, "spawn_groups", tripwire)
        capsys.readouterr()
        rc = cli.main([str(a) for a in argv])
        return rc, capsys.readouterr().err


def _pid(stderr: str) -> str:
    m = re.search(r"rank \d+ \(pid (\d+)\) died", stderr)
    return m.group(1) if m else "?"


def test_a_stopped_rank_ends_the_job_with_a_line_naming_it(tiny_jobs, tmp_path):
    """Rank 1 SIGSTOPped at its third step (the watchdog at 4 s): the job must end within a
    bounded time with exit 4 and one line naming rank 1 and its pid, and leave no process
    behind. Breaks if the watchdog is missing or blind to a silent rank (gloo's 30-minute
    timeout would then be all there is), or names the peer left waiting instead."""
    inputs = tiny_jobs.inputs("pipe")
    cfg = runs_config(inputs, tmp_path, {"hetloco.train.watchdog_timeout": 4})
    t0 = time.monotonic()
    proc = runs.launched(tmp_path / "launcher", "train", "--steps", runs.STEPS, "--model", inputs["hf"], "--data",
                         inputs["data"], "--config", cfg, "--out", tmp_path / "out", "--nproc", WORLD, cache=inputs["cache"],
                         fault="1:step:3:stop", timeout=180)
    elapsed = time.monotonic() - t0
    assert proc.returncode == 4, runs.explain(proc)
    lines = runs.error_lines(proc.stderr)
    assert len(lines) == 1, runs.explain(proc)
    m = re.fullmatch(r"hetloco-ds train: error: rank 1 \(pid (\d+) on \S+\) stopped responding: no heartbeat for "
                     r"\d+ s \(last: [^)]+\); ending the job", lines[0])
    assert m, lines
    with pytest.raises(ProcessLookupError):
        os.kill(int(m.group(1)), 0)
    assert elapsed < 120, elapsed


def test_all_replicas_nonfinite_stops_nonzero_and_keeps_the_last_good_checkpoint(tiny_jobs, tmp_path):
    """lr = 1e38 makes every replica's update non-finite from the second outer step on; with
    max_nonfinite_outer_steps = 2 the job must stop with exit 3 and one line, export nothing,
    and leave `latest` naming the last checkpoint taken before the streak (step 2), complete.
    Breaks if the streak is not detected (exit 0 with a stale export), if a checkpoint of the
    stuck model replaces the good one as `latest`, or if ranks disagree and one hangs."""
    inputs = tiny_jobs.inputs("replicas")
    cfg = runs_config(inputs, tmp_path, {"optimizer.params.lr": 1e38, "hetloco.train.max_nonfinite_outer_steps": 2})
    out = tmp_path / "out"
    # The 2 ranks as torchrun starts them, forked (fast): the decision and its line are the ranks'; a
    # launcher passing a rank's exit code on and stopping the others is test_a_stopped_rank's (exit 4).
    log = tmp_path / "job"
    procs = fork_job(log, WORLD, ["train", "--steps", runs.STEPS, "--model", inputs["hf"], "--data", inputs["data"],
                                  "--config", cfg, "--out", out], runs.env(inputs["cache"]))
    codes = until_a_rank_ends(procs, 180)
    stderr = job_stderr(log, WORLD)
    assert [c for c in codes if c not in (None, 0)][:1] == [3], f"exit codes {codes}\n{stderr[-4000:]}"
    ckpt_dir = out / "checkpoints"
    assert runs.error_lines(stderr) == [
        "hetloco-ds train: error: every replica's update was non-finite at 2 consecutive outer steps (steps 4, 6); "
        f"stopped without exporting; {ckpt_dir}/latest still names global_step2, the last good checkpoint"
    ], stderr[-4000:]
    assert checkpoint.latest_tag(str(ckpt_dir)) == "global_step2"
    _complete(ckpt_dir, "global_step2")
    assert not (out / "hf").exists()


def runs_config(inputs, tmp_path, edits: dict):
    from test_cli import write_config

    return write_config(tmp_path / "cfg.json", {**runs.LAYOUTS[inputs["layout"]], **edits})
