"""The watchdog's judgement on heartbeat files and a given clock, without threads or processes."""
from __future__ import annotations

import re

from hetloco_ds.watchdog import BUSY_FACTOR, Watchdog


def test_silent_rank_is_named_before_the_peers_waiting_for_it(tmp_path):
    """Rank 1 stops beating; rank 0 keeps beating but, waiting for rank 1, makes no progress. At
    the heartbeat limit rank 1 is named; later, when rank 0's own progress limit (twice the
    heartbeat limit) has passed too, still rank 1. A rank that never wrote a heartbeat (another
    node without a shared file system) and a rank that finished are never named. Breaks if a
    stop is judged by progress alone (the waiting peer would be blamed) or on clocks of other hosts."""
    dogs = [Watchdog(str(tmp_path), r, 3, timeout=10) for r in range(2)]  # rank 2 never beats
    me, other = dogs
    me.progress("step 1", step_seconds=0.1)
    for d in dogs:
        d._write_own()
    assert me.check(now=0.0) is None
    other.progress("step 1", step_seconds=0.1)  # rank 1 got further, then froze
    for d in dogs:
        d._write_own()
    assert me.check(now=5.0) is None
    me._write_own()
    line = me.check(now=15.5)
    assert re.fullmatch(r"rank 1 \(pid \d+ on \S+\) stopped responding: no heartbeat for 10 s "
                        r"\(last: finished step 1\)", line), line
    me._write_own()
    # Rank 0, waiting for rank 1, has now gone longer without progress (25 s, past its 20 s
    # limit) than rank 1 without a heartbeat (20 s): the silent one is still the one named.
    assert me.check(now=25.0).startswith("rank 1 ")

    other._done = True
    other._write_own()
    me._write_own()
    line = me.check(now=26.0)
    assert line.startswith("rank 0 ") and line.endswith("made no progress for 26 s (last: finished step 1; limit 20 s)")


def test_busy_phases_get_longer_and_steps_scale_the_limit(tmp_path):
    """A rank inside a declared long phase (a checkpoint) is allowed BUSY_FACTOR times the
    progress limit; after a slow step the limit grows to 20x that step. Breaks if a long export
    or checkpoint ends a healthy job, or if slow models are judged by a fast model's limit."""
    me = Watchdog(str(tmp_path), 0, 1, timeout=1)
    me._write_own()
    assert me.check(now=0.0) is None
    with me.busy("checkpoint at step 2"):
        me._write_own()
        assert me.check(now=1.0) is None
        assert me.check(now=1.0 + 2 * BUSY_FACTOR - 1) is None
        assert "made no progress" in me.check(now=1.0 + 2 * BUSY_FACTOR + 1)
    me.progress("step 3", step_seconds=0.5)  # 20 x 0.5 s = 10 s > 2 x timeout
    me._write_own()
    assert me.check(now=100.0) is None
    assert me.check(now=109.0) is None
    assert "limit 10 s" in me.check(now=111.0)


def test_waiting_for_the_fleet_is_judged_by_heartbeats_only(tmp_path):
    """Both stages of an elastic replica wait at the outer sync for their fleet (a quorum, a hung
    peer's join timeout): however long, their progress is not judged, but a rank that stops
    beating while waiting is still named. Breaks if a replica that is merely waiting for other
    replicas were ended by its own watchdog, or if a frozen one could hide in the wait."""
    dogs = [Watchdog(str(tmp_path), r, 2, timeout=1) for r in range(2)]
    me, sibling = dogs
    for d in dogs:
        d.progress("step 2", step_seconds=0.1)
        d._write_own()
    assert me.check(now=0.0) is None
    with me.waiting("outer sync after step 2"), sibling.waiting("outer sync after step 2"):
        for t in (0.5, 10.0, 1000.0):
            for d in dogs:
                d._write_own()
            assert me.check(now=t) is None, me.check(now=t)
        me._write_own()  # the sibling freezes while waiting
        line = me.check(now=1002.0)
        assert line.startswith("rank 1 ") and "stopped responding" in line, line
    me._write_own()
    assert "made no progress" not in (me.check(now=1002.5) or "")  # done waiting: the clock starts anew
