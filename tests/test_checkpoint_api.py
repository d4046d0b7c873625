"""The engine's checkpoint methods with DeepSpeed's arguments, in 2 gloo ranks (2 replicas x
1 stage, H = 2): a user's tag, and load_checkpoint's load_module_only / load_optimizer_states."""
from __future__ import annotations

import json
import re
import sys

import pytest

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
    writer = engine._checkpoint_writer
    out["staging"] = (writer.staging, len(writer._stager._cached_storage_mapping) > 0)  # whether anything was copied
    try:
        engine.load_checkpoint(ckpt_dir, load_module_strict=False)
    except ValueError as err:
        out["refused"] = str(err)
    return out


@pytest.mark.parametrize("staging", ["host", "none"])
def test_load_checkpoint_flags_do_what_deepspeeds_do_and_a_user_tag_saves(tmp_path, staging):
    """save_checkpoint(tag="mine") commits under that name and `latest` names it. After a further
    step: load_module_only=True restores the weights alone (theta_prev set to them; AdamW moments
    and counters stay this engine's, client state empty, as DeepSpeed returns it);
    load_optimizer_states=False restores everything but the moments; a plain load restores all;
    load_module_strict=False is refused in one line; the loader `initialize` attaches is saved at its
position and put back there. The same whether the save stages a host copy and writes it in the
background or writes the live tensors (`train.checkpoint_staging` "none"). Breaks if a flag is
ignored again, or the data restarts at 0."""
    from test_cli import save_tiny_hf_with_tokenizer, write_config

    hf = save_tiny_hf_with_tokenizer(tmp_path / "hf")
    cfg = write_config(tmp_path / "cfg.json", {"pipeline.stages": 1, "hetloco.sparseloco.inner_steps": 2,
                                               "hetloco.train.checkpoint_staging": staging})
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
        assert r["staging"] == (staging, staging == "host")


def test_auto_staging_copies_only_where_the_host_holds_every_local_ranks_copy():
    """`checkpoint.pick_staging`: "auto" stages where the local ranks' copies fit in nine tenths of
    the available memory, writes the live tensors where they do not, stages where the memory is
    unknown; "host" and "none" are kept as given."""
    from hetloco_ds.checkpoint import pick_staging

    assert pick_staging("auto", 10, 4, 45) == "host" and pick_staging("auto", 10, 4, 44) == "none"
    assert pick_staging("auto", 10 ** 12, 8, None) == "host"
    assert pick_staging("host", 10, 4, 1) == "host" and pick_staging("none", 1, 1, 10 ** 12) == "none"


def test_the_copy_a_save_would_stage_counts_8bit_moments_by_their_codes():
    """`checkpoint.host_bytes`, what "auto" weighs: plain tensors by their storages, torchao's
    8-bit moments by their codes and scales (about 1 B an element, not the 4 their wrapper reports)."""
    import torch

    from hetloco_ds.checkpoint import host_bytes

    w = torch.zeros(128, 128)
    assert host_bytes({"w": w, "n": [torch.zeros(3, dtype=torch.int64)], "x": 1.0}) == 4 * 128 * 128 + 24
    torchao_optim = pytest.importorskip("torchao.optim")
    p = torch.nn.Parameter(torch.randn(128, 128))
    opt = torchao_optim.AdamW8bit([p])
    p.grad = torch.ones_like(p)
    opt.step()
    moments = host_bytes(opt.state_dict()["state"])
    assert 2 * 128 * 128 <= moments < 2 * 128 * 128 * 1.2, moments


