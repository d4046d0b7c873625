"""The simulator measures the real system: same per-step losses as a multi-process run."""
from __future__ import annotations

import json
import os

import pytest
import torch

import runs
from distributed import run_job

MODEL = runs.TINY_MODEL


def _files(tmp_path, cache, tied: bool = False):
    cfg, model = runs.hetero_files(tmp_path, eval_batches=2, tied=tied)
    return cfg, model, dict(os.environ, HETLOCO_CACHE=str(cache))


def _step_losses(path, **match):
    rows = [json.loads(l) for l in open(path)]
    return {(r["step"], r["replica"]): r["loss"] for r in rows
            if r["kind"] == "step" and all(r.get(k) == v for k, v in match.items())}


@pytest.mark.parametrize("tied", [False, True])
def test_heterogeneous_engine_run_matches_simulator(tmp_path, tmp_path_factory, tied, monkeypatch, capsys):
    """2 replicas x 2 stages, replica 1 compressed at ratio 4, in 4 rank processes of the CLI,
    against `hetloco-ds simulate` with the same config, seeds and data: every replica's loss at
    every step agrees to float tolerance (through two outer steps and their embedding
    resyncs), for an untied model and a tied one (its embedding and head copies trained apart and
    reconciled at outer steps, the default). Breaks if the simulator and the engine differ in
    anything that touches training."""
    cache = tmp_path_factory.getbasetemp() / "hetloco-cache"
    cfg, model, env = _files(tmp_path, cache, tied)
    # `hetloco-ds simulate` is one process of its own: run by cli.main here (no fresh interpreter).
    from hetloco_ds import cli

    monkeypatch.setenv("HETLOCO_CACHE", str(cache))
    code = cli.main(["simulate", "--config", cfg, "--model-config", model, "--replicas", "2", "--steps", "6",
                     "--variants", "het:4", "--device", "cpu", "--out", str(tmp_path / "sim")])
    assert code == 0, capsys.readouterr().err[-3000:]
    # The 4 ranks as torchrun starts them (test_launchers: the same job as --nproc 4), forked: fast.
    run_job(tmp_path / "real.log", 4, ["train", "--config", cfg, "--model-config", model, "--steps", "6",
                                       "--out", str(tmp_path / "real")], env)
    s = _step_losses(tmp_path / "sim" / "metrics.jsonl")
    r = _step_losses(tmp_path / "real" / "metrics.jsonl")
    assert set(r) == {(step, m) for step in range(1, 7) for m in (0, 1)}
    for key in r:
        assert s[key] == pytest.approx(r[key], rel=1e-5), key
    results = json.loads((tmp_path / "sim" / "results.json").read_text())
    row = results["rows"][0]
    # Replica 0 sends b*L*d*4 each way per micro-batch; replica 1 b*L*(2*k*4 + 1 byte of id).
    b, L, gas, d, k = 2, 32, 1, 32, 8
    expected = (b * L * 2 * d * 4 * gas + b * L * (2 * k * 4 + 2) * gas) / 2 / (b * L * gas)
    assert row["stage_link_bytes_per_token"] == pytest.approx(expected)


