"""Replicas of their own pipeline depths in one static world (`hetloco.replica_stages`, issue 29).

Real gloo ranks on CPU, a 4-layer tiny LLaMA built from per-layer seeds (the simulator builds the
same model), H = 2, replica-specific batches. The outer sync runs by block (the finest common
partition of the replicas' cuts), so every replica must end each outer step with bitwise the same
parameters whatever its cut; with equal depths the block path must be today's engine bit for bit."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from distributed import run_job, run_ranks

SEQ, VOCAB, H, STEPS = 16, 96, 2, 4


def _config(replica_stages=None, stages=None, compressed=()):
    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "betas": [0.9, 0.95], "weight_decay": 0.1}},
        "hetloco": {"sparseloco": {"inner_steps": H}, "subspace": {"ratio": 4, "compressed_replicas": list(compressed)},
                    "train": {"seq_len": SEQ, "seed": 7}},
    }
    if replica_stages is not None:
        cfg["hetloco"]["replica_stages"] = replica_stages
    if stages is not None:
        cfg["pipeline"] = {"stages": stages}
    return cfg


def _batch(replica: int, step: int):
    g = torch.Generator().manual_seed(1000 * replica + step)
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=g)
    return ids, ids


def _state(module) -> dict:
    """(layer index, name) -> tensor for every parameter and T_perp this rank holds."""
    out = {}
    for idx, layer in module.local_layers().items():
        for name, t in list(layer.named_parameters()) + [(n, b) for n, b in layer.named_buffers() if n == "perp"]:
            out[(idx, name)] = t.detach().clone()
    return out


def _engine_body(rank, cfg, tied):
    from conftest import tiny_llama_config
    from hetloco_ds.build import build_engine, build_module
    from hetloco_ds.config import parse_config

    run = parse_config(cfg)
    module = build_module(run, tiny_llama_config(tied=tied))
    engine = build_engine(run, module, seq_len=SEQ)
    losses, synced = [], []
    for step in range(1, STEPS + 1):
        rec = engine.train_step(iter([_batch(engine.replica, step)]))
        losses.append(rec.loss)
        if rec.outer is not None:
            synced.append(_state(module))
    return engine.replica, losses, synced, dict(rec.bytes["outer_sync"])


def _by_replica(results):
    """replica -> (losses, [merged state after each outer step], [outer_sync bytes of each rank])."""
    out: dict = {}
    for replica, losses, synced, sync_bytes in results:
        entry = out.setdefault(replica, (losses, [{} for _ in synced], []))
        assert entry[0] == losses  # every stage of a replica reports the replica's loss
        for merged, state in zip(entry[1], synced):
            merged.update(state)
        entry[2].append(sync_bytes)
    return out


def _simulate(cfg, tied):
    from conftest import tiny_llama_config
    from hetloco_ds.config import parse_config
    from hetloco_ds.sim.replica import Simulation

    run = parse_config(cfg)
    stages = run.hetloco.replica_stages
    sim = Simulation(run, run.hetloco, tiny_llama_config(tied=tied), len(stages), run.stages, torch.device("cpu"))
    losses = []
    for step in range(1, STEPS + 1):
        losses.append(sim.train_step([[_batch(m, step)] for m in range(len(stages))]).reshape(-1).tolist())
        if step % H == 0:
            sim.outer_step()
    return losses, sim


@pytest.mark.parametrize("stages,tied,compressed", [([1, 2], False, [1]), ([1, 2], True, [1]), ([1, 2, 2], True, [2]),
                                                    ([1, 2, 2], False, [0, 2]), ([2, 3], True, [1])])
def test_mixed_depth_replicas_agree_bitwise_after_every_outer_step_and_match_the_simulator(stages, tied, compressed):
    """[1, 2] and [1, 2, 2], the last replica compressed (ratio 4; in one case the one-stage replica
    too, which has no link to compress but trains T_S as every compressed replica), tied and
    untied, and [2, 3] (three blocks: replica 0's second stage holds two, replica 1's stages one
    each): after each of
    the two outer steps every replica's whole model (every layer's parameters, a tied head's copy,
    T_perp) is bitwise the same, while the replicas' losses differ (they trained on their own
    data); the per-replica simulator with the same depths gives the same losses and synced model to
    float rounding (a few ulp: it runs each replica's forward in one process; test_simulate.py's
    CLI test holds losses to the same rel 1e-5). Each rank's outer-sync
    bytes are those of the blocks it holds. Breaks if a block's exchange mixes coordinates of
    different cuts, if the one-stage replica treats a tied head unlike the others, or if the
    simulator's block walk differs from the engine's."""
    cfg = _config(stages, compressed=compressed)
    replicas = _by_replica(run_ranks(_engine_body, sum(stages), cfg, tied))
    assert sorted(replicas) == list(range(len(stages)))
    assert len({tuple(losses) for losses, _, _ in replicas.values()}) == len(stages)
    ref = replicas[0][1]
    assert len(ref) == STEPS // H
    for m, (_, synced, _) in replicas.items():
        for k, (want, got) in enumerate(zip(ref, synced)):
            assert set(got) == set(want), (m, k)
            bad = [key for key in want if not torch.equal(want[key], got[key])]
            assert not bad, f"replica {m} after outer step {k + 1} differs from replica 0 in {bad[:4]}"
    sim_losses, sim = _simulate(cfg, tied)
    # Every rank's record holds its replica's bytes (its stages summed): each replica sends each
    # block's payload to the M - 1 others, whatever its cut (replica 0: both blocks on one rank).
    payload = sum(n for a in sim.replicas[0].algorithms for n in a.outer.nbytes)
    for m, (_, _, sync_bytes) in replicas.items():
        assert sync_bytes == [{"sent": payload * (len(stages) - 1), "recv": payload * (len(stages) - 1)}] * stages[m]
    for m, (losses, _, _) in replicas.items():
        assert [row[m] for row in sim_losses] == pytest.approx(losses, rel=1e-5), m
    layers = sim.replicas[0].layers
    for key, want in ref[-1].items():
        got = layers[key[0]].get_parameter(key[1]) if key[1] != "perp" else layers[key[0]].perp
        torch.testing.assert_close(got.detach(), want, rtol=1e-5, atol=1e-6, msg=str(key))


def test_equal_depths_through_replica_stages_are_todays_engine_bitwise():
    """replica_stages [2, 2] (the per-replica grids, the block groups) against pipeline.stages = 2
    (DeepSpeed's M x S grid): the same losses at every step and the same synced parameters, bit for
    bit, with replica 1 compressed. Breaks if the block path changes today's math or payloads."""
    new = _by_replica(run_ranks(_engine_body, 4, _config([2, 2], compressed=[1]), False))
    old = _by_replica(run_ranks(_engine_body, 4, _config(stages=2, compressed=[1]), False))
    for m in (0, 1):
        assert new[m][0] == old[m][0]
        for a, b in zip(new[m][1], old[m][1]):
            assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)
        assert new[m][2] == old[m][2]


