"""The shaped-links harness: link classes, real tc-shaped rates under gloo, and teardown."""
from __future__ import annotations

import json
import sys

import pytest

from hetloco_ds import netlab

OK, WHY = netlab.available()
TCP_EFFICIENCY = 1448 / 1514  # TCP payload per Ethernet frame at MTU 1500 with timestamps
needs_netns = pytest.mark.skipif(not OK, reason=f"shaped namespaces unavailable: {WHY}")

# Rank 0 sends NBYTES to rank 1 (a stage link) and then to rank 2 (a replica link); each
# receiver times its recv after a barrier and prints its goodput as JSON.
PROGRAM = r"""
import json, os, sys, time
import torch
import torch.distributed as dist

nbytes = int(sys.argv[1])
dist.init_process_group("gloo")
rank = dist.get_rank()
warm, big = torch.zeros(256), torch.zeros(nbytes // 4)
for peer in (1, 2):  # open both connections (and leave TCP slow start) before timing
    if rank == 0:
        dist.send(warm, peer)
    elif rank == peer:
        dist.recv(warm, 0)
for peer in (1, 2):
    dist.barrier()
    if rank == 0:
        dist.send(big, peer)
    elif rank == peer:
        t0 = time.monotonic()
        dist.recv(big, 0)
        dt = time.monotonic() - t0
        print(json.dumps({"peer": peer, "seconds": dt, "bps": nbytes * 8 / dt}))
dist.barrier()
dist.destroy_process_group()
"""


def test_link_class_follows_the_topology():
    """Stage links join adjacent stages of one replica, replica links one stage across replicas;
    a wrong class would shape the outer sync at the activation rate or vice versa."""
    c = netlab.deepspeed_coords(2)  # rank = stage * M + replica
    assert [c(r) for r in range(6)] == [(0, 0), (1, 0), (0, 1), (1, 1), (0, 2), (1, 2)]
    assert netlab.link_class(c(0), c(2)) == "stage"
    assert netlab.link_class(c(0), c(1)) == "replica"
    assert netlab.link_class(c(0), c(3)) == "other"
    assert netlab.link_class(c(0), c(4)) == "other"  # stages 0 and 2 are not adjacent
    r = netlab.replica_major_coords(4)
    assert r(5) == (1, 1)


def test_bad_arguments_name_the_value():
    """Mistyped rates or colliding coordinates fail before any namespace is made."""
    with pytest.raises(ValueError, match="-5"):
        netlab.ShapedNetwork(2, [(0, 0), (0, 1)], stage_rate_bps=-5)
    with pytest.raises(ValueError, match="same"):
        netlab.ShapedNetwork(2, [(0, 0), (0, 0)])


@needs_netns
def test_teardown_on_error_leaves_no_namespace():
    """An exception inside the context still deletes every namespace of the run."""
    with pytest.raises(RuntimeError, match="boom"):
        with netlab.ShapedNetwork(2, [(0, 0), (0, 1)], 8e6, None) as net:
            assert set(net.namespaces) <= set(netlab.list_namespaces())
            raise RuntimeError("boom")
    assert not [n for n in netlab.list_namespaces() if n.startswith(net.name)]


@needs_netns
def test_shaped_stage_link_runs_at_its_rate_and_replica_link_is_faster(tmp_path):
    """Rank 0 -> 1 crosses an 8 Mbit/s stage link, rank 0 -> 2 a 200 Mbit/s replica link.

    Guards the whole harness: namespaces, bridge, per-peer htb classes chosen by link class,
    gloo finding its interface, and teardown. A measured stage rate off by > 25% means shaping
    is missing or applied to the wrong class.
    """
    prog = tmp_path / "send.py"
    prog.write_text(PROGRAM)
    nbytes = 4 * 2**20
    coords = [(0, 0), (0, 1), (1, 0)]  # rank 1: next stage; rank 2: other replica
    stage_bps, replica_bps = 8e6, 200e6
    with netlab.ShapedNetwork(3, coords, stage_bps, replica_bps) as net:
        res = net.run(lambda r: [sys.executable, str(prog), str(nbytes)], timeout=50)
        counted = net.link_bytes()
    for r in res:
        assert r.returncode == 0, f"rank {r.rank} failed ({r.returncode}):\n{r.stderr[-3000:]}"
    rate = {}
    for r in res:
        for line in r.stdout.splitlines():
            if line.startswith("{"):
                m = json.loads(line)
                rate[m["peer"]] = m["bps"]
    print(f"measured goodput: stage link {rate[1] / 1e6:.2f} Mbit/s (shaped 8), "
          f"replica link {rate[2] / 1e6:.1f} Mbit/s (shaped 200)")
    assert 0.75 * stage_bps <= rate[1] <= 1.25 * stage_bps
    # The cost model's link term, with TCP/IPv4/Ethernet framing (plan's link_efficiency), is
    # what the shaped link delivers.
    modelled = nbytes * 8 / (stage_bps * TCP_EFFICIENCY)
    assert nbytes * 8 / rate[1] == pytest.approx(modelled, rel=0.15)
    assert rate[2] > 5 * rate[1]
    assert counted[(0, 1)] >= nbytes and counted[(0, 2)] >= nbytes
    assert not [n for n in netlab.list_namespaces() if n.startswith(net.name)]
