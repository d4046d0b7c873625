"""Nothing lost when two launches meet in one --out, or when the `--nproc` launcher is told to stop.

Real launchers (`python -m hetloco_ds.cli train --nproc 2`, on test_cli.py's tiny job forked with
their ranks from an already-imported server: tests/distributed.start_launcher); the faults are
real: a second launch held by tests/fault_inject between its checks and taking --out, and real
signals to the launcher's pid.
"""
from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import runs
from distributed import running, start_launcher
from test_cli import save_tiny_hf_with_tokenizer, write_config, write_text_folder

WAIT_S = 180.0


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    root = tmp_path_factory.mktemp("ownership")
    cfg = write_config(root / "cfg.json", {"hetloco.sparseloco.inner_steps": 2, "hetloco.train.checkpoint_interval": 1,
                                           "hetloco.train.keep_checkpoints": 2, "hetloco.train.watchdog_timeout": 60})
    return {"hf": save_tiny_hf_with_tokenizer(root / "hf"), "data": write_text_folder(root / "data"), "config": cfg,
            "cache": root / "cache"}


def _launch(job, out, steps: int, fault: str | None = None):
    """`hetloco-ds train --nproc 2 ...` started, forked (distributed.start_launcher): a Popen-like handle."""
    argv = ["train", "--nproc", "2", "--steps", steps, "--model", job["hf"], "--data", job["data"], "--config",
            job["config"], "--out", out]
    return start_launcher(f"{out}.launcher", argv, runs.env(job["cache"], fault), runs.REPO)


def _wait_for(path: Path, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + WAIT_S
    while not path.exists():
        assert proc.poll() is None, f"exited {proc.returncode} before {path} appeared:\n{proc.communicate()[1][-3000:]}"
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.1)


def _files(out: Path) -> dict:
    """Every file of the run (the lock and heartbeats aside) with its bytes."""
    return {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("*"))
            if p.is_file() and p.relative_to(out).parts[0] != ".hetloco"}


def test_a_launch_checked_before_another_run_took_out_is_refused_after_it(job, tmp_path):
    """B passes every check on an empty --out, then A runs to completion in it before B takes the
    lock (B's corpus took long to read). B must be refused with one line and leave A's files byte
    for byte; before the re-check under the lock B trained into A's directory, exiting 0."""
    out, hold = tmp_path / "cc", tmp_path / "hold"
    hold.mkdir()
    (hold / "hold").touch()
    late = _launch(job, out, 2, fault=f"launcher:own:1:{hold}")
    try:
        _wait_for(hold / "checked", late)
        first = runs.launched(tmp_path / "first", "train", "--nproc", 2, "--steps", 0, "--model", job["hf"], "--data",
                              job["data"], "--config", job["config"], "--out", out, cache=job["cache"])
        assert first.returncode == 0, runs.explain(first)
        before = _files(out)
        assert {"run_config.json", "metrics.jsonl", "checkpoints/latest"} <= set(before)
        (hold / "hold").unlink()
        _, err = late.communicate(timeout=WAIT_S)
    finally:
        if late.poll() is None:
            late.kill()
            late.communicate()
    assert late.returncode == 2, err
    assert runs.error_lines(err) == [
        f"hetloco-ds train: error: --out {out} already holds a run (run_config.json, metrics.jsonl, checkpoints, hf); "
        "pass --resume to continue it or --overwrite to replace it"], err
    assert _files(out) == before


# A rank that starts a child of its own (as a data loader or a compile worker would), then writes
# a line every 20 ms until it is stopped.
RANK = """
import os, subprocess, sys, time
d = sys.argv[1]
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
with open(os.path.join(d, "pids-" + os.environ["RANK"]), "w") as f:
    f.write(f"{os.getpid()} {child.pid}")
with open(os.path.join(d, "log-" + os.environ["RANK"]), "a") as log:
    while True:
        print("x" * 64, file=log)
        log.flush()
        time.sleep(0.02)
"""
LAUNCHER = """
import sys
from hetloco_ds import launch
sys.exit(launch.spawn(2, [sys.argv[1]], program=[sys.executable, "-c", sys.argv[2]]))
"""


