"""Training runs of the real CLI (its ranks as torchrun starts them, forked from the test's preloaded
server), checked by their outputs: the exported Hugging Face model, metrics.jsonl and the loss.

Why the CLI rather than a `run_ranks` body: what must hold is that the model `train.py`
validates after its last (forced) outer step is the model its export writes, and the
validation batches are a fixed, reconstructible set (the first `eval_batches` micro-batches
of the held-out blocks, `batches.validation_batches`). So the parent recomputes that loss with
`transformers` on OUT/hf and compares it to metrics.jsonl's validation row.
"""
from __future__ import annotations

import csv
import math
from collections import Counter

import pytest
import torch

from conftest import save_tiny_llama
import runs
from distributed import run_job
from test_cli import read_metrics, save_tiny_hf_with_tokenizer, transformers_validation_loss, write_config, write_text_folder

MICRO, SEQ_LEN, HIDDEN = 2, 16, 32  # write_config's micro batch and seq_len; conftest's hidden size


def _step_rows(rows):
    return [r for r in rows if r["kind"] == "step"]


def test_two_by_two_run_exports_its_validated_model_and_writes_the_metrics_contract(tmp_path):
    """2 stages x 2 replicas (replica 1 subspace-compressed, ratio 2), SparseLoCo H = 4, 8 steps,
    eval_interval 3 (so validation runs at the outer-step boundaries 4 and 8), from an HF checkpoint.

    Export: transformers' loss of OUT/hf on the validation batches equals the step-8 validation
    row (rtol 1e-5), the weights moved, and embed_tokens is bitwise T_S + T_perp of the last
    checkpoint's embedding (T_S back in Col(U) at that sync, T_perp outside it). Breaks if the
    export writes anything but the synced model that was validated (the pre-outer local model,
    another replica's, a stale checkpoint), or if T_S + T_perp is not recombined into embed_tokens.

    metrics.jsonl: exactly one step row per (step, replica) with loss, tokens, seconds, each stage's
    peak memory and bytes {activation, activation_grad, outer_sync} x {sent, recv}; the activation bytes of a step are
    exactly one micro-batch's wire payload (fp32 hidden states on replica 0, the k = d/2
    projection plus token ids on replica 1); outer_sync bytes only on outer steps; outer rows at
    steps 4 and 8 for both replicas; validation rows at 4 and 8 once each. Breaks if a field is
    renamed or dropped, if a stage's peak memory is not gathered, if a replica's rows are lost or doubled, if validation traffic is
    billed to the next training step (step 5), if the final validation is repeated when the
    last in-loop one fell on the last step, or if compression stops shrinking the wire."""
    from transformers import LlamaForCausalLM

    from hetloco_ds.sizes import id_bytes as id_width, subspace_dim

    hf_dir = save_tiny_hf_with_tokenizer(tmp_path / "hf")
    data_dir = write_text_folder(tmp_path / "data")
    cache, out = tmp_path / "cache", tmp_path / "out"
    cfg = write_config(tmp_path / "cfg.json", {
        "hetloco.sparseloco.inner_steps": 4,
        "hetloco.subspace.compressed_replicas": [1],
        "hetloco.subspace.ratio": 2,
        "hetloco.train.eval_interval": 3,
        "csv_monitor": {"enabled": True, "output_path": str(tmp_path / "csv"), "job_name": "run"},
    })
    # The 4 ranks as torchrun starts them (test_launchers: the same job as --nproc 4), forked: fast.
    run_job(tmp_path / "job", 4, ["train", "--steps", 8, "--model", hf_dir, "--out", out, "--config", cfg,
                                  "--data", data_dir], runs.env(cache))
    rows = read_metrics(out)

    # --- metrics contract
    steps = _step_rows(rows)
    assert Counter((r["step"], r["replica"]) for r in steps) == {(s, m): 1 for s in range(1, 9) for m in (0, 1)}
    k = subspace_dim(HIDDEN, 2)
    id_bytes = id_width(96)
    wire = {0: {"activation": MICRO * SEQ_LEN * HIDDEN * 4, "activation_grad": MICRO * SEQ_LEN * HIDDEN * 4},
            1: {"activation": MICRO * SEQ_LEN * (k * 4 + id_bytes), "activation_grad": MICRO * SEQ_LEN * k * 4}}
    assert wire[1]["activation"] < wire[0]["activation"]
    for r in steps:
        where = f"step {r['step']} replica {r['replica']}: {r}"
        assert math.isfinite(r["loss"]) and r["loss"] > 0, where
        assert r["tokens"] == MICRO * SEQ_LEN, where
        assert r["seconds"] > 0, where
        assert set(r["bytes"]) >= {"activation", "activation_grad", "outer_sync"}, where
        for kind in ("activation", "activation_grad", "outer_sync"):
            assert set(r["bytes"][kind]) == {"sent", "recv"}, where
            assert all(isinstance(v, int) for v in r["bytes"][kind].values()), where
        # Step 1 also carries DeepSpeed's one-time tensor-meta messages; from step 2 on a step
        # moves exactly one micro-batch each way.
        if r["step"] > 1:
            for kind, expected in wire[r["replica"]].items():
                assert r["bytes"][kind] == {"sent": expected, "recv": expected}, (kind, where)
        # Every stage's own high-water mark (resident set on the CPU: tens of MB with torch loaded),
        # the writer's (the last stage) the row's own field.
        by_stage = r["peak_memory_bytes_by_stage"]
        assert len(by_stage) == 2 and all(b > 50e6 for b in by_stage), where
        assert by_stage[1] <= r["peak_memory_bytes"], where
        synced = r["bytes"]["outer_sync"]
        if r["step"] % 4 == 0:
            assert synced["sent"] > 0 and synced["recv"] > 0, where
        else:
            assert synced == {"sent": 0, "recv": 0}, where
    outer = [r for r in rows if r["kind"] == "outer"]
    assert sorted((r["step"], r["replica"]) for r in outer) == [(4, 0), (4, 1), (8, 0), (8, 1)]
    assert all(sorted(r["contributors"]) == [0, 1] and r["excluded"] == [] for r in outer), outer
    validation = [r for r in rows if r["kind"] == "validation"]
    assert [r["step"] for r in validation] == [4, 8]

    # --- DeepSpeed's monitor (csv_monitor in the same JSON) receives the same scalars
    def monitor(name):
        with open(tmp_path / "csv" / "run" / f"{name}.csv") as f:
            return [(int(a), float(b)) for a, b in list(csv.reader(f))[1:]]

    replica0 = [(r["step"], r["loss"]) for r in steps if r["replica"] == 0]
    assert [s for s, _ in monitor("Train_loss")] == [s for s, _ in replica0]
    for (_, got), (_, want) in zip(monitor("Train_loss"), replica0):
        assert got == pytest.approx(want, rel=1e-6)
    assert [s for s, _ in monitor("Validation_loss")] == [4, 8]
    assert [v for _, v in monitor("Validation_loss")] == pytest.approx([r["loss"] for r in validation], rel=1e-6)

    # --- the export is the validated model: the uncompressed replica's validation loss is the
    # exported model's under transformers; the compressed replica's, through its compressed
    # boundaries, is close but not equal; the row's loss is their mean (as the paper averages).
    expected = transformers_validation_loss(out / "hf", data_dir, cfg, cache)
    last = validation[-1]
    assert len(last["replica_losses"]) == 2
    assert last["replica_losses"][0] == pytest.approx(expected, rel=1e-5)
    assert last["replica_losses"][1] != pytest.approx(expected, rel=1e-6)
    assert last["replica_losses"][1] == pytest.approx(expected, rel=0.05)
    assert last["loss"] == pytest.approx(sum(last["replica_losses"]) / 2, rel=1e-12)
    before = LlamaForCausalLM.from_pretrained(hf_dir).state_dict()
    after = LlamaForCausalLM.from_pretrained(out / "hf").state_dict()
    assert set(after) == set(before)
    assert not torch.equal(after["model.embed_tokens.weight"], before["model.embed_tokens.weight"])
    assert not torch.equal(after["lm_head.weight"], before["lm_head.weight"])

    # --- embed_tokens = T_S + T_perp, both as the last checkpoint (the final sync) holds them
    from hetloco_ds import subspace

    ckpt = out / "checkpoints"
    embedding = torch.load(ckpt / (ckpt / "latest").read_text().strip() / "layer_00-model_states.pt")
    t_s, perp = embedding["weight"], embedding["perp"]
    assert torch.equal(after["model.embed_tokens.weight"], t_s + perp)
    split = subspace.make_basis(HIDDEN, k, seed=1234)  # hetloco.subspace.seed's default
    assert subspace.off_subspace_norm(t_s, split) < 1e-5
    assert subspace.off_subspace_norm(perp, split) > 0.99


