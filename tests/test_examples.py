"""Every script in examples/ runs, at tiny scale on the CPU, with the command its header gives
(only the header's placeholders swapped for tiny inputs, and --steps or an env var added), and
does what its header says."""
from __future__ import annotations

import ast
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hetloco_ds.launch import free_port
from test_cli import SENTENCES, explain, save_tiny_hf_with_tokenizer, write_config, write_text_folder

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "examples"
COVERED = ("own_training_loop.py", "finetune_and_export.sh", "heterogeneous_fleet/run.sh", "multinode/run.sh")
"""Each example script, run below with its header's command."""


def header_command(script: Path) -> tuple[dict, list[str]]:
    """(environment, argv) of the command in `script`'s header: the first indented block of a .py
    docstring or of a .sh's leading comments, continuation lines joined, split as the shell does."""
    if script.suffix == ".py":
        lines = ast.get_docstring(ast.parse(script.read_text())).splitlines()
        lines = [line[4:] if line.startswith("    ") else None for line in lines]
    else:
        lines = [line[4:] if line.startswith("#   ") else None for line in script.read_text().splitlines()]
    block = []
    for line in lines:
        if line is not None and line.strip():
            block.append(line.strip().rstrip("\\"))
        elif block:
            break
    tokens = shlex.split(" ".join(block))
    env = {}
    while tokens and re.fullmatch(r"[A-Z_]+=.*", tokens[0]):
        key, value = tokens.pop(0).split("=", 1)
        env[key] = value
    return env, tokens


def run_header(name: str, cache, swap: dict, env: dict | None = None, args=(), timeout=600):
    """`name`'s header command from the repository root, each of its values in `swap` replaced (every
    one must be in the header, so the header cannot drift from what is run), `env` and `args` added.
    The header's repository paths must exist."""
    header_env, argv = header_command(EXAMPLES / name)
    words = list(header_env.values()) + argv
    missing = [k for k in swap if k not in words]
    assert not missing, f"{name}'s header no longer says {missing}: {header_env} {argv}"
    for word in words:
        if word.startswith(("examples/", "configs/")) and word not in swap:
            assert (REPO / word).exists(), f"{name}'s header names {word}, which does not exist"
    argv = [swap.get(a, a) for a in argv] + [str(a) for a in args]
    extra = {k: str(swap.get(v, v)) for k, v in header_env.items()}
    return _run(argv, cache, {**extra, **{k: str(v) for k, v in (env or {}).items()}}, timeout=timeout)


def test_every_example_is_run_with_its_header_command():
    """A new example script without a header command, or without a test here, fails."""
    scripts = sorted(str(p.relative_to(EXAMPLES)) for p in EXAMPLES.rglob("*") if p.suffix in (".py", ".sh"))
    assert scripts == sorted(COVERED)
    for name in COVERED:
        _, argv = header_command(EXAMPLES / name)
        assert any(name in a for a in argv), (name, argv)


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("examples")
    hf = save_tiny_hf_with_tokenizer(root / "hf")
    data = write_text_folder(root / "data")
    text = root / "corpus.txt"
    text.write_text(". ".join(SENTENCES * 40) + ".\n")
    return {"hf": hf, "data": data, "text": text, "cache": tmp_path_factory.getbasetemp() / "hetloco-cache"}


def _env(cache) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    env.update(HETLOCO_CACHE=str(cache), HETLOCO_QUIET="1", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1",
               OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
               PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    return env


def _run(cmd, cache, extra_env=None, timeout=400) -> subprocess.CompletedProcess:
    return subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=timeout, cwd=str(REPO),
                          env={**_env(cache), **(extra_env or {})})


