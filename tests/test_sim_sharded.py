"""A batched-simulator row spread over processes (sim/sharded.py) computes what one process computes.

Two gloo ranks holding 2 of M = 4 replicas each against one process holding all 4, on the CPU:
train losses, outer-step diagnostics, validation losses and final parameters are bitwise equal,
and a sharded row stopped at an outer boundary resumes from its blocks' saved states exactly.
"""
from __future__ import annotations

import os

import torch

from distributed import run_ranks

REPLICAS, STAGES, STEPS = 4, 2, 4
ROWS = ["sparseloco", "het:4", "adamw-het:4", "diloco:outer_lr=0.7:outer_momentum=0.9:norm_clip=none"]
MODEL = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
         "intermediate_size": 64, "max_position_embeddings": 64}


def _setup():
    from transformers import LlamaConfig

    from hetloco_ds.config import parse_config

    run = parse_config({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
                        "gradient_clipping": 1.0,
                        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
                        "scheduler": {"type": "WarmupCosineLR",
                                      "params": {"total_num_steps": STEPS, "warmup_num_steps": 1}},
                        "hetloco": {"sparseloco": {"inner_steps": 2}, "train": {"seq_len": 16, "eval_batches": 2}}})
    llama = LlamaConfig(vocab_size=96, rms_norm_eps=1e-5, **MODEL)
    return run, llama


def _sim_run(row: str, shards: int) -> dict:
    """One row on BatchedSimulation: STEPS steps of every replica's own batches, an outer step every
    H; what this process holds of the losses, diagnostics, validation, parameters and T_perp."""
    from hetloco_ds.sim.batched import BatchedSimulation
    from hetloco_ds.sim.rows import parse_variants
    from hetloco_ds.sim.sharded import Shards

    run, llama = _setup()
    variant = parse_variants([row], REPLICAS, [0])[0]
    hetloco = variant.hetloco(run.hetloco, REPLICAS)
    sh = Shards.of_world(REPLICAS, shards)
    sim = BatchedSimulation(variant.run(run), hetloco, llama, REPLICAS, STAGES, torch.device("cpu"), shards=sh)
    g = torch.Generator().manual_seed(0)
    losses, outer = [], []
    for step in range(1, STEPS + 1):
        batches = [[(ids, ids) for ids in torch.randint(0, 96, (run.grad_accum, 2, 16), generator=g)]
                   for _ in range(REPLICAS)]
        losses.append(sim.train_step([batches[m] for m in sh.ids]))
        if hetloco.sparseloco.enabled and step % hetloco.sparseloco.inner_steps == 0:
            outer.append(sim.outer_step())
    val = [tuple([torch.randint(0, 96, (2, 16), generator=g)] * 2) for _ in range(2)]
    return {"losses": torch.stack(losses), "outer": outer, "val": sim.validation_losses(val),
            "params": [p.detach().clone() for p in sim.params],
            "perp": [p.clone() for p in sim.perp if p is not None], "widths": sim.widths}


def _rows_both_ways(rank: int) -> dict:
    """Every row sharded over this world (2 ranks), then this rank's half of the rows in one process."""
    sharded = {row: _sim_run(row, 2) for row in ROWS}
    alone = {row: _sim_run(row, 1) for row in ROWS[rank::2]}
    return {"sharded": sharded, "alone": alone}


