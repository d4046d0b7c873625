"""The outer sync's gloo exchange returns exactly what all_gather returns."""
from __future__ import annotations

import pytest

from distributed import run_ranks


def _exchange_body(rank, groups):
    import torch
    import torch.distributed as tdist

    from hetloco_ds.transport.static import all_gather_payloads

    group = None
    if groups is not None:
        made = [tdist.new_group(g) for g in groups]  # every rank creates every group
        group = next(g for g, ranks in zip(made, groups) if rank in ranks)
    assert tdist.get_backend(group) == "gloo"
    gen = torch.Generator().manual_seed(1000 + rank)
    out = {}
    # An odd-length byte payload (like the packed SparseLoCo payload) and floats whose bit
    # patterns include NaNs and signed zeros: the comparison is on bytes.
    floats = torch.randn(1031, generator=gen)
    floats[::97] = float("nan")
    floats[5] = -0.0
    for name, t in (("uint8", torch.randint(0, 256, (160_637,), dtype=torch.uint8, generator=gen)),
                    ("float32", floats)):
        mine = all_gather_payloads(t, group)
        ref = [torch.empty_like(t) for _ in range(tdist.get_world_size(group))]
        tdist.all_gather(ref, t, group=group)
        out[name] = ([x.view(torch.uint8) for x in mine], [x.view(torch.uint8) for x in ref])
        assert mine[tdist.get_rank(group)].data_ptr() != t.data_ptr()  # own slot is a copy, as all_gather's
    return out


@pytest.mark.parametrize("world,groups", [(3, None), (4, [[0, 2], [1, 3]])])
def test_gloo_exchange_equals_all_gather(world, groups):
    """M = 3 on the whole world, and two M = 2 groups of non-adjacent ranks (DeepSpeed's
    data-parallel groups, rank = stage * M + replica): the recv-first exchange returns the same
    tensors, bit for bit and in group-rank order, as torch.distributed.all_gather. Breaks if a
    group rank is mistaken for a global rank, if a peer's slot is filled from the wrong sender,
    or if the exchange deadlocks with more than one peer."""
    import torch

    results = run_ranks(_exchange_body, world, groups, timeout=120)
    for rank, res in enumerate(results):
        for name, (mine, ref) in res.items():
            size = len(groups[0]) if groups else world
            assert len(mine) == len(ref) == size
            for i, (a, b) in enumerate(zip(mine, ref)):
                assert torch.equal(a, b), f"rank {rank} {name}: slot {i} differs from all_gather's"
