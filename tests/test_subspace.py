"""Subspace-compressed stage boundaries, heterogeneous replicas and embedding adaptation."""
from __future__ import annotations

import hashlib

import pytest
import torch

from distributed import build_from_hf, run_ranks
from hetloco_ds import subspace

SEQ = 16


# ----------------------------------------------------------------- pure functions
def test_basis_is_orthonormal_deterministic_and_nested():
    """U has orthonormal columns, is the same bits every time it is built from a seed, and a
    smaller k spans a subspace of a larger k's (so replicas with different ratios share T_S's
    subspace). Breaks if U is rebuilt differently on another rank or ratios stop nesting."""
    u8 = subspace.make_basis(64, 8, seed=3)
    u16 = subspace.make_basis(64, 16, seed=3)
    torch.testing.assert_close(u8.T @ u8, torch.eye(8), atol=1e-6, rtol=0)
    assert torch.equal(u8, subspace.make_basis(64, 8, seed=3))
    assert subspace.off_subspace_norm(u8.T, u16) < 1e-6
    assert not torch.equal(u8, subspace.make_basis(64, 8, seed=4))


def test_codec_round_trip_is_exact_in_subspace_and_truncates_outside():
    """X = T_perp[x] + Z with Z in Col(U) is rebuilt exactly; the part of Z outside Col(U) is
    what is lost (float64 reference). Breaks if encode/decode use different T_perp rows or U^T."""
    torch.manual_seed(0)
    d, k, vocab = 32, 8, 50
    # Re-orthonormalise the float32 basis in float64 so "exact" means float64 exact.
    u = torch.linalg.qr(subspace.make_basis(d, k, 0).double())[0]
    perp = torch.randn(vocab, d, dtype=torch.float64)
    ids = torch.randint(0, vocab, (2, 5))
    z_in = torch.randn(2, 5, k, dtype=torch.float64) @ u.T
    x = perp[ids] + z_in
    rebuilt = subspace.decode(subspace.encode(x, ids, perp, u), ids, perp, u)
    torch.testing.assert_close(rebuilt, x, rtol=1e-12, atol=1e-12)
    z_out = torch.randn(2, 5, d, dtype=torch.float64)
    rebuilt = subspace.decode(subspace.encode(perp[ids] + z_out, ids, perp, u), ids, perp, u)
    torch.testing.assert_close(rebuilt, perp[ids] + z_out @ u @ u.T, rtol=1e-12, atol=1e-12)


