"""`hetloco.train.optimizer_state` "bf16" and "8bit" through every driver: the engine (4 rank
processes, 2 replicas x 2 stages, replica 1 compressed), its checkpoint and `--resume`, the
per-replica and the batched simulator. Skipped where torchao is not installed."""
from __future__ import annotations

import json
import os

import pytest
import torch

import runs
from distributed import run_job

pytest.importorskip("torchao", reason="torchao is not installed (pip install torchao==0.18.0)")

STEPS = 6


def _job(tmp_path, state: str):
    cfg, model = runs.hetero_files(tmp_path, eval_batches=1)
    c = json.loads(open(cfg).read())
    c["hetloco"]["train"].update(checkpoint_interval=1, keep_checkpoints=0, optimizer_state=state)
    open(cfg, "w").write(json.dumps(c))
    return cfg, model


def _losses(out) -> dict:
    return {k: r["loss"] for k, r in runs.keyed(out, "step").items()}


# 8bit alone through the engine: its state is the one rebuilt from codes on load; bf16's plain moments
# round-trip bitwise in test_optimizer_state, and both options meet the simulator below.
@pytest.mark.parametrize("state", ["8bit"])
def test_a_resumed_run_equals_an_uninterrupted_one_and_the_simulator(state, tmp_path, tmp_path_factory, monkeypatch,
                                                                      capsys):
    """A 6-step run (H = 3) with the option; a second run stopped at step 3 (its checkpoint written
    then, the rank state read back weights-only) and `--resume`d to step 6: every replica's loss at
    every step is the uninterrupted run's bit for bit, and the same as `hetloco-ds simulate`'s
    (per-replica simulator) to float tolerance, as the fp32 run is in test_simulate. Breaks if the
    moments are lost, change type or are re-quantised differently on resume, if a checkpoint holds
    a tensor the weights-only reader refuses, or if a driver builds another optimizer."""
    cache = tmp_path_factory.getbasetemp() / "hetloco-cache"
    cfg, model = _job(tmp_path, state)
    env = runs.env(cache)
    run_job(tmp_path / "full.log", 4, ["train", "--config", cfg, "--model-config", model, "--steps", STEPS,
                                       "--out", str(tmp_path / "full")], env)
    run_job(tmp_path / "first.log", 4, ["train", "--config", cfg, "--model-config", model, "--steps", 3,
                                        "--out", str(tmp_path / "part")], env)
    run_job(tmp_path / "resume.log", 4, ["train", "--steps", STEPS, "--out", str(tmp_path / "part"), "--resume"], env)
    full = _losses(tmp_path / "full")
    assert set(full) == {(step, m) for step in range(1, STEPS + 1) for m in (0, 1)}
    assert _losses(tmp_path / "part") == full

    from hetloco_ds import cli

    monkeypatch.setenv("HETLOCO_CACHE", str(cache))
    code = cli.main(["simulate", "--config", cfg, "--model-config", model, "--replicas", "2", "--steps", str(STEPS),
                     "--variants", "het:4", "--device", "cpu", "--per-replica", "--out", str(tmp_path / "sim")])
    assert code == 0, capsys.readouterr().err[-3000:]
    rows = [json.loads(line) for line in open(tmp_path / "sim" / "metrics.jsonl")]
    sim = {(r["step"], r["replica"]): r["loss"] for r in rows if r["kind"] == "step"}
    for key, loss in full.items():
        assert sim[key] == pytest.approx(loss, rel=1e-5), key


@pytest.mark.parametrize("state", ["bf16", "8bit"])
def test_the_batched_simulator_steps_the_option_as_the_per_replica_one(state):
    """M = 2 x S = 2, replica 1 at ratio 4, H = 2, 4 steps with the option: every replica's loss
    and, after two outer steps, every parameter agree between the batched simulator (parameters
    stacked [M, ...], 8-bit moments quantised by one replica's slice) and the per-replica one to
    float tolerance, and both quantise the same tensors: the embedding and head (128 x 32 = 4096
    values a replica); the MLP weights (64 x 32 = 2048 a replica, 4096 stacked) are where the rule
    matters, by the stacked size they would be quantised in the batched run only. Breaks if the
    batched run quantises a tensor the per-replica one does not, or a block spans two replicas."""
    from transformers import LlamaConfig

    from hetloco_ds.config import parse_config
    from hetloco_ds.sim.batched import BatchedSimulation
    from hetloco_ds.sim.replica import Simulation

    cfg = parse_config({"train_micro_batch_size_per_gpu": 2,
                        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
                        "hetloco": {"sparseloco": {"inner_steps": 2},
                                    "subspace": {"ratio": 4, "compressed_replicas": [1]},
                                    "train": {"seq_len": 16, "optimizer_state": state}}})
    llama = LlamaConfig(vocab_size=128, tie_word_embeddings=False, rms_norm_eps=1e-5, **runs.TINY_MODEL)
    sims = {"per_replica": Simulation(cfg, cfg.hetloco, llama, 2, 2, torch.device("cpu")),
            "batched": BatchedSimulation(cfg, cfg.hetloco, llama, 2, 2, torch.device("cpu"))}
    g = torch.Generator().manual_seed(0)
    for step in range(1, 5):
        ids = torch.randint(0, 128, (2, 1, 2, 16), generator=g)
        batches = [[(ids[m, 0], ids[m, 0])] for m in range(2)]
        losses = {name: sim.train_step(batches) for name, sim in sims.items()}
        torch.testing.assert_close(losses["batched"], losses["per_replica"], rtol=1e-5, atol=0)
        if step % 2 == 0:
            for sim in sims.values():
                sim.outer_step()
    for ref, got in zip(sims["per_replica"].replicas, sims["batched"].replicas):
        for p, q in zip(ref.params, got.params):
            torch.testing.assert_close(q, p, rtol=1e-4, atol=1e-6)
    quantised = {name: sum(hasattr(v, "codes") for st in sim_opt.state.values() for v in st.values())
                 for name, sim_opt in (("per_replica", sims["per_replica"].replicas[0].optimizer),
                                       ("batched", sims["batched"].optimizer))}
    if state == "8bit":  # the per-replica count is one replica's; the batched optimizer holds the stacked tensors
        assert quantised["batched"] == quantised["per_replica"] > 0