def test_simulator_ablation_switches(tmp_path_factory):
    """In the simulator, embedding_adaptation=false leaves T_perp untouched by outer syncs and
    project_residual_weights puts o_proj's outputs in Col(U) without projecting T_S (that is its
    own switch); the defaults do neither. Breaks if a switch is ignored or if the Table 5b
    ablation drags the per-step T_S projection back in."""
    from hetloco_ds import subspace
    from hetloco_ds.config import parse_config
    from hetloco_ds.presets import model_config_for
    from hetloco_ds.sim.replica import Simulation
    from hetloco_ds.sim.rows import Variant

    cfg = parse_config({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
                        "hetloco": {"sparseloco": {"inner_steps": 2}, "train": {"seq_len": 16}}})
    llama = model_config_for("tiny", 96)

    def run(variant):
        sim = Simulation(cfg, variant.hetloco(cfg.hetloco, 2), llama, 2, 2, torch.device("cpu"))
        perp0 = sim.replicas[0].algorithms[0].perp.clone()
        g = torch.Generator().manual_seed(0)
        for _ in range(2):
            sim.train_step([[(ids, ids)] for ids in torch.randint(0, 96, (2, 2, 16), generator=g)])
        # After inner steps (the outer step then applies the unprojected sparse average).
        o = sim.replicas[1].layers[1].layer.self_attn.o_proj.weight.detach()
        basis = sim.replicas[1].algorithms[0].basis
        off = subspace.off_subspace_norm(o.T, basis)
        ts_off = subspace.off_subspace_norm(sim.replicas[1].layers[0].weight.detach(), basis)
        sim.outer_step()
        return torch.equal(perp0, sim.replicas[0].algorithms[0].perp), off, ts_off

    fixed, off, ts_off = run(Variant("ablate", ratio=4, compressed=2, embedding_adaptation=False,
                                     project_residual_weights=True))
    assert fixed and off < 1e-5 and ts_off > 1e-3
    fixed, off, ts_off = run(Variant("default", ratio=4, compressed=2))
    assert not fixed and off > 0.1 and ts_off > 1e-3


def test_row_flags_stepproj_and_tsdecay_set_their_subspace_switches():
    """`--variants pp:4:stepproj:tsdecay` is a row with the per-step T_S projection and the decay on
    T_S alone; a row without the flags runs the paper's method (no per-step projection, the whole
    table decayed), whatever the base config. Breaks if a flag is dropped on the way to the
    row's `hetloco.subspace` or a row inherits the ablation."""
    from hetloco_ds.config import ConfigError, parse_config
    from hetloco_ds.sim.rows import parse_variants

    base = parse_config({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
                         "hetloco": {"subspace": {"project_embedding_every_step": True, "embedding_weight_decay": "t_s"}}})
    rows = parse_variants(["pp:4:stepproj:tsdecay", "pp:4"], 2, [0])
    ablation, paper = (v.hetloco(base.hetloco, 2).subspace for v in rows)
    assert (ablation.project_embedding_every_step, ablation.embedding_weight_decay) == (True, "t_s")
    assert (paper.project_embedding_every_step, paper.embedding_weight_decay) == (False, "table")
    with pytest.raises(ConfigError, match="stepprojx"):
        parse_variants(["pp:4:stepprojx"], 2, [0])


@pytest.mark.parametrize("every_step", [False, True], ids=["paper", "every_step_ablation"])
def test_per_replica_ratios_share_the_smallest_subspace(every_step):
    """Replicas compressing at different ratios (4 and 8): between syncs each replica's T_S
    leaves its own Col(U) (the paper; with `project_embedding_every_step`, the ablation, it stays
    in it after every inner step), and after the outer sync T_S lies in the smallest shared
    subspace (ratio 8's), which is inside every replica's. Breaks if bases stop nesting, if the
    resync projects onto a replica's own basis instead of the shared one, or if the per-step
    projection runs by default or not under its switch."""
    from hetloco_ds import subspace
    from hetloco_ds.config import parse_config
    from hetloco_ds.presets import model_config_for
    from hetloco_ds.sim.replica import Simulation

    cfg = parse_config({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
                        "hetloco": {"sparseloco": {"inner_steps": 2},
                                    "subspace": {"ratio": 4, "compressed_replicas": "all", "replica_ratios": {"1": 8},
                                                 "project_embedding_every_step": every_step},
                                    "train": {"seq_len": 16}}})
    llama = model_config_for("tiny", 96)
    sim = Simulation(cfg, cfg.hetloco, llama, 2, 2, torch.device("cpu"))
    ks = [r.codecs[0].width for r in sim.replicas]
    assert ks == [32, 16]
    g = torch.Generator().manual_seed(0)
    for _ in range(2):
        sim.train_step([[(ids, ids)] for ids in torch.randint(0, 96, (2, 2, 16), generator=g)])
        for r in sim.replicas:
            off = subspace.off_subspace_norm(r.algorithms[0].embeddings[0].weight.detach(), r.algorithms[0].basis)
            assert off < 1e-5 if every_step else off > 1e-3, off
    sim.outer_step()
    for r in sim.replicas:
        assert subspace.off_subspace_norm(r.algorithms[0].embeddings[0].weight.detach(), r.algorithms[0].split_basis) < 1e-5
    assert torch.equal(sim.replicas[0].algorithms[0].embeddings[0].weight, sim.replicas[1].algorithms[0].embeddings[0].weight)


