"""`--nproc N`: run N local ranks of a command, for single-machine use without a launcher.

Each rank is a fresh `python -m hetloco_ds.cli ...` process with the environment the
`deepspeed` launcher and `torchrun` would give it. When a rank fails, the others are stopped
at once (a stopped, SIGSTOPped one included), so a crash never leaves peers waiting in a
collective; a rank that died by a signal is named in one line, since it could not say so itself.
SIGTERM, SIGHUP or SIGINT to the launcher stops its ranks the same way before it lets go of the
run directory (each rank is its own process group, so the signal reaches whatever it started,
and a Ctrl-C in the terminal reaches only the launcher, which stops the ranks in order).
`spawn_groups` runs several such jobs side by side (`--elastic`: one per replica), where a
failure stops only its own job.
"""
from __future__ import annotations

import contextlib
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time

STOP_GRACE_S = 5.0
STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)


def free_port() -> int:
    """A local port free now, for MASTER_PORT, outside the kernel's ephemeral range: the ranks bind it
    seconds later, and a port from that range (what binding port 0 returns) can be taken meanwhile as
    the source port of any process's outgoing connection, e.g. another job's starting beside it
    (`spawn_groups`), which then fails with EADDRINUSE."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = (int(x) for x in f.read().split()[:2])
    except (OSError, ValueError):
        low, high = 32768, 60999
    spans = [(a, b) for a, b in ((max(1024, low // 2), low), (high + 1, 65536)) if b - a >= 64]
    if not spans:  # the whole port space is ephemeral: nothing to avoid
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]
    rng = random.Random()  # its own: jobs seeded alike must not pick alike
    for _ in range(200):
        port = rng.randrange(*rng.choice(spans))
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port found outside the ephemeral range {low}-{high}")


def under_launcher() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def signal_group(p: subprocess.Popen, sig: int) -> None:
    """`sig` to `p`'s process group (a rank started as its own group's leader), if it still exists."""
    try:
        os.killpg(p.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


@contextlib.contextmanager
def stop_requests():
    """While the launcher waits on its ranks: STOP_SIGNALS recorded instead of ending the launcher,
    which would leave the ranks training in a directory no longer locked. Yields a list that holds
    the first such signal once one came; the waiting loop polls it, so the stop itself is never
    interrupted by a second signal."""
    came: list[int] = []
    if threading.current_thread() is not threading.main_thread():  # handlers belong to the main thread
        yield came
        return

    def note(signum, _frame):
        if not came:
            came.append(signum)

    before = {sig: signal.signal(sig, note) for sig in STOP_SIGNALS}
    try:
        yield came
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)


def stop_ranks(procs: list[subprocess.Popen], send=signal_group) -> None:
    """SIGTERM (with SIGCONT, so a stopped process receives it), then SIGKILL after a grace period,
    each signal delivered by `send(proc, sig)` (by default to the rank's process group: what the
    rank started, a compile worker or a data loader, stops with it)."""
    for p in procs:
        if p.poll() is None:
            send(p, signal.SIGTERM)
            send(p, signal.SIGCONT)
    deadline = time.monotonic() + STOP_GRACE_S
    for p in procs:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            send(p, signal.SIGKILL)
            p.wait()


def usable_cores() -> list[int]:
    """The cores this process may run on (its affinity, e.g. under taskset or a container's cpuset),
    not the machine's count: ranks sized from the latter oversubscribe a restricted launcher."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def threads_per_rank(total: int) -> int:
    """OMP_NUM_THREADS of each of `total` local ranks: the usable cores shared out, at least 1."""
    return max(1, len(usable_cores()) // total)


def core_shares(total: int) -> list[list[int]]:
    """The usable cores cut into `total` disjoint contiguous shares, one per rank (the remainder
    unused): `--bind-cores`, as DeepSpeed's launcher --bind_cores_to_rank. Raises ValueError when
    there are fewer cores than ranks."""
    cores = usable_cores()
    share = len(cores) // total
    if share < 1:
        raise ValueError(f"--bind-cores: {len(cores)} usable cores cannot give each of {total} local ranks its own")
    return [cores[r * share:(r + 1) * share] for r in range(total)]


def _start(nproc: int, argv: list[str], env: dict | None, threads: int,
           cores: list[list[int]] | None = None, program: list[str] | None = None) -> list[subprocess.Popen]:
    """`nproc` ranks of `program *argv` (`python -m hetloco_ds.cli` by default), one job (its own
    MASTER_PORT); `cores[r]`: the cores rank r is pinned to (None: not pinned)."""
    port = free_port()
    procs = []
    base = dict(os.environ if env is None else env)
    program = program or [sys.executable, "-m", "hetloco_ds.cli"]
    for rank in range(nproc):
        rank_env = dict(base)
        rank_env.update(
            RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(nproc),
            MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
        )
        rank_env.setdefault("OMP_NUM_THREADS", str(len(cores[rank]) if cores else threads))
        if rank != 0:
            rank_env["HETLOCO_QUIET"] = "1"
        pin = (lambda mine=cores[rank]: os.sched_setaffinity(0, mine)) if cores else None
        procs.append(start_rank([*program, *argv], rank_env, pin))
    return procs


def die_with_parent() -> None:
    """In a child before it runs its program: SIGKILL it when the process that started it dies
    (Linux's PR_SET_PDEATHSIG; elsewhere nothing). A rank has a session of its own, so a launcher
    killed outright (SIGKILL, the OOM killer, a scheduler killing the launcher's process group)
    reaches no rank through signals; without this its ranks would go on holding their GPUs. Linux
    signals the death of the *thread* that started the child: start ranks from the main thread."""
    if sys.platform.startswith("linux"):
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(1, int(signal.SIGKILL), 0, 0, 0) != 0:  # 1 = PR_SET_PDEATHSIG
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG)")
        if os.getppid() == 1:  # the parent died before the prctl: no signal would ever come
            os._exit(128 + int(signal.SIGKILL))


def start_rank(cmd: list[str], env: dict, pin) -> subprocess.Popen:
    """One rank: `cmd` in a process of its own, in a new session (its own process group), with `env`,
    killed when the launcher dies (`die_with_parent`); `pin()` (or None) runs in the child before
    `cmd` starts. The one place a rank process is made: tests/elastic_ranks.py replaces it in a
    forked launcher to fork ranks from already-imported modules."""
    def prepare() -> None:
        die_with_parent()
        if pin is not None:
            pin()

    return subprocess.Popen(cmd, env=env, preexec_fn=prepare, start_new_session=True)


def supervise(procs: list[subprocess.Popen], send=signal_group) -> tuple[int | None, int]:
    """Wait for one job's ranks until all have exited 0, one fails or the launcher is asked to stop
    (STOP_SIGNALS); then stop the rest (`stop_ranks`, signals delivered by `send`). Returns (the
    first failing rank, its return code), (None, 0) when all succeeded, or (None, 128 + N) when
    stopped by signal N."""
    running = set(range(len(procs)))
    first: tuple[int | None, int] = (None, 0)
    with stop_requests() as came:
        while running and first[0] is None and not came:
            for rank in sorted(running):
                rc = procs[rank].poll()
                if rc is None:
                    continue
                running.discard(rank)
                if rc != 0:
                    first = (rank, rc)
                    break
            time.sleep(0.05)
        stop_ranks(procs, send)
    return (None, 128 + came[0]) if came and first[0] is None else first


def _stopped_by(rc: int, ranks: int) -> str:
    return f"stopped by {signal.Signals(rc - 128).name}; its {ranks} ranks were stopped first"


def _died(rank: int, proc: subprocess.Popen, rc: int) -> str:
    return f"rank {rank} (pid {proc.pid}) died with {signal.Signals(-rc).name}"


def spawn(nproc: int, argv: list[str], env: dict | None = None, name: str = "hetloco-ds train",
          bind_cores: bool = False, program: list[str] | None = None) -> int:
    """Run `python -m hetloco_ds.cli *argv` (or `program *argv`) as `nproc` ranks, each pinned to its
    own share of the cores with `bind_cores` (`core_shares`); returns the first failing rank's exit
    code (128 + N for a rank killed by signal N), or 0."""
    procs = _start(nproc, argv, env, threads_per_rank(nproc), core_shares(nproc) if bind_cores else None, program)
    rank, rc = supervise(procs)
    if rank is None:
        if rc:
            print(f"{name}: error: {_stopped_by(rc, nproc)}", file=sys.stderr, flush=True)
        return rc
    if rc < 0:
        print(f"{name}: error: {_died(rank, procs[rank], rc)}; stopped the other ranks", file=sys.stderr,
              flush=True)
        return 128 - rc
    return rc


def spawn_groups(groups: dict, tick=None, ended=None, bind_cores: bool = False) -> dict:
    """Several independent jobs at once (an elastic fleet's replicas): `groups` maps a name to
    (nproc, argv, env) as `spawn` takes them. A job whose rank fails is stopped alone, and
    `ended(name, line)` is told (line: what failed, or None when the job finished); the others go
    on. `tick(running names)` is called while they run; `bind_cores`: as `spawn`'s, over every rank of
    every job. Returns {name: exit code} (128 + N for a rank killed by signal N)."""
    total = sum(n for n, _, _ in groups.values())
    shares = iter(core_shares(total)) if bind_cores else None
    procs = {g: _start(n, argv, env, threads_per_rank(total), [next(shares) for _ in range(n)] if shares else None)
             for g, (n, argv, env) in groups.items()}
    codes: dict = {}
    with stop_requests() as came:
        while len(codes) < len(procs) and not came:
            for g, ranks in procs.items():
                if g in codes:
                    continue
                polled = [p.poll() for p in ranks]
                bad = [(r, rc) for r, rc in enumerate(polled) if rc not in (None, 0)]
                if bad:
                    rank, rc = bad[0]
                    stop_ranks(ranks)
                    codes[g] = 128 - rc if rc < 0 else rc
                    what = _died(rank, ranks[rank], rc) if rc < 0 else f"rank {rank} exited with code {rc}"
                    if ended is not None:
                        ended(g, f"{what}; stopped its other ranks")
                elif all(rc == 0 for rc in polled):
                    codes[g] = 0
                    if ended is not None:
                        ended(g, None)
            if tick is not None:
                tick({g for g in procs if g not in codes})
            time.sleep(0.05)
        for g, ranks in procs.items():
            if g not in codes:
                stop_ranks(ranks)
                codes[g] = 128 + came[0]
    return codes
