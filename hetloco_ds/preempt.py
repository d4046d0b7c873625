"""A rank told to stop saves first: SIGTERM, SIGINT or SIGHUP become a checkpoint at a step every
rank of the job agrees on, then exit EXIT_PREEMPTED; the time-interval saves are agreed the same way.

Why the job's store and not the step's collectives. A save is a collective, so all ranks must
choose the same step. Between outer steps the replicas do not meet (each runs its H inner steps
at its own pace), so a flag on a per-step reduction - the pipe group's loss vector - reaches only
one replica's stages, and a signal that reaches one rank (`kill` of one pid, a node's own
shutdown) has no collective to ride on until the next outer step, which may be minutes away.
Where the whole world already meets is the rendezvous store every rank connected to at start
(torch's TCPStore at MASTER_ADDR:MASTER_PORT: our `--nproc`, deepspeed's launcher and torchrun all
provide it). Each rank opens one more client to it, used by one background thread; the training
step itself does no collective and no I/O for this: the main thread reads a few fields under a
lock between steps.

One round (a stop, or a save rank 0's clock asks for):

- A rank that wants one (signalled; rank 0 once `every_s` has passed since the last save)
  publishes its floor - the steps its main thread has started - under the round's key and bumps
  the `opened` counter.
- Every rank's thread polls `opened` (one store round trip per poll); on a new round it publishes
  its own floor. A rank that has published starts no further step until the round's step is
  known, so its floor bounds how far it goes, and every rank can still reach the largest floor.
- Once all floors are in, every rank derives the same step from the same values: a stop at the
  largest floor (the earliest step all can reach: usually the step in progress), a save at the
  first outer boundary at or after it (where a checkpoint stores each tensor once), capped at the
  run's last step (whose save the run makes anyway).

The stop round is one per job (it ends the job) and may be agreed while a save round is pending,
so a signal never waits for an interval save's boundary.

Bounds. The first signal (or the first news of another rank's) arms a deadline `grace_s` away;
a second thread that only reads signals ends the process at the deadline even when the main
thread is stuck in a collective: with EXIT_PREEMPTED if the checkpoint was committed, else with
128 + N and one line for the job (the checkpoint's atomic commit means a save cut short is never
`latest`). A second signal more than REPEAT_WINDOW_S after the first ends the process at once;
one sooner is the same request arriving by another path (a terminal's Ctrl-C reaches deepspeed's
launcher and its ranks, Slurm signals every process of a step and torchrun forwards it again).
A wait for a save round's floors is bounded by AGREE_TIMEOUT_S, a backstop: the watchdog names a
silent rank sooner.

Signals are read through `signal.set_wakeup_fd`: the C-level handler writes the signal's number
to a pipe the moment it arrives, so a main thread blocked in a collective does not delay the
agreement (the Python-level handler is a no-op). Signals the process inherited as ignored
(`nohup`) stay ignored.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import select
import signal
import sys
import threading
import time

from .launch import EXIT_PREEMPTED, STOP_SIGNALS

REPEAT_WINDOW_S = 2.0
STOPPED = "stopped"
"""The claim (`Preemption.claim`) of the job's one line saying it stopped after saving."""
AGREE_TIMEOUT_S = 600.0
POLL_S = 1.0
"""Longest wait between two polls of the store (shorter for a short grace period)."""


@dataclasses.dataclass(frozen=True)
class Due:
    """What the ranks agreed to do at this step, before starting the next."""

    save: bool
    """A checkpoint of this step (a save round's step, or a stop's)."""
    stop: int | None = None
    """The signal that stopped the job: save, then exit EXIT_PREEMPTED."""


class NoAgreement(RuntimeError):
    """The ranks did not publish their floors within AGREE_TIMEOUT_S; `report` on one rank of the job."""

    def __init__(self, message: str, report: bool):
        super().__init__(message)
        self.report = report


