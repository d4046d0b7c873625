"""The simulator measures the real system: same per-step losses as a multi-process run."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

MODEL = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
         "intermediate_size": 64, "max_position_embeddings": 64}


def _files(tmp_path, cache):
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(repo, "configs", "cpu_tiny.json")) as f:
        cfg = json.load(f)
    cfg["train_micro_batch_size_per_gpu"] = 2
    cfg["hetloco"]["sparseloco"]["inner_steps"] = 3
    cfg["hetloco"]["subspace"] = {"ratio": 4, "compressed_replicas": [1]}
    cfg["hetloco"]["train"].update(seq_len=32, vocab_size=512, eval_interval=0, eval_batches=2)
    cfg["scheduler"]["params"].update(total_num_steps=6, warmup_num_steps=2)
    (tmp_path / "cfg.json").write_text(json.dumps(cfg))
    (tmp_path / "model.json").write_text(json.dumps(MODEL))
    env = dict(os.environ, HETLOCO_CACHE=str(cache))
    return str(tmp_path / "cfg.json"), str(tmp_path / "model.json"), env


def _step_losses(path, **match):
    rows = [json.loads(l) for l in open(path)]
    return {(r["step"], r["replica"]): r["loss"] for r in rows
            if r["kind"] == "step" and all(r.get(k) == v for k, v in match.items())}


def test_heterogeneous_engine_run_matches_simulator(tmp_path, tmp_path_factory):
    """2 replicas x 2 stages, replica 1 compressed at ratio 4, in 4 processes through the CLI,
    against `hetloco-ds simulate` with the same config, seeds and data: every replica's loss at
    every step agrees to float tolerance (through two outer steps and their embedding
    resyncs). Breaks if the simulator and the engine differ in anything that touches training."""
    cache = tmp_path_factory.getbasetemp() / "hetloco-cache"
    cfg, model, env = _files(tmp_path, cache)
    cli = [sys.executable, "-m", "hetloco_ds.cli"]
    sim = subprocess.run(cli + ["simulate", "--config", cfg, "--model-config", model, "--replicas", "2", "--steps", "6",
                                "--variants", "het:4", "--device", "cpu", "--out", str(tmp_path / "sim")],
                         env=env, capture_output=True, text=True, timeout=300)
    assert sim.returncode == 0, sim.stderr[-3000:]
    real = subprocess.run(cli + ["train", "--config", cfg, "--model-config", model, "--nproc", "4", "--steps", "6",
                                 "--out", str(tmp_path / "real")], env=env, capture_output=True, text=True, timeout=300)
    assert real.returncode == 0, real.stderr[-3000:]
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
    project_residual_weights puts o_proj's outputs in Col(U); the defaults do neither."""
    from hetloco_ds import subspace
    from hetloco_ds.config import parse_config
    from hetloco_ds.presets import model_config_for
    from hetloco_ds.simulate import Simulation, Variant

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
        off = subspace.off_subspace_norm(o.T, sim.replicas[1].algorithms[0].basis)
        sim.outer_step()
        return torch.equal(perp0, sim.replicas[0].algorithms[0].perp), off

    fixed, off = run(Variant("ablate", ratio=4, compressed=2, embedding_adaptation=False, project_residual_weights=True))
    assert fixed and off < 1e-5
    fixed, off = run(Variant("default", ratio=4, compressed=2))
    assert not fixed and off > 0.1


def test_per_replica_ratios_share_the_smallest_subspace():
    """Replicas compressing at different ratios (4 and 8): each keeps T_S in its own Col(U)
    during inner steps, and after the outer sync T_S lies in the smallest shared subspace
    (ratio 8's), which is inside every replica's. Breaks if bases stop nesting or the resync
    projects onto a replica's own basis instead of the shared one."""
    from hetloco_ds import subspace
    from hetloco_ds.config import parse_config
    from hetloco_ds.presets import model_config_for
    from hetloco_ds.simulate import Simulation

    cfg = parse_config({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
                        "hetloco": {"sparseloco": {"inner_steps": 2},
                                    "subspace": {"ratio": 4, "compressed_replicas": "all", "replica_ratios": {"1": 8}},
                                    "train": {"seq_len": 16}}})
    llama = model_config_for("tiny", 96)
    sim = Simulation(cfg, cfg.hetloco, llama, 2, 2, torch.device("cpu"))
    ks = [r.codecs[0].width for r in sim.replicas]
    assert ks == [32, 16]
    g = torch.Generator().manual_seed(0)
    for _ in range(2):
        sim.train_step([[(ids, ids)] for ids in torch.randint(0, 96, (2, 2, 16), generator=g)])
        for r in sim.replicas:
            assert subspace.off_subspace_norm(r.algorithms[0].embeddings[0].weight.detach(), r.algorithms[0].basis) < 1e-5
    sim.outer_step()
    for r in sim.replicas:
        assert subspace.off_subspace_norm(r.algorithms[0].embeddings[0].weight.detach(), r.algorithms[0].split_basis) < 1e-5
    assert torch.equal(sim.replicas[0].algorithms[0].embeddings[0].weight, sim.replicas[1].algorithms[0].embeddings[0].weight)
