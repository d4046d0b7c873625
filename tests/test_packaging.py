"""A non-editable install works: the wheel carries the configs and the DeepSpeed adapter inside
our namespace, and `hetloco-ds train` runs from it with the default config."""
from __future__ import annotations

import glob
import os
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_wheel_installs_into_a_fresh_venv_and_trains(tmp_path, tmp_path_factory):
    """Build the wheel (no build isolation: no network), install it into a fresh venv that sees
    this machine's torch/DeepSpeed/transformers but not the checkout, and train 2 steps with the
    default config from a directory outside the repository. Breaks if configs/ is not package
    data ("config file not found .../site-packages/configs/cpu_tiny.json"), if patches/ installs
    as a top-level package or not at all, or if the installed package imports from the checkout."""
    dist = tmp_path / "dist"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(dist),
                    str(REPO)], check=True, timeout=300, capture_output=True)
    (wheel,) = glob.glob(str(dist / "*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    assert "hetloco_ds/configs/cpu_tiny.json" in names and "hetloco_ds/patches/engine.py" in names
    assert not any(n.startswith("patches/") for n in names), "the adapter must install inside hetloco_ds"

    env_dir = tmp_path / "venv"
    venv.EnvBuilder(system_site_packages=True, with_pip=True).create(env_dir)
    py = env_dir / "bin" / "python"
    site = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          check=True, capture_output=True, text=True).stdout.strip()
    subprocess.run([str(py), "-m", "pip", "install", "-q", "--no-deps", wheel], check=True, timeout=300,
                   capture_output=True)
    work = tmp_path / "elsewhere"
    work.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(HETLOCO_CACHE=str(tmp_path_factory.getbasetemp() / "hetloco-cache"), HETLOCO_QUIET="1",
               TOKENIZERS_PARALLELISM="false", PATH=f"{env_dir / 'bin'}{os.pathsep}{env.get('PATH', '')}")
    where = subprocess.run([str(py), "-c", "import hetloco_ds, hetloco_ds.patches as p; print(hetloco_ds.__file__, "
                            "p.__file__, hetloco_ds.__version__)"], cwd=work, env=env, check=True,
                           capture_output=True, text=True).stdout.split()
    assert where[0].startswith(site) and where[1].startswith(site), where
    proc = subprocess.run([str(env_dir / "bin" / "hetloco-ds"), "train", "--steps", "2", "--out", str(work / "run")],
                          cwd=work, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (work / "run" / "hf" / "config.json").is_file() and (work / "run" / "metrics.jsonl").is_file()
