"""A replica's pipeline links: this stage's sends to and receives from its neighbour stages.

The engine's pipeline instructions call these instead of DeepSpeed's p2p module, so every byte
is counted where it is handed to torch.distributed, by kind. Receivers allocate from the
message's spec (`BoundaryCodec.message_spec`), which both ends derive from the same config, so
no shape metadata travels.

Two ways to use a link:

* blocking (`send`, `recv`): DeepSpeed's TrainSchedule and the inference schedule; on the
  default group, as DeepSpeed's p2p does.
* non-blocking (`isend`, `post_recv` / `wait_recv`, `wait_sends`): the overlapped schedule
  (`pipe.schedule`), through the rank's one `LinkBackend`, chosen once at start by `open_links`
  (which also owns the host discovery it needs and the copy engines' fallback):
  - `CopyEngineLinks` (`pipe.copy_engine`): GPUs inside a host, moved by the copy engines;
  - `DirectedGroups`: each direction of each link is its own two-rank process group:
    activations going down and gradients going up then never share a connection or a
    communicator. On NCCL, p2p operations of one communicator run in the order they were
    posted, so an early-posted receive of the next activation would otherwise sit in front of
    a gradient send the peer is waiting for; on gloo (TCP, rendezvous: a send's data leaves
    once the peer's ready-to-receive notice arrives), a notice would otherwise queue behind the
    bulk data already written the other way on the same connection;
  - `WorldLinks`: the default group, where the blocking schedule makes no non-blocking call.
"""
from __future__ import annotations

import hashlib
import logging
import os
import socket
from collections import deque
from dataclasses import dataclass
from typing import Callable, Protocol, Sequence

import torch
import torch.distributed as tdist

from ..meter import ByteMeter, nbytes
from . import order
from .copy_engine import CopyEngineLinks, CopyEngineUnavailable, layout

log = logging.getLogger(__name__)

Spec = Sequence[tuple[tuple[int, ...], torch.dtype]]


def nccl_link_options(max_ctas: int | None):
    """Process-group options capping an NCCL link communicator at `max_ctas` CTAs
    (`hetloco.pipeline.link_max_ctas`); None where there is nothing to cap: no cap asked, or a
    backend other than NCCL (gloo has no CTAs)."""
    if max_ctas is None or tdist.get_backend() != "nccl":
        return None
    options = tdist.ProcessGroupNCCL.Options()
    options.config.max_ctas = max_ctas
    return options


def gemm_sm_carveout(setting: int | str, max_ctas: int | None, link_kernels: int, device) -> int:
    """SMs this stage's matmuls leave free (`hetloco.pipeline.gemm_sm_carveout`, "auto": `max_ctas`
    per resident link kernel), applied for the process on CUDA when a link kernel can be resident:
    cuBLASLt as torch's matmul library and torch's SM carveout (the carveout reaches cuBLASLt only).
    Returns the SMs left free (0: nothing changed)."""
    sms = (max_ctas or 0) * link_kernels if setting == "auto" else int(setting)
    if sms == 0 or link_kernels == 0 or device.type != "cuda":
        return 0
    total = torch.cuda.get_device_properties(device).multi_processor_count
    if sms >= total:
        raise ValueError(f"hetloco.pipeline.gemm_sm_carveout = {setting!r} leaves the matmuls {total - sms} of "
                         f"the device's {total} SMs; it must be below {total}")
    torch.backends.cuda.preferred_blas_library("cublaslt")
    torch._C._set_sm_carveout_experimental(sms)
    return sms


HOST_ENV = "HETLOCO_HOST"
"""Where set, the host a rank counts itself on instead of its host name: netlab sets it to the rank's
network namespace, which stands for a host of its own behind its shaped links (`hetloco-ds train --link`)."""