def _sim_classes():
    from hetloco_ds.sim.replica import Simulation
    from hetloco_ds.sim.batched import BatchedSimulation

    return {"per_replica": Simulation, "batched": BatchedSimulation}


def _random_step(g, replicas, gas=1, micro=2, seq=16, vocab=96):
    return [[(ids, ids) for ids in torch.randint(0, vocab, (gas, micro, seq), generator=g)] for _ in range(replicas)]


@pytest.mark.parametrize("driver", ["per_replica", "batched"])
def test_adamw_het_replicas_stay_bitwise_identical_in_the_simulator(driver):
    """Plain data parallelism (the AdamW rows), M = 4 x S = 2, replica 3 compressed at ratio 8:
    after every step every replica's parameters and every stage's T_perp are bitwise those of
    replica 0, in the per-replica and in the batched simulator. Breaks if only the compressed
    replica projects T_S (the issue-16 drift) or if the batched simulator's AdamW, clipping or
    gradient averaging treats replicas differently."""
    from hetloco_ds.config import parse_config
    from hetloco_ds.presets import model_config_for

    cfg = parse_config({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
                        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
                        "hetloco": {"sparseloco": {"enabled": False},
                                    "subspace": {"ratio": 8, "compressed_replicas": [3]}, "train": {"seq_len": 16}}})
    sim = _sim_classes()[driver](cfg, cfg.hetloco, model_config_for("tiny", 96), 4, 2, torch.device("cpu"))
    assert [a.basis is not None for a in (r.algorithms[0] for r in sim.replicas)] == [False, False, False, True]
    g = torch.Generator().manual_seed(0)
    for step in range(1, 5):
        sim.train_step(_random_step(g, 4))
        first = sim.replicas[0]
        for r in sim.replicas[1:]:
            for p, q in zip(first.params, r.params):
                assert torch.equal(p, q), f"replica {r.replica} differs from replica 0 after step {step}"
            for a, b in zip(first.algorithms, r.algorithms):
                assert torch.equal(a.perp, b.perp), f"replica {r.replica}'s T_perp differs after step {step}"


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_batched_simulator_matches_per_replica(tied):
    """The batched simulator against the per-replica reference, M = 3 x S = 2 with replica 0
    uncompressed, 1 at ratio 4 and 2 at ratio 8 (bases zero-padded to the larger k), 2
    micro-batches a step, H = 2: every replica's loss at every step, the parameters and T_perp
    after two outer steps, the per-sync diagnostics and each replica's validation loss agree to
    float tolerance. Breaks if a replica's codec, clipping norm, gradient scale, the views the
    StageAlgorithms write through, or the tied head's T_perp differ between the two."""
    from transformers import LlamaConfig

    from hetloco_ds.config import parse_config

    cfg = parse_config({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
                        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
                        "hetloco": {"sparseloco": {"inner_steps": 2},
                                    "subspace": {"ratio": 4, "compressed_replicas": [1, 2], "replica_ratios": {"2": 8}},
                                    "train": {"seq_len": 16}}})
    llama = LlamaConfig(vocab_size=96, tie_word_embeddings=tied, rms_norm_eps=1e-5, **MODEL)
    sims = {name: cls(cfg, cfg.hetloco, llama, 3, 2, torch.device("cpu")) for name, cls in _sim_classes().items()}
    assert [r.width for r in sims["batched"].replicas] == [32, 8, 4]
    g = torch.Generator().manual_seed(0)
    diagnostics = {name: [] for name in sims}
    for step in range(1, 5):
        batches = _random_step(g, 3, gas=2)
        losses = {name: sim.train_step(batches) for name, sim in sims.items()}
        torch.testing.assert_close(losses["batched"], losses["per_replica"], rtol=1e-5, atol=0)
        if step % 2 == 0:
            for name, sim in sims.items():
                diagnostics[name].append(sim.outer_step())
    for ref, got in zip(*(sims[n].replicas for n in ("per_replica", "batched"))):
        for p, q in zip(ref.params, got.params):
            torch.testing.assert_close(q, p, rtol=1e-4, atol=1e-6)
        for a, b in zip(ref.algorithms, got.algorithms):
            torch.testing.assert_close(b.perp, a.perp, rtol=1e-4, atol=1e-6)
    for ref, got in zip(diagnostics["per_replica"], diagnostics["batched"]):
        assert got.keys() == ref.keys()
        for key in ref:
            assert got[key] == pytest.approx(ref[key], rel=1e-5), key
    val = [tuple([torch.randint(0, 96, (2, 16), generator=g)] * 2) for _ in range(2)]
    assert sims["batched"].validation_losses(val) == pytest.approx(sims["per_replica"].validation_losses(val), rel=1e-5)