def test_nproc_3_one_and_two_stage_replicas_train_and_export_a_model_transformers_loads(tmp_path, capsys):
    """`hetloco-ds train` on 3 ranks (as --nproc 3 starts them) with replica_stages [1, 2] (a tied model from an HF directory,
    replica 1 compressed, H = 2, 4 steps), then `hetloco-ds export`: transformers loads the export,
    its loss on the validation batches is the one-stage replica's final validation loss (so the
    export is the replicas' synced model), and it equals the OUT/hf the run wrote. Breaks if the
    launcher, the checkpoint or the export assume one depth for every replica."""
    from transformers import LlamaForCausalLM

    import runs
    from conftest import save_tiny_llama
    from test_cli import read_metrics, tiny_tokenizer, transformers_validation_loss, write_config, write_text_folder

    hf = tmp_path / "hf"
    save_tiny_llama(hf, tied=True)
    tiny_tokenizer().save_pretrained(hf)
    data, cache, out = write_text_folder(tmp_path / "data"), tmp_path / "cache", tmp_path / "out"
    cfg = write_config(tmp_path / "cfg.json", {"hetloco.replica_stages": [1, 2], "hetloco.sparseloco.inner_steps": 2,
                                               "hetloco.subspace.compressed_replicas": [1],
                                               "hetloco.subspace.ratio": 2})
    # The 3 ranks as `--nproc 3` starts them (test_launchers: the same job), forked: fast.
    run_job(tmp_path / "job", 3, ["train", "--steps", 4, "--model", hf, "--data", data, "--config", cfg, "--out", out],
            runs.env(cache))
    exported = tmp_path / "exported"
    from hetloco_ds import cli  # `hetloco-ds export` is one process: its main, run here

    assert cli.main(["export", str(out / "checkpoints"), str(exported)]) == 0, capsys.readouterr().err[-3000:]
    model = LlamaForCausalLM.from_pretrained(exported)
    assert model.config.tie_word_embeddings and model.config.num_hidden_layers == 4
    ours, theirs = runs.hf_tensors(exported), runs.hf_tensors(out / "hf")
    assert set(ours) == set(theirs) and all(torch.equal(ours[k], theirs[k]) for k in ours)
    last = [r for r in read_metrics(out) if r["kind"] == "validation"][-1]
    assert last["step"] == 4 and len(last["replica_losses"]) == 2
    assert last["replica_losses"][0] == pytest.approx(transformers_validation_loss(exported, data, cfg, cache), rel=1e-5)