def host_ids(device, meter: ByteMeter) -> list[bytes]:
    """Every rank's host, as the SHA-256 of its host name (or of $HETLOCO_HOST), gathered over the
    world (collective). A fixed 32 bytes a rank, so the control bytes metered are exact: a ring
    all-gather sends and receives 32 (W - 1) bytes a rank."""
    world = tdist.get_world_size()
    host = os.environ.get(HOST_ENV) or socket.gethostname()
    mine = torch.frombuffer(bytearray(hashlib.sha256(host.encode()).digest()), dtype=torch.uint8)
    every = torch.empty(world * 32, dtype=torch.uint8, device=device)
    tdist.all_gather_into_tensor(every, mine.to(device))
    meter.add("sent", 32 * (world - 1), "control")
    meter.add("recv", 32 * (world - 1), "control")
    return [bytes(h.tolist()) for h in every.cpu().view(world, 32)]


def crossing_link(replica_ranks: Sequence[Sequence[int]], hosts: Sequence) -> tuple[int, int] | None:
    """The first stage link of any replica that joins two ranks on different hosts (`hosts[rank]`),
    as its (rank, rank); None when every link stays inside a host."""
    return next(((a, b) for ranks in replica_ranks for a, b in zip(ranks, ranks[1:]) if hosts[a] != hosts[b]), None)


class LinkBackend(Protocol):
    """What moves a rank's non-blocking stage-link messages (`StageLinks.isend`, `post_recv`). Each
    call starts the transfer of one message (its tensors, in order) and returns its works, each with
    a `wait()` after which the message may be used (a receive) or reused (a send); per direction,
    messages arrive in the order they were sent. `open_links` picks one per rank, once."""

    def send(self, tensors: Sequence[torch.Tensor], dst: int) -> list: ...

    def recv(self, tensors: Sequence[torch.Tensor], src: int) -> list: ...


class WorldLinks:
    """Non-blocking messages on the default group: the backend of the blocking schedule, which
    sends and receives with `StageLinks.send` / `recv` and posts nothing ahead."""

    def send(self, tensors: Sequence[torch.Tensor], dst: int) -> list:
        return [tdist.isend(t, dst) for t in tensors]

    def recv(self, tensors: Sequence[torch.Tensor], src: int) -> list:
        return [tdist.irecv(t, src) for t in tensors]


class DirectedGroups:
    """One two-rank process group per direction of every stage link of every replica.

    `replica_ranks[m]` lists replica m's global ranks by stage. Every rank of the world must
    construct it at the same point with the same argument (torch's `new_group` is collective
    over the world), and each group is opened at once, link by link from the first stage down,
    with one one-element message in the group's own direction: NCCL creates a communicator, and
    its point-to-point connection to a peer, on first use, and that first use can block the host
    until the peer's matching call; in the middle of a schedule it would stall a stage behind
    work its peer cannot start. Those warm-up bytes are control.
    """

    def __init__(self, replica_ranks: Sequence[Sequence[int]], me: int, device, meter: ByteMeter,
                 max_ctas: int | None = None):
        self.down: dict[int, object] = {}  # stage s -> group of (s, s + 1) for activations
        self.up: dict[int, object] = {}    # stage s -> group of (s, s + 1) for gradients
        self._to: dict[int, object] = {}    # peer rank -> the group this rank sends to it on
        self._from: dict[int, object] = {}  # peer rank -> the group this rank receives from it on
        mine: list[tuple[object, int, int]] = []  # (group, sender, receiver), in stage order: a chain, no cycle
        options = nccl_link_options(max_ctas)
        for ranks in replica_ranks:
            for s in range(len(ranks) - 1):
                pair = [ranks[s], ranks[s + 1]]
                down, up = tdist.new_group(pair, pg_options=options), tdist.new_group(pair, pg_options=options)
                if me in pair:
                    self.down[s], self.up[s] = down, up
                    mine += [(down, pair[0], pair[1]), (up, pair[1], pair[0])]
                    for group, src, dst in mine[-2:]:
                        if src == me:
                            self._to[dst] = group
                        else:
                            self._from[src] = group
        one = torch.zeros(1, device=device)
        for group, src, dst in mine:
            if me == src:
                tdist.send(one, dst, group=group)
                meter.add("sent", nbytes(one), "control")
            else:
                tdist.recv(one, src, group=group)
                meter.add("recv", nbytes(one), "control")

    def send(self, tensors: Sequence[torch.Tensor], dst: int) -> list:
        group = self._to[dst]
        return [tdist.isend(t, dst, group=group) for t in tensors]

    def recv(self, tensors: Sequence[torch.Tensor], src: int) -> list:
        group = self._from[src]
        return [tdist.irecv(t, src, group=group) for t in tensors]