@pytest.fixture(scope="module")
def stdlib_hf_dir(tmp_path_factory):
    """A tiny LLaMA whose vocabulary is a 512-token default (stdlib BPE) tokenizer, saved with it;
    and the token cache (the stdlib corpus is tokenised once into it, by the run)."""
    from hetloco_ds.data import default_tokenizer

    root = tmp_path_factory.mktemp("stdlib_run")
    cache = root / "cache"
    tok = default_tokenizer(vocab_size=512, cache_dir=cache, max_train_bytes=1_000_000, progress=False)
    hf_dir = root / "hf"
    save_tiny_llama(hf_dir, vocab=len(tok))
    tok.save_pretrained(hf_dir)
    return hf_dir, cache


def test_fine_tuning_from_hf_checkpoint_lowers_loss_on_default_corpus(stdlib_hf_dir, tmp_path):
    """`train --model HF_DIR` with the default data (the stdlib corpus, tokenised with the HF
    directory's own tokenizer), 2 stages, SparseLoCo H = 3 with a dense-enough top-k, 30 steps:
    the mean loss of the last 5 steps is at least 0.4 nats below the first 5 (about 6.2 -> 5.4
    when written), and the final validation is below the first steps' loss too. Breaks if
    outer steps discard or misapply the inner progress (e.g. the pseudo-gradient's sign or the
    error feedback), if the loaded checkpoint is not what trains, or if the default corpus
    stops reaching the model."""
    hf_dir, cache = stdlib_hf_dir
    cfg = write_config(tmp_path / "cfg.json", {
        "train_micro_batch_size_per_gpu": 8,
        "optimizer.params.lr": 2e-2,
        "scheduler.params.total_num_steps": 30,
        "scheduler.params.warmup_num_steps": 3,
        "hetloco.sparseloco.inner_steps": 3,
        "hetloco.sparseloco.chunk_size": 64,
        "hetloco.sparseloco.topk": 16,
    })
    out = tmp_path / "out"
    run_job(tmp_path / "job", 2, ["train", "--steps", 30, "--model", hf_dir, "--out", out, "--config", cfg],
            runs.env(cache))
    rows = read_metrics(out)
    losses = [r["loss"] for r in sorted(_step_rows(rows), key=lambda r: r["step"])]
    assert len(losses) == 30
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert last < first - 0.4, losses
    assert sorted(r["step"] for r in rows if r["kind"] == "outer") == list(range(3, 31, 3))
    validation = [r for r in rows if r["kind"] == "validation"]
    assert [r["step"] for r in validation] == [30]
    assert validation[0]["loss"] < first - 0.4, (validation, losses[:5])