def _ts_copies(replica) -> list[torch.Tensor]:
    """Every T_S copy a replica holds: each stage's trained embeddings (the first stage's, a tied
    head's copy on the last)."""
    return [e.weight.detach() for a in replica.algorithms for e in a.embeddings]


@pytest.mark.parametrize("every_step", [False, True], ids=["paper", "every_step_ablation"])
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("driver", ["per_replica", "batched"])
def test_ts_leaves_col_u_between_syncs_and_reenters_it_identically_at_each_sync(driver, tied, every_step):
    """M = 3 x S = 3, replica 0 uncompressed, 1 at ratio 4, 2 at ratio 8, H = 2, weight decay on,
    three syncs: after each inner step between syncs every T_S copy of a compressed replica (the
    first stage's and a tied head's) has left its replica's Col(U) (off-subspace norm > 1e-3) and
    T_perp has not moved; after each sync every T_S copy of every replica is bitwise the same and
    lies in the shared Col(U), and T_perp has moved and is bitwise the same on every stage of
    every replica. With `project_embedding_every_step` (the ablation: the behaviour before issue
    57) T_S stays in Col(U) after every inner step. Breaks if T_S is projected between syncs by
    default, if the ablation's switch is ignored, if an inner step touches T_perp, or if eqs. 3-4
    differ between stages, replicas or simulators."""
    from conftest import tiny_llama_config
    from hetloco_ds import subspace
    from hetloco_ds.config import parse_config

    cfg = parse_config({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
                        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1}},
                        "hetloco": {"sparseloco": {"inner_steps": 2},
                                    "subspace": {"ratio": 4, "compressed_replicas": [1, 2], "replica_ratios": {"2": 8},
                                                 "project_embedding_every_step": every_step},
                                    "train": {"seq_len": 16}}})
    sim = _sim_classes()[driver](cfg, cfg.hetloco, tiny_llama_config(tied=tied), 3, 3, torch.device("cpu"))
    perps = [a.perp for r in sim.replicas for a in r.algorithms]
    assert len(perps) == 9
    synced = perps[0].clone()
    g = torch.Generator().manual_seed(0)
    for step in range(1, 7):
        sim.train_step(_random_step(g, 3))
        if step % 2:
            for r in sim.replicas[1:]:
                offs = [subspace.off_subspace_norm(t, r.algorithms[0].basis) for t in _ts_copies(r)]
                assert len(offs) == (2 if tied else 1)
                assert (max(offs) < 1e-5) if every_step else (min(offs) > 1e-3), (step, r.replica, offs)
            assert all(torch.equal(p, synced) for p in perps), f"an inner step moved T_perp (step {step})"
            continue
        sim.outer_step()
        copies = [t for r in sim.replicas for t in _ts_copies(r)]
        assert all(torch.equal(t, copies[0]) for t in copies), f"T_S copies differ after the sync at step {step}"
        assert subspace.off_subspace_norm(copies[0], sim.replicas[2].algorithms[0].basis) < 1e-5
        assert all(torch.equal(p, perps[0]) for p in perps), f"T_perp differs after the sync at step {step}"
        assert not torch.equal(perps[0], synced)
        synced = perps[0].clone()


