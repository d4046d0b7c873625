"""The outer sync's all-gather, with a cost that follows the link on gloo over slow TCP links.

`all_gather_payloads(tensor, group)` returns every rank's `tensor` in group-rank order, the same
tensors (bit for bit) that `torch.distributed.all_gather` fills in.

* NCCL (and every backend but gloo): `all_gather` itself; NCCL's links are full duplex.
* gloo: a pairwise exchange that posts a receive from every peer *before* any send, then waits
  for all of them. Why: gloo's TCP transport is a rendezvous. A send's data leaves only after the
  peer's "ready to receive" notification arrives, and that notification travels on the same TCP
  connection as bulk data going the other way. In gloo's all_gather (and all_reduce) a rank can
  have its own payload already queued in its socket and its shaped egress queue when it posts
  its receive; its notification then waits behind that payload, and the peer's data only starts
  once it has drained: the two directions of a pair run largely one after the other (1.0x-1.5x a
  one-way transfer of a 160 KB payload at 5-100 Mbit/s, depending on a race; the probe points of
  bench/results/shaped_links.json). Posting every receive first puts every notification on the
  wire ahead of any bulk data, so both directions of every pair move at once and the exchange
  takes one one-way transfer per peer link (1.01x-1.02x at 20 and 5 Mbit/s there).

Bytes are the same as all_gather's: each rank sends its tensor to each of the M - 1 others and
receives M - 1 tensors. On a rank with one uplink of rate bw that is (M - 1) * size / bw, as for a
ring all-gather; on per-peer links (netlab) the M - 1 sends run side by side.
"""
from __future__ import annotations

import torch
import torch.distributed as tdist


def all_gather_payloads(tensor: torch.Tensor, group=None) -> list[torch.Tensor]:
    """[tensor of group rank 0, ..., of group rank M-1]; see the module docstring.

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
