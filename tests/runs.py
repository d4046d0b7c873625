"""Tiny 2-rank runs of the real CLI, shared by test_faults.py and test_launchers.py.

The job: tests/test_cli.py's tiny LLaMA (hidden 32, 4 layers, its own 96-token tokenizer) on its
text folder, SparseLoCo H = 2, a checkpoint at every outer step (two kept), validation at steps
4 and 8, 8 steps; in one of two layouts of 2 ranks: "pipe" (2 stages x 1 replica: each rank
writes its own stage's DeepSpeed files) or "replicas" (1 stage x 2 replicas: the ranks meet in
outer syncs). `conftest.tiny_jobs` runs each once, uninterrupted, when a test first needs it.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
FAULTS = REPO / "tests" / "fault_inject"
STEPS = 8
BASE = {
    "hetloco.sparseloco.inner_steps": 2,
    "hetloco.train.checkpoint_interval": 1,
    "hetloco.train.keep_checkpoints": 2,
    "hetloco.train.eval_interval": 4,
    "hetloco.train.watchdog_timeout": 60,
}
LAYOUTS = {"pipe": {**BASE, "pipeline.stages": 2}, "replicas": {**BASE, "pipeline.stages": 1}}

# The heterogeneous job of test_simulate.py and test_rehearse.py: a 2-layer LLaMA (vocab 512, the
# default tokenizer) and configs/cpu_tiny.json with replica 1 compressed (ratio 4), H = 3, 6 steps.
TINY_MODEL = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "intermediate_size": 64, "max_position_embeddings": 64}


def hetero_files(tmp_path: Path, eval_batches: int, gas: int | None = None, tied: bool = False) -> tuple[str, str]:
    """(config path, model-config path) of that job under `tmp_path`; `gas` overrides cpu_tiny's
    gradient accumulation, `tied` ties the embedding and the head."""
    with open(REPO / "configs" / "cpu_tiny.json") as f:
        cfg = json.load(f)
    cfg["train_micro_batch_size_per_gpu"] = 2
    if gas is not None:
        cfg["gradient_accumulation_steps"] = gas
    cfg["hetloco"]["sparseloco"]["inner_steps"] = 3
    cfg["hetloco"]["subspace"] = {"ratio": 4, "compressed_replicas": [1]}
    cfg["hetloco"]["train"].update(seq_len=32, vocab_size=512, eval_interval=0, eval_batches=eval_batches)
    cfg["scheduler"]["params"].update(total_num_steps=6, warmup_num_steps=2)
    (tmp_path / "cfg.json").write_text(json.dumps(cfg))
    (tmp_path / "model.json").write_text(json.dumps({**TINY_MODEL, "tie_word_embeddings": tied}))
    return str(tmp_path / "cfg.json"), str(tmp_path / "model.json")


def env(cache, fault: str | None = None) -> dict:
    """The environment of a CLI run: token caches under `cache`, no bars, offline; with `fault`,
    tests/fault_inject/sitecustomize.py armed with HETLOCO_FAULT=fault in every rank."""
    e = dict(os.environ, HETLOCO_CACHE=str(cache), HETLOCO_QUIET="1", TOKENIZERS_PARALLELISM="false",
             HF_HUB_OFFLINE="1", PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "HETLOCO_FAULT"):
        e.pop(k, None)
    if fault is not None:
        e["HETLOCO_FAULT"] = fault
        e["PYTHONPATH"] = os.pathsep.join([str(FAULTS), e["PYTHONPATH"]])
    return e


def run(cmd: list, cache, fault: str | None = None, timeout: float = 240) -> subprocess.CompletedProcess:
    """`cmd` (e.g. [python, -m, hetloco_ds.cli, train, ...]) with `env`; output captured."""
    return subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=timeout,
                          env=env(cache, fault), cwd=str(REPO))


def cli(*args, cache, fault: str | None = None, timeout: float = 240) -> subprocess.CompletedProcess:
    return run([sys.executable, "-m", "hetloco_ds.cli", *args], cache, fault, timeout)


def launched(log, *args, cache, fault: str | None = None, timeout: float = 240) -> subprocess.CompletedProcess:
    """As `cli(*args)`, the launcher and its ranks forked from the preloaded server instead of each
    starting an interpreter (tests/distributed.launch_job); their output also in LOG.out/.err."""
    from distributed import launch_job

    return launch_job(log, list(args), env(cache, fault), REPO, timeout)


def train_args(inputs: dict, out, *extra) -> list:
    return ["train", "--steps", STEPS, "--model", inputs["hf"], "--data", inputs["data"], "--config",
            inputs["config"], "--out", out, *extra]


def error_lines(text: str, prefix: str = "hetloco-ds train: error:") -> list[str]:
    """Lines starting with `prefix` (progress bars end theirs with carriage returns)."""
    lines = []
    for line in re.split(r"[\r\n]", text):
        i = line.find(prefix)
        if i >= 0:
            lines.append(line[i:])
    return lines


def explain(proc: subprocess.CompletedProcess) -> str:
    return f"exit {proc.returncode}\n--- stderr (tail) ---\n{proc.stderr[-4000:]}\n--- stdout (tail) ---\n{proc.stdout[-1500:]}"


def rows(out) -> list[dict]:
    with open(Path(out) / "metrics.jsonl") as f:
        return [json.loads(line) for line in f]


def keyed(out, kind: str) -> dict:
    """{(step, replica): row} of `kind`, asserting no (step, replica) appears twice."""
    found: dict = {}
    for r in rows(out):
        if r["kind"] == kind:
            key = (r["step"], r["replica"])
            assert key not in found, f"{kind} row {key} is in {out}/metrics.jsonl twice"
            found[key] = r
    return found


def hf_tensors(hf_dir) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out = {}
    for f in sorted(Path(hf_dir).glob("*.safetensors")):
        out.update(load_file(f))
    return out
