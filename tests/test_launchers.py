"""Every way of starting ranks starts the same job: our `--nproc` (tests/test_faults.py's runs, its
ranks forked; each rank its own fresh interpreter in tests/test_examples.py and tests/test_packaging.py),
the `deepspeed` launcher (`--num_gpus` here; with a hostfile, as on each node of a multi-node
job, in tests/test_examples.py), and `torchrun`.

Each runs tests/runs.py's job (2 ranks on CPU) and must reproduce the reference (conftest.tiny_jobs:
the ranks as torchrun starts them, forked) exactly: the same loss for every (step, replica) and the
same exported weights. `accelerate launch --use_deepspeed --deepspeed_config_file JOB.json` starts ranks the
way torchrun does and hands the JSON over in ACCELERATE_DEEPSPEED_CONFIG_FILE, which
`hetloco-ds train` reads when --config is absent (test_config_comes_from_accelerate, without
starting ranks).
"""
from __future__ import annotations

import json
import os
import sys

import pytest
import torch

import runs
from distributed import running
from hetloco_ds import launch
from hetloco_ds.launch import free_port


def _same_job(out, reference) -> None:
    got, want = runs.keyed(out, "step"), runs.keyed(reference, "step")
    assert {k: r["loss"] for k, r in got.items()} == {k: r["loss"] for k, r in want.items()}
    a, b = runs.hf_tensors(out / "hf"), runs.hf_tensors(reference / "hf")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _deepspeed(*launcher_args):
    return [sys.executable, "-m", "deepspeed.launcher.runner", *launcher_args, "--master_port", free_port(),
            "--module", "hetloco_ds.cli"]


@pytest.mark.parametrize("launcher", ["deepspeed", "torchrun"])
def test_launcher_starts_the_same_job(launcher, tiny_jobs, tmp_path):
    """The `deepspeed` launcher puts `--local_rank=N` before `train` (argparse once rejected it,
    exit 2); torchrun sets LOCAL_RANK only. Breaks if either is not accepted, if a rank under an
    external launcher plans, owns or defaults --out differently, or if the ranks' layout differs.
    The hostfile form each node of a multi-node job runs (`--hostfile --no_ssh --node_rank`) is
    tests/test_examples.py's run of examples/multinode/run.sh."""
    inputs, reference = tiny_jobs.reference("replicas")
    out = tmp_path / "out"
    if launcher == "deepspeed":
        cmd = _deepspeed("--num_gpus", 2)
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", 2, "--master_port", free_port(),
               "-m", "hetloco_ds.cli"]
    proc = runs.run([*cmd, *runs.train_args(inputs, out)], inputs["cache"])
    assert proc.returncode == 0, runs.explain(proc)
    _same_job(out, reference)


def test_config_comes_from_accelerate(tiny_jobs, tmp_path, monkeypatch):
    """Under `accelerate launch --use_deepspeed --deepspeed_config_file F`, F is the run's config
    when --config is absent, and a different --config is refused. Breaks if the plugin's JSON is
    ignored (the default config would silently train another job)."""
    from hetloco_ds.config import ConfigError
    from hetloco_ds.train import TrainArgs, plan_run
    from test_cli import write_config

    inputs = tiny_jobs.inputs("replicas")
    monkeypatch.setenv("HETLOCO_CACHE", str(inputs["cache"]))
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_CONFIG_FILE", str(inputs["config"]))
    args = TrainArgs(model=str(inputs["hf"]), data=str(inputs["data"]), out=str(tmp_path / "out"))
    plan = plan_run(args, 2)
    assert plan.run.source == str(inputs["config"]) and plan.run.stages == 1 and plan.replicas == 2
    other = write_config(tmp_path / "other.json")
    with pytest.raises(ConfigError, match=f"--config {other} differs from accelerate's deepspeed_config_file"):
        plan_run(TrainArgs(config=str(other), **{k: getattr(args, k) for k in ("model", "data", "out")}), 2)


REPORT_AFFINITY = ("import json, os, sys; open(os.path.join(sys.argv[1], os.environ['RANK']), 'w').write("
                   "json.dumps([sorted(os.sched_getaffinity(0)), int(os.environ['OMP_NUM_THREADS'])]))")


@pytest.mark.parametrize("bind", [False, True])
def test_nproc_ranks_share_the_launchers_cores_or_each_get_their_own(bind, tmp_path, monkeypatch):
    """`--nproc` sizes each rank's OpenMP pool from the cores the launcher may use (its affinity,
    not the machine's count: under `taskset` the latter oversubscribed them); `--bind-cores` pins
    each rank to its own disjoint share of those cores. The ranks report what they got."""
    cores = launch.usable_cores()
    if len(cores) < 2:
        pytest.skip(f"needs 2 usable cores, this process has {len(cores)}")
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 64 * len(cores))  # a machine bigger than what we may use
    rc = launch.spawn(2, [str(tmp_path)], bind_cores=bind, program=[sys.executable, "-c", REPORT_AFFINITY])
    assert rc == 0
    got = [json.loads((tmp_path / str(r)).read_text()) for r in range(2)]
    share = len(cores) // 2
    if bind:
        assert got == [[cores[:share], share], [cores[share:2 * share], share]]
    else:
        assert got == [[cores, share], [cores, share]]


def test_free_port_is_outside_the_ephemeral_range_so_no_connection_can_take_it_before_the_ranks_bind():
    import socket

    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        low, high = (int(x) for x in f.read().split()[:2])
    ports = [free_port() for _ in range(50)]
    assert all(1024 <= p < 65536 and not low <= p <= high for p in ports), (low, high, ports)
    assert len(set(ports)) > 40  # drawn, not a fixed port every job would share
    for p in ports[:5]:
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))


WRITE_PID_AND_WAIT = ("import os, sys, time; open(os.path.join(sys.argv[1], os.environ['RANK']), 'w').write(str(os.getpid())); "
                      "time.sleep(120)")


@pytest.mark.parametrize("bind", [False, True])
def test_a_launcher_killed_outright_takes_its_ranks_with_it(bind, tmp_path):
    """A launcher SIGKILLed (by a scheduler, the OOM killer, a harness killing its process group)
    cannot stop its ranks, which run in sessions of their own: each rank must die with it, within
    seconds, not train on holding its GPU (on a 4-GPU machine an 8B job's ranks went on for minutes
    and took half of every later run's GPU time). Breaks without `launch.die_with_parent`."""
    import signal
    import subprocess
    import time

    if bind and len(launch.usable_cores()) < 2:
        pytest.skip("needs 2 usable cores")
    code = ("import sys; from hetloco_ds import launch; "
            f"sys.exit(launch.spawn(2, [sys.argv[1]], bind_cores={bind}, program=[sys.executable, '-c', {WRITE_PID_AND_WAIT!r}]))")
    launcher = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)])
    try:
        deadline = time.monotonic() + 60
        while not all((tmp_path / str(r)).exists() and (tmp_path / str(r)).read_text() for r in range(2)):
            assert launcher.poll() is None and time.monotonic() < deadline, "the ranks did not start"
            time.sleep(0.05)
        pids = [int((tmp_path / str(r)).read_text()) for r in range(2)]
        assert all(running(p) for p in pids)
        launcher.send_signal(signal.SIGKILL)
        launcher.wait(10)
        deadline = time.monotonic() + 10
        while any(running(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(running(p) for p in pids), [p for p in pids if running(p)]
    finally:
        launcher.kill()
        for r in range(2):
            f = tmp_path / str(r)
            if f.exists() and f.read_text():
                try:
                    os.kill(int(f.read_text()), signal.SIGKILL)
                except ProcessLookupError:
                    pass