def test_resync_matches_paper_equations_3_and_4():
    """T_perp += T_S - Pi(T_S), T_S = Pi(T_S), computed from the averaged pseudo-gradient alone,
    equals the paper's equations on the synced T_S (float64), and TE = T_S + T_perp is unchanged
    by the resync. Breaks if the sign or the outer lr is wrong, or if TE moves."""
    torch.manual_seed(1)
    d, k, vocab, lr = 16, 4, 10, 0.7
    u = torch.linalg.qr(subspace.make_basis(d, k, 0).double())[0]
    theta_prev = subspace.project(torch.randn(vocab, d, dtype=torch.float64), u)
    perp = torch.randn(vocab, d, dtype=torch.float64)
    avg = torch.randn(vocab, d, dtype=torch.float64)
    t_s = theta_prev - lr * avg
    te_before = t_s + perp
    expected_perp = perp + (t_s - subspace.project(t_s, u))
    expected_ts = subspace.project(t_s, u)
    subspace.resync_embedding_(t_s, perp, avg, lr, u)
    torch.testing.assert_close(perp, expected_perp, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(t_s, expected_ts, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(t_s + perp, te_before, rtol=1e-12, atol=1e-12)


# ------------------------------------------------------------------------- engine
def _config(stages, ratio, compressed, inner_steps=2, adaptation=True, wproj=False, every_step=False):
    return {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 2,
        "gradient_clipping": 1.0,
        "pipeline": {"stages": stages},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "hetloco": {
            "sparseloco": {"inner_steps": inner_steps},
            "subspace": {"ratio": ratio, "compressed_replicas": compressed, "embedding_adaptation": adaptation,
                         "project_residual_weights": wproj, "project_embedding_every_step": every_step},
            "train": {"seq_len": SEQ},
        },
    }


def _batches(replica, step):
    g = torch.Generator().manual_seed(100 * replica + step)
    ids = torch.randint(0, 96, (2, 2, SEQ), generator=g)
    return [(m, m) for m in ids]


def _digest(t):
    return hashlib.sha256(t.detach().cpu().contiguous().numpy().tobytes()).hexdigest()


def _het_body(rank, hf_dir, ds_cfg, steps):
    from hetloco_ds.model import DecoderLayer

    engine, module, _ = build_from_hf(hf_dir, ds_cfg, SEQ)
    basis = module.codec.basis
    out = []
    for step in range(1, steps + 1):
        perp_before = module.codec.perp.clone()
        rec = engine.train_step(iter(_batches(engine.replica, step)))
        row = {"step": step, "outer": rec.outer is not None, "bytes": rec.bytes,
               "perp": _digest(module.codec.perp), "perp_changed": not torch.equal(perp_before, module.codec.perp)}
        embs = module.embeddings()
        if embs:
            row["te"] = _digest(embs[0].table())
            row["ts"] = _digest(embs[0].weight)
            if basis is not None:
                row["ts_off"] = subspace.off_subspace_norm(embs[0].weight.detach(), basis)
        if basis is not None:
            offs = [subspace.off_subspace_norm(l.layer.self_attn.o_proj.weight.detach().T, basis)
                    for l in module.local_layers().values() if isinstance(l, DecoderLayer)]
            row["oproj_off"] = max(offs) if offs else None
        out.append(row)
    return {"replica": engine.replica, "stage": engine.stage_id, "compressed": basis is not None, "rows": out}


@pytest.mark.parametrize("every_step", [False, True], ids=["paper", "every_step_ablation"])
def test_heterogeneous_run_ts_leaves_subspace_between_syncs_and_agrees_bitwise_after_each(hf_tied, every_step):
    """2 replicas x 2 stages, replica 1 compressed (tied embeddings, so T_S lives on both the
    first and the last stage), H = 2: on the compressed replica T_S has left Col(U) after each
    inner step between syncs (the paper; with `project_embedding_every_step`, the ablation, it
    stays in Col(U) after every step) and is back in it after each sync; after every outer sync
    T_S and TE = T_S + T_perp are bitwise identical on every replica and stage that holds them,
    and T_perp is identical on every rank after every step. Breaks if the resync is skipped on
    a stage or uses a different aggregate, if T_S is projected between syncs by default, or if
    the ablation's switch is ignored."""
    results = run_ranks(_het_body, 4, hf_tied, _config(2, 4, [1], every_step=every_step), 4)
    offs = {True: [], False: []}
    for r in results:
        if r["compressed"]:
            for row in r["rows"]:
                offs[row["outer"]].append(row["ts_off"])
    assert len(offs[True]) == len(offs[False]) == 4  # two stages, two steps of each kind
    assert max(offs[True]) < 1e-5
    assert (max(offs[False]) < 1e-5) if every_step else (min(offs[False]) > 1e-3), offs[False]
    for step in (2, 4):
        rows = [r["rows"][step - 1] for r in results]
        assert len({row["te"] for row in rows if "te" in row}) == 1, f"TE differs across holders after outer step at {step}"
        assert len({row["ts"] for row in rows if "ts" in row}) == 1, f"T_S differs across holders after outer step at {step}"
        assert all(row["perp_changed"] for row in rows)
    for step in range(1, 5):
        assert len({r["rows"][step - 1]["perp"] for r in results}) == 1, f"T_perp differs after step {step}"
    # Inner steps leave T_perp alone.
    assert not any(r["rows"][i]["perp_changed"] for r in results for i in (0, 2))


def _decay_body(rank, hf_dir, ds_cfg, steps):
    engine, module, _ = build_from_hf(hf_dir, ds_cfg, SEQ)
    perp = module.codec.perp.clone()
    for step in range(1, steps + 1):
        engine.train_step(iter(_batches(engine.replica, step)))
    embs = module.embeddings()
    return {"perp": perp, "perp_after": module.codec.perp.clone(), "ts": embs[0].weight.detach().clone() if embs else None}


def test_engine_decays_the_whole_table_with_each_steps_own_lr(hf_untied):
    """The engine under DeepSpeed's LR schedule (its lr differs at each of the first three steps),
    one compressed replica of 2 stages, two inner steps and no sync, wd 0.1: `embedding_weight_decay:
    table` (the default) ends with T_S equal to `t_s`'s minus lr_2 * wd * T_perp (lr_2 the second
    step's lr; the first's is 0) and T_perp untouched on both stages, as the simulators do
    (test_simulate). Breaks if the engine reads the lr after DeepSpeed's schedule moved it, or
    not at all."""
    from test_simulate import WARMUP, _schedule_lrs

    lrs = _schedule_lrs(WARMUP, 1e-2, 3)
    runs = {}
    for decay in ("table", "t_s"):
        cfg = _config(2, 4, "all", inner_steps=10)
        cfg["scheduler"] = WARMUP
        cfg["optimizer"]["params"]["weight_decay"] = 0.1
        cfg["hetloco"]["subspace"]["embedding_weight_decay"] = decay
        runs[decay] = run_ranks(_decay_body, 2, hf_untied, cfg, 2)
    for decay, results in runs.items():
        assert all(torch.equal(r["perp"], r["perp_after"]) for r in results), decay
    perp, table, alone = runs["table"][0]["perp"], runs["table"][0]["ts"], runs["t_s"][0]["ts"]
    torch.testing.assert_close(table, alone - lrs[1] * 0.1 * perp, rtol=0, atol=1e-9)
    assert (table - alone).abs().max() > 100 * 1e-9


def _bytes_body(rank, hf_dir, ds_cfg):
    engine, module, _ = build_from_hf(hf_dir, ds_cfg, SEQ)
    recs = [engine.train_step(iter(_batches(0, s))).bytes for s in (1, 2)]
    return {"stage": engine.stage_id, "k": module.codec.basis.shape[1], "bytes": recs[1]}


@pytest.mark.parametrize("ratio,bf16", [(4, False), (8, False), (8, True)])
def test_compressed_boundary_bytes_are_b_l_k_plus_ids(hf_untied, ratio, bf16):
    """Bytes over a compressed boundary per micro-batch, measured at the send calls: forward
    b*L*k*w + b*L*1 (ids as int8 for a 96-token vocabulary), backward b*L*k*w, with w = 4 for
    fp32 and 2 under bf16. Breaks if the full hidden state, wide ids, fp32 under bf16 or extra
    tensors cross the link."""
    cfg = _config(2, ratio, "all")
    cfg["bf16"] = {"enabled": bf16}
    results = run_ranks(_bytes_body, 2, hf_untied, cfg)
    b, gas, w = 2, 2, 2 if bf16 else 4
    k = 32 // ratio
    for r in results:
        assert r["k"] == k
        # Summed over the replica's two ranks: each message is counted once sent and once received.
        fwd, bwd = gas * (b * SEQ * k * w + b * SEQ), gas * b * SEQ * k * w
        assert r["bytes"]["activation"] == {"sent": fwd, "recv": fwd}
        assert r["bytes"]["activation_grad"] == {"sent": bwd, "recv": bwd}


def test_ratio_one_reproduces_uncompressed_pipeline(hf_untied):
    """k = d: the compressed boundary rebuilds X to float precision, so loss and gradients
    equal transformers' (through the T_S + T_perp split). Breaks if the codec or the embedding
    split changes the function being trained."""
    from test_pipeline import _grads_body, _reference

    torch.manual_seed(1)
    batch = torch.randint(0, 96, (4, 16))
    ref_loss, ref_grads = _reference(hf_untied, batch)
    cfg = _config(2, 1, "all")
    cfg["gradient_clipping"] = 0.0
    results = run_ranks(_grads_body, 2, hf_untied, cfg, batch)
    merged = {}
    for loss, grads in results:
        assert loss == pytest.approx(ref_loss, rel=1e-5)
        merged.update(grads)
    for name, g in ref_grads.items():
        torch.testing.assert_close(merged[name], g, rtol=1e-3, atol=1e-5, msg=lambda m: f"{name}: {m}")


def _ablation_body(rank, hf_dir, ds_cfg):
    out = _het_body(rank, hf_dir, ds_cfg, 2)
    return out


@pytest.mark.parametrize("adaptation,wproj", [(False, True)])
def test_engine_ablation_switches_change_what_they_claim(hf_untied, adaptation, wproj):
    """embedding_adaptation=false leaves T_perp fixed at outer syncs (Table 5a); with
    project_residual_weights the o_proj outputs lie in Col(U) after inner steps (Table 5b).
    The default run (previous tests) shows the opposite of both. Breaks if a switch is ignored."""
    results = run_ranks(_ablation_body, 2, hf_untied, _config(2, 4, "all", adaptation=adaptation, wproj=wproj))
    for r in results:
        assert not any(row["perp_changed"] for row in r["rows"])
        for row in r["rows"]:
            # After an inner step (the outer step applies the sparse average, unprojected).
            if row.get("oproj_off") is not None and not row["outer"]:
                assert row["oproj_off"] < 1e-5


def test_engine_default_does_not_project_weights(hf_untied):
    """Without the Table 5b switch, o_proj keeps components outside Col(U)."""
    results = run_ranks(_ablation_body, 2, hf_untied, _config(2, 4, "all"))
    offs = [row["oproj_off"] for r in results for row in r["rows"] if row.get("oproj_off") is not None]
    assert offs and min(offs) > 0.1