def _two_saves_body(rank, hf_dir, cfg_path, ckpt_dir):
    import torch
    from torch.distributed.checkpoint import _state_dict_stager, staging

    from distributed import build_from_hf

    from hetloco_ds import checkpoint

    # torch 2.11's DefaultStager closes its StateDictStager after every copy (its buffers freed, its
    # type table emptied); a checkpoint path through it fails at the second save.
    stage_once = staging.DefaultStager._stage

    def stage_and_close(self, state_dict, **kwargs):
        try:
            return stage_once(self, state_dict, **kwargs)
        finally:
            self._state_dict_stager.close()

    staging.DefaultStager._stage = stage_and_close
    copies = []  # per save: {source storage pointer: host copy's pointer}
    stage = _state_dict_stager.StateDictStager.stage

    def recording(self, state_dict, non_blocking=False):
        out = stage(self, state_dict, non_blocking=non_blocking)
        pairs, found = {}, []

        def walk(a, b):
            if isinstance(a, torch.Tensor):
                found.append((a, b))
            elif isinstance(a, dict):
                for k in a:
                    walk(a[k], b[k])
            elif isinstance(a, (list, tuple)):
                for x, y in zip(a, b):
                    walk(x, y)

        walk(state_dict, out)
        for a, b in found:
            if a.numel() > 1:
                pairs[a.untyped_storage().data_ptr()] = b.untyped_storage().data_ptr()
        copies.append(pairs)
        return out

    _state_dict_stager.StateDictStager.stage = recording
    from hetloco_ds.data import ReplicaBatches

    engine, _, _ = build_from_hf(hf_dir, json.loads(open(cfg_path).read()), seq_len=16)
    blocks = torch.randint(96, (64, 16), generator=torch.Generator().manual_seed(0))
    engine.set_dataloader(ReplicaBatches(blocks, engine.replica, engine.num_replicas, engine.micro_batch_size))
    for tag in ("first", "second"):
        for _ in range(2):  # an outer step each
            engine.train_batch()
        checkpoint.save(engine, ckpt_dir, engine.local_steps, 0, tag=tag)
    first, second = copies
    reused = [p for p in second if p in first]
    return {"tensors": (len(first), len(second)), "reused": len(reused),
            "same_buffers": sum(first[p] == second[p] for p in reused)}


def test_a_second_save_reuses_the_first_saves_host_buffers_whatever_torchs_stager_does(tmp_path):
    """Two saves in one process, with DefaultStager behaving as torch 2.11's (it closes its
    StateDictStager after each copy): both commit, and every tensor of the second save that the
    first also copied lands in the same host buffer (a GPU save then pays the pinned allocation
    once per process). Breaks if the saves go through DefaultStager again: the second fails
    (KeyError: <class 'type'>), as it did in an 8B run on torch 2.11."""
    from test_cli import save_tiny_hf_with_tokenizer, write_config

    hf = save_tiny_hf_with_tokenizer(tmp_path / "hf")
    cfg = write_config(tmp_path / "cfg.json", {"pipeline.stages": 1, "hetloco.sparseloco.inner_steps": 2})
    results = run_ranks(_two_saves_body, 2, str(hf), str(cfg), str(tmp_path / "ckpt"), timeout=240)
    assert (tmp_path / "ckpt" / "latest").read_text() == "second"
    for r in results:
        n_first, n_second = r["tensors"]
        assert n_first >= 10 and n_second == n_first
        assert r["reused"] == n_first and r["same_buffers"] == n_first


def test_the_private_torch_stager_is_checked_before_a_run_naming_what_changed(monkeypatch):
    """checkpoint.check_torch passes on this torch, and names the module, the class, torch's version
    and the missing parameter when the class is gone or its `stage` no longer takes `non_blocking`
    (a torch that renamed it would otherwise fail at a run's first save, hours in)."""
    import types

    import torch

    from hetloco_ds import checkpoint

    checkpoint.check_torch()
    monkeypatch.setattr(checkpoint, "STAGER", ("torch.distributed.checkpoint._state_dict_stager", "NoSuchStager"))
    with pytest.raises(checkpoint.TorchMismatch, match=rf"torch {re.escape(torch.__version__)}: .*NoSuchStager is gone"):
        checkpoint.check_torch()

    class Renamed:
        def __init__(self, pin_memory=False, share_memory=False):
            pass

        def stage(self, state_dict, blocking=True):
            pass

    fake = types.ModuleType("fake_stager")
    fake.Renamed = Renamed
    monkeypatch.setitem(sys.modules, "fake_stager", fake)
    monkeypatch.setattr(checkpoint, "STAGER", ("fake_stager", "Renamed"))
    with pytest.raises(checkpoint.TorchMismatch, match=r"fake_stager\.Renamed\.stage lacks non_blocking"):
        checkpoint.check_torch()


