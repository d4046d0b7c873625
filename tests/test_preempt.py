"""Nothing lost on preemption: real SIGTERMs to tiny 2-rank CLI jobs (tests/runs.py: H = 2, 8 steps,
a checkpoint at every outer step) and to a process running the agreement alone.

A job is held at a known step by tests/fault_inject/sitecustomize.py's `holdstep` (rank 1 waits
inside its third AdamW step while HOLD/hold exists, and writes the step its ranks agreed to stop at
to HOLD/agreed-stop), so a signal lands mid-round, between outer steps, every time.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

import runs
from distributed import fork_job, job_stderr, run_job, running, start_launcher
from hetloco_ds import checkpoint
from hetloco_ds.launch import EXIT_PREEMPTED
from test_run_ownership import _cleaned_up, _wait_for

WORLD = 2
WAIT_S = 180.0


def _held_launch(tiny_jobs, tmp_path, layout: str):
    """`train --nproc 2` of the layout's job, rank 1 held inside its step 3: (inputs, out, hold dir, launcher)."""
    inputs = tiny_jobs.inputs(layout)
    hold, out = tmp_path / "hold", tmp_path / "out"
    hold.mkdir()
    (hold / "hold").touch()
    proc = start_launcher(tmp_path / "launcher", runs.train_args(inputs, out, "--nproc", WORLD),
                          runs.env(inputs["cache"], fault=f"1:holdstep:3:{hold}"), runs.REPO)
    _wait_for(hold / "held", proc)
    return inputs, out, hold, proc


def _agreed(hold: Path, proc) -> int:
    _wait_for(hold / "agreed-stop", proc)
    return int((hold / "agreed-stop").read_text())


def _heartbeats(out: Path) -> list[dict]:
    beats = sorted((out / ".hetloco" / "heartbeat").rglob("rank*.json"))
    assert len(beats) == WORLD, beats
    return [json.loads(b.read_text()) for b in beats]


def _rank_pids(out: Path) -> list[int]:
    return [beat["pid"] for beat in _heartbeats(out)]


def _lines(err: str) -> list[str]:
    return runs.error_lines(err, "hetloco-ds train:")


def _complete(ckpt_dir: Path, tag: str) -> None:
    assert checkpoint.verify(str(ckpt_dir), tag, WORLD) is None, checkpoint.verify(str(ckpt_dir), tag, WORLD)


def _released_and_saved(hold: Path, proc, out: Path, step: int) -> None:
    """Once the ranks agreed on `step`, rank 1 goes on: the job must commit that step, exit 75 and say so."""
    assert _agreed(hold, proc) == step
    (hold / "hold").unlink()
    _, err = proc.communicate(timeout=WAIT_S)
    assert proc.returncode == EXIT_PREEMPTED, err[-3000:]
    ckpt_dir, tag = out / "checkpoints", f"global_step{step}"
    assert _lines(err) == [f"hetloco-ds train: stopped by SIGTERM at step {step}; checkpoint {tag} is committed in "
                           f"{ckpt_dir}: --resume continues from it"], err[-3000:]
    assert checkpoint.latest_tag(str(ckpt_dir)) == tag
    _complete(ckpt_dir, tag)


