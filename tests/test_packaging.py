"""A non-editable install works: the wheel carries the configs and the DeepSpeed adapter inside
our namespace, and `hetloco-ds train` runs from it with the default config."""
from __future__ import annotations

import glob
import os
import site
import subprocess
import sys
import sysconfig
import venv
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _run(cmd, timeout: float = 600, **kwargs) -> subprocess.CompletedProcess:
    """`cmd` to the end; a failure fails the test with the child's own stdout and stderr."""
    proc = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=timeout, **kwargs)
    assert proc.returncode == 0, (f"{' '.join(map(str, cmd))}: exit {proc.returncode}\n--- stderr (tail) ---\n"
                                  f"{proc.stderr[-4000:]}\n--- stdout (tail) ---\n{proc.stdout[-2000:]}")
    return proc


def _this_interpreters_site_dirs() -> list[str]:
    """Where the running interpreter imports installed packages from: its venv's site-packages when
    it runs in one (and the base's too, with system site packages), else the system's."""
    dirs = [*site.getsitepackages(), sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]]
    return [d for d in dict.fromkeys(dirs) if os.path.isdir(d)]


def fresh_venv_seeing_this_interpreter(env_dir: Path) -> Path:
    """A new venv whose python sees the packages of the interpreter running the tests, and nothing
    of the checkout. `system_site_packages` would not do: it shows the *base* interpreter's
    packages, so inside a virtualenv the child would not find that venv's torch. A .pth file that
    `site.addsitedir`s each of this interpreter's site directories does, after the venv's own
    site-packages (where the wheel goes, so it wins over an editable install seen there; pip
    must then be told `--ignore-installed`, or it takes that install for this one). The venv has no
    pip of its own (ensurepip costs seconds): `pip --python VENV_PYTHON` installs into it, pip
    running under the venv's interpreter."""
    venv.EnvBuilder(with_pip=False).create(env_dir)
    py = env_dir / "bin" / "python"
    purelib = _run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).stdout.strip()
    lines = [f"import site; site.addsitedir({d!r})" for d in _this_interpreters_site_dirs()]
    Path(purelib, "zz_running_interpreter.pth").write_text("\n".join(lines) + "\n")
    return py


@pytest.fixture(scope="module")
def fresh_venv(tmp_path_factory) -> tuple[Path, Path]:
    """(venv directory, its python): one fresh venv for this module's tests (the first only imports
    torch in it; the second installs the wheel into it)."""
    env_dir = tmp_path_factory.mktemp("pkg") / "venv"
    return env_dir, fresh_venv_seeing_this_interpreter(env_dir)


def test_fresh_venv_sees_the_running_interpreters_packages(fresh_venv):
    """The child venv imports torch from where the running interpreter does (its virtualenv's,
    when the tests run in one). Breaks if the venv is built with system site packages again: run
    from a virtualenv that holds its own torch, the child then finds the base interpreter's torch,
    or none."""
    import torch

    _, py = fresh_venv
    child = _run([py, "-c", "import torch; print(torch.__file__)"], env={**os.environ, "PYTHONPATH": ""}).stdout
    assert child.strip() == torch.__file__, (child, torch.__file__)


def test_wheel_installs_into_a_fresh_venv_and_trains(fresh_venv, tmp_path, tmp_path_factory):
    """Build the wheel (no build isolation: no network), install it into a fresh venv that sees
    the running interpreter's torch/DeepSpeed/transformers but not the checkout, and train 2 steps
    with the default config from a directory outside the repository. Breaks if configs/ is not
    package data ("config file not found .../site-packages/configs/cpu_tiny.json"), if patches/
    installs as a top-level package or not at all, or if the installed package imports from the
    checkout; every child's own output is in the failure message."""
    dist = tmp_path / "dist"
    _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", dist, REPO], timeout=300)
    (wheel,) = glob.glob(str(dist / "*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    assert "hetloco_ds/configs/cpu_tiny.json" in names and "hetloco_ds/patches/engine.py" in names
    assert not any(n.startswith("patches/") for n in names), "the adapter must install inside hetloco_ds"

    env_dir, py = fresh_venv
    site_dir = _run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).stdout.strip()
    _run([sys.executable, "-m", "pip", "--python", py, "install", "-q", "--no-deps", "--ignore-installed", wheel],
         timeout=300)
    work = tmp_path / "elsewhere"
    work.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(HETLOCO_CACHE=str(tmp_path_factory.getbasetemp() / "hetloco-cache"), HETLOCO_QUIET="1",
               TOKENIZERS_PARALLELISM="false", PATH=f"{env_dir / 'bin'}{os.pathsep}{env.get('PATH', '')}")
    where = _run([py, "-c", "import hetloco_ds, hetloco_ds.patches as p; print(hetloco_ds.__file__, p.__file__, "
                  "hetloco_ds.__version__)"], cwd=work, env=env).stdout.split()
    assert where[0].startswith(site_dir) and where[1].startswith(site_dir), where
    _run([env_dir / "bin" / "hetloco-ds", "train", "--steps", "2", "--out", work / "run"], cwd=work, env=env)
    assert (work / "run" / "hf" / "config.json").is_file() and (work / "run" / "metrics.jsonl").is_file()