@dataclass(frozen=True)
class LinkChoice:
    """What `open_links` chose for a rank (the schedule and the transport: the same on every rank of the job)."""

    schedule: str
    """The schedule the engine runs: "overlapped" or "blocking"."""
    transport: str
    """What `backend` is: "copy_engine" or "process_group"."""
    backend: LinkBackend
    resident_kernels: int
    """Link kernels the stage can hold resident on its device at once (`order.resident_link_kernels`;
    none on the copy engines), which `pipeline.gemm_sm_carveout: "auto"` leaves SMs to."""


def open_links(pipeline, replica_ranks: Sequence[Sequence[int]], me: int, device, meter: ByteMeter,
               message_spec: Callable[[], Spec]) -> LinkChoice:
    """The schedule and the one `LinkBackend` of rank `me` for `pipeline` (`hetloco.pipeline`), chosen
    here and nowhere else: where the choice depends on it, whether some stage link joins two hosts
    (`host_ids`, a collective); the plan (`order.links_plan`); the copy engines when the plan says so,
    else, or when any rank cannot start them (`CopyEngineUnavailable` on every rank at once), what the
    plan chooses without them, on every rank alike, with one warning from rank 0. A copy-engine
    transport named in the config that cannot start is a ValueError on every rank.

    Every rank of the job calls it at the same point (it may all-gather and create groups);
    `replica_ranks[m]` lists replica m's global ranks by stage; `message_spec()`: the largest message
    this rank receives (a copy-engine link's slot), asked only for the copy engines."""
    # Chosen alike on every rank (collectives follow): by whether any replica has stage links, so a
    # one-stage replica beside deeper ones (`hetloco.replica_stages`) takes part in making their groups.
    stages = max(len(ranks) for ranks in replica_ranks)
    own = next(ranks for ranks in replica_ranks if me in ranks)
    named = pipeline.link_transport
    apart = None  # a stage link between two hosts: where it matters to the choice
    if stages > 1 and (named == "copy_engine" or (
            device.type == "cuda" and (pipeline.schedule, named) != ("blocking", "process_group"))):
        apart = crossing_link(replica_ranks, host_ids(device, meter))
    if named == "copy_engine" and apart is not None:
        raise ValueError('hetloco.pipeline.link_transport = "copy_engine" needs both ranks of every stage '
                         f"link on one host; ranks {apart[0]} and {apart[1]} are on different hosts")
    schedule, transport = order.links_plan(pipeline.schedule, named, device.type, apart is not None)
    if stages == 1:
        transport = "process_group"  # no stage links
    if transport == "copy_engine":
        try:
            engines = CopyEngineLinks(replica_ranks, me, device, layout(message_spec())[1])
            return LinkChoice(schedule, transport, engines, 0)
        except CopyEngineUnavailable as err:
            if named == "copy_engine":
                raise ValueError(str(err)) from err
            reason = err
        schedule, transport = order.links_plan(pipeline.schedule, "process_group", device.type, apart is not None)
        if me == 0:
            log.warning(f"copy-engine stage links unavailable ({reason}); running the {schedule} "
                        "schedule over process groups")
    kernels = order.resident_link_kernels(schedule, len(own), own.index(me))
    if schedule == "overlapped" and stages > 1:
        groups = DirectedGroups(replica_ranks, me, device, meter, pipeline.link_max_ctas)
        return LinkChoice(schedule, transport, groups, kernels)
    return LinkChoice(schedule, transport, WorldLinks(), kernels)