def _client_state_body(rank, hf_dir, cfg_path, ckpt_dir, marker):
    import os

    import numpy as np
    import torch
    from deepspeed import comm as dist

    from distributed import build_from_hf
    from test_crafted_files import craft

    from hetloco_ds import checkpoint
    from hetloco_ds.data import ReplicaBatches

    engine, _, _ = build_from_hf(hf_dir, json.loads(open(cfg_path).read()), seq_len=16)
    blocks = torch.randint(96, (64, 16), generator=torch.Generator().manual_seed(0))
    engine.set_dataloader(ReplicaBatches(blocks, engine.replica, engine.num_replicas, engine.micro_batch_size))
    for _ in range(2):
        engine.train_batch()
    plain = {"best": 1.5, "seen": [1, (2, "b")], "name": b"x", "ids": torch.arange(3), "none": None}
    engine.save_checkpoint(ckpt_dir, tag="plain", client_state=plain)
    out = {}
    try:
        engine.save_checkpoint(ckpt_dir, tag="numpy", client_state={"best": np.float64(1.5), "n": 1})
    except checkpoint.CheckpointError as err:
        out["refused"] = (str(err), err.report)
    dist.barrier()
    out["tags"] = sorted(os.listdir(ckpt_dir))
    _, client = engine.load_checkpoint(ckpt_dir, tag="plain")
    out["client"] = client
    dist.barrier()
    if rank == 0:  # both replicas read replica 0's layer files
        craft(os.path.join(ckpt_dir, "plain", "layer_01-model_states.pt"), marker)
    dist.barrier()
    try:
        engine.load_checkpoint(ckpt_dir, tag="plain")
    except checkpoint.CheckpointError as err:
        out["crafted"] = str(err)
    return out


def test_client_state_is_plain_data_a_numpy_scalar_is_refused_and_a_crafted_layer_file_runs_nothing(tmp_path):
    """The API's checkpoints hold tensors and plain data, read back without running code:
    client_state of dicts, lists, tuples, numbers, strings, bytes, tensors and None comes back as
    saved; one holding a numpy scalar is refused on every rank in one line naming where it is, and
    nothing is committed (a file written with it could not be read back); a layer file crafted to
    run code, read by load_checkpoint (the layer files go through our reader, not DeepSpeed's
    checkpoint engine), is refused naming it, and its code never runs. Breaks if the save commits a
    file that a resume refuses, or if a layer file is unpickled with weights_only=False again."""
    import torch

    from test_cli import save_tiny_hf_with_tokenizer, write_config

    hf = save_tiny_hf_with_tokenizer(tmp_path / "hf")
    cfg = write_config(tmp_path / "cfg.json", {"pipeline.stages": 1, "hetloco.sparseloco.inner_steps": 2})
    ckpt, marker = tmp_path / "ckpt", tmp_path / "MARKER"
    results = run_ranks(_client_state_body, 2, str(hf), str(cfg), str(ckpt), str(marker), timeout=240)
    for rank, r in enumerate(results):
        line, report = r["refused"]
        assert line == ("rank 0: hetloco_rank00000.pt would not load back: its ['client_state']['best'] is a "
                        "numpy.float64, and a checkpoint holds only tensors and plain data (dict, list, tuple, str, "
                        "int, float, bool, None, bytes); pass client_state as plain data (e.g. float(x), "
                        "x.tolist()); checkpoint numpy was not committed")
        assert report == (rank == 0)  # one line for the job
        assert r["tags"] == ["hf_meta", "latest", "plain"]
        client = r["client"]
        assert torch.equal(client.pop("ids"), torch.arange(3))
        assert client == {"best": 1.5, "seen": [1, (2, "b")], "name": b"x", "none": None,
                          "data_position": client["data_position"]}
        layer = ckpt / "plain" / "layer_01-model_states.pt"
        assert r["crafted"] == (f"checkpoint file {layer} is refused: loading it would call getattr; only tensors "
                                "and plain data are read from a file, and nothing in this one was run")
    assert not marker.exists()
