"""Checkpoints at scale, on the heterogeneous job (2 replicas x 2 stages, replica 1 compressed):
each tensor stored once, and a SIGKILL during a background write loses nothing.

One uninterrupted 4-rank run (H = 3, a checkpoint at every outer step, 9 steps) is the reference
both tests read.
"""
from __future__ import annotations

import hashlib
import json

import pytest
import torch

import runs
from distributed import fork_job, job_stderr, run_job, until_a_rank_ends
from hetloco_ds import checkpoint

STEPS = 9
HEADERS = 48 * 1024


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
    T_perp, DeepSpeed's module or optimizer files would be). On disk: 16 bytes per parameter
    (weights 4, AdamW 8, error feedback 4) plus T_perp once for replica 0, i.e. for M = 1, and 12
    (its AdamW and error feedback) for replica 1, each within HEADERS of file headers, counters and
    the LR schedule. Breaks if any duplicate comes back or any per-replica state is left out."""
    ckpt_dir = reference["out"] / "checkpoints"
    for tag in ("global_step3", "global_step9"):
        assert checkpoint.verify(str(ckpt_dir), tag, 4) is None
        manifest = json.loads((ckpt_dir / tag / checkpoint.MANIFEST).read_text())
        seconds = manifest["seconds"]
        assert set(seconds) == {"blocked", "staging", "waited_for_previous", "written", "to_commit"}
        assert 0 <= seconds["waited_for_previous"] < seconds["to_commit"]
        assert 0 < seconds["blocked"] < seconds["to_commit"] and 0 < seconds["written"] < seconds["to_commit"]
        assert 0 < seconds["staging"] <= seconds["blocked"]
        seen: dict = {}
        layer_numel = 0
        for f in sorted((ckpt_dir / tag).glob("*.pt")):
            state = torch.load(f, map_location="cpu", weights_only=True)
            for t in _tensors(state, []):
                if f.name.startswith("layer_") and t.numel() and not (f.name.startswith("layer_00") and t is state.get("perp")):
                    layer_numel += t.numel()
                if t.numel() < 2 or bool((t == t.flatten()[0]).all()):
                    continue  # Adam's step counters, zero buffers: equal by nature
                key = (str(t.dtype), tuple(t.shape), hashlib.sha256(t.contiguous().numpy().tobytes()).hexdigest())
                assert key not in seen, f"{tag}: {f.name} holds a tensor {tuple(t.shape)} already in {seen[key]}"
                seen[key] = f.name
        # Bytes by owner: what M = 1 would write (replica 0: the layer files and its ranks' own
        # state) and what replica 1 adds (its ranks' own state).
        owner = {f"hetloco_rank{r:05d}.pt": layout["data"] for r, layout in enumerate(manifest["ranks"])}
        by = {0: 0, 1: 0}
        for name, entry in manifest["files"].items():
            by[owner.get(name, 0)] += entry["bytes"]
        perp = 512 * 32 * 4  # T_perp, once (vocab x hidden fp32), beside the parameters
        print(f"{tag}: {layer_numel} parameters; M = 1 part {by[0]} bytes ({(by[0] - perp) / layer_numel:.2f} B/param "
              f"without T_perp), replica 1 adds {by[1]} ({by[1] / layer_numel:.2f} B/param)")
        assert 16 * layer_numel + perp <= by[0] <= 16 * layer_numel + perp + HEADERS, by
        assert 12 * layer_numel <= by[1] <= 12 * layer_numel + HEADERS, by


def test_each_commit_is_one_metrics_row_with_what_it_cost(reference):
    """Every committed checkpoint (steps 3, 6 and 9) is one `checkpoint` row of metrics.jsonl,
    written once although 2 replicas' last stages write metrics: its bytes are its manifest's
    files', its seconds the manifest's, and only the first save is marked as the one that
    allocated the staging buffers. Breaks if a commit goes unlogged, is logged twice, or the row
    disagrees with what is on disk."""
    ckpt_dir = reference["out"] / "checkpoints"
    rows = [r for r in runs.rows(reference["out"]) if r["kind"] == "checkpoint"]
    assert [(r["tag"], r["step"], r["first_save"]) for r in rows] == [
        ("global_step3", 3, True), ("global_step6", 6, False), ("global_step9", 9, False)]
    for r in rows:
        manifest = json.loads((ckpt_dir / r["tag"] / checkpoint.MANIFEST).read_text())
        assert r["bytes"] == sum(f["bytes"] for f in manifest["files"].values())
        assert r["seconds"] == manifest["seconds"]


@pytest.mark.parametrize("staging", ["auto", "none"])
def test_a_kill_during_a_write_keeps_latest_and_the_resume_is_bitwise(reference, tmp_path, staging):
    """Rank 3 (replica 1, stage 1) is SIGKILLed halfway through writing its file of the step-6
    checkpoint: under `train.checkpoint_staging` "auto" (a host copy here) in the background thread
    while the main thread trains on, under "none" from the live tensors while training waits.
    `latest` still names global_step3, complete (step 3's commit came first), the half-written step
    6 is only a `.partial` directory; `--resume` from step 3 reproduces the uninterrupted run's
    losses, every replica's, and its export bit for bit. Breaks if `latest` moves before every
    rank's write ended, if a partial checkpoint is picked, or if resuming loses any state stored
    once."""
    out, cache = tmp_path / "out", reference["cache"]
    ckpt_dir = out / "checkpoints"
    files = list(reference["files"])
    if staging != "auto":  # the same job, saving another way: the same bits train
        cfg = json.loads(open(files[1]).read())
        cfg["hetloco"]["train"]["checkpoint_staging"] = staging
        files[1] = str(tmp_path / "run.json")
        open(files[1], "w").write(json.dumps(cfg))
    # The 4 ranks as torchrun starts them, forked (a launcher's report of a dead rank is
    # test_faults.py's); when rank 3 dies the others are stopped, as a launcher stops them.
    log = tmp_path / "killed"
    procs = fork_job(log, 4, ["train", *files, "--steps", STEPS, "--out", str(out)], runs.env(cache),
                     fault="3:ckpt:2")
    until_a_rank_ends(procs, 600)
    assert procs[3].exitcode == -9, f"exit codes {[p.exitcode for p in procs]}\n{job_stderr(log, 4)[-4000:]}"
    assert "[fault_inject] rank 3: kill at ckpt #2" in job_stderr(log, 4)
    assert json.loads((out / "run_config.json").read_text())["hetloco"]["train"]["checkpoint_staging"] == staging
    assert checkpoint.latest_tag(str(ckpt_dir)) == "global_step3"
    assert checkpoint.verify(str(ckpt_dir), "global_step3", 4) is None
    assert not (ckpt_dir / "global_step6").exists()
    torn = ckpt_dir / ".global_step6.partial" / "hetloco_rank00003.pt"
    assert torn.exists()

    # As torchrun starts it (test_launchers: the same job as --nproc 4), forked: fast.
    run_job(tmp_path / "resume.log", 4, ["train", "--steps", STEPS, "--out", str(out), "--resume"], runs.env(cache))
    for kind in ("step", "validation"):
        got, want = runs.keyed(out, kind), runs.keyed(reference["out"], kind)
        assert sorted(got) == sorted(want), kind
        assert {k: r["loss"] for k, r in got.items()} == {k: r["loss"] for k, r in want.items()}, kind
    got, want = runs.hf_tensors(out / "hf"), runs.hf_tensors(reference["out"] / "hf")
    assert got.keys() == want.keys()
    assert all(torch.equal(got[k], want[k]) for k in want)
    assert checkpoint.latest_tag(str(ckpt_dir)) == f"global_step{STEPS}"
    assert not torn.exists()  # the next commit cleared the killed save's leftovers