def test_own_training_loop_on_the_public_api(inputs, tmp_path, capsys):
    """examples/own_training_loop.py with its header's command (torchrun, 4 ranks, the heterogeneous
    rehearsal config: 2 stages x 2 replicas, replica 1 compressed at ratio 4, H = 4), 8 steps: the
    loss falls, the checkpoint is complete, and save_pretrained writes the same model `hetloco-ds
    export` makes of that checkpoint (same tensors, bit for bit), which transformers loads. Breaks
    if initialize skips the CLI's checks or drops a return value, if train_batch's loss, the data
    loader, save_checkpoint or save_pretrained drops a piece of the model or the state."""
    from hetloco_ds import checkpoint

    out = tmp_path / "out"
    proc = run_header("own_training_loop.py", inputs["cache"],
                      {"./llama-hf": inputs["hf"], "corpus.txt": inputs["text"], "runs/mine": out},
                      env={"PET_MASTER_PORT": free_port()}, args=["--steps", 8])
    assert proc.returncode == 0, explain(proc)
    losses = [float(line.split()[3]) for line in proc.stdout.splitlines() if line.startswith("step ")]
    assert len(losses) == 8 and losses[-1] < losses[0], losses
    assert checkpoint.pick(str(out / "checkpoints")).tag is not None
    again = tmp_path / "again"
    from hetloco_ds import cli  # `hetloco-ds export` is one process: its main, run here

    assert cli.main(["export", str(out / "checkpoints"), str(again)]) == 0, capsys.readouterr().err[-3000:]
    from safetensors.torch import load_file
    from transformers import LlamaForCausalLM

    a, b = load_file(str(out / "hf" / "model.safetensors")), load_file(str(again / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    LlamaForCausalLM.from_pretrained(str(out / "hf"))
    assert (out / "hf" / "tokenizer.json").is_file()


def test_finetune_and_export_script(inputs, tmp_path):
    """examples/finetune_and_export.sh with its header's command on a tiny checkpoint: it trains,
    exports the latest checkpoint again, and transformers loads the result."""
    cfg = write_config(tmp_path / "cfg.json", {"hetloco.sparseloco.inner_steps": 2})
    out = tmp_path / "ft"
    proc = run_header("finetune_and_export.sh", inputs["cache"], {"./llama-hf": inputs["hf"], "./texts/": inputs["data"]},
                      env={"CONFIG": cfg, "NPROC": 2, "STEPS": 2, "OUT": out})
    assert proc.returncode == 0, explain(proc)
    assert f"loads: {out}/hf-latest" in proc.stdout


def test_heterogeneous_fleet_example_is_what_the_planner_says(inputs, tmp_path):
    """examples/heterogeneous_fleet: `plan --fleet --stages 2` puts M = 10 replicas, and compresses the
    groups it compresses (the replicas after the datacenter's 4) at the ratio config.json says; the
    toy rehearsal of the same mix trains on 4 ranks. Breaks if the planner's answer and the
    example's config drift apart."""
    from hetloco_ds import plan

    here = EXAMPLES / "heterogeneous_fleet"
    fp = plan.plan_fleet(str(here / "fleet.json"), "1B", 0.9, n_mb=64, stages=2)
    first, compressed = 0, {}
    for g in fp.groups:
        if g.role == "compressed":
            compressed.update({m: g.ratio for m in range(first, first + g.replicas)})
        first += g.replicas
    cfg = json.loads((here / "config.json").read_text())
    assert cfg["pipeline"]["stages"] == fp.stages and fp.replicas == 10
    assert compressed == {m: cfg["hetloco"]["subspace"]["ratio"] for m in cfg["hetloco"]["subspace"]["compressed_replicas"]}
    out = tmp_path / "rehearsal"
    proc = run_header("heterogeneous_fleet/run.sh", inputs["cache"], {},
                      env={"STEPS": 4, "OUT": out, "DATA": inputs["data"]})
    assert proc.returncode == 0, explain(proc)
    assert "home-3090s" in proc.stdout and (out / "hf" / "config.json").is_file()


def test_multinode_script_with_a_hostfile(inputs, tmp_path):
    """examples/multinode/run.sh with its header's command, as each node runs it without ssh (here:
    one node of 2 slots, the tiny preset and config instead of 512M)."""
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("localhost slots=2\n")
    cfg = write_config(tmp_path / "cfg.json", {"hetloco.sparseloco.inner_steps": 2})
    out = tmp_path / "mn"
    proc = run_header("multinode/run.sh", inputs["cache"],
                      {"examples/multinode/hostfile": hostfile, "node-a": "127.0.0.1", "configs/gpu_512m.json": cfg,
                       "512M": "tiny", "my_corpus/": inputs["data"], "runs/512m": out},
                      env={"NODE_RANK": 0, "MASTER_PORT": free_port()}, args=["--steps", 2])
    assert proc.returncode == 0, explain(proc)
    assert (out / "hf" / "config.json").is_file()


def test_readme_shows_the_tested_example_verbatim():
    """The README's "Use it from your own script" code is part of examples/own_training_loop.py,
    so the tested script and the documented one cannot drift apart."""
    readme = (REPO / "README.md").read_text()
    block = readme.split("<!-- own-training-loop -->\n```python\n")[1].split("\n```\n<!-- /own-training-loop -->")[0]
    assert "hetloco_ds.initialize(" in block and block in (EXAMPLES / "own_training_loop.py").read_text()
