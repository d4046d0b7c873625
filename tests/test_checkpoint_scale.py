"""Checkpoints at scale, on the heterogeneous job (2 replicas x 2 stages, replica 1 compressed):
each tensor stored once, and a SIGKILL during a background write loses nothing.

One uninterrupted 4-rank run (H = 3, a checkpoint at every outer step, 9 steps) is the reference
both tests read.
"""
from __future__ import annotations

import hashlib
import json
import os

import pytest
import torch

import runs
from distributed import run_job
from hetloco_ds import checkpoint

STEPS = 9


def _job(tmp_path):
    cfg, model = runs.hetero_files(tmp_path, eval_batches=1)
    c = json.loads(open(cfg).read())
    c["hetloco"]["train"].update(checkpoint_interval=1, keep_checkpoints=0)
    c["scheduler"]["params"]["total_num_steps"] = STEPS
    open(cfg, "w").write(json.dumps(c))
    return ["--config", cfg, "--model-config", model]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt_scale")
    cache = tmp_path_factory.getbasetemp() / "hetloco-cache"
    files = _job(root)
    run_job(root / "ref.log", 4, ["train", *files, "--steps", STEPS, "--out", str(root / "ref")],
            runs.env(cache))
    return {"files": files, "cache": cache, "out": root / "ref"}


def _tensors(obj, found: list) -> list:
    if isinstance(obj, torch.Tensor):
        found.append(obj)
    elif isinstance(obj, dict):
        for v in obj.values():
            _tensors(v, found)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            _tensors(v, found)
    return found


def test_a_checkpoint_at_an_outer_boundary_holds_no_tensor_twice(reference):
    """Every tensor of global_step3 (committed in the background while training went on) and
    global_step9 (the last, at the end), loaded and hashed by (dtype, shape, bytes): no two
    non-constant tensors are equal (a replica's copy of the synced weights, theta_prev, a second
    T_perp, DeepSpeed's module or optimizer files would be), and the bytes on disk are within
    16 per parameter for replica 0 (weights 4, AdamW 8, error feedback 4) plus replica 1's own
    12, plus 1% for T_perp, counters and file headers. Breaks if any duplicate comes back."""
    ckpt_dir = reference["out"] / "checkpoints"
    params = 0
    for tag in ("global_step3", "global_step9"):
        assert checkpoint.verify(str(ckpt_dir), tag, 4) is None
        manifest = json.loads((ckpt_dir / tag / checkpoint.MANIFEST).read_text())
        assert set(manifest["seconds"]) == {"blocked", "written", "commit"}
        seen: dict = {}
        layer_numel = 0
        for f in sorted((ckpt_dir / tag).glob("*.pt")):
            state = torch.load(f, map_location="cpu", weights_only=False)
            for t in _tensors(state, []):
                if f.name.startswith("layer_") and t.numel() and not (f.name.startswith("layer_00") and t is state.get("perp")):
                    layer_numel += t.numel()
                if t.numel() < 2 or bool((t == t.flatten()[0]).all()):
                    continue  # Adam's step counters, zero buffers: equal by nature
                key = (str(t.dtype), tuple(t.shape), hashlib.sha256(t.contiguous().numpy().tobytes()).hexdigest())
                assert key not in seen, f"{tag}: {f.name} holds a tensor {tuple(t.shape)} already in {seen[key]}"
                seen[key] = f.name
        params = layer_numel
        total = sum(e["bytes"] for e in manifest["files"].values())
        perp = 512 * 32 * 4
        assert total <= (16 + 12) * params * 1.01 + perp + 64 * 1024, (tag, total, params)
        assert total >= (16 + 12) * params, (tag, total, params)  # nothing per replica was left out
        print(f"{tag}: {total} bytes for {params} parameters, M = 2: {total / params:.2f} B/param")


def test_a_kill_during_a_background_write_keeps_latest_and_the_resume_is_bitwise(reference, tmp_path):
    """Rank 3 (replica 1, stage 1) is SIGKILLed halfway through writing its file of the step-6
    checkpoint, in the background thread, while the main thread trains on: `latest` still names
    global_step3, complete (step 3's commit came first), the half-written step 6 is only a
    `.partial` directory; `--resume` from step 3 reproduces the uninterrupted run's losses, every
    replica's, and its export bit for bit. Breaks if `latest` moves before every rank's write
    ended, if a partial checkpoint is picked, or if resuming loses any state stored once."""
    out, cache = tmp_path / "out", reference["cache"]
    ckpt_dir = out / "checkpoints"
    killed = runs.cli("train", *reference["files"], "--steps", STEPS, "--out", out, "--nproc", 4, cache=cache,
                      fault="3:ckpt:2")
    assert killed.returncode == 128 + 9, runs.explain(killed)
    assert "[fault_inject] rank 3: kill at ckpt #2" in killed.stderr
    assert checkpoint.latest_tag(str(ckpt_dir)) == "global_step3"
    assert checkpoint.verify(str(ckpt_dir), "global_step3", 4) is None
    assert not (ckpt_dir / "global_step6").exists()
    torn = ckpt_dir / ".global_step6.partial" / "hetloco_rank00003.pt"
    assert torn.exists()

    resumed = runs.cli("train", "--steps", STEPS, "--out", out, "--resume", cache=cache)
    assert resumed.returncode == 0, runs.explain(resumed)
    for kind in ("step", "validation"):
        got, want = runs.keyed(out, kind), runs.keyed(reference["out"], kind)
        assert sorted(got) == sorted(want), kind
        assert {k: r["loss"] for k, r in got.items()} == {k: r["loss"] for k, r in want.items()}, kind
    got, want = runs.hf_tensors(out / "hf"), runs.hf_tensors(reference["out"] / "hf")
    assert got.keys() == want.keys()
    assert all(torch.equal(got[k], want[k]) for k in want)
    assert checkpoint.latest_tag(str(ckpt_dir)) == f"global_step{STEPS}"
    assert not torn.exists()  # the next commit cleared the killed save's leftovers
