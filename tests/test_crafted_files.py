"""Nothing read from a checkpoint runs code: crafted files in a real run directory, with `--resume`
and `hetloco-ds export` run as a user runs them.

A crafted file is a torch file whose pickle calls a function when unpickled; here `Path.touch` of
a marker file, standing in for `os.system`. Its size and crc32 are written into the manifest, as
anyone who can replace a file can do (the manifest sits beside it), so the checksums pass. The job
is tests/runs.py's tiny 2-rank "pipe" run (`conftest.tiny_jobs`), copied.
"""
from __future__ import annotations

import json
import pathlib
import re
import shutil

import torch

import runs
from hetloco_ds import checkpoint

REFUSED = ("is refused: loading it would call getattr; only tensors and plain data are read from a file, and "
           "nothing in this one was run")
"""How `Path.touch` (pickled as getattr(PosixPath, "touch"), at pickle protocol 2) is named."""


class _Touch:
    """Unpickled, creates `marker`."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return pathlib.Path.touch, (pathlib.Path(self.marker),)


def craft(path, marker) -> None:
    """`path` (a checkpoint's torch file) rewritten with a `_Touch(marker)` inside, and its
    manifest updated to the new size and crc32."""
    state = torch.load(path, map_location="cpu", weights_only=True)
    state["meter" if "meter" in state else "crafted"] = _Touch(marker)
    torch.save(state, path)
    manifest_path = pathlib.Path(path).parent / checkpoint.MANIFEST
    manifest = json.loads(manifest_path.read_text())
    manifest["files"][pathlib.Path(path).name] = {"bytes": pathlib.Path(path).stat().st_size,
                                                  "crc32": checkpoint.file_crc32(str(path))}
    manifest_path.write_text(json.dumps(manifest))


def _copy_of_the_run(tiny_jobs, tmp_path):
    inputs, reference = tiny_jobs.reference("pipe")
    out = tmp_path / "run"
    shutil.copytree(reference, out, ignore=shutil.ignore_patterns("heartbeat"))
    return inputs, out, out / "checkpoints" / f"global_step{runs.STEPS}"


def _error_lines(text: str) -> list[str]:
    """Every line (progress bars end theirs with carriage returns) holding an error: a line glued
    to a bar is one line here, and fails an equality with the error alone."""
    return [line for line in re.split(r"[\r\n]", text) if "error:" in line]


def test_a_crafted_file_runs_code_when_unpickled_as_checkpoints_were_read(tmp_path):
    """The harness itself: loaded as `checkpoint._read` once loaded every rank's state
    (weights_only=False), a crafted file creates its marker. Breaks if `craft` stopped crafting,
    which would let the tests below pass for nothing."""
    path, marker = tmp_path / "hetloco_rank00000.pt", tmp_path / "MARKER"
    torch.save({"meter": {}, "local_steps": 8}, path)
    (tmp_path / checkpoint.MANIFEST).write_text(json.dumps({"files": {}}))
    craft(path, marker)
    torch.load(path, weights_only=False)
    assert marker.exists()
    assert json.loads((tmp_path / checkpoint.MANIFEST).read_text())["files"]["hetloco_rank00000.pt"]["bytes"] == \
        path.stat().st_size


def test_resume_refuses_a_crafted_rank_state_file_in_one_line_and_runs_nothing(tiny_jobs, tmp_path):
    """Rank 0's state file crafted, its manifest entry updated: `--resume` exits 2 with one line
    naming the file, before any rank starts, and the marker is never created. Breaks if any read
    of a checkpoint unpickles with weights_only=False again (the command ran, then a KeyError
    traceback followed), or if the refusal surfaces inside a rank (exit 1, a line per rank)."""
    inputs, out, tag_dir = _copy_of_the_run(tiny_jobs, tmp_path)
    marker, crafted = tmp_path / "MARKER", tag_dir / "hetloco_rank00000.pt"
    craft(crafted, marker)
    assert checkpoint.verify(str(out / "checkpoints"), tag_dir.name, 2) is None  # the checksums pass
    proc = runs.cli("train", "--steps", runs.STEPS, "--out", out, "--resume", cache=inputs["cache"])
    assert proc.returncode == 2, runs.explain(proc)
    assert _error_lines(proc.stderr) == [f"hetloco-ds train: error: --resume: checkpoint file {crafted} {REFUSED}"], \
        runs.explain(proc)
    assert "Traceback" not in proc.stderr
    assert not marker.exists()


def test_resume_and_export_refuse_a_crafted_layer_file_in_one_line_and_run_nothing(tiny_jobs, tmp_path):
    """A layer file (stage 1's, which DeepSpeed's load_state_dir once unpickled with
    weights_only=False) crafted: `--resume` and `hetloco-ds export` each exit 2 with one line
    naming it, the marker is never created and the export writes nothing. Breaks if a layer file
    is read by DeepSpeed's checkpoint engine again, or if export's refusal is an UnpicklingError
    traceback (exit 1), as it was."""
    inputs, out, tag_dir = _copy_of_the_run(tiny_jobs, tmp_path)
    marker, crafted = tmp_path / "MARKER", tag_dir / "layer_03-model_states.pt"
    craft(crafted, marker)
    proc = runs.cli("train", "--steps", runs.STEPS, "--out", out, "--resume", cache=inputs["cache"])
    assert proc.returncode == 2, runs.explain(proc)
    assert _error_lines(proc.stderr) == [f"hetloco-ds train: error: --resume: checkpoint file {crafted} {REFUSED}"], \
        runs.explain(proc)

    target = tmp_path / "exported"
    proc = runs.cli("export", out / "checkpoints", target, cache=inputs["cache"])
    assert proc.returncode == 2, runs.explain(proc)
    assert _error_lines(proc.stderr) == [f"hetloco-ds export: error: layer file {crafted} {REFUSED}"], runs.explain(proc)
    assert "Traceback" not in proc.stderr
    assert not marker.exists()
    assert not target.exists()


def test_export_of_a_truncated_layer_file_is_one_line(tiny_jobs, tmp_path, capsys):
    """A layer file cut short (a copy interrupted; export reads `latest` and does not verify the
    manifest): one line naming the file, exit 2, nothing written. Breaks if torch's zip-reader
    error escapes as a traceback."""
    from hetloco_ds import cli

    _, out, tag_dir = _copy_of_the_run(tiny_jobs, tmp_path)
    cut = tag_dir / "layer_02-model_states.pt"
    cut.write_bytes(cut.read_bytes()[:200])
    target = tmp_path / "exported"
    capsys.readouterr()
    assert cli.main(["export", str(out / "checkpoints"), str(target)]) == 2
    lines = _error_lines(capsys.readouterr().err)
    assert len(lines) == 1 and lines[0].startswith(
        f"hetloco-ds export: error: layer file {cut} is corrupt: PytorchStreamReader failed reading zip archive"), lines
    assert not target.exists()