def _schedule_lrs(scheduler: dict, lr: float, steps: int) -> list[float]:
    """The lr each of the first `steps` optimizer steps takes under DeepSpeed's `scheduler`."""
    from hetloco_ds import optim

    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)
    sched = optim.build_scheduler(scheduler, opt)
    lrs = []
    for _ in range(steps):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return lrs


WARMUP = {"type": "WarmupCosineLR", "params": {"total_num_steps": 6, "warmup_num_steps": 3, "warmup_min_ratio": 0.1,
                                               "cos_min_ratio": 0.1}}
"""An lr that differs at each of the first three steps (DeepSpeed's: 0, then 1e-3, then more at lr 1e-2)."""


@pytest.mark.parametrize("driver", ["per_replica", "batched"])
def test_weight_decay_shrinks_the_whole_embedding_and_reaches_t_perp_through_the_sync(driver):
    """`embedding_weight_decay: table` (the default, the authors' code) against `t_s`, from one
    start and data, M = 2 x S = 2 both compressed, wd 0.1, a warmup schedule, H = 2, a dense sync
    (every coordinate, no clip, outer lr 1): after the two inner steps T_perp has not moved in
    either run and table's T_S is t_s's minus lr_2 * wd * T_perp, lr_2 the second step's lr (the
    first step's is 0, so that step decays nothing in either); after the sync table's T_perp is
    t_s's minus that same share, i.e. T_perp shrank by 1 - lr_2 wd through the pseudo-gradient.
    Breaks if the whole table is not decayed, if the decay takes the schedule's next or previous
    lr, or if T_perp is decayed in place instead of through the sync."""
    from conftest import tiny_llama_config
    from hetloco_ds.config import parse_config

    lrs = _schedule_lrs(WARMUP, 1e-2, 3)
    assert lrs[0] == 0 and 0 < lrs[1] < lrs[2]
    share = lrs[1] * 0.1

    def run(decay):
        cfg = parse_config({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
                            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1}},
                            "scheduler": WARMUP,
                            "hetloco": {"sparseloco": {"inner_steps": 2, "aggregation": "dense", "norm_clip": "none",
                                                       "outer_lr": 1.0},
                                        "subspace": {"ratio": 4, "compressed_replicas": "all",
                                                     "embedding_weight_decay": decay},
                                        "train": {"seq_len": 16}}})
        sim = _sim_classes()[driver](cfg, cfg.hetloco, tiny_llama_config(), 2, 2, torch.device("cpu"))
        alg = sim.replicas[1].algorithms[0]
        perp0 = alg.perp.clone()
        g = torch.Generator().manual_seed(0)
        for _ in range(2):
            sim.train_step(_random_step(g, 2))
        assert torch.equal(alg.perp, perp0)
        t_s = alg.embeddings[0].weight.detach().clone()
        sim.outer_step()
        return perp0, t_s, alg.perp.clone()

    perp0, ts_table, perp_table = run("table")
    _, ts_alone, perp_alone = run("t_s")
    torch.testing.assert_close(ts_table, ts_alone - share * perp0, rtol=0, atol=1e-9)
    assert (ts_table - ts_alone).abs().max() > 100 * 1e-9
    torch.testing.assert_close(perp_table, perp_alone - share * perp0, rtol=0, atol=1e-8)
    assert (perp_table - perp_alone).abs().max() > 100 * 1e-8


