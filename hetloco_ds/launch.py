"""`--nproc N`: run N local ranks of a command, for single-machine use without a launcher.

Each rank is a fresh `python -m hetloco_ds.cli ...` process with the environment the
`deepspeed` launcher and `torchrun` would give it. When a rank fails, the others are stopped
at once (a stopped, SIGSTOPped one included), so a crash never leaves peers waiting in a
collective; a rank that died by a signal is named in one line, since it could not say so itself.
SIGTERM, SIGHUP or SIGINT to the launcher is passed on to its ranks as SIGTERM (each rank is its
own process group, so the signal reaches whatever it started, and a Ctrl-C in the terminal
reaches only the launcher); training ranks then save a checkpoint (hetloco_ds/preempt.py), and
the launcher waits for them up to its grace period, or until a second signal, before SIGKILL, and
only then lets go of the run directory.
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
EXIT_PREEMPTED = 75
"""A job told to stop that committed a checkpoint first: `--resume` continues it. sysexits.h's
EX_TEMPFAIL ("try again later"), so a scheduler's retry policy can match it, and apart from the
small codes a run's own outcomes use and the 128 + N of a process ended by signal N."""


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
    which would leave the ranks training in a directory no longer locked. Yields a list of the
    signals that came, in order; the waiting loop polls it, so the stop itself is never interrupted
    by a second signal: it only hurries it."""
    came: list[int] = []
    if threading.current_thread() is not threading.main_thread():  # handlers belong to the main thread
        yield came
        return

    def note(signum, _frame):
        came.append(signum)  # the first is the stop; a later one hurries it (`stop_ranks`)

    before = {sig: signal.signal(sig, note) for sig in STOP_SIGNALS}
    try:
        yield came
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)


def stop_ranks(procs: list, send=signal_group, grace_s: float = STOP_GRACE_S, hurry=None, term: bool = True) -> None:
    """SIGTERM (with SIGCONT, so a stopped process receives it; none when `term` is False: the ranks
    are stopping by themselves), then SIGKILL to whichever still runs after `grace_s` or as soon as
    `hurry()` is true (a second signal to the launcher), each signal delivered by `send(proc, sig)`
    (by default to the rank's process group: what the rank started, a compile worker or a data
    loader, stops with it)."""
    for p in procs:
        if term and p.poll() is None:
            send(p, signal.SIGTERM)
            send(p, signal.SIGCONT)
    deadline = time.monotonic() + grace_s
    while any(p.poll() is None for p in procs) and time.monotonic() < deadline and not (hurry and hurry()):
        time.sleep(0.05)
    for p in procs:
        if p.poll() is None:
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


def supervise(procs: list[subprocess.Popen], send=signal_group, grace_s: float = STOP_GRACE_S,
              failed_grace_s: float = STOP_GRACE_S) -> tuple[int | None, int]:
    """Wait for one job's ranks until all have exited 0, one fails or the launcher is asked to stop
    (STOP_SIGNALS); then stop the rest (`stop_ranks`, signals delivered by `send`): after a signal,
    or a rank that stopped with EXIT_PREEMPTED (it was signalled and its peers are saving with it),
    within `grace_s` (a second signal: at once); after a failure within `failed_grace_s`. Returns
    (the first failing rank, its return code), (None, 0) when all succeeded, (None, EXIT_PREEMPTED)
    when stopped by a signal and every rank exited EXIT_PREEMPTED, else (None, 128 + N) when
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
        asked = len(came)
        saving = bool(came) or first[1] == EXIT_PREEMPTED
        stop_ranks(procs, send, grace_s if saving else failed_grace_s, hurry=lambda: len(came) > asked,
                   term=first[1] != EXIT_PREEMPTED or bool(came))
    if came and first[0] is None:
        return None, EXIT_PREEMPTED if all(p.poll() == EXIT_PREEMPTED for p in procs) else 128 + came[0]
    return first


def _stopped_by(rc: int, ranks: int) -> str:
    return f"stopped by {signal.Signals(rc - 128).name}; its {ranks} ranks were stopped first"


def _died(rank: int, proc: subprocess.Popen, rc: int) -> str:
    return f"rank {rank} (pid {proc.pid}) died with {signal.Signals(-rc).name}"


def spawn(nproc: int, argv: list[str], env: dict | None = None, name: str = "hetloco-ds train",
          bind_cores: bool = False, program: list[str] | None = None, grace_s: float = STOP_GRACE_S,
          failed_grace_s: float = STOP_GRACE_S) -> int:
    """Run `python -m hetloco_ds.cli *argv` (or `program *argv`) as `nproc` ranks, each pinned to its
    own share of the cores with `bind_cores` (`core_shares`); returns the first failing rank's exit
    code (128 + N for a rank killed by signal N), or 0. `grace_s`, `failed_grace_s`: `supervise`'s
    (training: the time its ranks have to save when told to stop; none after a rank failed, since a
    save needs every rank)."""
    procs = _start(nproc, argv, env, threads_per_rank(nproc), core_shares(nproc) if bind_cores else None, program)
    rank, rc = supervise(procs, grace_s=grace_s, failed_grace_s=failed_grace_s)
    if rank is None:
        if rc and rc != EXIT_PREEMPTED:  # a stop that saved: the ranks said so
            print(f"{name}: error: {_stopped_by(rc, nproc)}", file=sys.stderr, flush=True)
        return rc
    if rc < 0:
        print(f"{name}: error: {_died(rank, procs[rank], rc)}; stopped the other ranks", file=sys.stderr,
              flush=True)
        return 128 - rc
    return rc


def spawn_groups(groups: dict, tick=None, ended=None, bind_cores: bool = False, grace_s: float = STOP_GRACE_S,
                 failed_grace_s: float = STOP_GRACE_S) -> dict:
    """Several independent jobs at once (an elastic fleet's replicas): `groups` maps a name to
    (nproc, argv, env) as `spawn` takes them. A job whose rank fails is stopped alone, and
    `ended(name, line)` is told (line: what failed, or None when the job finished); the others go
    on. A job whose rank exits EXIT_PREEMPTED (told to stop, it saved: an elastic replica leaving)
    ends the same way, its other ranks given `grace_s` to finish saving. `tick(running names)` is
    called while they run; `bind_cores`: as `spawn`'s, over every rank of every job; `grace_s`,
    `failed_grace_s`: as `supervise`'s, a signal to the launcher stopping every job at once.
    Returns {name: exit code} (128 + N for a rank killed by signal N)."""
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
                    left = rc == EXIT_PREEMPTED
                    stop_ranks(ranks, grace_s=grace_s if left else failed_grace_s, term=not left)
                    codes[g] = 128 - rc if rc < 0 else rc
                    what = (_died(rank, ranks[rank], rc) + "; stopped its other ranks" if rc < 0 else
                            f"left the fleet after committing a checkpoint (exit {rc})" if left else
                            f"rank {rank} exited with code {rc}; stopped its other ranks")
                    if ended is not None:
                        ended(g, what)
                elif all(rc == 0 for rc in polled):
                    codes[g] = 0
                    if ended is not None:
                        ended(g, None)
            if tick is not None:
                tick({g for g in procs if g not in codes})
            time.sleep(0.05)
        rest = {g: ranks for g, ranks in procs.items() if g not in codes}
        asked = len(came)
        stop_ranks([p for ranks in rest.values() for p in ranks], grace_s=grace_s, hurry=lambda: len(came) > asked)
        for g, ranks in rest.items():
            codes[g] = EXIT_PREEMPTED if all(p.poll() == EXIT_PREEMPTED for p in ranks) else 128 + came[0]
    return codes
