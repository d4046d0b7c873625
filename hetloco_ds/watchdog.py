"""A rank that stops responding or stops making progress ends the job, with one line naming it.

Every rank runs a small thread that, about once a second, writes a heartbeat file
(`OUT/.hetloco/heartbeat/<job>/rank<r>.json`: a beat counter, the rank's progress counter and
where it is) and reads everyone else's. Counters are compared against this process's own
monotonic clock, so clocks of different hosts never have to agree.

- No heartbeat from a rank for `timeout` seconds: that rank is stopped or frozen (SIGSTOP, a
  hung node). Gloo would notice only after its 30-minute default timeout, if ever.
- A rank's progress counter unchanged for max(2 x timeout, 20 x the slowest step seen) while it
  still beats: it is stuck (a deadlock, a collective no peer will join). Twice the heartbeat
  limit, so that when one rank goes silent it is named, not the peers left waiting for it.
  Known long operations (start-up and the first step, checkpoints, validation, the export) are
  `busy` phases, allowed ten times as long. A `waiting` phase (an elastic replica waiting for its
  fleet at the outer sync, where every wait ends by its own timeout) is not judged on progress.

The first rank to see a stall claims `stalled` in the job directory (O_EXCL, so one line is
printed for the job), prints the line and exits with EXIT_STALLED; the launcher stops the rest.
A rank that has never written a heartbeat (another node without a shared file system) is
never judged.
"""
from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
import threading
import time

EXIT_STALLED = 4
BUSY_FACTOR = 10
STEP_FACTOR = 20


class Watchdog:
    def __init__(self, directory: str, rank: int, world: int, timeout: float, prefix: str = "hetloco-ds train"):
        self.directory, self.rank, self.world, self.timeout = directory, rank, world, timeout
        self.prefix = prefix
        self.beat_s = max(0.05, min(1.0, timeout / 8))
        self._lock = threading.Lock()
        self._progress = 0
        self._where = "starting"
        self._busy = True  # start-up and the first step (which may compile) are busy
        self._waiting = False
        self._slowest = 0.0
        self._beats = 0
        self._done = False
        self._seen: dict[int, dict] = {}  # rank -> {"beat", "beat_t", "progress", "progress_t"} (our clock)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="hetloco-watchdog", daemon=True)
        self.enabled = timeout > 0

    # ------------------------------------------------------------------ main thread
    def start(self) -> "Watchdog":
        if self.enabled:
            os.makedirs(self.directory, exist_ok=True)
            self._write_own()  # before training starts: a rank that freezes at once is still judged
            self._thread.start()
        return self

    def progress(self, done: str, step_seconds: float | None = None) -> None:
        """The main thread finished `done` (e.g. "step 12"), which took `step_seconds`."""
        with self._lock:
            self._progress += 1
            self._where = f"finished {done}"
            self._busy = False
            if step_seconds is not None:
                self._slowest = max(self._slowest, step_seconds)

    @contextlib.contextmanager
    def busy(self, where: str):
        """A known long operation: its progress limit is BUSY_FACTOR times the usual one."""
        with self._lock:
            before = self._busy
            self._progress += 1
            self._where, self._busy = f"in {where}", True
        try:
            yield
        finally:
            with self._lock:
                self._progress += 1
                self._where, self._busy = f"finished {where}", before

    @contextlib.contextmanager
    def waiting(self, where: str):
        """A wait bounded elsewhere (the elastic quorum: hetloco.elastic timeouts): while in it this
        rank is judged by its heartbeats only, so waiting for other replicas never ends the job."""
        with self._lock:
            self._progress += 1
            self._where, self._waiting = f"in {where}", True
        try:
            yield
        finally:
            with self._lock:
                self._progress += 1
                self._where, self._waiting = f"finished {where}", False

    def stop(self) -> None:
        """Stop beating, leaving a last heartbeat that says this rank is done (not stalled)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
            with self._lock:
                self._where, self._done = "done", True
            try:
                self._write_own()
            except OSError:
                pass

    # ------------------------------------------------------------------ watchdog thread
    def _path(self, rank: int) -> str:
        return os.path.join(self.directory, f"rank{rank:05d}.json")

    def _write_own(self) -> None:
        with self._lock:
            self._beats += 1
            me = {"rank": self.rank, "pid": os.getpid(), "host": socket.gethostname(), "beat": self._beats,
                  "progress": self._progress, "where": self._where, "busy": self._busy, "waiting": self._waiting,
                  "slowest": self._slowest,
                  "done": self._done}
        tmp = self._path(self.rank) + ".tmp"
        with open(tmp, "w") as f:
            json.dump(me, f)
        os.replace(tmp, self._path(self.rank))

    def _read(self, rank: int) -> dict | None:
        try:
            with open(self._path(rank)) as f:
                return json.load(f)
        except (OSError, ValueError):
            return None

    def check(self, now: float) -> str | None:
        """Read every rank's heartbeat; the line to print if one has stalled, else None."""
        limit = max(2 * self.timeout, STEP_FACTOR * max((s.get("slowest", 0.0) for s in self._seen.values()), default=0))
        stalled = []
        for rank in range(self.world):
            hb = self._read(rank)
            seen = self._seen.get(rank)
            if hb is None and seen is None:
                continue  # never beat: not ours to judge
            if hb is not None and hb.get("done"):
                continue
            if hb is not None:
                if seen is None or hb["beat"] != seen["beat"]:
                    progress_t = now if seen is None or hb["progress"] != seen["progress"] else seen["progress_t"]
                    seen = self._seen[rank] = {**hb, "beat_t": now, "progress_t": progress_t}
            if rank != self.rank and now - seen["beat_t"] > self.timeout:
                stalled.append((0, rank, f"rank {rank} (pid {seen['pid']} on {seen['host']}) stopped responding: "
                                         f"no heartbeat for {now - seen['beat_t']:.0f} s (last: {seen['where']})"))
                continue
            allowed = limit * (BUSY_FACTOR if seen["busy"] else 1)
            if now - seen["progress_t"] > allowed and not seen.get("waiting"):
                stalled.append((1, rank, f"rank {rank} (pid {seen['pid']} on {seen['host']}) made no progress for "
                                         f"{now - seen['progress_t']:.0f} s (last: {seen['where']}; limit {allowed:.0f} s)"))
        if not stalled:
            return None
        # A silent rank explains the others' lack of progress; otherwise the longest stuck one.
        stalled.sort(key=lambda s: (s[0], -(now - self._seen[s[1]]["progress_t"])))
        return stalled[0][2]

    def _run(self) -> None:
        while not self._stop.wait(self.beat_s):
            try:
                self._write_own()
                line = self.check(time.monotonic())
            except OSError:
                continue  # a full disk or a vanished directory must not kill training
            if line is not None:
                self._fire(line)

    def _fire(self, line: str) -> None:
        try:
            fd = os.open(os.path.join(self.directory, "stalled"), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            os.write(fd, (line + "\n").encode())
            os.close(fd)
            print(f"{self.prefix}: error: {line}; ending the job", file=sys.stderr, flush=True)
        except FileExistsError:
            pass  # another rank already said it
        os._exit(EXIT_STALLED)
