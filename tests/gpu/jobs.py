"""What the GPU tier runs: each job a function of the shared inputs that returns what its test asserts.

Jobs are the paths users run, under the defaults unless a job names what it changes: `hetloco-ds
train` through `deepspeed`, `--nproc` and `torchrun`, a run and its resume from a checkpoint, a
user's own loop on `hetloco_ds.initialize` (api_loop.py), the simulators (bench/sim_check.py), an
elastic fleet (bench/gpu_elastic.py). `Pool` starts the jobs a session selected together, each in a
thread running its processes one after another: they share the GPUs, and the tier fits its time.

The model is tests/test_cli.py's tiny LLaMA (hidden 32, 4 layers, 4 heads over 2 key/value heads:
grouped-query attention; a 96-token tokenizer) fine-tuned from its HF directory, tied or untied;
SparseLoCo H = 2, 6 steps, a checkpoint at every outer step.
"""
from __future__ import annotations

import concurrent.futures
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
STEPS, H, RESUME_FROM = 6, 2, 2
SEQ_LEN = 16
BASE = {
    "train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": 2,
    "pipeline.stages": 1,
    "bf16.enabled": True,
    "hetloco.sparseloco.inner_steps": H,
    "hetloco.train.checkpoint_interval": 1,
    "hetloco.train.keep_checkpoints": 3,
    "hetloco.train.eval_interval": 4,
    "hetloco.train.watchdog_timeout": 120,
}
PROCESS_TIMEOUT_S = 300


class Inputs:
    """The tiny HF checkpoints (untied and tied, with their tokenizer), the text data and the token
    cache, written once; the cache is filled here, before jobs tokenise side by side."""

    def __init__(self, root: Path):
        from conftest import save_tiny_llama
        from test_cli import save_tiny_hf_with_tokenizer, tiny_tokenizer, write_text_folder

        self.root = root
        self.hf = str(save_tiny_hf_with_tokenizer(root / "hf"))
        self.hf_tied = str(root / "hf_tied")
        save_tiny_llama(self.hf_tied, tied=True)
        tiny_tokenizer().save_pretrained(self.hf_tied)
        self.data = str(write_text_folder(root / "data", docs=24, repeats=16))
        self.cache = str(root / "cache")
        from transformers import AutoTokenizer

        from hetloco_ds.data import load_corpus

        load_corpus(self.data, AutoTokenizer.from_pretrained(self.hf), SEQ_LEN, cache_dir=self.cache, progress=False)

    def env(self, fault: str | None = None, **extra) -> dict:
        import runs

        return {**runs.env(self.cache, fault), "OMP_NUM_THREADS": "2", **extra}


def write_config(path: Path, edits: dict) -> str:
    from test_cli import write_config as write

    return str(write(path, {**BASE, **edits}))


def command(launcher: str, gpus: int, args: list) -> list[str]:
    """`hetloco-ds ARGS` as each launcher starts it on `gpus` GPUs of this machine."""
    from hetloco_ds.launch import free_port

    py = sys.executable
    if launcher == "deepspeed":  # the `deepspeed` script is this module's main
        return [py, "-m", "deepspeed.launcher.runner", "--num_gpus", str(gpus), "--master_port", str(free_port()),
                "--module", "hetloco_ds.cli", *map(str, args)]
    if launcher == "nproc":
        return [py, "-m", "hetloco_ds.cli", *map(str, args), "--nproc", str(gpus)]
    if launcher == "torchrun":
        return [py, "-m", "torch.distributed.run", "--nproc_per_node", str(gpus), "--master_port", str(free_port()),
                "-m", "hetloco_ds.cli", *map(str, args)]
    raise ValueError(launcher)


def script(path: Path, *args) -> list[str]:
    """`torchrun` (one GPU) of a Python script of ours: a user's own training script as it is launched."""
    from hetloco_ds.launch import free_port

    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "1", "--master_port", str(free_port()),
            str(path), *map(str, args)]


def run(cmd: list[str], env: dict, log: Path, timeout: float = PROCESS_TIMEOUT_S) -> dict:
    """The command to its end (killed past `timeout`): exit code and the output's tail."""
    with open(log, "w") as f:
        try:
            proc = subprocess.run(cmd, env=env, cwd=REPO, stdout=f, stderr=subprocess.STDOUT, timeout=timeout)
            rc = proc.returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    return {"rc": rc, "log": str(log), "tail": Path(log).read_text(errors="replace")[-3000:], "cmd": " ".join(cmd)}