def _resume_body(rank, cfg, ckpt_dir):
    from conftest import tiny_llama_config
    from hetloco_ds.build import build_engine, build_module
    from hetloco_ds.config import parse_config

    run = parse_config(cfg)
    module = build_module(run, tiny_llama_config(tied=True))
    engine = build_engine(run, module, seq_len=SEQ)
    for step in (1, 2):
        engine.train_step(iter([_batch(engine.replica, step)]))
    engine.save_checkpoint(ckpt_dir)
    runs = []
    for _ in range(2):  # straight on; then again from the checkpoint
        losses = [engine.train_step(iter([_batch(engine.replica, step)])).loss for step in (3, 4)]
        runs.append((losses, _state(module)))
        engine.load_checkpoint(ckpt_dir)
    return runs


def test_a_mixed_depth_run_resumes_from_its_checkpoint_bit_for_bit(tmp_path):
    """[1, 2], tied, replica 1 compressed, Nesterov outer momentum: a checkpoint at the first outer
    step, loaded back, continues to the same losses and the same synced model, bitwise, on every
    rank (replica 0's rank holds two blocks, each with its own outer state and momentum). Breaks if
    a rank's blocks, a one-stage replica's head copy or its momentum are lost in the checkpoint."""
    cfg = _config([1, 2], compressed=[1])
    cfg["hetloco"]["sparseloco"]["outer_momentum"] = 0.9
    for (straight, s_state), (resumed, r_state) in run_ranks(_resume_body, 3, cfg, str(tmp_path / "ckpt")):
        assert straight == resumed
        assert set(s_state) == set(r_state) and all(torch.equal(s_state[k], r_state[k]) for k in s_state)


def test_rank_layout_and_block_holders():
    """Equal depths keep DeepSpeed's layout (rank = stage x M + replica); mixed depths number each
    replica's ranks contiguously; each block's holders, one per replica, sorted by rank, are in
    replica order (what GroupTransport's member order needs). Breaks if a layout change reorders
    replicas inside a block group or moves today's equal-depth ranks."""
    from hetloco_ds import sizes

    assert sizes.replica_ranks([2, 2]) == [[0, 2], [1, 3]]
    assert sizes.replica_ranks([1, 2, 2]) == [[0], [1, 2], [3, 4]]
    assert sizes.replica_ranks([2, 1]) == [[0, 1], [2]]
    assert sizes.block_parts(4, [1, 2]) == [0, 3, 7]  # embedding + 2 decoders | 2 decoders + norm + head
    assert sizes.block_ranks(4, [1, 2, 2]) == [[0, 1, 3], [0, 2, 4]]
    assert sizes.block_ranks(4, [2, 3]) == [[0, 2], [1, 3], [1, 4]]
    assert sizes.block_ranks(4, [2, 2]) == [[0, 1], [2, 3]]  # the stages' data-parallel groups
    for stages in ([1, 2], [2, 1], [3, 1, 2], [2, 3]):
        assert all(b == sorted(b) for b in sizes.block_ranks(4, stages))


@pytest.mark.parametrize("settings", [{}, {"quant_bits": 2, "outer_momentum": 0.9, "norm_clip": "median"}])
def test_a_stage_split_into_blocks_takes_the_whole_stages_outer_step_bit_for_bit(settings):
    """Three fake replicas, five tensors of a stage in two blocks (BlockStates, one payload each)
    against one SparseLoCoState over all five, two outer steps: the same parameters, bitwise, and
    one more 16-byte header per block on the wire. The premise of the exchange by block: a
    tensor's chunking, top-k, quantisation, clipping, error feedback and momentum never depend
    on the other tensors of its payload. Breaks if any of them starts to."""
    from hetloco_ds.config import SparseLoCoConfig
    from hetloco_ds.sparseloco.blocks import BlockStates
    from hetloco_ds.sparseloco.outer import SparseLoCoState

    cfg = SparseLoCoConfig(preset="paper", topk=4, chunk_size=16, **settings)
    g = torch.Generator().manual_seed(0)
    shapes = [(8, 8), (8,), (8, 8), (4, 8), (8,)]
    whole = [[torch.randn(s, generator=g) for s in shapes] for _ in range(3)]
    split = [[t.clone() for t in p] for p in whole]
    one = [SparseLoCoState(p, cfg) for p in whole]
    blocked = [BlockStates(p, [[0, 1], [2, 3, 4]], cfg) for p in split]
    for _ in range(2):
        for a, b in zip(whole, split):
            for x, y in zip(a, b):
                step = torch.randn(x.shape, generator=g) * 0.1
                x.add_(step), y.add_(step)
        payloads = [s.prepare(p) for s, p in zip(one, whole)]
        reports = [s.finish(p, payloads) for s, p in zip(one, whole)]
        by_block = list(zip(*[s.prepare(p) for s, p in zip(blocked, split)]))
        blocked_reports = [s.finish(p, by_block) for s, p in zip(blocked, split)]
        assert blocked_reports[0].bytes_per_replica == reports[0].bytes_per_replica + 16
        assert blocked_reports[0].contributors == reports[0].contributors == (0, 1, 2)
        assert all(torch.equal(x, y) for a, b in zip(whole, split) for x, y in zip(a, b))