def test_sigterm_to_the_launcher_mid_round_saves_and_the_resume_reproduces_the_uninterrupted_run(tiny_jobs, tmp_path):
    """SIGTERM to the `--nproc` launcher while the job is inside step 3 (H = 2: between outer steps,
    each replica's weights its own): the ranks agree on step 3, commit global_step3 and the launcher
    exits 75 with one line; `--resume` then ends with every loss and the exported weights bitwise
    the uninterrupted run's. Breaks if a signal still saves nothing (exit 143, latest global_step2),
    if the ranks save at different steps or past the one agreed, or if the mid-round checkpoint
    misses state a resume needs."""
    _, reference = tiny_jobs.reference("pipe")
    inputs, out, hold, proc = _held_launch(tiny_jobs, tmp_path, "pipe")
    with _cleaned_up(proc, []):
        proc.send_signal(signal.SIGTERM)
        _released_and_saved(hold, proc, out, 3)

    run_job(tmp_path / "resumed", WORLD, ["train", "--steps", runs.STEPS, "--out", out, "--resume"],
            runs.env(inputs["cache"]))
    for kind in ("step", "outer", "validation"):
        got, want = runs.keyed(out, kind), runs.keyed(reference, kind)
        assert sorted(got) == sorted(want), kind
        if kind != "outer":
            assert {k: r["loss"] for k, r in got.items()} == {k: r["loss"] for k, r in want.items()}, kind
    got, want = runs.hf_tensors(out / "hf"), runs.hf_tensors(reference / "hf")
    assert got.keys() == want.keys()
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_sigterm_to_one_rank_of_one_replica_stops_every_replica_at_one_step(tiny_jobs, tmp_path):
    """Two replicas of one stage: rank 1 (replica 1) is held inside step 3 while rank 0 (replica 0)
    runs on to the outer step at 4 and waits there; SIGTERM reaches rank 0 alone. Rank 1 learns of
    it through the job's store, both agree on step 4 (the furthest a rank had started), commit it,
    and the job exits 75 with one line. Breaks if a signal to one rank stops only that rank (its
    peer would be left in the outer step: a lost-rank failure), or if the ranks choose different
    steps."""
    _, out, hold, proc = _held_launch(tiny_jobs, tmp_path, "replicas")
    pids = _rank_pids(out)
    with _cleaned_up(proc, pids):
        deadline = time.monotonic() + WAIT_S
        while _heartbeats(out)[0]["where"] != "finished step 3":  # then inside step 4, waiting for replica 1
            assert time.monotonic() < deadline, _heartbeats(out)[0]
            time.sleep(0.1)
        os.kill(pids[0], signal.SIGTERM)
        _released_and_saved(hold, proc, out, 4)


def test_a_second_signal_to_the_launcher_stops_at_once_without_committing(tiny_jobs, tmp_path):
    """While the ranks would save (rank 1 still held inside step 3), a second SIGTERM to the launcher
    ends the job at once: exit 143 and the launcher's line, no process left, no checkpoint of step 3
    committed. Breaks if the second signal waits out the grace period or leaves a rank running, or
    if a cut-short save were committed."""
    _, out, hold, proc = _held_launch(tiny_jobs, tmp_path, "pipe")
    pids = _rank_pids(out)
    with _cleaned_up(proc, pids):
        proc.send_signal(signal.SIGTERM)
        assert _agreed(hold, proc) == 3
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=WAIT_S)
        elapsed = time.monotonic() - t0
        assert [p for p in pids if running(p)] == []
    assert proc.returncode == 128 + signal.SIGTERM, err[-3000:]
    assert runs.error_lines(err) == ["hetloco-ds train: error: stopped by SIGTERM; its 2 ranks were stopped first"], \
        err[-3000:]
    assert elapsed < 5.0, elapsed
    # Step 2's save was still being written in the background (committed at the next outer step);
    # step 3's was never committed.
    assert not (out / "checkpoints" / "global_step3").exists()
    assert checkpoint.latest_tag(str(out / "checkpoints")) in (None, "global_step2")


def test_checkpoint_every_s_saves_at_agreed_outer_boundaries_without_changing_training(tiny_jobs, tmp_path):
    """checkpoint_interval 0 (no step-count saves) and checkpoint_every_s a fraction of a second:
    rank 0's clock opens a save round while replica 1 is held inside step 3 (so the round is
    agreed before the run could end), every rank saves at the outer boundary agreed on, so a
    checkpoint is committed before the last step, at a multiple of H; every loss is the
    uninterrupted run's. Breaks if the time-interval saves never happen, if ranks save at different
    steps (the commit would fail or hang), or if a save disturbs training."""
    from test_cli import write_config

    _, reference = tiny_jobs.reference("replicas")
    inputs = tiny_jobs.inputs("replicas")
    cfg = write_config(tmp_path / "cfg.json", {**runs.LAYOUTS["replicas"], "hetloco.train.checkpoint_interval": 0,
                                               "hetloco.train.checkpoint_every_s": 0.05})
    hold, out, log = tmp_path / "hold", tmp_path / "out", tmp_path / "job"
    hold.mkdir()
    (hold / "hold").touch()
    procs = fork_job(log, WORLD, runs.train_args({**inputs, "config": cfg}, out), runs.env(inputs["cache"]),
                     fault=f"1:holdstep:3:{hold}")
    try:
        deadline = time.monotonic() + WAIT_S
        while not (hold / "agreed-save0").exists():
            assert time.monotonic() < deadline and all(p.exitcode is None for p in procs), job_stderr(log, WORLD)[-3000:]
            time.sleep(0.05)
        (hold / "hold").unlink()
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
    assert [p.exitcode for p in procs] == [0] * WORLD, job_stderr(log, WORLD)[-3000:]
    saved = sorted(r["step"] for r in runs.rows(out) if r["kind"] == "checkpoint")
    early = [s for s in saved if s < runs.STEPS]
    assert early and int((hold / "agreed-save0").read_text()) in early, saved
    assert all(s % 2 == 0 for s in early), saved
    for kind in ("step", "validation"):
        got, want = runs.keyed(out, kind), runs.keyed(reference, kind)
        assert {k: r["loss"] for k, r in got.items()} == {k: r["loss"] for k, r in want.items()}, kind


