"""The static transport: every replica in one torch.distributed world, as DeepSpeed lays it out.

`GroupTransport` runs a stage's outer-sync exchange inside DeepSpeed's data-parallel group of
that stage (replicas of their own depths: one per outer-sync block, in the block's group,
`block_groups`); `PipeStageLink` shares tensors from a replica's first stage over its pipe group.
Both count what they put on a wire in the engine's ByteMeter.

Why the gloo exchange is not `all_gather`: gloo's TCP transport is a rendezvous. A send's data
leaves only after the peer's "ready to receive" notification arrives, and that notification
travels on the same TCP connection as bulk data going the other way. In gloo's all_gather (and
all_reduce) a rank can have its own payload already queued in its socket and its shaped egress
queue when it posts its receive; its notification then waits behind that payload, and the
peer's data only starts once it has drained: the two directions of a pair run largely one after
the other (1.0x-1.5x a one-way transfer of a 160 KB payload at 5-100 Mbit/s, depending on a race;
bench/results/shaped_links.json). Posting every receive first puts every notification on the wire
ahead of any bulk data, so both directions of every pair move at once and the exchange takes one
one-way transfer per peer link. NCCL's links are full duplex: it keeps all_gather.

Bytes are the same as all_gather's: each rank sends its tensor to each of the M - 1 others and
receives M - 1 tensors.
"""
from __future__ import annotations

import torch
import torch.distributed as tdist

from ..meter import ByteMeter, nbytes
from . import Gathered, ReplicaTransport


def all_gather_payloads(tensor: torch.Tensor, group=None) -> list[torch.Tensor]:
    """[tensor of group rank 0, ..., of group rank M-1], the tensors `all_gather` fills in.

    Every rank of `group` must call it with a contiguous tensor of the same shape and dtype.
    The own slot is a copy, as all_gather's is.
    """
    group = tdist.group.WORLD if group is None else group
    world = tdist.get_world_size(group)
    if world == 1:
        return [tensor.clone()]
    if tdist.get_backend(group) != "gloo":
        out = [torch.empty_like(tensor) for _ in range(world)]
        tdist.all_gather(out, tensor, group=group)
        return out
    ranks = tdist.get_process_group_ranks(group)
    me = tdist.get_rank(group)
    peers = [(me + i) % world for i in range(1, world)]
    out = [tensor.clone() if i == me else torch.empty_like(tensor) for i in range(world)]
    # Every irecv first: each posts its ready-to-receive notification before any bulk data is queued.
    reqs = [tdist.irecv(out[i], src=ranks[i], group=group) for i in peers]
    reqs += [tdist.isend(tensor, dst=ranks[i], group=group) for i in peers]
    for r in reqs:
        r.wait()
    return out


def block_groups(block_ranks: list[list[int]]) -> list:
    """One process group per outer-sync block (`sizes.block_ranks`: the rank of every replica that
    holds it), for replicas of their own depths. Collective over the whole world: every rank creates
    every block's group, in block order. A group's ranks sorted are in replica order
    (`sizes.replica_ranks`), so its rank i is replica i, as `GroupTransport` needs."""
    return [tdist.new_group(ranks=ranks) for ranks in block_ranks]


class GroupTransport(ReplicaTransport):
    """A stage's outer-sync exchange inside a fixed process group whose rank i is replica i.

    Every rank of the group reaches `exchange` at the same outer step with a payload of the same
    length (the layout depends only on the stage's parameter shapes and the config), so the
    collective cannot mismatch or deadlock.
    """

    def __init__(self, group, meter: ByteMeter):
        self.group = group
        self.meter = meter
        self.size = tdist.get_world_size(group) if group is not None else 1
        self.members = tuple(str(m) for m in range(self.size))

    def exchange(self, payload: torch.Tensor) -> Gathered:
        if self.size == 1:
            return Gathered([payload], self.members)
        gathered = all_gather_payloads(payload, self.group)
        self.meter.add("sent", nbytes(payload) * (self.size - 1), "outer_sync")
        self.meter.add("recv", nbytes(payload) * (self.size - 1), "outer_sync")
        return Gathered(gathered, self.members)


class PipeStageLink:
    """Shares a tensor from a replica's first (or last) stage with its other stages over the pipe group.

    Every stage of the replica calls the same `share_*` at the same point, the owner with the
    tensor and the others with None (a broadcast: all ranks of the group must take part).
    `src` and `last_src` are the global ranks of the replica's first and last stages.
    """

    def __init__(self, group, src: int, is_first: bool, num_stages: int, device, meter: ByteMeter,
                 last_src: int | None = None, is_last: bool = False):
        self.group, self.src, self.is_first = group, src, is_first
        self.last_src, self.is_last = last_src, is_last
        self.num_stages, self.device, self.meter = num_stages, device, meter

    def _count(self, n: int, kind: str, owner: bool | None = None) -> None:
        if self.is_first if owner is None else owner:
            self.meter.add("sent", n * (self.num_stages - 1), kind)
        else:
            self.meter.add("recv", n, kind)

    def offer(self, tensor: torch.Tensor, source: str) -> None:
        """Nothing to do: the owner passes its tensor to `share_sparse` itself."""

    def share_dense(self, tensor: torch.Tensor | None, shape: tuple[int, ...], kind: str = "control",
                    source: str = "first") -> torch.Tensor:
        owner = self.is_first if source == "first" else self.is_last
        out = tensor.detach().clone() if owner else torch.empty(shape, device=self.device)
        if self.num_stages > 1:
            tdist.broadcast(out, src=self.src if source == "first" else self.last_src, group=self.group)
            self._count(nbytes(out), kind, owner)
        return out

    def share_sparse(self, tensor: torch.Tensor | None, shape: tuple[int, ...],
                     kind: str = "embedding_sync", source: str = "first") -> torch.Tensor:
        """The non-zeros as (int32 flat indices, values): the decoded average of M top-k payloads
        has at most M*k entries per chunk."""
        if self.num_stages == 1:
            return tensor
        owner = self.is_first if source == "first" else self.is_last
        src = self.src if source == "first" else self.last_src
        count = torch.zeros(1, dtype=torch.int64, device=self.device)
        if owner:
            flat = tensor.reshape(-1)
            idx = flat.nonzero().reshape(-1).to(torch.int32)
            vals = flat[idx.long()]
            count[0] = idx.numel()
        tdist.broadcast(count, src=src, group=self.group)
        n = int(count.item())
        if not owner:
            idx = torch.empty(n, dtype=torch.int32, device=self.device)
            vals = torch.empty(n, dtype=torch.float32, device=self.device)
        tdist.broadcast(idx, src=src, group=self.group)
        tdist.broadcast(vals, src=src, group=self.group)
        self._count(nbytes(count) + nbytes(idx) + nbytes(vals), kind, owner)
        if owner:
            return tensor
        out = torch.zeros(shape, device=self.device).reshape(-1)
        out[idx.long()] = vals
        return out.reshape(shape)
