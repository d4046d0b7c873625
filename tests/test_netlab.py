"""The shaped-links harness: link classes, real tc-shaped rates under gloo, and teardown."""
from __future__ import annotations

import json
import os
import statistics
import sys
import time

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
    c = netlab.replica_coords([3, 3])  # rank = stage * M + replica
    assert c == [(0, 0), (1, 0), (0, 1), (1, 1), (0, 2), (1, 2)]
    assert netlab.link_class(c[0], c[2]) == "stage"
    assert netlab.link_class(c[0], c[1]) == "replica"
    assert netlab.link_class(c[0], c[3]) == "other"
    assert netlab.link_class(c[0], c[4]) == "other"  # stages 0 and 2 are not adjacent
    mixed = netlab.replica_coords([1, 2])  # mixed depths: replica by replica
    assert mixed == [(0, 0), (1, 0), (1, 1)] and netlab.link_class(mixed[1], mixed[2]) == "stage"
    r = netlab.replica_major_coords(4)
    assert r(5) == (1, 1)


def test_bad_arguments_name_the_value():
    """Mistyped rates or colliding coordinates fail before any namespace is made."""
    with pytest.raises(ValueError, match="-5"):
        netlab.ShapedNetwork(2, [(0, 0), (0, 1)], stage_rate_bps=-5)
    with pytest.raises(ValueError, match="same"):
        netlab.ShapedNetwork(2, [(0, 0), (0, 0)])
    with pytest.raises(ValueError, match="gso_max_segs"):
        netlab.ShapedNetwork(2, [(0, 0), (0, 1)], gso_max_segs=0)


@needs_netns
def test_teardown_on_error_leaves_no_namespace():
    """An exception inside the context still deletes every namespace of the run (and, while it
    is up, the veth has no GSO burst and set_rate changes every class of the link)."""
    with pytest.raises(RuntimeError, match="boom"):
        with netlab.ShapedNetwork(2, [(0, 0), (0, 1)], 8e6, None) as net:
            assert set(net.namespaces) <= set(netlab.list_namespaces())
            # No GSO burst past htb; the link's class with its ACK and data children at the rate.
            link = netlab._sh("ip", "-n", net.namespaces[0], "-d", "link", "show", netlab.IFACE).stdout
            assert "gso_max_segs 1 " in link
            classes = netlab._sh("tc", "-n", net.namespaces[0], "class", "show", "dev", netlab.IFACE).stdout
            assert classes.count("ceil 8Mbit") == 3 and "prio 0" in classes
            net.set_rate(2e6)
            classes = netlab._sh("tc", "-n", net.namespaces[0], "class", "show", "dev", netlab.IFACE).stdout
            assert classes.count("ceil 2Mbit") == 3
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


# ----------------------------------------------------------------------------- the engine on a shaped stage link

SHAPED_VOCAB, SHAPED_SEQ, SHAPED_MICRO, SHAPED_N_MB = 512, 64, 4, 2
SHAPED_RATE = 4e6  # bits/s on the one stage link
SHAPED_MODEL = dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                    intermediate_size=352, max_position_embeddings=SHAPED_SEQ)


