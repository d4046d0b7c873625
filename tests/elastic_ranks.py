"""Processes of a real `hetloco-ds train` job, forked from a server that has imported torch,
DeepSpeed, transformers and torchft once (tests/distributed.py): each starts in a fraction of a
second instead of several on a 2-core machine.

`run`: one rank with the environment a launcher gives it (RANK, WORLD_SIZE, MASTER_ADDR/PORT),
running `hetloco_ds.cli.main(argv)`: the same code path as under torchrun. `launcher`: `python -m
hetloco_ds.cli ARGV` itself (`--nproc`, `--elastic`), whose ranks are forked in turn (from its
`Zygote`, in place of the fresh interpreter `hetloco_ds.launch.start_rank` starts) and then run the
same `python -m hetloco_ds.cli` module code; everything else (checks, supervising, stopping, the
lines it prints, exit codes) is the launcher's own. Faults come from
tests/fault_inject/sitecustomize.py, armed in-process (a forked child never imports sitecustomize
itself).
"""
from __future__ import annotations

import importlib.util
import os
import runpy
import subprocess
import sys
import time
import traceback
import warnings

FAULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fault_inject", "sitecustomize.py")
CLI = [sys.executable, "-m", "hetloco_ds.cli"]
"""The command `hetloco_ds.launch` starts a rank with: the ranks forked here."""


def _arm(spec: str) -> None:
    """HETLOCO_FAULT's grammar (<rank>:<event>:<n>[:<action>]) for this process's RANK ("launcher": none)."""
    load = importlib.util.spec_from_file_location("hetloco_fault_inject", FAULTS)
    inject = importlib.util.module_from_spec(load)
    load.loader.exec_module(inject)  # HETLOCO_FAULT is not in the environment here: arms nothing by itself
    rank, event, n, action = inject._parse(spec)
    if rank == os.environ.get("RANK", "launcher"):  # _parse keeps the rank a string
        inject._install(inject._Fault(event, n, action))


def _output_to(log: str) -> None:
    for fd, suffix in ((1, ".out"), (2, ".err")):
        opened = os.open(log + suffix, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        os.dup2(opened, fd)
        os.close(opened)


def _enter(env: dict, fault: str | None, threads: int | None) -> None:
    os.environ.clear()
    os.environ.update(env)
    if threads is not None:
        import torch

        torch.set_num_threads(threads)
    if fault:
        _arm(fault)


def _exit(code) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # no interpreter teardown: torchft's threads, gloo's sockets


def _as_main(argv: list[str]) -> int:
    """`python -m hetloco_ds.cli ARGV` in this process: the module's `__main__` block runs; its exit code."""
    sys.argv = ["hetloco_ds.cli", *argv]
    try:
        with warnings.catch_warnings():  # that hetloco_ds.cli is imported already (the preloaded server did)
            warnings.filterwarnings("ignore", "'hetloco_ds.cli' found in sys.modules", RuntimeWarning)
            runpy.run_module("hetloco_ds.cli", run_name="__main__", alter_sys=True)
    except SystemExit as end:
        return end.code if isinstance(end.code, int) else (0 if end.code is None else 1)
    except BaseException:  # noqa: BLE001 - as the interpreter would: the traceback, exit 1
        traceback.print_exc()
        return 1
    return 0


def run(argv: list[str], env: dict, log: str, fault: str | None = None) -> None:
    _output_to(log)
    _enter(env, fault, 1)
    from hetloco_ds import cli

    _exit(cli.main(list(argv)))


class ForkedRank:
    """What the launcher uses of a rank's `subprocess.Popen` (pid, poll, wait), for a forked rank."""

    def __init__(self, pid: int, args: list[str]):
        self.pid, self.args, self.returncode = pid, args, None

    def poll(self):
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)  # -N when killed by signal N, as Popen's
        return self.returncode

    def wait(self, timeout=None):
        end = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if end is not None and time.monotonic() >= end:
                raise subprocess.TimeoutExpired(self.args, timeout)
            time.sleep(0.01)
        return self.returncode


class Zygote:
    """Where the launcher's ranks are forked from: a child forked from the launcher before it does
    anything (so it holds none of what the launcher takes later: the run's lock, the lighthouse's
    threads and socket). `start_rank` is `hetloco_ds.launch.start_rank` for `python -m hetloco_ds.cli
    ...`: the zygote forks a middle process that forks the rank and exits, so the rank is reparented
    to the launcher (a child subreaper) and the launcher waits for it as for a Popen'd rank. The rank
    starts in a new session with `env`, and runs the module as `-m` runs it. Any other command, or
    one pinned to cores, is started as the library starts it."""

    def __init__(self):
        import ctypes
        from multiprocessing import Pipe

        if ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0) != 0:  # PR_SET_CHILD_SUBREAPER
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER)")
        self.conn, theirs = Pipe()
        self.pid = os.fork()
        if self.pid == 0:
            self.conn.close()
            _serve(theirs)
        theirs.close()

    def start_rank(self, cmd: list[str], env: dict, pin):
        if cmd[:len(CLI)] != CLI or pin is not None:
            return _start_rank(cmd, env, pin)
        self.conn.send((cmd[len(CLI):], env))
        return ForkedRank(self.conn.recv(), cmd)


def _serve(conn) -> None:
    """The zygote: for each (argv, env) received, a rank; its pid sent back once it is the launcher's child."""
    while True:
        try:
            argv, env = conn.recv()
        except EOFError:
            os._exit(0)
        r, w = os.pipe()
        middle = os.fork()
        if middle == 0:
            os.close(r)
            middle_pid = os.getpid()
            rank = os.fork()
            if rank == 0:
                os.close(w)
                conn.close()
                _rank(argv, env, middle_pid)
            os.write(w, str(rank).encode())
            os._exit(0)
        os.close(w)
        pid = int(os.read(r, 32))
        os.close(r)
        os.waitpid(middle, 0)  # the middle has exited: the rank is the launcher's now
        conn.send(pid)


def _rank(argv: list[str], env: dict, middle_pid: int) -> None:
    code = 1
    try:
        os.setsid()
        while os.getppid() == middle_pid:  # until the launcher (the subreaper) is this rank's parent
            time.sleep(0.001)
        from hetloco_ds import launch

        launch.die_with_parent()  # as `launch.start_rank` makes every rank
        _enter(env, env.get("HETLOCO_FAULT"), int(env.get("OMP_NUM_THREADS") or 1))
        code = _as_main(argv)
    except BaseException:  # noqa: BLE001
        traceback.print_exc()
    finally:
        _exit(code)


_start_rank = None


def launcher(argv: list[str], env: dict, log: str, cwd: str) -> None:
    """`python -m hetloco_ds.cli ARGV` run to its end in this (forked) process, in `cwd`, its ranks
    forked from a `Zygote`; its output goes to LOG.out/.err, its exit code is this process's."""
    global _start_rank
    _output_to(log)
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    from hetloco_ds import launch

    _start_rank, launch.start_rank = launch.start_rank, Zygote().start_rank
    if env.get("HETLOCO_FAULT"):
        _arm(env["HETLOCO_FAULT"])
    _exit(_as_main(list(argv)))
