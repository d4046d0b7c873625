"""Every script in examples/ runs, at tiny scale on the CPU, and does what its header says."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hetloco_ds.launch import free_port
from test_cli import SENTENCES, explain, save_tiny_hf_with_tokenizer, write_config, write_text_folder

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "examples"


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


def test_own_training_loop_on_the_public_api(inputs, tmp_path):
    """examples/own_training_loop.py under torchrun, 2 ranks = 2 stages of one compressed replica
    (ratio 4, H = 2): the loss falls, the checkpoint is complete, and save_pretrained writes the
    same model `hetloco-ds export` makes of that checkpoint (same tensors, bit for bit), which
    transformers loads. Breaks if initialize, train_batch's returned loss, save_checkpoint or
    save_pretrained drops a piece of the model or the state."""
    from hetloco_ds import checkpoint

    cfg = write_config(tmp_path / "cfg.json", {"hetloco.subspace.compressed_replicas": "all",
                                               "hetloco.subspace.ratio": 4, "hetloco.sparseloco.inner_steps": 2})
    out = tmp_path / "out"
    proc = _run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", 2, "--master_port", free_port(),
                 EXAMPLES / "own_training_loop.py", "--model", inputs["hf"], "--data", inputs["text"], "--config", cfg,
                 "--out", out, "--steps", 8], inputs["cache"])
    assert proc.returncode == 0, explain(proc)
    losses = [float(line.split()[-1]) for line in proc.stdout.splitlines() if line.startswith("step ")]
    assert len(losses) == 8 and losses[-1] < losses[0], losses
    assert checkpoint.pick(str(out / "checkpoints")).tag is not None
    again = tmp_path / "again"
    proc = _run([sys.executable, "-m", "hetloco_ds.cli", "export", out / "checkpoints", again], inputs["cache"])
    assert proc.returncode == 0, explain(proc)
    from safetensors.torch import load_file
    from transformers import LlamaForCausalLM

    a, b = load_file(str(out / "hf" / "model.safetensors")), load_file(str(again / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    LlamaForCausalLM.from_pretrained(str(out / "hf"))
    assert (out / "hf" / "tokenizer.json").is_file()


def test_finetune_and_export_script(inputs, tmp_path):
    """examples/finetune_and_export.sh on a tiny checkpoint: it trains, exports the latest
    checkpoint again, and transformers loads the result."""
    cfg = write_config(tmp_path / "cfg.json", {"hetloco.sparseloco.inner_steps": 2})
    out = tmp_path / "ft"
    proc = _run(["bash", EXAMPLES / "finetune_and_export.sh"], inputs["cache"],
                {"MODEL": str(inputs["hf"]), "DATA": str(inputs["data"]), "CONFIG": str(cfg), "NPROC": "2",
                 "STEPS": "2", "OUT": str(out)})
    assert proc.returncode == 0, explain(proc)
    assert f"loads: {out}/hf-latest" in proc.stdout


def test_heterogeneous_fleet_example_is_what_the_planner_says(inputs, tmp_path):
    """examples/heterogeneous_fleet: `plan --fleet` puts S = 2, M = 10 replicas, the home group
    (replicas 8-9, after the datacenter's 4 and the lab's 4) compressed at ratio 4, which is what
    config.json says; the toy rehearsal of the same mix trains on 4 ranks. Breaks if the planner's
    answer and the example's config drift apart."""
    from hetloco_ds import plan

    here = EXAMPLES / "heterogeneous_fleet"
    fp = plan.plan_fleet(str(here / "fleet.json"), "1B", 0.9, n_mb=64)
    first, compressed = 0, {}
    for g in fp.groups:
        if g.role == "compressed":
            compressed.update({m: g.ratio for m in range(first, first + g.replicas)})
        first += g.replicas
    cfg = json.loads((here / "config.json").read_text())
    assert cfg["pipeline"]["stages"] == fp.stages and fp.replicas == 10
    assert compressed == {m: cfg["hetloco"]["subspace"]["ratio"] for m in cfg["hetloco"]["subspace"]["compressed_replicas"]}
    out = tmp_path / "rehearsal"
    proc = _run(["bash", here / "run.sh"], inputs["cache"], {"STEPS": "4", "OUT": str(out)})
    assert proc.returncode == 0, explain(proc)
    assert "home-3090s" in proc.stdout and (out / "hf" / "config.json").is_file()


def test_multinode_script_with_a_hostfile(inputs, tmp_path):
    """examples/multinode/run.sh as each node runs it without ssh (here: one node of 2 slots)."""
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("localhost slots=2\n")
    cfg = write_config(tmp_path / "cfg.json", {"hetloco.sparseloco.inner_steps": 2})
    out = tmp_path / "mn"
    proc = _run(["bash", EXAMPLES / "multinode" / "run.sh", "--model", inputs["hf"], "--data", inputs["data"],
                 "--steps", 2, "--out", out], inputs["cache"],
                {"HOSTFILE": str(hostfile), "CONFIG": str(cfg), "NODE_RANK": "0", "MASTER_PORT": str(free_port())})
    assert proc.returncode == 0, explain(proc)
    assert (out / "hf" / "config.json").is_file()


def test_readme_shows_the_tested_example_verbatim():
    """The README's "Use it from your own script" code is part of examples/own_training_loop.py,
    so the tested script and the documented one cannot drift apart."""
    readme = (REPO / "README.md").read_text()
    block = readme.split("<!-- own-training-loop -->\n```python\n")[1].split("\n```\n<!-- /own-training-loop -->")[0]
    assert "hetloco_ds.initialize(" in block and block in (EXAMPLES / "own_training_loop.py").read_text()