def _shaped_links_bench():
    """bench/shaped_links.py as a module: the test uses the benchmark's own measurement method."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "bench" / "shaped_links.py"
    spec = importlib.util.spec_from_file_location("shaped_links_bench", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="session")
def shaped_inputs(tmp_path_factory):
    """(token cache, data dir): the default tokenizer (vocab 512) and a few stdlib files, built
    once per session in a temporary HETLOCO_CACHE, outside every timed run."""
    import shutil
    import sysconfig

    from hetloco_ds import data

    root = tmp_path_factory.mktemp("shaped")
    cache, docs = root / "cache", root / "docs"
    docs.mkdir()
    for name in ("argparse.py", "typing.py", "inspect.py", "dataclasses.py", "functools.py", "textwrap.py"):
        shutil.copy(os.path.join(sysconfig.get_paths()["stdlib"], name), docs / (name + ".txt"))
    tok = data.default_tokenizer(vocab_size=SHAPED_VOCAB, cache_dir=cache, progress=False)
    data.load_corpus(str(docs), tok, SHAPED_SEQ, cache_dir=cache, progress=False)
    return cache, docs


@needs_netns
def test_compressed_stage_link_beats_uncompressed_by_the_planned_factor(tmp_path, shaped_inputs):
    """S = 2, M = 1 (2 ranks, `hetloco-ds train` in two namespaces, gloo over TCP), one stage
    link shaped to 4 Mbit/s: ratio 8 must be faster than ratio 1 by about what plan.predict says.

    Each ratio is one run: a few steps on an unlimited link (they calibrate the compute time,
    t_c = T / (n_mb + S - 1)), then the link drops to 4 Mbit/s for a few more (the step in
    flight at the change is dropped). Bytes per step must equal the plan's exactly; the measured
    speed-up T1 / T8 must lie within 0.5x-2x of the plan's (plan's blocking schedule charges
    n_mb + S - 1 transfers per link direction where the engine makes n_mb, so it over-predicts
    the uncompressed, link-bound step by up to (n_mb + 1) / n_mb here).
    """
    sl = _shaped_links_bench()
    cache, docs = shaped_inputs
    model_path = tmp_path / "model.json"
    model_path.write_text(json.dumps(SHAPED_MODEL))
    shape = sl.model_shape(SHAPED_MODEL, SHAPED_VOCAB, SHAPED_SEQ)
    env = dict(os.environ, HETLOCO_CACHE=str(cache), HETLOCO_QUIET="1", TQDM_DISABLE="1",
               TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    step, plan_step, nbytes, plan_bytes = {}, {}, {}, {}
    for ratio in (1, 8):
        cfg = tmp_path / f"r{ratio}.json"
        cfg.write_text(json.dumps(sl.ds_config(2, SHAPED_N_MB, ratio, inner_steps=10**5, micro=SHAPED_MICRO,
                                               seq=SHAPED_SEQ, vocab=SHAPED_VOCAB)))
        out = tmp_path / f"r{ratio}"
        out.mkdir()
        cmd = sl.train_cmd(str(cfg), str(model_path), str(out), data=str(docs), nice=False)
        with netlab.ShapedNetwork(2, netlab.replica_coords([2]), stage_rate_bps=sl.UNLIMITED) as net:
            run = sl.EngineRun(net, cmd, str(out), env)
            try:
                sl.wait_steps(run, 2, max_s=60)  # start-up and the first (tensor-meta) step
                fast = sl.collect(run, time.time(), 3, max_s=30)
                slow = sl.collect(run, sl.set_rate(net, SHAPED_RATE), 3, max_s=40)
            finally:
                run.stop()
        assert len(fast) == 3 and len(slow) == 3, f"ratio {ratio}: too few steps ({len(fast)}, {len(slow)})"
        t_fast = statistics.median(v[0]["seconds"] for v in fast.values())
        step[ratio] = statistics.median(v[0]["seconds"] for v in slow.values())
        tflops = sl.calibrated_tflops(t_fast, ratio, shape, SHAPED_MICRO, SHAPED_N_MB)
        p = sl.predict_stage(ratio, SHAPED_RATE, tflops, shape, SHAPED_MICRO, SHAPED_N_MB)
        plan_step[ratio] = p.total_time
        plan_bytes[ratio] = p.stage_link_bytes_per_step
        rows = [v[0] for v in slow.values()]
        nbytes[ratio] = {r["bytes"]["activation"]["sent"] + r["bytes"]["activation_grad"]["sent"] for r in rows}
        print(f"ratio {ratio}: unlimited {t_fast:.3f} s, 4 Mbit/s {step[ratio]:.3f} s "
              f"(plan {p.total_time:.3f} s), {sorted(nbytes[ratio])} B/step (plan {plan_bytes[ratio]})")
    for ratio in (1, 8):
        assert nbytes[ratio] == {plan_bytes[ratio]}
    measured, predicted = step[1] / step[8], plan_step[1] / plan_step[8]
    print(f"speed-up of ratio 8 at 4 Mbit/s: measured {measured:.2f}x, plan {predicted:.2f}x")
    assert step[8] < step[1]
    assert 0.5 * predicted <= measured <= 2 * predicted
