"""`--nproc N`: run N local ranks of a command, for single-machine use without a launcher.

Each rank is a fresh `python -m hetloco_ds.cli ...` process with the environment the
`deepspeed` launcher and `torchrun` would give it. When a rank fails, the others are stopped
at once (a stopped, SIGSTOPped one included), so a crash never leaves peers waiting in a
collective; a rank that died by a signal is named in one line, since it could not say so itself.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

STOP_GRACE_S = 5.0


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def under_launcher() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def _stop(procs: list[subprocess.Popen]) -> None:
    """SIGTERM (with SIGCONT, so a stopped process receives it), then SIGKILL after a grace period."""
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
            p.send_signal(signal.SIGCONT)
    deadline = time.monotonic() + STOP_GRACE_S
    for p in procs:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def spawn(nproc: int, argv: list[str], env: dict | None = None, name: str = "hetloco-ds train") -> int:
    """Run `python -m hetloco_ds.cli *argv` as `nproc` ranks; returns the first failing rank's exit
    code (128 + N for a rank killed by signal N), or 0."""
    port = free_port()
    procs = []
    base = dict(os.environ if env is None else env)
    threads = max(1, (os.cpu_count() or 1) // nproc)
    for rank in range(nproc):
        rank_env = dict(base)
        rank_env.update(
            RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(nproc),
            MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
        )
        rank_env.setdefault("OMP_NUM_THREADS", str(threads))
        if rank != 0:
            rank_env["HETLOCO_QUIET"] = "1"
        procs.append(subprocess.Popen([sys.executable, "-m", "hetloco_ds.cli", *argv], env=rank_env))
    first: tuple[int, int] | None = None
    try:
        running = set(range(nproc))
        while running and first is None:
            for rank in sorted(running):
                rc = procs[rank].poll()
                if rc is None:
                    continue
                running.discard(rank)
                if rc != 0:
                    first = (rank, rc)
                    break
            time.sleep(0.05)
    except KeyboardInterrupt:
        _stop(procs)
        return 130
    _stop(procs)
    if first is None:
        return 0
    rank, rc = first
    if rc < 0:
        sig = signal.Signals(-rc).name
        print(f"{name}: error: rank {rank} (pid {procs[rank].pid}) died with {sig}; stopped the other ranks",
              file=sys.stderr, flush=True)
        return 128 - rc
    return rc
