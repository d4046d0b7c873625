"""`--nproc N`: run N local ranks of a command, for single-machine use without a launcher.

Each rank is a fresh `python -m hetloco_ds.cli ...` process with the environment the
`deepspeed` launcher and `torchrun` would give it. If any rank fails, the others are
stopped, so a crash never leaves peers waiting in a collective forever.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def under_launcher() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def spawn(nproc: int, argv: list[str], env: dict | None = None) -> int:
    """Run `python -m hetloco_ds.cli *argv` as `nproc` ranks; returns the first failing exit code."""
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
    code = 0
    try:
        while procs:
            for p in list(procs):
                rc = p.poll()
                if rc is None:
                    continue
                procs.remove(p)
                if rc != 0 and code == 0:
                    code = rc
                    for other in procs:
                        other.send_signal(signal.SIGTERM)
            time.sleep(0.1)
    except KeyboardInterrupt:
        for p in procs:
            p.send_signal(signal.SIGTERM)
        code = 130
    finally:
        for p in procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
    return code
