"""The checkpoint directory's rules on plain files, without processes: which checkpoint --resume
picks (and the line it prints when that is not `latest`), rotation, the metrics rows dropped on
resume, and a full disk named as such."""
from __future__ import annotations

import json
import os
import subprocess

import pytest
import torch

from hetloco_ds import checkpoint
from hetloco_ds.metrics import keep_rows_up_to


def _committed(ckpt_dir, step: int, files: dict[str, bytes], world: int = 2) -> str:
    """A checkpoint as `save` commits it: the files, then a manifest of their sizes."""
    tag = checkpoint.tag_for(step)
    d = ckpt_dir / tag
    d.mkdir(parents=True)
    for name, data in files.items():
        (d / name).write_bytes(data)
    (d / checkpoint.MANIFEST).write_text(json.dumps(
        {"format": 1, "tag": tag, "step": step, "world_size": world, "stages": 1,
         "files": {n: len(b) for n, b in files.items()}}))
    return tag


FILES = {"hetloco_rank00000.pt": b"rank0!", "hetloco_rank00001.pt": b"rank1!", "mp_rank_00_model_states.pt": b"ds"}


def test_resume_falls_back_to_the_newest_complete_checkpoint_with_a_line(tmp_path):
    """`latest` naming a checkpoint with a truncated file (how the old writer left it when a rank
    died mid-write) must not be loaded: the pick is the newest complete one, with one line naming
    the bad file. A committed checkpoint newer than `latest` (killed between the rename and
    `latest`) is complete and preferred; an uncommitted directory (no manifest) never is.
    Breaks if verification trusts `latest` or a directory's name, or checks only presence."""
    ckpt = tmp_path / "checkpoints"
    _committed(ckpt, 2, FILES)
    _committed(ckpt, 4, FILES)
    (ckpt / "latest").write_text("global_step4")
    (ckpt / "global_step4" / "hetloco_rank00001.pt").write_bytes(b"ran")  # torn
    (ckpt / "global_step6").mkdir()  # a directory that was never committed
    (ckpt / "global_step6" / "hetloco_rank00000.pt").write_bytes(b"x")
    got = checkpoint.pick(str(ckpt), world_size=2)
    assert (got.tag, got.step) == ("global_step2", 2)
    assert got.note == (f"global_step4 (named by latest) is incomplete: {ckpt}/global_step4/hetloco_rank00001.pt has "
                        "3 bytes, its manifest says 6; resuming from global_step2, the newest complete checkpoint")

    _committed(ckpt, 8, FILES)
    got = checkpoint.pick(str(ckpt), world_size=2)
    assert got.tag == "global_step8"
    assert got.note == ("resuming from global_step8, the newest complete checkpoint (latest names global_step4: the "
                        "run stopped before updating it)")

    with pytest.raises(checkpoint.CheckpointError, match="holds no complete checkpoint"):
        checkpoint.pick(str(ckpt), world_size=4)  # written by 2 ranks: none fits a 4-rank run
    (ckpt / "latest").write_text("global_step8")
    assert checkpoint.pick(str(ckpt), world_size=2).note is None


def test_rotation_keeps_the_newest_and_clears_leftovers(tmp_path):
    """keep = 2 after committing step 6: steps 4 and 6 stay; step 2 and the leftovers of killed
    saves (.partial, .replaced, .deleting, a user tag's too) and a killed `latest` writer's temp
    file go; a checkpoint newer than the commit (from a run that went further before a resume
    went back) is not rotation's to delete.
    Breaks if rotation deletes the commit, counts uncommitted directories, or keeps too many."""
    ckpt = tmp_path / "checkpoints"
    for s in (2, 4, 6, 10):
        _committed(ckpt, s, FILES)
    for leftover in (".global_step8.partial", ".global_step2.replaced", ".global_step0.deleting", ".mine.partial"):
        (ckpt / leftover).mkdir()
    (ckpt / "hf_meta").mkdir()
    (ckpt / "latest.tmp-12345").write_text("global_step")  # a `latest` writer killed before its rename
    checkpoint._rotate(str(ckpt), committed=6, keep=2)
    assert sorted(os.listdir(ckpt)) == ["global_step10", "global_step4", "global_step6", "hf_meta"]