@contextlib.contextmanager
def _cleaned_up(proc: subprocess.Popen, pids: list[int]):
    """Whatever the test finds, nothing it started outlives it."""
    try:
        yield
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
        for pid in pids:
            if running(pid):
                os.kill(pid, signal.SIGKILL)


def _stop(proc: subprocess.Popen, sig: int, pids: list[int]) -> str:
    """Send `sig` to the launcher; once it has exited, none of `pids` may run, and it must have said
    why in one line and exited 128 + sig. Returns its stderr."""
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=60)
    assert [p for p in pids if running(p)] == [], "a process of a rank outlived the launcher"
    assert proc.returncode == 128 + sig, err
    assert runs.error_lines(err) == [f"hetloco-ds train: error: stopped by {signal.Signals(sig).name}; its 2 ranks "
                                     "were stopped first"], err
    assert "Traceback" not in err
    return err


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP, signal.SIGINT], ids=lambda s: s.name)
def test_a_signal_to_the_launcher_stops_every_process_of_its_ranks_first(tmp_path, sig):
    """Each signal a user or a scheduler sends a launcher (kill, a closed terminal, Ctrl-C through
    `kill -INT`) reaches every rank and what each rank started (its process group) before the
    launcher exits 128 + N with one line: once the launcher died alone and the ranks went on."""
    proc = subprocess.Popen([sys.executable, "-c", LAUNCHER, str(tmp_path), RANK], stderr=subprocess.PIPE, text=True,
                            env=runs.env(tmp_path / "cache"))
    pids: list[int] = []
    with _cleaned_up(proc, pids):
        for r in range(2):
            _wait_for(tmp_path / f"pids-{r}", proc)
            while not (tmp_path / f"pids-{r}").read_text():
                time.sleep(0.02)
            pids += [int(p) for p in (tmp_path / f"pids-{r}").read_text().split()]
        _stop(proc, sig, pids)
        sizes = [(tmp_path / f"log-{r}").stat().st_size for r in range(2)]
        time.sleep(0.3)
        assert [(tmp_path / f"log-{r}").stat().st_size for r in range(2)] == sizes


def test_sigterm_to_a_training_launcher_leaves_a_complete_run_and_a_free_out(job, tmp_path):
    """A training job told to stop: its ranks save where they are (exit 75, one line naming the
    checkpoint), and when its launcher has exited no rank is left, nothing writes to --out any more,
    its lock is free and the checkpoint the line names is the newest complete one (a --resume can go
    on from it)."""
    import re

    from hetloco_ds import checkpoint, rundir
    from hetloco_ds.launch import EXIT_PREEMPTED

    out = tmp_path / "run"
    proc = _launch(job, out, 10_000)
    pids: list[int] = []
    with _cleaned_up(proc, pids):
        _wait_for(out / "checkpoints" / "latest", proc)
        for beat in sorted((out / ".hetloco" / "heartbeat").rglob("rank*.json")):
            pids.append(json.loads(beat.read_text())["pid"])
        assert len(pids) == 2
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
        assert [p for p in pids if running(p)] == [], "a process of a rank outlived the launcher"
        assert proc.returncode == EXIT_PREEMPTED, err
        lines = runs.error_lines(err, "hetloco-ds train:")
        saved = re.fullmatch(r"hetloco-ds train: stopped by SIGTERM at step \d+; checkpoint (global_step\d+) is committed "
                             rf"in {re.escape(str(out / 'checkpoints'))}: --resume continues from it", lines[-1])
        assert len(lines) == 1 and saved, err
        size = (out / "metrics.jsonl").stat().st_size
        rundir.RunLock(str(out)).release()  # free: no process holds it
        time.sleep(1.0)
        assert (out / "metrics.jsonl").stat().st_size == size
        for line in (out / "metrics.jsonl").read_text().splitlines():
            json.loads(line)
        assert checkpoint.pick(str(out / "checkpoints"), 2).tag == saved.group(1)