def test_outer_step_diagnostics_on_a_dense_sync():
    """With every coordinate sent (top-k = the whole chunk) and no error feedback, eq. (2) is
    dense averaging: every coordinate comes from all M replicas, the applied update is the dense
    mean of the pseudo-gradients (cosine 1, equal norms, T_perp's share of the embedding
    included) and the error buffers stay zero. With the default top-32 of 4096 the overlap and
    the cosine drop. Breaks if a diagnostic is computed from the wrong tensors."""
    from hetloco_ds.config import parse_config
    from hetloco_ds.presets import model_config_for
    from hetloco_ds.sim.replica import Simulation

    llama = model_config_for("tiny", 96)
    out = {}
    for topk, decay in ((4096, 0.0), (32, 0.95)):
        cfg = parse_config({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
                            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
                            "hetloco": {"sparseloco": {"preset": "paper", "inner_steps": 2, "topk": topk,
                                                       "error_decay": decay},
                                        "subspace": {"ratio": 4, "compressed_replicas": [2]}, "train": {"seq_len": 16}}})
        sim = Simulation(cfg, cfg.hetloco, llama, 3, 2, torch.device("cpu"))
        g = torch.Generator().manual_seed(0)
        for _ in range(2):
            sim.train_step(_random_step(g, 3))
        out[topk] = sim.outer_step()
    dense = out[4096]
    assert dense["replicas_per_selected"] == 3.0
    assert dense["update_cosine"] == pytest.approx(1.0, abs=1e-6)
    assert dense["update_norm"] == pytest.approx(dense["dense_norm"], rel=1e-5)
    assert dense["error_norm"] == 0.0
    sparse = out[32]
    assert 1.0 <= sparse["replicas_per_selected"] < 1.5
    assert 0.0 < sparse["update_cosine"] < 0.9
    assert sparse["error_norm"] > 0


def _tiny_rows(tmp_path, schedule: int = 6, warmup: int = 2, gas: int = 2):
    """row(spec, steps, **kw): simulate_variant of row `spec` (M = 2 x S = 2, H = 2, micro-batch 2 x
    `gas`, a `schedule`-step LR schedule) on random tokens."""
    from hetloco_ds.config import parse_config
    from hetloco_ds.data import Corpus
    from hetloco_ds.presets import model_config_for
    from hetloco_ds.sim.rows import parse_variants, simulate_variant

    cfg = parse_config({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": gas,
                        "scheduler": {"type": "WarmupCosineLR",
                                      "params": {"total_num_steps": schedule, "warmup_num_steps": warmup}},
                        "hetloco": {"sparseloco": {"inner_steps": 2}, "train": {"seq_len": 16, "eval_batches": 2}}})
    g = torch.Generator().manual_seed(0)
    corpus = Corpus(torch.randint(0, 96, (64, 16), generator=g, dtype=torch.int32),
                    torch.randint(0, 96, (8, 16), generator=g, dtype=torch.int32), "random", tmp_path)
    llama = model_config_for("tiny", 96)

    def row(spec: str, steps: int, **kw):
        variant = parse_variants([spec], 2, [0])[0]
        return simulate_variant(cfg, variant, llama, corpus, 2, 2, steps, torch.device("cpu"), progress=False, **kw)
    return row


def _het4_row(tmp_path):
    """simulate_variant of het:4 (M = 2 x S = 2, H = 2, a 6-step LR schedule) on random tokens, as
    row(steps=6, **kw)."""
    rows = _tiny_rows(tmp_path)

    def row(steps=6, **kw):
        return rows("het:4", steps, **kw)
    return row


def test_a_saved_row_resumes_where_it_stopped(tmp_path):
    """A row stopped by its deadline at the first outer-step boundary saves its state; a second
    call continues from it and ends with the same per-step losses, outer-step diagnostics and
    validation losses as an uninterrupted run, bit for bit (AdamW moments, LR schedule, error
    buffers, theta at the last sync, T_perp and the data positions all come back). Breaks if any
    of them is lost or the data feed restarts."""
    row = _het4_row(tmp_path)

    full = row()
    state = str(tmp_path / "row.pt")
    first = row(deadline=0.0, state_path=state)
    assert first["status"] == "saved" and first["step"] == 2
    second = row(state_path=state)
    assert second["status"] == "done" and not os.path.exists(state)
    assert second["replica_losses"] == full["replica_losses"]
    assert second["outer"] == full["outer"] and second["outer_steps"] == 3
    assert second["val_losses"] == full["val_losses"]
    assert row(deadline=0.0)["status"] == "abandoned"