def train_and_resume(ctx: Inputs, name: str, edits: dict, *, tied: bool = False, gpus: int = 1,
                     launchers: tuple[str, str] = ("deepspeed", "nproc"), model: list | None = None,
                     data: str | None = "inputs", steps: int = STEPS, h: int = H, resume_from: int = RESUME_FROM,
                     timeout: float = PROCESS_TIMEOUT_S) -> dict:
    """A run of `steps` steps (a checkpoint at every outer step and at the end, validation, the export)
    through the first launcher; its checkpoints verified here; then a run directory holding its metrics
    and the checkpoint at `resume_from` alone (moved, not copied: a 1B run's state is tens of GB)
    resumed to `steps` through the second launcher. `model`: the train arguments that name it (default:
    the tiny checkpoint); `data`: a `--data` value, "inputs" for the tiny text, None for the default."""
    from hetloco_ds import checkpoint

    work = ctx.root / name
    work.mkdir()
    cfg = write_config(work / "config.json", {"hetloco.sparseloco.inner_steps": h, **edits})
    data = ctx.data if data == "inputs" else data
    ref, res = work / "ref", work / "res"
    model = model or ["--model", ctx.hf_tied if tied else ctx.hf]
    train = ["train", "--steps", steps, *model, *(["--data", data] if data else []), "--config", cfg]
    out = {"config": cfg, "ref_out": str(ref), "res_out": str(res), "tied": tied, "edits": edits, "data": data,
           "from_checkpoint": model[0] == "--model", "steps": steps, "h": h, "resume_from": resume_from}
    out["ref"] = run(command(launchers[0], gpus, [*train, "--out", ref]), ctx.env(), work / "ref.log", timeout)
    if out["ref"]["rc"] != 0:
        return out
    ckpts = ref / "checkpoints"
    out["latest"] = checkpoint.latest_tag(str(ckpts))
    out["verified"] = {d.name: checkpoint.verify(str(ckpts), d.name) for d in sorted(ckpts.iterdir())
                       if checkpoint.step_of(d.name) is not None}
    res.mkdir()
    for f in ("metrics.jsonl", "run_config.json"):
        shutil.copy2(ref / f, res / f)
    (res / "checkpoints").mkdir()
    for d in ckpts.iterdir():
        if d.name == "hf_meta" or checkpoint.step_of(d.name) == resume_from:
            os.replace(d, res / "checkpoints" / d.name)
        elif checkpoint.step_of(d.name) is not None:
            shutil.rmtree(d)
    (res / "checkpoints" / "latest").write_text(f"global_step{resume_from}")
    out["res"] = run(command(launchers[1], gpus, ["train", "--resume", "--steps", steps, "--out", res]), ctx.env(),
                     work / "res.log", timeout)
    return out


