"""The GPU tier: `pytest -m gpu tests/gpu` on a machine with CUDA (README, "Development").

Every test here is marked `gpu` and skipped where CUDA is absent, so the CPU suite (CI) stays green
and fast; a test that needs more GPUs than the machine has is skipped with the count it needs
(`@pytest.mark.gpus(n)`). The selected tests' jobs (tests/gpu/jobs.py: real `hetloco-ds train`
runs, a user's loop, the simulators, an elastic fleet) all start together, at the first test,
each in a thread of its own: they share the GPU, and the tier fits its time that way.

A run on a GPU writes `tests/gpu/last_run.json` (and `$OUT/gpu_last_run.json` when the device tool's
OUT is set): the commit it ran at (`HETLOCO_COMMIT`, else git), a digest of the package's files,
the card, the versions, and every test's outcome. It is committed, so the notes can name the
commit whose GPU path was last checked.
"""
from __future__ import annotations

import hashlib
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
if str(HERE.parent) not in sys.path:
    sys.path.insert(0, str(HERE.parent))  # tests/: runs.py, test_cli.py's helpers
RECORD = HERE / "last_run.json"
_OUTCOMES: dict[str, dict] = {}
_STARTED = time.time()


def _cuda_devices() -> int:
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:  # noqa: BLE001 - no torch, no CUDA: nothing here runs
        return 0


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs CUDA (tests/gpu; skipped without it)")
    config.addinivalue_line("markers", "gpus(n): needs n GPUs (skipped with that count on fewer)")
    config.addinivalue_line("markers", "job(name): the tests/gpu/jobs.py job whose result the test reads")


@pytest.hookimpl(tryfirst=True)  # before `-m gpu` selects: the mark is also set here, not only by the modules
def pytest_collection_modifyitems(config, items):
    have = _cuda_devices()
    for item in items:
        if HERE not in Path(str(item.fspath)).resolve().parents:
            continue
        item.add_marker(pytest.mark.gpu)
        need = item.get_closest_marker("gpus")
        need = need.args[0] if need else 1
        if have == 0:
            item.add_marker(pytest.mark.skip(reason="needs CUDA (the GPU tier: pytest -m gpu tests/gpu on a GPU machine)"))
        elif have < need:
            item.add_marker(pytest.mark.skip(reason=f"needs {need} GPUs, this machine has {have}"))


def pytest_runtest_logreport(report):
    if not report.nodeid.startswith("tests/gpu/") and "/gpu/" not in report.nodeid:
        return
    if report.when == "call" or report.outcome != "passed":
        entry = {"outcome": report.outcome if not (report.when != "call" and report.skipped) else "skipped",
                 "seconds": round(report.duration, 2)}
        if report.skipped and isinstance(report.longrepr, tuple):
            entry["reason"] = report.longrepr[2]
        elif report.failed:
            entry["error"] = str(report.longrepr)[-1500:]
        _OUTCOMES.setdefault(report.nodeid, entry)


def _package_digest() -> str:
    """sha256 over the package's files (hetloco_ds/, patches/, configs/), path and bytes: which code ran."""
    h = hashlib.sha256()
    for top in ("hetloco_ds", "patches", "configs"):
        for path in sorted((REPO / top).rglob("*")):
            if path.is_file() and not path.is_symlink() and "__pycache__" not in path.parts:
                h.update(str(path.relative_to(REPO)).encode() + b"\0" + path.read_bytes())
    return h.hexdigest()


def _commit() -> str:
    if os.environ.get("HETLOCO_COMMIT"):
        return os.environ["HETLOCO_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True,
                              timeout=10).stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def pytest_sessionfinish(session, exitstatus):
    mine = _OUTCOMES
    if not mine or _cuda_devices() == 0:
        return  # a CPU run leaves the committed record alone
    import importlib.metadata as md

    import torch

    def version(name):
        try:
            return md.version(name)
        except md.PackageNotFoundError:
            return None

    counts = {o: sum(v["outcome"] == o for v in mine.values()) for o in ("passed", "failed", "skipped")}
    record = {
        "commit": _commit(),
        "package_sha256": _package_digest(),
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "cards": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
        "versions": {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
                     **{n: version(n) for n in ("deepspeed", "transformers", "torchft", "pydantic")}},
        "command": " ".join(sys.argv),
        "exit_status": int(exitstatus),
        "seconds": round(time.time() - _STARTED, 1),
        "counts": counts,
        "tests": dict(sorted(mine.items())),
    }
    text = json.dumps(record, indent=1) + "\n"
    RECORD.write_text(text)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "gpu_last_run.json").write_text(text)


@pytest.fixture(scope="session")
def gpu_jobs(request, tmp_path_factory):
    """{job name: Future} of every job a selected test reads (its `job` marker), all started now."""
    from gpu import jobs

    wanted = []
    for item in request.session.items:
        mark = item.get_closest_marker("job")
        skipped = any(m.name == "skip" for m in item.iter_markers())
        if mark and not skipped and mark.args[0] not in wanted:
            wanted.append(mark.args[0])
    pool = jobs.Pool(tmp_path_factory.mktemp("gpu_jobs"))
    for name in wanted:
        pool.submit(name)
    yield pool
    pool.close()
    if os.environ.get("OUT"):  # the device tool brings back $OUT: every job's logs and small JSONs, packed
        import tarfile

        with tarfile.open(Path(os.environ["OUT"], "gpu_jobs_logs.tgz"), "w:gz") as tar:
            for path in sorted(pool.root.rglob("*")):
                if path.is_file() and (path.suffix == ".log" or (path.suffix == ".json" and path.stat().st_size < 1e6)):
                    tar.add(path, arcname=str(path.relative_to(pool.root)))


@pytest.fixture
def job_result(request, gpu_jobs):
    """The result of this test's job (its `job` marker), waited for."""
    name = request.node.get_closest_marker("job").args[0]
    return gpu_jobs.result(name)
