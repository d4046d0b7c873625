"""The engine's checkpoint methods with DeepSpeed's arguments, in 2 gloo ranks (2 replicas x
1 stage, H = 2): a user's tag, and load_checkpoint's load_module_only / load_optimizer_states."""
from __future__ import annotations

import json

from distributed import run_ranks


def _api_body(rank, hf_dir, cfg_path, ckpt_dir):
    import torch

    from distributed import build_from_hf

    from hetloco_ds.data import ReplicaBatches

    engine, _, _ = build_from_hf(hf_dir, json.loads(open(cfg_path).read()), seq_len=16)
    blocks = torch.randint(96, (64, 16), generator=torch.Generator().manual_seed(0))
    # As `initialize(training_data=...)` attaches it (train_batch() then reads it): save and load keep its position.
    data = ReplicaBatches(blocks, engine.replica, engine.num_replicas, engine.micro_batch_size)
    engine.set_dataloader(data)

    def weights():
        return [p.detach().clone() for p in engine.algorithm.params]

    def moments():
        return [engine.optimizer.state[p]["exp_avg"].clone() for p in engine.algorithm.params]

    def equal(a, b):
        return all(torch.equal(x, y) for x, y in zip(a, b))

    for _ in range(2):  # step 2 ends with an outer step
        engine.train_batch()
    assert engine.save_checkpoint(ckpt_dir, tag="mine") == "mine"
    saved_w, saved_m, saved_position = weights(), moments(), data.position
    engine.train_batch()  # step 3 moves the weights and the moments
    moved_w, moved_m = weights(), moments()
    assert not equal(moved_w, saved_w) and not equal(moved_m, saved_m)

    out = {}
    _, client = engine.load_checkpoint(ckpt_dir, tag="mine", load_module_only=True)
    theta_prev = engine.algorithm.outer.theta_prev
    out["module_only"] = (equal(weights(), saved_w), equal(moments(), moved_m), equal(theta_prev, saved_w),
                          engine.local_steps, client)
    _, client = engine.load_checkpoint(ckpt_dir, load_optimizer_states=False)  # `latest` names "mine"
    out["no_optimizer"] = (equal(weights(), saved_w), equal(moments(), moved_m), engine.local_steps,
                           client["data_position"])
    engine.load_checkpoint(ckpt_dir)
    out["all"] = (equal(weights(), saved_w), equal(moments(), saved_m), engine.local_steps)
    out["positions"] = (saved_position, data.position)
    try:
        engine.load_checkpoint(ckpt_dir, load_module_strict=False)
    except ValueError as err:
        out["refused"] = str(err)
    return out


def test_load_checkpoint_flags_do_what_deepspeeds_do_and_a_user_tag_saves(tmp_path):
    """save_checkpoint(tag="mine") commits under that name and `latest` names it. After a further
    step: load_module_only=True restores the weights alone (theta_prev set to them; AdamW moments
    and counters stay this engine's, client state empty, as DeepSpeed returns it);
    load_optimizer_states=False restores everything but the moments; a plain load restores all;
    load_module_strict=False is refused in one line; the loader `initialize` attaches is saved at its
position and put back there. Breaks if a flag is ignored again, or the data restarts at 0."""
    from test_cli import save_tiny_hf_with_tokenizer, write_config

    hf = save_tiny_hf_with_tokenizer(tmp_path / "hf")
    cfg = write_config(tmp_path / "cfg.json", {"pipeline.stages": 1, "hetloco.sparseloco.inner_steps": 2})
    results = run_ranks(_api_body, 2, str(hf), str(cfg), str(tmp_path / "ckpt"), timeout=240)
    assert (tmp_path / "ckpt" / "latest").read_text() == "mine"
    for r in results:
        assert r["module_only"] == (True, True, True, 3, {})
        saved_position, resumed_position = r["positions"]
        assert saved_position > 0 and resumed_position == saved_position  # not where step 3 left it
        assert r["no_optimizer"] == (True, True, 2, saved_position)
        assert r["all"] == (True, True, 2)
        assert r["refused"] == ("load_checkpoint: load_module_strict=False and custom_load_fn are not supported "
                                "(a hetloco checkpoint always holds every layer of every stage)")