def _wait_for(path: Path, proc: subprocess.Popen, timeout: float = PROCESS_TIMEOUT_S) -> bool:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def preempted(ctx: Inputs, name: str) -> dict:
    """The "defaults" job's run, SIGTERMed through its `--nproc` launcher while its rank is held inside
    step 3 (tests/fault_inject's `holdstep`: between outer steps, H = 2), then resumed through
    `deepspeed`: the save at the agreed step, exit 75, and a resume to compare with that job's run."""
    from hetloco_ds import checkpoint

    work = ctx.root / name
    work.mkdir()
    cfg = write_config(work / "config.json", {})
    out, hold = work / "run", work / "hold"
    hold.mkdir()
    (hold / "hold").touch()
    cmd = command("nproc", 1, ["train", "--steps", STEPS, "--model", ctx.hf, "--data", ctx.data, "--config", cfg,
                               "--out", out])
    result: dict = {"config": cfg, "out": str(out)}
    log = work / "held.log"
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, env=ctx.env(fault=f"0:holdstep:3:{hold}"), cwd=REPO, stdout=f,
                                stderr=subprocess.STDOUT)
        try:
            result["held_at_3"] = _wait_for(hold / "held", proc)
            proc.send_signal(signal.SIGTERM)
            result["agreed"] = _wait_for(hold / "agreed-stop", proc, 120) and int((hold / "agreed-stop").read_text())
            (hold / "hold").unlink()
            rc = proc.wait(timeout=PROCESS_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            rc = "timeout"
    result["held"] = {"rc": rc, "log": str(log), "tail": log.read_text(errors="replace")[-3000:], "cmd": " ".join(cmd)}
    ckpts = out / "checkpoints"
    result["latest"] = checkpoint.latest_tag(str(ckpts))
    result["verified"] = checkpoint.verify(str(ckpts), result["latest"]) if result["latest"] else "none"
    result["res"] = run(command("deepspeed", 1, ["train", "--resume", "--steps", STEPS, "--out", out]), ctx.env(),
                        work / "res.log")
    return result


def api_loop(ctx: Inputs, name: str) -> dict:
    """A user's loop (api_loop.py) in two processes: train, save between outer steps and at one,
    save_pretrained, the engine's logits; then a fresh process loads the mid-round checkpoint and
    takes the same step."""
    work = ctx.root / name
    work.mkdir()
    cfg = write_config(work / "config.json", {"bf16.enabled": False})
    out = {"work": str(work), "config": cfg}
    for phase in ("train", "load"):
        out[phase] = run(script(HERE / "api_loop.py", phase, ctx.hf, ctx.data, cfg, work), ctx.env(), work / f"{phase}.log")
        if out[phase]["rc"] != 0:
            break
    return out


def memory(ctx: Inputs, name: str, edits: dict | None = None) -> dict:
    """A model large enough that the state and activations `plan` models dominate the peak (d = 1024,
    6 layers, seq 512, micro 4 x 2), trained through the API for 4 steps (H = 2) under the defaults
    (and `edits`); its measured peak and what the engine resolved, for the test to compare with `plan`."""
    work = ctx.root / name
    work.mkdir()
    cfg = write_config(work / "config.json", {"train_micro_batch_size_per_gpu": 4, "hetloco.train.seq_len": 512,
                                              **(edits or {})})
    cmd = script(HERE / "api_loop.py", "memory", ctx.hf, ctx.data, cfg, work)
    return {"work": str(work), "config": cfg, "memory": run(cmd, ctx.env(), work / "memory.log")}


def simulators(ctx: Inputs, name: str) -> dict:
    """bench/sim_check.py on this GPU under the defaults (the outer state on the host): the per-replica
    and the batched simulator (eager and compiled), M = 2 x S = 2, one replica compressed (ratio 4,
    so the embedding's resync runs), bf16; their losses compared and the outer step checked."""
    work = ctx.root / name
    work.mkdir()
    js = work / "sim_check.json"
    cmd = [sys.executable, str(REPO / "bench" / "sim_check.py"), "--shape", "tiny", "--vocab", "256", "--replicas",
           "2", "--stages", "2", "--micro", "2", "--seq", "64", "--steps", "3", "--variant", "het:4", "--out", str(js)]
    out = run(cmd, ctx.env(), work / "sim_check.log")
    out["json"] = json.loads(js.read_text()) if js.exists() else None
    return out


def elastic(ctx: Inputs, name: str, stages: str = "1,1", share: bool = True) -> dict:
    """bench/gpu_elastic.py: two replicas, each a job of its own (sharing one GPU when `share`), a
    lighthouse, checkpoints at every outer step, one replica killed mid-round and restarted."""
    work = ctx.root / name
    work.mkdir()
    js = work / "elastic.json"
    cmd = [sys.executable, str(REPO / "bench" / "gpu_elastic.py"), "--replica-stages", stages, "--model", ctx.hf,
           "--data", ctx.data, "--seq", str(SEQ_LEN), "--micro", "2", "--gas", "1", "--inner-steps", "2",
           "--together", "2", "--alone", "2", "--checkpoint-interval", "1", "--phase-timeout", "120",
           "--work", str(work / "run"), "--out", str(js), *(["--share-gpu"] if share else [])]
    out = run(cmd, ctx.env(HETLOCO_CACHE=ctx.cache), work / "elastic.log", timeout=420)
    out["json"] = json.loads(js.read_text()) if js.exists() else None
    out["run"] = str(work / "run" / "run")
    return out


def _layout(stages: int, replicas: int, **more) -> dict:
    """A world of `replicas` x `stages` (or `replica_stages`), replica 1 compressed when there is one
    (else replica 0), ratio 4: every boundary and embedding resync of the method on the GPUs."""
    edits = {"pipeline.stages": stages, "hetloco.subspace.ratio": 4,
             "hetloco.subspace.compressed_replicas": [1] if replicas > 1 else [0]}
    edits.update(more)
    return edits


JOBS = {
    # one GPU
    "defaults": lambda c, n: train_and_resume(c, n, {}),
    "compile_tied": lambda c, n: train_and_resume(c, n, {"hetloco.train.compile": True}, tied=True,
                                                  launchers=("nproc", "deepspeed")),
    "outer_on_gpu": lambda c, n: train_and_resume(c, n, {"hetloco.sparseloco.outer_state_device": "gpu"},
                                                  launchers=("torchrun", "deepspeed")),
    "fp32_tied": lambda c, n: train_and_resume(c, n, {"bf16.enabled": False}, tied=True),
    "ac_compile_tied": lambda c, n: train_and_resume(
        c, n, {"hetloco.train.compile": True, "pipeline.activation_checkpoint_interval": 1}, tied=True,
        launchers=("nproc", "torchrun")),
    # AdamW's state options (hetloco.train.optimizer_state) through save, resume and export: the 20M preset,
    # whose matrices are large enough to be quantised (the tiny model's all keep fp32 moments under 8bit).
    "moments_8bit_20m": lambda c, n: train_and_resume(
        c, n, {"hetloco.train.optimizer_state": "8bit", "hetloco.train.seq_len": 128, "hetloco.train.eval_interval": 0},
        model=["--model-config", "20M"], data=None),
    "moments_on_host_20m": lambda c, n: train_and_resume(
        c, n, {"hetloco.train.optimizer_state": "cpu_offload", "hetloco.train.seq_len": 128,
               "hetloco.train.eval_interval": 0}, model=["--model-config", "20M"], data=None,
        launchers=("torchrun", "deepspeed")),
    # Saves that write the live tensors (train.checkpoint_staging "none"): torchao's 8-bit state and the
    # weights written from the GPU without a host copy, read back by the resume and the export.
    "unstaged_saves_8bit_20m": lambda c, n: train_and_resume(
        c, n, {"hetloco.train.optimizer_state": "8bit", "hetloco.train.checkpoint_staging": "none",
               "hetloco.train.seq_len": 128, "hetloco.train.eval_interval": 0},
        model=["--model-config", "20M"], data=None, launchers=("torchrun", "nproc")),
    "moments_bf16_tied": lambda c, n: train_and_resume(c, n, {"hetloco.train.optimizer_state": "bf16"}, tied=True,
                                                       launchers=("nproc", "deepspeed")),
    # The last stage's loss 32 tokens at a time (hetloco.train.loss_chunk_tokens), the head's weight and its
    # gradient through torch's checkpoint on the GPU: the 20M preset at the default data's vocabulary, 8192.
    "loss_chunked_20m": lambda c, n: train_and_resume(
        c, n, {"hetloco.train.loss_chunk_tokens": 32, "hetloco.train.seq_len": 128, "hetloco.train.eval_interval": 0},
        model=["--model-config", "20M"], data=None, launchers=("nproc", "torchrun")),
    "preempted": preempted,
    "api": api_loop,
    "memory": memory,
    "memory_ac": lambda c, n: memory(c, n, {"pipeline.activation_checkpoint_interval": 1}),
    "memory_8bit": lambda c, n: memory(c, n, {"hetloco.train.optimizer_state": "8bit"}),
    "simulators": simulators,
    "elastic": elastic,
    # The 1B preset at S = 1 (micro 4 x 8, seq 1024, H = 20) on the default data, with train.deterministic:
    # at seq 1024 flash attention's backward adds in atomics, and only then does a resume repeat bit for bit.
    "preset_1b": lambda c, n: train_and_resume(
        c, n, {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 8, "hetloco.train.seq_len": 1024,
               "hetloco.train.eval_interval": 0, "hetloco.train.deterministic": True},
        model=["--model-config", "1B"], data=None, steps=40, h=20, resume_from=20, timeout=480),
    # several GPUs (the tests skip with the count they need)
    "s2": lambda c, n: train_and_resume(c, n, _layout(2, 1), gpus=2),
    "m2": lambda c, n: train_and_resume(c, n, _layout(1, 2), gpus=2),
    "m2s2": lambda c, n: train_and_resume(c, n, _layout(2, 2), gpus=4),
    "mixed_1_2": lambda c, n: train_and_resume(c, n, _layout(1, 2, **{"hetloco.replica_stages": [1, 2]}), gpus=3),
    "mixed_1_1_2": lambda c, n: train_and_resume(c, n, _layout(1, 3, **{"hetloco.replica_stages": [1, 1, 2],
                                                                        "hetloco.subspace.compressed_replicas": [2]}),
                                                 gpus=4),
    "elastic_1_2": lambda c, n: elastic(c, n, stages="1,2", share=False),
}


class Pool:
    """The session's jobs, each a future; the inputs are made once, before the first job starts."""

    def __init__(self, root: Path):
        self.root = root
        self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=len(JOBS), thread_name_prefix="gpu-job")
        self._futures: dict[str, concurrent.futures.Future] = {}
        self._lock = threading.Lock()
        self._inputs: Inputs | None = None

    def submit(self, name: str) -> None:
        with self._lock:
            if self._inputs is None:
                self._inputs = Inputs(self.root)
            if name not in self._futures:
                self._futures[name] = self._executor.submit(JOBS[name], self._inputs, name)

    def result(self, name: str, timeout: float = 900) -> dict:
        self.submit(name)
        return self._futures[name].result(timeout)

    @property
    def inputs(self) -> Inputs:
        return self._inputs

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