class StageLinks:
    """This stage's links to its neighbours: blocking operations on the default group, and
    non-blocking ones through `backend`, the rank's one `LinkBackend` (`open_links`)."""

    def __init__(self, prev_rank: int | None, next_rank: int | None, device, meter: ByteMeter,
                 backend: LinkBackend, stage: int = 0):
        self.prev_rank, self.next_rank, self.device, self.meter = prev_rank, next_rank, device, meter
        self.backend, self.stage = backend, stage
        self._posted: dict[bool, deque] = {True: deque(), False: deque()}  # from_prev -> (i, tensors, works)
        self._sends: deque = deque()  # (tensors, works), oldest first

    # ------------------------------------------------------------------ blocking
    def send(self, tensors: Sequence[torch.Tensor], to_next: bool, kind: str) -> None:
        dst = self.next_rank if to_next else self.prev_rank
        for t in tensors:
            tdist.send(t.contiguous(), dst)
            self.meter.add("sent", nbytes(t), kind)

    def recv(self, spec: Spec, from_prev: bool, kind: str) -> list[torch.Tensor]:
        src = self.prev_rank if from_prev else self.next_rank
        out = []
        for shape, dtype in spec:
            t = torch.empty(shape, dtype=dtype, device=self.device)
            tdist.recv(t, src)
            self.meter.add("recv", nbytes(t), kind)
            out.append(t)
        return out

    # ------------------------------------------------------------------ non-blocking
    def isend(self, tensors: Sequence[torch.Tensor], to_next: bool, kind: str, keep: int) -> None:
        """Start sending `tensors`; the oldest sends are completed while more than `keep`
        messages are in flight (the memory they pin is bounded)."""
        dst = self.next_rank if to_next else self.prev_rank
        tensors = [t.contiguous() for t in tensors]
        works = self.backend.send(tensors, dst)
        for t in tensors:
            self.meter.add("sent", nbytes(t), kind)
        self._sends.append((tensors, works))
        while len(self._sends) > keep:
            self._complete_oldest_send()

    def post_recv(self, micro_batch: int, spec: Spec, from_prev: bool, kind: str) -> None:
        """Post receives for micro-batch `micro_batch`'s message; `wait_recv` returns it."""
        src = self.prev_rank if from_prev else self.next_rank
        tensors = [torch.empty(shape, dtype=dtype, device=self.device) for shape, dtype in spec]
        works = self.backend.recv(tensors, src)
        for t in tensors:
            self.meter.add("recv", nbytes(t), kind)
        self._posted[from_prev].append((micro_batch, tensors, works))

    def wait_recv(self, micro_batch: int, from_prev: bool) -> list[torch.Tensor]:
        queue = self._posted[from_prev]
        if not queue or queue[0][0] != micro_batch:
            have = [i for i, _, _ in queue]
            raise RuntimeError(f"stage {self.stage}: waiting for micro-batch {micro_batch} "
                               f"{'activations' if from_prev else 'gradients'}, posted receives are {have}")
        _, tensors, works = queue.popleft()
        for w in works:
            w.wait()
        return tensors

    def _complete_oldest_send(self) -> None:
        _, works = self._sends.popleft()
        for w in works:
            w.wait()

    def wait_sends(self) -> None:
        """Complete every send in flight; no receive may still be posted (a schedule ends clean)."""
        while self._sends:
            self._complete_oldest_send()
        left = {d: [i for i, _, _ in q] for d, q in self._posted.items() if q}
        if left:
            raise RuntimeError(f"stage {self.stage}: receives posted but never waited for: {left}")