def test_a_rows_seconds_by_phase_put_each_wait_where_it_was_spent(tmp_path, monkeypatch):
    """het:4 over 6 steps (H = 2, validation every 2) on a clock that moves only when an outer step
    (0.3 s), a validation (0.2 s) or a step's batches (0.1 s) are called: the row's seconds_by_phase
    are 0.9 s of outer steps (3), 0.6 s of validation (2 on the way, 1 at the end), 0.6 s of
    training and no flush, summing to its seconds; stopped at step 2 and resumed, the two calls
    add up to the same. Breaks if a phase's time lands in another, or a resume forgets the phases
    before it. (A real clock's bounds fail on a loaded machine.)"""
    import time
    import types

    from hetloco_ds.sim import rows
    from hetloco_ds.sim.batched import BatchedSimulation

    row = _het4_row(tmp_path)
    clock = types.SimpleNamespace(now=0.0)
    monkeypatch.setattr(rows, "time", types.SimpleNamespace(perf_counter=lambda: clock.now, time=time.time))
    outer, val, batches = BatchedSimulation.outer_step, BatchedSimulation.validation_losses, rows.step_batches

    def delayed(fn, s):
        def wrapped(*a, **kw):
            clock.now += s
            return fn(*a, **kw)
        return wrapped

    monkeypatch.setattr(BatchedSimulation, "outer_step", delayed(outer, 0.3))
    monkeypatch.setattr(BatchedSimulation, "validation_losses", delayed(val, 0.2))
    monkeypatch.setattr(rows, "step_batches", delayed(batches, 0.1))
    want = {"train": 0.6, "outer": 0.9, "flush": 0.0, "validation": 0.6}

    whole = row(val_every=2)
    assert whole["seconds_by_phase"] == pytest.approx(want) and whole["seconds"] == pytest.approx(2.1)
    state = str(tmp_path / "row.pt")
    first = row(val_every=2, deadline=0.0, state_path=state)
    assert (first["status"], first["step"]) == ("saved", 2)
    assert first["seconds_by_phase"] == pytest.approx({"train": 0.2, "outer": 0.3, "flush": 0.0, "validation": 0.2})
    resumed = row(val_every=2, state_path=state)
    assert resumed["seconds_by_phase"] == pytest.approx(want) and resumed["seconds"] == pytest.approx(2.1)


def test_a_diverged_row_ends_early_with_a_non_finite_loss(tmp_path):
    """At lr 1e30 (M = 2 x S = 2, H = 2, a 120-step schedule): AdamW's loss turns NaN within a few
    steps and the row ends at its first loss flush (step 50), not after 120 steps of NaN, with
    diverged_at_step the first step whose every replica's loss is NaN; SparseLoCo's first outer
    step excludes both replicas' non-finite pseudo-gradients and the row ends there (before, it
    raised and the sweep lost the row). Each row's val_loss is NaN, so a sweep ranks that lr
    worst, while what the replicas held is kept apart; at lr 1e-3 nothing diverges."""
    import math

    rows = _tiny_rows(tmp_path, schedule=120, warmup=1, gas=1)

    def row(spec, steps=120):
        return rows(spec, steps)

    adamw = row("adamw:lr=1e30")
    losses = adamw["train_losses"]
    first_nan = next(s for s, x in enumerate(losses, 1) if math.isnan(x))
    assert 1 < first_nan < 50 and all(math.isnan(x) for x in losses[first_nan - 1:])
    assert (adamw["diverged_at_step"], adamw["ended_at_step"], len(losses)) == (first_nan, 50, 50)
    assert math.isnan(adamw["val_loss"]) and all(math.isnan(x) for x in adamw["val_losses_at_divergence"])

    sl = row("sparseloco:lr=1e30")
    assert sl["outer_steps"] >= 1 and len(sl["outer"][-1]["excluded"]) == 2
    assert sl["ended_at_step"] == sl["diverged_at_step"] == sl["outer"][-1]["step"] == len(sl["train_losses"]) < 50
    assert math.isnan(sl["val_loss"]) and all(math.isfinite(x) for x in sl["val_losses_at_divergence"])

    plain = row("adamw:lr=1e-3", steps=6)
    assert plain["diverged_at_step"] is None and math.isfinite(plain["val_loss"])


