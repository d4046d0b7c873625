"""`pipe.copy_engine`'s protocol on its own, on host streams (tests/host_streams.py): messages of
mixed dtypes and odd sizes arrive whole and in order through a ring of slots, both directions at
once, and a message too big for the receiver's slots is refused before it is copied."""
from __future__ import annotations

import os
import shutil
import time

import torch

from distributed import run_ranks


def _messages(src: int, n: int) -> list[list[torch.Tensor]]:
    """n messages from rank `src`: a bf16 tensor of an odd size and 3-byte rows of ids, distinct each time."""
    g = torch.Generator().manual_seed(src)
    return [[torch.randn(3, 5 + i, generator=g).to(torch.bfloat16),
             torch.randint(0, 255, (2, 3), generator=g, dtype=torch.uint8)] for i in range(n)]


def _ring_body(rank, tag, n, depth):
    import torch.distributed as tdist
    from host_streams import HostStreamsBackend

    from hetloco_ds.pipe.copy_engine import CopyEngineLinks, layout

    peer = 1 - rank
    biggest = layout([((3, 5 + n - 1), torch.bfloat16), ((2, 3), torch.uint8)])[1]
    links = CopyEngineLinks([[0, 1]], rank, torch.device("cpu"), biggest, depth=depth,
                            backend=HostStreamsBackend(tag, rank))
    mine, theirs = _messages(rank, n), _messages(peer, n)
    # every receive posted up front, as the overlapped schedule posts ahead; sends in order after
    posted = []
    for m in theirs:
        out = [torch.empty_like(t) for t in m]
        posted.append((out, links.recv(out, peer)))
    sent = [links.send(m, peer) for m in mine]
    got = []
    for out, works in posted:
        for w in works:
            w.wait()
        got.append(out)
    for works in sent:
        for w in works:
            w.wait()
    ok = all(torch.equal(a, b) for m, o in zip(theirs, got) for a, b in zip(m, o))
    tdist.barrier()
    too_big = None
    try:
        links.send([torch.zeros(biggest + 1, dtype=torch.uint8)], peer)
    except ValueError as err:
        too_big = str(err)
    return ok, too_big


def test_messages_arrive_whole_and_in_order_through_the_slot_ring():
    """8 messages each way through 2 slots (and through 1): every element arrives, in order, with
    both directions in flight at once. Breaks if a slot is reused before its message was copied
    out (flow control), if the layout misplaces a tensor, or if a sequence number is off by one
    (a wait that is never met fails the host stream after its timeout). A message larger than
    the receiver's slots is refused naming both sizes."""
    tag = f"ring-{os.getpid()}-{time.monotonic_ns()}"
    try:
        for depth in (2, 1):
            for ok, too_big in run_ranks(_ring_body, 2, f"{tag}-{depth}", 8, depth):
                assert ok
                assert too_big == "a 768-byte message does not fit the copy-engine link's 512-byte slots"
    finally:
        for depth in (2, 1):
            shutil.rmtree(f"/dev/shm/hetloco-test-{tag}-{depth}", ignore_errors=True)


def _failing_body(rank, tag, stage):
    """Rank 1 of 3 (one pipeline of 3 stages) cannot map its peers' memory, or cannot allocate its own."""
    from host_streams import HostStreamsBackend

    from hetloco_ds.pipe.copy_engine import CopyEngineLinks, CopyEngineUnavailable

    class Refusing(HostStreamsBackend):
        def zeros(self, numel, dtype):
            if stage == "allocate" and self.rank == 1:
                raise RuntimeError("CUDA error: out of memory")
            return super().zeros(numel, dtype)

        def map_peer(self, path, dtype, numel, peer):
            if stage == "map" and self.rank == 1:
                raise RuntimeError(f"GPU 1 cannot reach GPU of rank {peer}")
            return super().map_peer(path, dtype, numel, peer)

    try:
        CopyEngineLinks([[0, 1, 2]], rank, torch.device("cpu"), 512, backend=Refusing(tag, rank))
    except CopyEngineUnavailable as err:
        return str(err)
    return None


def test_a_rank_that_cannot_set_up_fails_every_rank_at_once_naming_it():
    """Setup is all-or-nothing: when one rank cannot allocate its slots, or cannot map a peer's, every
    rank of the job raises the same error naming that rank, rank 2 too, which shares no link with
    rank 1's failing map of rank 0. Breaks if a rank went on past setup alone or learnt of only its
    own failure: the engine's fallback to process groups would then split the job."""
    tag = f"fail-{os.getpid()}-{time.monotonic_ns()}"
    try:
        assert run_ranks(_failing_body, 3, f"{tag}-a", "allocate") == ["rank 1: CUDA error: out of memory"] * 3
        assert run_ranks(_failing_body, 3, f"{tag}-m", "map") == ["rank 1: GPU 1 cannot reach GPU of rank 0"] * 3
        assert run_ranks(_failing_body, 3, f"{tag}-ok", "none") == [None] * 3
    finally:
        for case in ("a", "m", "ok"):
            shutil.rmtree(f"/dev/shm/hetloco-test-{tag}-{case}", ignore_errors=True)
