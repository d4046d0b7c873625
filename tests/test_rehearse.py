"""`hetloco-ds train --link ...`: the job on shaped links, ending with measured vs planned."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

import pytest

import runs
from distributed import launch_job
from hetloco_ds import netlab

OK, WHY = netlab.available()
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LINE = re.compile(r"\[hetloco\] rehearsal \(stage 2 Mbit/s, replica 20 Mbit/s, overlapped schedule, M=2 x S=2\): "
                  r"step ([0-9.e+-]+) s measured vs ([0-9.e+-]+) s planned \(x([0-9.]+)\); compute utilisation "
                  r"(\d+)% measured vs (\d+)% planned")


def _files(tmp_path):
    cfg, model = runs.hetero_files(tmp_path, eval_batches=1, gas=4)
    return ["--config", cfg, "--model-config", model]


def _train(args, env, timeout=400):
    return subprocess.run([sys.executable, "-m", "hetloco_ds.cli", "train", *args], env=env, capture_output=True,
                          text=True, timeout=timeout, cwd=REPO)


@pytest.mark.skipif(not OK, reason=f"shaped namespaces unavailable: {WHY}")
def test_rehearsal_runs_the_job_on_shaped_links_and_compares_with_the_plan(tmp_path, tmp_path_factory):
    """2 replicas x 2 stages, replica 1 compressed, stage links at 2 Mbit/s and replica links at
    20 Mbit/s: the job trains and exports as without --link, and its last line compares the
    measured step time and utilisation with plan's; at this rate the links dominate, so the
    two agree to within 2x even on a loaded machine. Breaks if the ranks do not run in their
    namespaces, if the summary is missing, or if the plan misses the links by far."""
    env = dict(os.environ, HETLOCO_CACHE=str(tmp_path_factory.getbasetemp() / "hetloco-cache"),
               TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1")
    out = tmp_path / "out"
    before = set(netlab.harness_namespaces())
    proc = _train([*_files(tmp_path), "--nproc", "4", "--steps", "6", "--out", str(out),
                   "--link", "stage=2mbit", "--link", "replica=20mbit"], env)
    left = set(netlab.harness_namespaces()) - before
    assert proc.returncode == 0, proc.stderr[-3000:]
    last = proc.stdout.strip().splitlines()[-1]
    print(last)
    m = LINE.fullmatch(last)
    assert m, last
    measured, planned, ratio = float(m[1]), float(m[2]), float(m[3])
    assert 0.5 <= measured / planned <= 2.0 and ratio == pytest.approx(measured / planned, abs=0.03), last
    assert (out / "hf" / "config.json").exists()
    # The run's namespaces are gone (others' may exist: their creators are still alive).
    assert not [n for n in left if not netlab._pid_alive(int(n[len(netlab.PREFIX):].split("-")[0]))], left


def test_rehearsal_without_tc_fails_with_one_line_before_any_rank_starts(tmp_path):
    """With `tc` missing from PATH (or without root), --link stops at once with one line that
    names what is missing, exit 2, and nothing written. A bad --link says which one."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("ip",):
        found = shutil.which(tool)
        if found:
            os.symlink(found, bin_dir / tool)
    env = dict(os.environ, PATH=str(bin_dir))
    out = tmp_path / "out"
    # The launcher forked from the preloaded server (its checks are what runs; no rank may start).
    proc = launch_job(tmp_path / "no_tc", ["train", *_files(tmp_path), "--nproc", "4", "--out", str(out), "--link",
                                           "stage=1G"], env, REPO, timeout=120)
    assert proc.returncode == 2
    lines = [l for l in proc.stderr.splitlines() if l.strip()]
    assert len(lines) == 1, proc.stderr
    if os.geteuid() == 0:
        assert "`tc`" in lines[0] and "not found" in lines[0], lines[0]
    else:
        assert "root" in lines[0], lines[0]
    assert not out.exists()
    bad = launch_job(tmp_path / "bad", ["train", *_files(tmp_path), "--out", str(out), "--link", "stage=fast"],
                     dict(os.environ), REPO, timeout=120)
    assert bad.returncode == 2 and "stage=fast" not in bad.stdout and "fast" in bad.stderr
    assert len([l for l in bad.stderr.splitlines() if l.strip()]) == 1, bad.stderr
    assert not out.exists()


_STUBBORN = """
import os, signal, sys, time
from hetloco_ds import launch, netlab, rehearse

script = '''
import os, signal, sys, time
if os.environ["RANK"] == "0":
    time.sleep(1.0)
    sys.exit(3)
signal.signal(signal.SIGTERM, signal.SIG_IGN)
open(sys.argv[1] + os.environ["RANK"], "w").write(str(os.getpid()))
time.sleep(600)
'''
pids, tmp = sys.argv[1], sys.argv[2]
with netlab.ShapedNetwork(3, netlab.replica_coords([1, 1, 1]), None, None) as net:
    t0 = time.monotonic()
    code = rehearse._run_ranks(net, [sys.executable, "-c", script, pids], dict(os.environ), tmp)
    print(code, time.monotonic() - t0, launch.STOP_GRACE_S)
"""


@pytest.mark.skipif(not OK, reason=f"shaped namespaces unavailable: {WHY}")
def test_a_failing_rank_stops_the_others_even_those_that_ignore_sigterm(tmp_path):
    """Rank 0 exits with 3 after a second; ranks 1 and 2 ignore SIGTERM (as a rank stuck where the
    signal cannot reach its Python handler would). The rehearsal returns 3 once the grace period
    has passed and the two are SIGKILLed, and neither is left running. Breaks if the stop stays at
    SIGTERM (the rehearsal then never returns: the subprocess times out)."""
    pids = str(tmp_path / "pid")
    proc = subprocess.run([sys.executable, "-c", _STUBBORN, pids, str(tmp_path)], capture_output=True, text=True,
                          timeout=90, cwd=REPO, env=dict(os.environ, PYTHONPATH=REPO))
    assert proc.returncode == 0, proc.stderr[-3000:]
    code, elapsed, grace = proc.stdout.split()
    assert int(code) == 3
    assert float(grace) <= float(elapsed) < float(grace) + 15
    for rank in (1, 2):
        assert not netlab._pid_alive(int((tmp_path / f"pid{rank}").read_text())), rank
