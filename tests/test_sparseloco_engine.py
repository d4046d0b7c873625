"""SparseLoCo as the engine's step: local steps, bitwise-identical syncs, exact bytes, resume."""
from __future__ import annotations

import hashlib

import pytest
import torch
from transformers import LlamaForCausalLM

from distributed import build_from_hf, run_ranks

SEQ = 16
VOCAB = 96


def _config(stages, inner_steps, topk=32, error_decay=0.95, clip=1.0, lr=1e-2, checkpoint=None):
    return {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 2,
        "gradient_clipping": clip,
        "pipeline": {"stages": stages},
        "optimizer": {"type": "AdamW", "params": {"lr": lr, "betas": [0.9, 0.95], "weight_decay": 0.1}},
        "hetloco": {
            "sparseloco": {"inner_steps": inner_steps, "topk": topk, "error_decay": error_decay, "outer_lr": 1.0},
            "train": {"seq_len": SEQ},
        },
    }


def _batches(replica: int, step: int):
    """Deterministic, replica-specific micro-batches for one optimizer step."""
    g = torch.Generator().manual_seed(1000 * replica + step)
    ids = torch.randint(0, VOCAB, (2, 2, SEQ), generator=g)
    return [(m, m) for m in ids]


def _params_hash(module) -> str:
    h = hashlib.sha256()
    for p in module.parameters():
        h.update(p.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def _hf_named_params(module, cfg):
    from hetloco_ds import convert

    out = {}
    for idx, layer in module.local_layers().items():
        mapping = convert.hf_keys_for_layer(cfg, idx)
        for name, p in layer.named_parameters():
            if name in mapping:
                out[mapping[name]] = p.detach().clone()
    return out


def _train_body(rank, hf_dir, ds_cfg, steps, trace_collectives):
    """Train `steps` steps; per step record the replica loss, a parameter hash and, optionally,
    every collective this rank issues with the ranks of its group."""
    import torch.distributed as tdist

    engine, module, cfg = build_from_hf(hf_dir, ds_cfg, SEQ)
    calls: list[tuple[int, str, tuple]] = []
    phase = {"step": 0}
    if trace_collectives:
        for name in ("all_reduce", "all_gather", "broadcast", "reduce_scatter", "barrier", "all_gather_into_tensor",
                     "reduce_scatter_tensor", "send", "recv", "all_to_all_single", "reduce"):
            original = getattr(tdist, name)

            def traced(*args, _orig=original, _name=name, **kwargs):
                group = kwargs.get("group")
                ranks = tuple(tdist.get_process_group_ranks(group)) if group is not None else tuple(range(tdist.get_world_size()))
                if _name in ("send", "recv"):
                    peer = kwargs.get("dst", kwargs.get("src", args[1] if len(args) > 1 else None))
                    ranks = tuple(sorted({tdist.get_rank(), peer}))
                calls.append((phase["step"], _name, ranks))
                return _orig(*args, **kwargs)

            setattr(tdist, name, traced)
    original_outer = engine.outer_step

    def outer_step():
        phase["step"] = -phase["step"]  # negative marks "inside the outer step of this step"
        try:
            return original_outer()
        finally:
            phase["step"] = -phase["step"]

    engine.outer_step = outer_step
    records = []
    for step in range(1, steps + 1):
        phase["step"] = step
        rec = engine.train_step(iter(_batches(engine.replica, step)))
        records.append({"loss": rec.loss, "hash": _params_hash(module), "outer": rec.outer, "bytes": rec.bytes})
    shapes = [tuple(p.shape) for p in engine.trainable_params()]
    return {"replica": engine.replica, "stage": engine.stage_id, "records": records, "calls": calls,
            "dp_ranks": tuple(tdist.get_process_group_ranks(engine.dp_group)), "shapes": shapes,
            "params": _hf_named_params(module, cfg)}


@pytest.mark.parametrize("stages,world", [(1, 2), (2, 4)])
def test_replicas_diverge_inside_and_agree_bitwise_after_outer_steps(hf_untied, stages, world):
    """2 replicas x 1 stage and 2 x 2: parameters differ between replicas during inner steps,
    are bitwise identical after every outer step, each rank's outer-step traffic equals the
    analytic payload size, and no collective touches the data-parallel group between outer
    steps. Breaks if a gradient or loss all-reduce sneaks back in, if aggregation is not
    deterministic, or if the payload is not the compact one."""
    from hetloco_ds.sparseloco.payload import payload_nbytes

    H, steps = 3, 6
    cfg = _config(stages, H)
    results = run_ranks(_train_body, world, hf_untied, cfg, steps, True)
    by_stage: dict[int, list] = {}
    for r in results:
        by_stage.setdefault(r["stage"], []).append(r)
    for stage, members in by_stage.items():
        a, b = sorted(members, key=lambda r: r["replica"])
        for i in range(steps):
            synced = (i + 1) % H == 0
            if synced:
                assert a["records"][i]["hash"] == b["records"][i]["hash"], f"stage {stage} step {i + 1} not identical"
            else:
                assert a["records"][i]["hash"] != b["records"][i]["hash"], f"stage {stage} step {i + 1} did not diverge"
        expected = payload_nbytes(a["shapes"], cfg["hetloco"]["sparseloco"] | {})
        for r in members:
            for rec in r["records"]:
                if rec["outer"] is not None:
                    assert rec["outer"]["payload_bytes"] == expected
    for r in results:
        dp = set(r["dp_ranks"])
        for step, name, ranks in r["calls"]:
            if step > 0:  # between outer steps
                assert not (set(ranks) >= dp and len(dp) > 1 and len(set(ranks) & dp) > 1), (
                    f"rank group {ranks} ({name}) crosses replicas during inner step {step}")
    # Replica losses are each replica's own: they differ during inner steps.
    losses = {(r["replica"], r["stage"]): [x["loss"] for x in r["records"]] for r in results}
    assert losses[(0, stages - 1)][0] != losses[(1, stages - 1)][0]


def _bytes_body(rank, hf_dir, ds_cfg, steps):
    out = _train_body(rank, hf_dir, ds_cfg, steps, False)
    return {k: out[k] for k in ("replica", "stage", "records", "shapes")}


def test_outer_sync_bytes_per_step_equal_payload(hf_untied):
    """The `outer_sync` bytes in the step record (summed over the replica's ranks) equal
    sent = sum of each stage's payload and recv = (M-1) x that, at outer steps only."""
    from hetloco_ds.sparseloco.payload import payload_nbytes

    H = 2
    cfg = _config(2, H)
    results = run_ranks(_bytes_body, 4, hf_untied, cfg, 2)
    per_stage = {r["stage"]: payload_nbytes(r["shapes"], cfg["hetloco"]["sparseloco"]) for r in results}
    total = sum(per_stage.values())
    for r in results:
        first, second = r["records"]
        assert first["bytes"]["outer_sync"] == {"sent": 0, "recv": 0}
        assert second["bytes"]["outer_sync"] == {"sent": total, "recv": total}


def _adamw_body(rank, hf_dir, ds_cfg, batches):
    engine, module, cfg = build_from_hf(hf_dir, ds_cfg, SEQ)
    for mbs in batches:
        engine.train_step(iter(mbs))
    return _hf_named_params(module, cfg)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_degenerate_sparseloco_is_plain_adamw(hf_untied, compiled):
    """M = 1, H = 1, top-k = whole chunk, error_decay = 0, outer_lr = 1: the weights after each
    outer step equal plain torch.optim.AdamW training of LlamaForCausalLM (here on a 2-stage
    pipeline). Breaks if the outer step applies anything but theta, if the inner step differs
    from AdamW (clipping over the replica, grad accumulation), or if stages drift apart.
    `compiled`: the same with `train.compile` (torch.compile'd decoder layers and loss)."""
    cfg = _config(2, 1, topk=4096, error_decay=0.0, clip=1.0, lr=1e-2)
    cfg["hetloco"]["train"]["compile"] = compiled
    batches = [_batches(0, s) for s in range(1, 4)]
    got = {}
    for part in run_ranks(_adamw_body, 2, hf_untied, cfg, batches):
        got.update(part)
    model = LlamaForCausalLM.from_pretrained(hf_untied, attn_implementation="sdpa").float()
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, eps=1e-8)
    for mbs in batches:
        opt.zero_grad()
        for ids, _ in mbs:
            (model(input_ids=ids, labels=ids).loss / len(mbs)).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
    for name, p in model.named_parameters():
        if not compiled:
            torch.testing.assert_close(got[name], p.detach(), rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")
            continue
        # Compiled kernels reorder fp32 sums, and AdamW's first steps (update ~ lr * sign(g))
        # turn that noise into a full lr-sized flip on the odd near-zero gradient; so compare
        # each tensor's whole update: a wrong step differs by its own size.
        update = (p.detach() - initial[name]).norm()
        error = (got[name] - p.detach()).norm()
        assert error <= 1e-3 * update, f"{name}: |got - ref| = {error:.3g} vs update {update:.3g}"


def _resume_body(rank, hf_dir, ds_cfg, ckpt_dir, start, stop, save_at):
    from hetloco_ds import checkpoint

    engine, module, _ = build_from_hf(hf_dir, ds_cfg, SEQ)
    if start > 0:
        checkpoint.load(engine, ckpt_dir)
        assert engine.local_steps == start
    losses = []
    for step in range(start + 1, stop + 1):
        rec = engine.train_step(iter(_batches(engine.replica, step)))
        losses.append(rec.loss)
        if step == save_at:
            checkpoint.save(engine, ckpt_dir, step, data_position=step * 2)
    return losses


def test_kill_and_resume_continues_with_identical_losses(hf_untied, tmp_path):
    """Stopping after a checkpoint at an outer boundary and resuming in fresh processes gives
    the same per-step losses as an uninterrupted run. Breaks if any per-replica state (AdamW
    moments, error buffers, theta at the last sync, step counters, LR schedule) is lost."""
    H = 2
    cfg = _config(2, H)
    full = run_ranks(_resume_body, 4, hf_untied, cfg, str(tmp_path / "unused"), 0, 3 * H, -1)
    first = run_ranks(_resume_body, 4, hf_untied, cfg, str(tmp_path / "ckpt"), 0, H, H)
    second = run_ranks(_resume_body, 4, hf_untied, cfg, str(tmp_path / "ckpt"), H, 3 * H, -1)
    for r in range(4):
        assert first[r] == full[r][:H]
        assert second[r] == full[r][H:], f"rank {r}: resumed {second[r]} vs uninterrupted {full[r][H:]}"


def _adamw_het_body(rank, hf_dir, ds_cfg, steps):
    engine, module, _ = build_from_hf(hf_dir, ds_cfg, SEQ)
    hashes = []
    for step in range(1, steps + 1):
        engine.train_step(iter(_batches(engine.replica, step)))
        perp = engine.algorithm.perp
        hashes.append((_params_hash(module), hashlib.sha256(perp.detach().cpu().numpy().tobytes()).hexdigest()))
    return {"replica": engine.replica, "stage": engine.stage_id, "compressed": engine.module.codec.compressed,
            "hashes": hashes}


def test_adamw_het_replicas_stay_bitwise_identical(hf_untied):
    """Plain data parallelism (sparseloco.enabled false, the AdamW baselines) with replica 1 of 2
    compressed at ratio 8, 2 stages: after every step each stage's parameters and T_perp are
    bitwise identical on both replicas, as DDP promises whatever the boundaries carry. Breaks if
    only the compressed replica keeps T_S in Col(U) (the replicas then drift apart) or if the
    re-split of T_S's off-subspace part into T_perp differs between stages or replicas."""
    cfg = _config(2, 1)
    cfg["hetloco"]["sparseloco"]["enabled"] = False
    cfg["hetloco"]["subspace"] = {"ratio": 8, "compressed_replicas": [1]}
    steps = 3
    results = run_ranks(_adamw_het_body, 4, hf_untied, cfg, steps)
    assert sorted((r["replica"], r["compressed"]) for r in results) == [(0, False), (0, False), (1, True), (1, True)]
    for stage in (0, 1):
        a, b = sorted((r for r in results if r["stage"] == stage), key=lambda r: r["replica"])
        for step in range(steps):
            assert a["hashes"][step] == b["hashes"][step], f"stage {stage}: replicas differ after step {step + 1}"


def _placement_body(rank, hf_dir, ds_cfg, steps):
    engine, module, _ = build_from_hf(hf_dir, ds_cfg, SEQ)
    records = []
    for step in range(1, steps + 1):
        rec = engine.train_step(iter(_batches(engine.replica, step)))
        records.append((rec.loss, _params_hash(module)))
    outer = engine.algorithm.state_dict()["outer"]  # what checkpoint.save writes for the algorithm
    return {"replica": engine.replica, "stage": engine.stage_id, "records": records,
            "on_host": engine.algorithm.outer.on_host,
            "outer": [t.clone() for t in outer["theta_prev"] + outer["error"]]}


def test_outer_state_on_the_host_trains_the_same_bits_as_on_the_device(hf_untied):
    """sparseloco.outer_state_device "cpu" against "gpu" (the state on the parameters' device), 2 replicas,
    replica 1 compressed (the embedding's resync rebases theta_prev), 2 outer steps: every step's loss
    and parameters bitwise equal on every rank, and the algorithm state a checkpoint holds (theta at the
    last sync, error feedback) equal too. Breaks if the setting does not reach the stage's state, if the
    host placement drops a write-back or reads a stale copy, or if the state leaves
    StageAlgorithm.state_dict."""
    H, steps = 2, 4
    runs = {}
    for where in ("gpu", "cpu"):
        cfg = _config(1, H)
        cfg["hetloco"]["sparseloco"]["outer_state_device"] = where
        cfg["hetloco"]["subspace"] = {"ratio": 8, "compressed_replicas": [1]}
        runs[where] = {(r["replica"], r["stage"]): r for r in run_ranks(_placement_body, 2, hf_untied, cfg, steps)}
    assert sorted(runs["gpu"]) == sorted(runs["cpu"]) == [(0, 0), (1, 0)]
    for key, on_device in runs["gpu"].items():
        on_host = runs["cpu"][key]
        assert on_host["records"] == on_device["records"], f"replica, stage {key}: losses or parameters differ"
        assert all(torch.equal(a, b) for a, b in zip(on_host["outer"], on_device["outer"])), key
        assert on_host["on_host"] and not on_device["on_host"]
    # the replicas differ between outer steps and agree after them, in both runs
    for run in runs.values():
        a, b = run[(0, 0)]["records"], run[(1, 0)]["records"]
        assert [x[1] == y[1] for x, y in zip(a, b)] == [False, True, False, True]