@dataclasses.dataclass
class _Round:
    key: str
    floor: int | None = None
    """This rank's published floor (None: not published yet)."""
    step: int | None = None
    """The agreed step, once every rank's floor is in."""
    signal: int = 0
    """Stop round: the first signal any rank reported."""


def _noop(signum, frame) -> None:
    """The Python-level handler: the work is done by the thread reading the wakeup fd."""


class Preemption:
    """One rank's side of the agreement (module docstring). `store`: a client of the job's store
    (set, add, multi_get); `prefix`: this job's keys in it; `boundary`: the outer step's H (1
    without SparseLoCo); `steps`: the run's last step; `claim_dir`: where the first rank to report a
    failure for the job claims the line (None: each reports); `busy(where)`: a context the main
    thread waits in (the watchdog's)."""

    def __init__(self, store, prefix: str, rank: int, world: int, *, grace_s: float, every_s: float, boundary: int,
                 steps: int, claim_dir: str | None = None, busy=None, prefix_line: str = "hetloco-ds train"):
        self.store, self.prefix, self.rank, self.world = store, prefix, rank, world
        self.grace_s, self.every_s, self.boundary, self.steps = grace_s, every_s, max(1, boundary), steps
        self.claim_dir, self.busy, self.prefix_line = claim_dir, busy, prefix_line
        # A stop must be agreed well inside its grace, a save round noticed well inside its interval.
        self.poll_s = max(0.01, min(POLL_S, grace_s / 20, every_s / 4 if every_s > 0 else POLL_S))
        self._cond = threading.Condition()
        self._started: int | None = None
        self._stop = _Round("stop")
        self._save = _Round("save0")
        self._saves = 0
        self._signal = 0
        self._first_at: float | None = None
        self._deadline: float | None = None
        self._committed = False
        self._last_save = time.monotonic()
        self._seen_opened = 0
        self._recheck = False
        self._wake = threading.Event()
        self._closed = threading.Event()
        self._handlers: dict = {}
        self._fds: tuple[int, int] | None = None
        self._old_wakeup = -1
        self._threads: list[threading.Thread] = []

    # ------------------------------------------------------------------ main thread
    def install(self) -> "Preemption":
        """Catch the stop signals (main thread only; elsewhere only the agreement runs) and start the threads."""
        if threading.current_thread() is threading.main_thread():
            r, w = os.pipe()
            os.set_blocking(r, False)
            os.set_blocking(w, False)
            self._fds = (r, w)
            self._old_wakeup = signal.set_wakeup_fd(w, warn_on_full_buffer=False)
            for sig in STOP_SIGNALS:
                if signal.getsignal(sig) is not signal.SIG_IGN:
                    self._handlers[sig] = signal.signal(sig, _noop)
            self._threads.append(threading.Thread(target=self._watch_signals, name="hetloco-signals", daemon=True))
        self._threads.append(threading.Thread(target=self._agree, name="hetloco-preempt", daemon=True))
        for t in self._threads:
            t.start()
        return self

    def begin(self, step: int) -> None:
        """The training loop starts at `step`: from now on this rank's floor can be published."""
        with self._cond:
            self._started = step
            self._last_save = time.monotonic()
        self._wake.set()

    def between_steps(self, step: int) -> Due | None:
        """Called with the steps done, before starting the next: what is due at this step (the step
        is then not marked started; call again after acting), else None and the next step counts as
        started. Waits while a round this rank published has no step yet."""
        with self._cond:
            if self._unresolved():
                with self.busy("agreeing on a checkpoint step") if self.busy else contextlib.nullcontext():
                    self._wait_resolved()
            for r in (self._stop, self._save):
                if r.step is not None and step > r.step:
                    # Only a jump can pass an agreed step (no rank starts past one): an elastic replica
                    # healed at its outer step takes the donor's step count, every rank of it alike.
                    r.step = step
            stop_here, save_here = self._stop.step == step, self._save.step == step
            if save_here:  # consumed: the next save round
                self._saves += 1
                self._save = _Round(f"save{self._saves}")
                self._recheck = True
            if stop_here or save_here:
                return Due(save=True, stop=self._stop.signal if stop_here else None)
            self._started = step + 1
            return None

    def saved(self) -> None:
        """Any save (interval, regular or the API's): the interval's clock starts again."""
        with self._cond:
            self._last_save = time.monotonic()

    def committed(self) -> None:
        """The stop's checkpoint, or the run's last, is committed: nothing is left to save, so a stop
        exits EXIT_PREEMPTED at its deadline, and one that comes from now on at once."""
        with self._cond:
            self._committed = True

    @property
    def stop_signal(self) -> int:
        """The signal of a stop this rank got or learnt of (0: none)."""
        with self._cond:
            return self._stop.signal or self._signal or (signal.SIGTERM if self._stop.floor is not None else 0)

    def close(self) -> None:
        self._closed.set()
        self._wake.set()
        for t in self._threads:
            t.join(timeout=2.0)
        if threading.current_thread() is threading.main_thread():
            for sig, handler in self._handlers.items():
                signal.signal(sig, handler)
            if self._fds is not None:
                signal.set_wakeup_fd(self._old_wakeup)
        self._handlers.clear()
        if self._fds is not None:
            for fd in self._fds:
                os.close(fd)
            self._fds = None

    def _unresolved(self) -> _Round | None:
        return next((r for r in (self._stop, self._save) if r.floor is not None and r.step is None), None)

    def _wait_resolved(self) -> None:
        end = time.monotonic() + AGREE_TIMEOUT_S
        while (r := self._unresolved()) is not None:
            left = end - time.monotonic()
            if left <= 0:
                line = (f"the ranks did not agree on a checkpoint step within {AGREE_TIMEOUT_S:.0f} s ({r.key} round: "
                        f"not every rank published its step to the job's store)")
                raise NoAgreement(line, self.claim("no-agreement"))
            self._cond.wait(min(left, 1.0))

    # ------------------------------------------------------------------ signal thread
    def _watch_signals(self) -> None:
        r = self._fds[0]
        while not self._closed.is_set():
            with self._cond:
                deadline = self._deadline
            timeout = 0.5 if deadline is None else max(0.0, min(0.5, deadline - time.monotonic()))
            ready, _, _ = select.select([r], [], [], timeout)
            if ready:
                try:
                    data = os.read(r, 64)
                except BlockingIOError:
                    data = b""
                for signum in data:
                    if signum in self._handlers:
                        self._on_signal(signum)
            if deadline is not None and time.monotonic() >= deadline and not self._closed.is_set():
                self._expire()

    def _on_signal(self, signum: int) -> None:
        now = time.monotonic()
        with self._cond:
            if self._first_at is None:
                self._first_at, self._signal = now, signum
                self._arm(now)
            elif now - self._first_at > REPEAT_WINDOW_S:
                sys.stderr.flush()
                os._exit(128 + signum)  # a second signal: at once, as before there was a save to wait for
        self._wake.set()

    def _arm(self, now: float) -> None:
        """Under the lock: the grace period starts (the earliest of this rank's reasons counts)."""
        end = now if self._committed else now + self.grace_s
        self._deadline = end if self._deadline is None else min(self._deadline, end)

    def _expire(self) -> None:
        with self._cond:
            committed, step = self._committed, self._stop.step
            signum = self._stop.signal or self._signal or signal.SIGTERM
        if committed:
            if self.claim(STOPPED):
                print(f"{self.prefix_line}: stopped by {signal.Signals(signum).name} after its last checkpoint was "
                      "committed: --resume continues from it", file=sys.stderr, flush=True)
            os._exit(EXIT_PREEMPTED)
        what = f"committed no checkpoint at the agreed step {step}" if step is not None else \
            "did not agree on a step to save"
        if self.claim("preempt-expired"):
            print(f"{self.prefix_line}: error: stopped by {signal.Signals(signum).name} without saving: the ranks {what} "
                  f"within train.preempt_grace_s = {self.grace_s:g} s; --resume continues from the newest complete "
                  "checkpoint", file=sys.stderr, flush=True)
        else:
            time.sleep(0.5)  # the claiming rank's line first
        sys.stdout.flush()
        os._exit(128 + signum)

    def claim(self, name: str) -> bool:
        """Whether this rank is the first of its job to report `name` (one line for the job)."""
        if self.claim_dir is None:
            return True
        try:
            os.makedirs(self.claim_dir, exist_ok=True)
            os.close(os.open(os.path.join(self.claim_dir, name), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
            return True
        except FileExistsError:
            return False
        except OSError:
            return True

    # ------------------------------------------------------------------ agreement thread
    def _agree(self) -> None:
        while not self._closed.is_set():
            self._wake.wait(self._next_poll())
            self._wake.clear()
            if self._closed.is_set():
                return
            try:
                self._poll()
            except Exception:  # noqa: BLE001 - a store gone with its job; the deadline and timeouts bound the rest
                with self._cond:
                    self._recheck = True  # a round opened meanwhile is not missed once the store answers again
                time.sleep(self.poll_s)

    def _next_poll(self) -> float:
        """Seconds to the next poll: `poll_s`, or sooner on rank 0 when the interval's save falls due."""
        if self.rank != 0 or self.every_s <= 0:
            return self.poll_s
        with self._cond:
            due = self._last_save + self.every_s - time.monotonic()
        return min(self.poll_s, max(0.01, due))

    def _poll(self) -> None:
        with self._cond:
            if self._started is None:
                return
            stop, save = self._stop, self._save
            want_stop = bool(self._signal) and stop.floor is None
            want_save = (self.rank == 0 and self.every_s > 0 and save.floor is None
                         and time.monotonic() - self._last_save >= self.every_s)
            recheck, self._recheck = self._recheck, False
        if want_stop:
            self._publish(stop, opens=True)
        if want_save:
            self._publish(save, opens=True)
        opened = int(self.store.add(self.prefix + "opened", 0))
        if opened != self._seen_opened or recheck:
            self._seen_opened = opened
            for r in (stop, save):
                if r.floor is None and int(self.store.add(self.prefix + r.key + "/n", 0)) > 0:
                    self._publish(r, opens=False)
        for r in (stop, save):
            if r.floor is not None and r.step is None:
                self._resolve(r)

    def _publish(self, r: _Round, opens: bool) -> None:
        with self._cond:
            if r.floor is not None:
                return
            r.floor = self._started
            signum = self._signal if r is self._stop else 0
            if r is self._stop:
                self._arm(time.monotonic())
        self.store.set(f"{self.prefix}{r.key}/{self.rank}", f"{r.floor} {signum}")
        self.store.add(f"{self.prefix}{r.key}/n", 1)
        if opens:
            self.store.add(self.prefix + "opened", 1)

    def _resolve(self, r: _Round) -> None:
        if int(self.store.add(f"{self.prefix}{r.key}/n", 0)) < self.world:
            return
        values = self.store.multi_get([f"{self.prefix}{r.key}/{q}" for q in range(self.world)])
        pairs = [tuple(int(x) for x in bytes(v).decode().split()) for v in values]
        top = max(floor for floor, _ in pairs)
        step = top if r is self._stop else min(self.steps, math.ceil(top / self.boundary) * self.boundary)
        with self._cond:
            r.step = step
            r.signal = next((s for _, s in pairs if s), signal.SIGTERM) if r is self._stop else 0
            self._cond.notify_all()


__all__ = ["Preemption", "Due", "NoAgreement", "EXIT_PREEMPTED", "REPEAT_WINDOW_S"]