def test_a_row_sharded_over_two_processes_matches_one_process():
    """sparseloco, het:4 (replicas 2 and 3 compress: global ids), adamw (dense gradient averaging
    every step) and diloco (dense aggregation, Nesterov outer step), M = 4 x S = 2, H = 2, 2
    micro-batches a step: 2 gloo ranks x 2 replicas against 1 process x 4, bit for bit - every
    replica's micro-batch losses, every outer step's diagnostics (update cosine, overlap, error
    norm, excluded), every replica's validation loss, its final parameters and T_perp. Breaks if
    a block sees only its own replicas where the row couples them (payloads, dense mean, gradient
    average, padded k), or uses local replica ids where the method needs global ones."""
    results = run_ranks(_rows_both_ways, 2)
    alone = {**results[0]["alone"], **results[1]["alone"]}
    for row in ROWS:
        a, b = alone[row], [r["sharded"][row] for r in results]
        assert torch.equal(torch.cat([b[0]["losses"], b[1]["losses"]], 1), a["losses"]), row
        assert b[0]["outer"] == b[1]["outer"] == a["outer"], row
        assert b[0]["val"] == b[1]["val"] == a["val"], row
        assert b[0]["widths"] == a["widths"], row
        for got0, got1, want in zip(b[0]["params"], b[1]["params"], a["params"]):
            assert torch.equal(torch.cat([got0, got1]), want), row
        for got0, got1, want in zip(b[0]["perp"], b[1]["perp"], a["perp"]):
            assert torch.equal(torch.cat([got0, got1]), want), row
    assert alone["het:4"]["widths"] == [32, 32, 8, 8]
    assert len(alone["sparseloco"]["outer"]) == 2 and alone["adamw-het:4"]["outer"] == []


def _resumed_row(rank: int, tmp: str) -> dict:
    from hetloco_ds.data import Corpus
    from hetloco_ds.sim.rows import parse_variants, simulate_variant

    run, llama = _setup()
    g = torch.Generator().manual_seed(0)
    corpus = Corpus(torch.randint(0, 96, (64, 16), generator=g, dtype=torch.int32),
                    torch.randint(0, 96, (8, 16), generator=g, dtype=torch.int32), "random", tmp)
    variant = parse_variants(["het:4"], REPLICAS, [0])[0]

    def row(shards, **kw):
        return simulate_variant(run, variant, llama, corpus, REPLICAS, STAGES, STEPS, torch.device("cpu"),
                                progress=False, shards=shards, **kw)

    state = os.path.join(tmp, "row.pt")
    out = {"full": row(2, metrics_path=os.path.join(tmp, "sharded.jsonl"), val_every=2)}
    out["first"] = row(2, deadline=0.0, state_path=state, val_every=2)
    out["saved"] = sorted(f for f in os.listdir(tmp) if f.startswith("row.pt"))
    out["second"] = row(2, state_path=state, val_every=2)
    out["left"] = os.path.exists(f"{state}.g{rank}")  # each rank removes its own block's state
    if rank == 0:
        out["alone"] = row(1, metrics_path=os.path.join(tmp, "alone.jsonl"), val_every=2)
    return out


def test_a_sharded_row_resumes_from_its_blocks_states(tmp_path):
    """simulate_variant(shards=2) of het:4: the whole row's result on both ranks equals the
    one-process row's (per-step replica losses, outer diagnostics, validation losses, the
    validation curve every 2 steps, and metrics.jsonl, written by rank 0 alone, byte for byte);
    stopped by its deadline at the first outer boundary, each rank saves its block (row.pt.g0,
    row.pt.g1) and the resumed row ends as the uninterrupted one, its states removed. Breaks if a
    block's state or data position is lost, the blocks disagree where to stop, or rank 1 writes
    metrics too."""
    results = run_ranks(_resumed_row, 2, str(tmp_path))
    alone = results[0]["alone"]
    for r in results:
        assert r["first"]["status"] == "saved" and r["first"]["step"] == 2
        assert r["saved"] == ["row.pt.g0", "row.pt.g1"] and not r["left"]
        for key in ("replica_losses", "outer", "val_losses", "val_curve", "replicas", "outer_steps"):
            assert r["full"][key] == r["second"][key] == alone[key], key
    assert [p["step"] for p in alone["val_curve"]] == [2, 4]
    assert len(alone["replica_losses"][0]) == REPLICAS and alone["outer_steps"] == 2
    assert (tmp_path / "sharded.jsonl").read_text() == (tmp_path / "alone.jsonl").read_text()