# One rank's agreement alone (a world of 1, torch's in-process store): a loop of "steps" that, once a
# stop is due, stands still as a save that never ends would.
_AGREEMENT = """
import sys, time
from torch.distributed import HashStore
from hetloco_ds.preempt import Preemption
p = Preemption(HashStore(), "t/", 0, 1, grace_s=float(sys.argv[1]), every_s=0, boundary=2, steps=10**9).install()
p.begin(0)
step = 0
print("ready", flush=True)
while True:
    due = p.between_steps(step)
    if due is not None:
        print("due", step, due.stop, flush=True)
        time.sleep(600)
    time.sleep(0.01)
    step += 1
"""


def _agreement(grace_s: float) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", _AGREEMENT, str(grace_s)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=runs.env(Path("/nonexistent")), cwd=runs.REPO)
    assert proc.stdout.readline() == "ready\n", proc.communicate()[1]
    return proc


def test_a_rank_ignores_a_repeat_within_the_window_and_stops_at_once_on_a_later_signal():
    """SIGTERM, then SIGINT right after (the same request by another path: a terminal's Ctrl-C
    reaching deepspeed's launcher and its ranks): the stop becomes due and the process keeps saving;
    a SIGTERM later than REPEAT_WINDOW_S ends it at once with 143. Breaks if a duplicate aborts the
    save, or if a real second signal has to wait out the grace period."""
    from hetloco_ds.preempt import REPEAT_WINDOW_S

    proc = _agreement(60.0)
    try:
        # The repeat goes after the stop is seen: sent together, both would be pending at once and the
        # kernel hands over the lower-numbered SIGINT first (CI saw that), so which one is "first" would
        # be the kernel's choice, not the test's.
        first = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        due = proc.stdout.readline().split()
        assert due[0] == "due" and due[2] == str(int(signal.SIGTERM)), due
        proc.send_signal(signal.SIGINT)
        assert time.monotonic() - first < REPEAT_WINDOW_S / 2  # the repeat really is within the window
        time.sleep(REPEAT_WINDOW_S + 0.3)
        assert proc.poll() is None
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=10)
        assert time.monotonic() - t0 < 5.0  # at once: the grace period here is 60 s
        assert proc.returncode == 128 + signal.SIGTERM
    finally:
        proc.kill()
        proc.communicate()


def test_a_save_that_cannot_commit_within_the_grace_period_exits_without_it():
    """A stop whose save never finishes (the process stands still once the stop is due, as a rank
    stuck in a collective would): past preempt_grace_s the process ends itself with 143 and one line
    saying nothing was committed. Breaks if the grace period is not enforced off the main thread
    (the process would hang until the scheduler's SIGKILL) or if it claimed a save it did not make."""
    proc = _agreement(1.0)
    try:
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
        elapsed = time.monotonic() - t0
        out, err = proc.communicate()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert 1.0 <= elapsed < 5.0, elapsed
    step = out.split()[1]
    assert runs.error_lines(err) == [
        f"hetloco-ds train: error: stopped by SIGTERM without saving: the ranks committed no checkpoint at the agreed "
        f"step {step} within train.preempt_grace_s = 1 s; --resume continues from the newest complete checkpoint"], err