def test_an_unsaved_row_is_abandoned_by_its_steady_pace_not_its_first_interval(tmp_path, monkeypatch):
    """Without a state path, a row whose first interval is slow (as a compile makes it: step 1
    takes 2 s) runs to the end when its later pace fits the deadline, though the mean pace at the
    first boundary projects past it; a row whose steps slow to 1.5 s after the first boundary is
    abandoned at the second one (step 4 of 6), as even that pace cannot end it in time. Breaks if
    the first interval's pace decides, or if the projection ignores the pace after it. Both clocks
    the row reads move only by the steps' delays, so a loaded machine's real step times (which once
    pushed the first case past its deadline) do not enter."""
    import types

    from hetloco_ds.sim import rows

    row, plain = _het4_row(tmp_path), rows.step_batches
    seconds, calls = {}, []
    clock = types.SimpleNamespace(now=1000.0)
    monkeypatch.setattr(rows, "time", types.SimpleNamespace(perf_counter=lambda: clock.now, time=lambda: clock.now))

    def slow(*a, **kw):
        calls.append(1)
        clock.now += seconds.get(len(calls), seconds.get(0, 0.0))
        return plain(*a, **kw)

    monkeypatch.setattr(rows, "step_batches", slow)
    seconds.update({1: 2.0, 0: 0.1})
    assert row(deadline=clock.now + 4.5)["status"] == "done"
    calls.clear()
    seconds.clear()
    seconds.update({1: 0.0, 2: 0.0, 0: 1.5})
    late = row(deadline=clock.now + 4.0)
    assert (late["status"], late["step"]) == ("abandoned", 4)


def test_a_rows_validation_curve_is_each_shorter_rows_final_validation(tmp_path):
    """simulate_variant(val_every=2) of het:4 over 6 steps (H = 2): its val_curve holds steps 2, 4
    and 6, and the point at step s is, bit for bit, the final validation of the same row run for s
    steps (same LR schedule, same held-out batches); training is untouched by the extra
    validations (per-step losses equal a row without them); stopped at step 2 and resumed, the
    curve comes back whole. val_every 3 (not a multiple of H) is refused, naming 3."""
    from hetloco_ds.config import ConfigError

    row = _het4_row(tmp_path)

    curve = row(val_every=2)
    assert [p["step"] for p in curve["val_curve"]] == [2, 4, 6]
    for p in curve["val_curve"]:
        assert p["loss"] == row(steps=p["step"])["val_loss"], p
    plain = row()
    assert plain["val_curve"] == [] and plain["replica_losses"] == curve["replica_losses"]
    assert len({p["loss"] for p in curve["val_curve"]}) == 3
    state = str(tmp_path / "row.pt")
    assert row(val_every=2, deadline=0.0, state_path=state)["status"] == "saved"
    assert row(val_every=2, state_path=state)["val_curve"] == curve["val_curve"]
    with pytest.raises(ConfigError, match="val_every 3"):
        row(val_every=3)


def test_a_variants_command_line_settings_are_read_as_the_config_would_read_them():
    """`--variants sparseloco:outer_lr=0.5:topk=16:aggregation=mean` hands the row's sparseloco
    settings over as command-line strings; they are read into the config's types (the config
    file's section is strict, these are not), and a bad one is still one line naming the row.
    Breaks if strict config types refused every row that sets a number."""
    from hetloco_ds.config import ConfigError, HetlocoConfig
    from hetloco_ds.sim.rows import parse_variants

    row = parse_variants(["sparseloco:outer_lr=0.5:topk=16:aggregation=mean"], 2, [0])[0]
    sl = row.hetloco(HetlocoConfig(), 2).sparseloco
    assert (sl.outer_lr, sl.topk, sl.aggregation) == (0.5, 16, "mean")
    bad = parse_variants(["sparseloco:topk=many"], 2, [0])[0]
    with pytest.raises(ConfigError, match=r"^row sparseloco:topk=many@seed0: sparseloco \{'topk': 'many'\}: "):
        bad.hetloco(HetlocoConfig(), 2)