def test_resume_drops_metrics_rows_past_the_checkpoint(tmp_path):
    """Rows a killed run wrote past the checkpoint it resumes from are dropped (they are written
    again), rows up to it stay in order, and a line torn by a full disk goes. Breaks if a
    resumed run's rows duplicate (step, replica) pairs."""
    path = tmp_path / "metrics.jsonl"
    rows = [{"kind": "step", "step": s, "replica": r} for s in (1, 2, 3) for r in (0, 1)]
    rows.append({"kind": "validation", "step": 2, "replica": 0})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"kind": "step", "st')
    assert keep_rows_up_to(str(path), 2) == 3
    assert [json.loads(line) for line in path.read_text().splitlines()] == [r for r in rows if r["step"] <= 2]


@pytest.fixture
def full_disk(tmp_path):
    """A 256 KiB tmpfs (needs root and mount rights; skipped otherwise)."""
    mnt = tmp_path / "small_fs"
    mnt.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mnt)],
                                           capture_output=True).returncode != 0:
        pytest.skip("cannot mount a small tmpfs here")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], check=True)


def test_a_full_disk_is_named_in_one_line(full_disk):
    """A checkpoint file that does not fit: the error names the device and the file, for one
    write and for the background writer's (which returns it for the commit's exchange). Breaks
    if it surfaces as torch's zip-writer "unexpected pos" message, or as a traceback per rank."""
    big = {"w": torch.zeros(256 * 1024)}  # 1 MiB
    path = str(full_disk / "hetloco_rank00000.pt")
    with pytest.raises((OSError, RuntimeError)) as err:
        checkpoint.write_durably(path, lambda f: torch.save(big, f))
    assert checkpoint.describe_os_error(err.value, path) == (
        f"no space left on tmpfs (mounted at {full_disk}) while writing {path}")

    os.unlink(path)
    outcome = checkpoint._write_files(str(full_disk), {"layer_00-model_states.pt": {"w": torch.zeros(16)},
                                                       "layer_01-model_states.pt": big})
    layer1 = full_disk / "layer_01-model_states.pt"
    assert outcome["error"] == f"no space left on tmpfs (mounted at {full_disk}) while writing {layer1}"
    assert list(outcome["files"]) == ["layer_00-model_states.pt"]


def _with_crc(ckpt_dir, tag: str) -> None:
    """Rewrite `tag`'s manifest as `save` writes it now: size and crc32 of every file."""
    path = ckpt_dir / tag / checkpoint.MANIFEST
    manifest = json.loads(path.read_text())
    manifest.update(format=checkpoint.FORMAT, files={
        n: {"bytes": b, "crc32": checkpoint.file_crc32(str(ckpt_dir / tag / n))} for n, b in manifest["files"].items()})
    path.write_text(json.dumps(manifest))


def test_resume_skips_a_checkpoint_whose_file_fails_its_checksum(tmp_path):
    """A same-size corruption of a committed file (a flipped byte: its size still matches the
    manifest) is found by its crc32: --resume's pick skips that checkpoint with a line naming the
    file and both checksums, and takes the newest one that verifies. A user's tag (named by its
    manifest's step) is a candidate like global_step<N>. Breaks if verification checks sizes only."""
    ckpt = tmp_path / "checkpoints"
    for step in (2, 4):
        _with_crc(ckpt, _committed(ckpt, step, FILES))
    (ckpt / "latest").write_text("global_step4")
    assert checkpoint.pick(str(ckpt), world_size=2) == checkpoint.Pick("global_step4", 4, None)
    bad = ckpt / "global_step4" / "hetloco_rank00001.pt"
    bad.write_bytes(b"rank1?")  # same size
    want = checkpoint.file_crc32(str(ckpt / "global_step2" / "hetloco_rank00001.pt"))
    got = checkpoint.pick(str(ckpt), world_size=2)
    assert (got.tag, got.step) == ("global_step2", 2)
    assert got.note == (f"global_step4 (named by latest) is incomplete: {bad} fails its checksum (crc32 "
                        f"{checkpoint.file_crc32(str(bad)):08x}, its manifest says {want:08x}); resuming from "
                        "global_step2, the newest complete checkpoint")

    tag = _committed(ckpt, 3, FILES)
    os.rename(ckpt / tag, ckpt / "mine")
    _with_crc(ckpt, "mine")
    (ckpt / "latest").write_text("mine")
    assert checkpoint.pick(str(ckpt), world_size=2) == checkpoint.Pick("mine", 3, None)
    with pytest.raises(ValueError, match="checkpoint tag '../x' is not a plain directory name"):
        checkpoint.check_tag("../x")
