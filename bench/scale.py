"""The sizes users bring: ours against stock DeepSpeed at 1B (and 178M, and an 8B shape), through
the path users run (`hetloco-ds train`, its data loader and launcher) on one GPU machine.

Parts (each appends its rows to OUT/scale.json and can be run alone):
  profile   M = 2 x S = 2 at 1B on 4 GPUs: stock, ours (defaults: blocking inside a host), ours
            (overlapped, over the copy engines), one run each,
            one steady step of every rank recorded by hetloco_ds.profiling
  speed     the same three, REPEATS times, interleaved; and 178M S = 2 on 2 GPUs, stock vs ours
  memory    1B on one GPU: stock vs ours (outer state on the GPU and on the host)
  8b        a Llama-3-8B shape in 4 stages, M = 1: tokens/s, MFU, peak memory, checkpoint bytes
            and the seconds training blocked for it; the outer state on the GPU vs on the host
  ckpt      1B on one GPU, a checkpoint every outer step: first and later saves' seconds blocked
  outer_place  1B and 178M on one GPU: the outer state on the GPU vs on the host, repeats interleaved
  mixed     178M on 4 GPUs, replicas of depths (1, 1, 2) against (2, 2) (hetloco.replica_stages):
            per replica tokens/s, bytes per link class, outer-step seconds (issue 29)
  largest   one GPU, every decoder layer recomputed (issue 59, item 3): the Llama-3-8B shape at seq
            8192 whole, ours with 8-bit and host AdamW moments beside stock DeepSpeed (checkpointed
            too; expected out of memory, recorded as its outcome), and one S = 8 stage of the 70B
            preset; tokens/s, MFU, peak against `plan`'s prediction, the host memory each needs
Before each run its GPUs (CUDA_VISIBLE_DEVICES', else all) must be free of processes (up to 60 s;
what was there is in the row's `gpu_apps_before`; what ran on the machine's other GPUs meanwhile,
one bench per GPU, in `gpu_apps_beside`). --only NAME,... makes only the runs whose names start so (a part split over calls).

    OUT=DIR bash bench/gpu.sh --gpus 4 --timeout 570 scale.py --parts speed --out DIR   # GPU machine
    python bench/scale.py --cpu-smoke --parts speed --out DIR                         # this CPU
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

# The anchors' 1B run (shared/anchors/het_1b.json): M = 2 x S = 2, replica 1 at ratio 8, H = 20.
HET_1B = {
    "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 8, "gradient_clipping": 1.0,
    "steps_per_print": 1000000000, "pipeline": {"stages": 2},
    "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1}},
    "bf16": {"enabled": True},
    "hetloco": {"sparseloco": {"inner_steps": 20}, "subspace": {"ratio": 8, "compressed_replicas": [1]},
                "train": {"seq_len": 1024, "eval_interval": 0, "eval_batches": 2, "checkpoint_interval": 0}},
}


def deep_update(base: dict, over: dict) -> dict:
    out = json.loads(json.dumps(base))
    for k, v in over.items():
        out[k] = deep_update(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def steady_rates(metrics_path: str, inner_steps: int, skip: int = 5, profiled: int = 0) -> dict:
    """Median global tokens/s over the step rows, leaving out the first `skip` steps, the steps
    at and right after each outer step (ANCHORS.md's rule) and the profiled step; peak memory the
    writers saw, and each stage's (the most over the replicas; rows since metrics carry it)."""
    rows = [json.loads(line) for line in open(metrics_path)]
    steps = [r for r in rows if r.get("kind") == "step"]
    keep = [r for r in steps if r["step"] > skip and r["step"] % inner_steps not in (0, 1) and r["step"] != profiled]
    rates = [r["global_tokens_per_s"] for r in keep if "global_tokens_per_s" in r]
    outer = [r["seconds"] for r in rows if r.get("kind") == "outer"]
    by_stage = [r["peak_memory_bytes_by_stage"] for r in steps if r.get("peak_memory_bytes_by_stage")]
    return {"global_tokens_per_s": statistics.median(rates) if rates else None, "steady_steps": len(rates),
            "mfu": statistics.median([r["mfu"] for r in keep if "mfu" in r]) if any("mfu" in r for r in keep) else None,
            "peak_memory_gib_writers": max((r.get("peak_memory_bytes", 0) for r in steps), default=0) / 2**30,
            "peak_memory_gib_by_stage": [max(s) / 2**30 for s in zip(*by_stage)] if by_stage else None,
            "outer_step_seconds": outer, "final_loss": steps[-1]["loss"] if steps else None}


def profiles(directory: str) -> dict:
    out = {}
    if os.path.isdir(directory):
        for name in sorted(os.listdir(directory)):
            if name.endswith(".json"):
                with open(os.path.join(directory, name)) as f:
                    out[name[:-5]] = json.load(f)
    return out


def gpu_apps(mine: bool = True) -> list[str]:
    """Processes on this machine's GPUs (nvidia-smi), [] where there is none or no nvidia-smi; with
    `mine`, only on the GPUs CUDA_VISIBLE_DEVICES gives this bench (one bench per GPU may run beside
    others), else only on the others."""
    def query(what: str) -> list[list[str]]:
        try:
            out = subprocess.run(["nvidia-smi", f"--query-{what}", "--format=csv,noheader"],
                                 capture_output=True, text=True, timeout=20).stdout
        except (OSError, subprocess.SubprocessError):
            return []
        return [[f.strip() for f in line.split(",")] for line in out.splitlines() if line.strip()]

    apps = query("compute-apps=pid,gpu_bus_id,used_memory")
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        ours_ = {bus for index, bus in query("gpu=index,pci.bus_id") if index in visible.split(",")}
        apps = [a for a in apps if len(a) > 1 and (a[1] in ours_) == mine]
    elif not mine:
        apps = []
    return [", ".join(a) for a in apps]


def gpus_free(wait: float = 60.0) -> list[str]:
    """Wait up to `wait` seconds for every GPU to be free of processes; what is still there after.
    A run beside another run's leftover ranks measures neither (it happened: an earlier run's ranks
    outlived their launcher's kill and halved the next runs' speed)."""
    deadline = time.time() + wait
    while (apps := gpu_apps()) and time.time() < deadline:
        time.sleep(2.0)
    return apps


def run_cmd(argv: list[str], log: str, timeout: float, env: dict | None = None, done=None) -> tuple[int, float]:
    """Run `argv` in its own session; `done()` true ends it early (its whole process group; our
    launcher's ranks die with it), rc 0."""
    start = time.time()
    with open(log, "w") as f:
        f.write(" ".join(argv) + "\n")
        f.flush()
        proc = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT, env={**os.environ, **(env or {})},
                                start_new_session=True)
        rc = None
        while rc is None and time.time() - start < timeout:
            time.sleep(1.0)
            rc = proc.poll()
            if rc is None and done is not None and done():
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                rc = 0
        if rc is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            rc = 124
    return rc, time.time() - start


def step_rows(metrics_path: str, kind: str = "step") -> int:
    try:
        with open(metrics_path) as f:
            return sum(f'"kind": "{kind}"' in line for line in f)
    except OSError:
        return 0


# --only: names of the runs to make (prefixes); the others of the parts asked for are skipped, so a
# part too long for one device call is split over two.
ONLY: list[str] = []


def wanted(name: str) -> bool:
    return not ONLY or any(name.startswith(p) for p in ONLY)


def ours(name: str, work: str, nproc: int, config: dict, model: str, steps: int, timeout: float,
         env: dict | None = None, stop_after: int | None = None, commits: int = 0) -> dict | None:
    """`hetloco-ds train --nproc N` on `config`; the steady rates, profiles and checkpoint sizes.
    `stop_after`: end the run once that many step rows are written (a speed run skips the final
    checkpoint and export); `commits`: and once that many checkpoints have been committed."""
    if not wanted(name):
        return None
    run_dir = os.path.join(work, name)
    shutil.rmtree(run_dir, ignore_errors=True)
    os.makedirs(work, exist_ok=True)
    cfg_path = os.path.join(work, f"{name}.json")
    with open(cfg_path, "w") as f:
        json.dump(config, f, indent=1)
    argv = [sys.executable, "-m", "hetloco_ds.cli", "train", "--config", cfg_path, "--model-config", model,
            "--steps", str(steps), "--nproc", str(nproc), "--out", run_dir]
    metrics = os.path.join(run_dir, "metrics.jsonl")
    done = (lambda: step_rows(metrics) >= stop_after and step_rows(metrics, "checkpoint") >= commits) \
        if stop_after else None
    busy = gpus_free()
    rc, wall = run_cmd(argv, os.path.join(work, f"{name}.log"), timeout, env, done)
    row = {"system": "ours", "name": name, "rc": rc, "wall_seconds": wall, "nproc": nproc, "model": model,
           "steps": steps, "config": config, "resolved": resolved(cfg_path), "stopped_after_step_rows": stop_after,
           "gpu_apps_before": busy, "gpu_apps_beside": gpu_apps(mine=False)}
    if os.path.exists(metrics):
        row.update(steady_rates(metrics, config["hetloco"]["sparseloco"]["inner_steps"],
                                profiled=config["hetloco"]["train"].get("profile_step", 0)))
        row["checkpoints"] = checkpoint_facts(metrics, run_dir)
    row["profile"] = profiles(os.path.join(run_dir, "profile"))
    return row


def resolved(config_path: str) -> dict:
    """What the run's "auto" schedule and link transport (on this machine's device, every stage link
    inside it, as in every run here) and its outer-state placement came to under this checkout's
    rules: the defaults change between commits, and a committed row must say what it measured."""
    import torch

    from hetloco_ds.config import load_config
    from hetloco_ds.pipe.order import links_plan

    run = load_config(config_path)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    schedule, transport = links_plan(run.hetloco.pipeline.schedule, run.hetloco.pipeline.link_transport, device)
    return {"schedule": schedule, "link_transport": transport,
            "outer_state_device": run.hetloco.sparseloco.outer_state_device}


def checkpoint_facts(metrics_path: str, run_dir: str) -> dict:
    """The newest committed checkpoint: bytes on disk, bytes per parameter (its manifest's ranks'
    layouts) and its manifest's seconds (training blocked, the longest background write, save to
    commit); `commits`: every commit's metrics row, each with the median seconds of the steps
    trained while it was written (its save's end to its commit) beside those of the others."""
    ckpt = os.path.join(run_dir, "checkpoints")
    latest = os.path.join(ckpt, "latest")
    if not os.path.exists(latest):
        return {"bytes": None}
    tag = open(latest).read().strip()
    size = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(os.path.join(ckpt, tag)) for f in fs)
    with open(os.path.join(ckpt, tag, "manifest.json")) as f:
        manifest = json.load(f)
    rows = [json.loads(line) for line in open(metrics_path)]
    steps = [r for r in rows if r.get("kind") == "step"]
    commits = []
    for c in (r for r in rows if r.get("kind") == "checkpoint"):
        start = c["time"] - c["seconds"]["to_commit"] + c["seconds"]["blocked"]
        during = [r["seconds"] for r in steps if start < r["time"] <= c["time"]]
        commits.append({**c, "steps_while_written": len(during),
                        "median_step_seconds_while_written": statistics.median(during) if during else None})
    others = [r["seconds"] for r in steps[5:] if not any(
        c["time"] - c["seconds"]["to_commit"] < r["time"] <= c["time"] + 1 for c in commits)]
    return {"tag": tag, "bytes": size, "step": manifest.get("step"), "seconds": manifest.get("seconds"),
            "files": len(manifest.get("files", {})), "commits": commits,
            "median_step_seconds_otherwise": statistics.median(others) if others else None}


def stock(name: str, work: str, nproc: int, stages: int, model: str, mb: int, gas: int, seq: int, steps: int,
          timeout: float, vocab: int = 8192, profile_step: int = 0, bf16: bool = True,
          activation_checkpoint_interval: int = 0) -> dict | None:
    """bench/stock_pipe.py under torchrun; `activation_checkpoint_interval` > 0: through
    `stock_pipe_checkpointed` (DeepSpeed's own activation checkpointing of the decoder layers)."""
    if not wanted(name):
        return None
    out = os.path.join(work, f"{name}.json")
    prof = os.path.join(work, f"{name}_profile")
    shutil.rmtree(prof, ignore_errors=True)
    script = [os.path.join(HERE, "stock_pipe.py")]
    if activation_checkpoint_interval:
        script = [os.path.abspath(__file__), STOCK_CHECKPOINTED, str(activation_checkpoint_interval)]
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
            *script, "--stages", str(stages), "--model", model, "--vocab", str(vocab),
            "--mb", str(mb), "--gas", str(gas), "--seq", str(seq), "--steps", str(steps), "--out-json", out]
    if bf16:
        argv.append("--bf16")
    if profile_step:
        argv += ["--profile-step", str(profile_step), "--profile-dir", prof]
    busy = gpus_free()
    rc, wall = run_cmd(argv, os.path.join(work, f"{name}.log"), timeout)
    row = {"system": "stock_deepspeed", "name": name, "rc": rc, "wall_seconds": wall, "nproc": nproc,
           "gpu_apps_before": busy, "gpu_apps_beside": gpu_apps(mine=False)}
    if activation_checkpoint_interval:
        row["activation_checkpoint_interval"] = activation_checkpoint_interval
    if os.path.exists(out):
        with open(out) as f:
            row.update(json.load(f))
    row["profile"] = profiles(prof)
    return row


class Results:
    """OUT/scale.json, rewritten (atomically) after every row, so a call cut short keeps what ran."""

    def __init__(self, path: str, card: str):
        self.path = path
        self.data = {"card": card, "rows": []}
        if os.path.exists(path):
            with open(path) as f:
                self.data = json.load(f)

    def add(self, part: str, row: dict | None) -> None:
        if row is None:  # a run --only left out
            return
        row = {"part": part, **row}
        self.data["rows"].append(row)
        brief = {k: row.get(k) for k in ("part", "name", "rc", "global_tokens_per_s", "median_step_seconds",
                                         "peak_allocated_gib_by_rank", "wall_seconds")}
        print(json.dumps(brief), flush=True)
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(self.data, f, indent=1)
        os.replace(tmp, self.path)


def part_profile(res: Results, work: str, a) -> None:
    s = a.shapes
    res.add("profile", stock("stock_1b_s2", work, s["nproc"], 2, s["model"], s["mb"], s["gas"], s["seq"],
                             s["stock_steps"], a.timeout, vocab=s["vocab"], profile_step=s["profile_step"]))
    for name, over in (("ours_1b_default", {}), ("ours_1b_overlapped", {"hetloco": {"pipeline": {"schedule": "overlapped"}}})):
        cfg = deep_update(s["config"], deep_update(over, {"hetloco": {"train": {"profile_step": s["profile_step"]}}}))
        res.add("profile", ours(name, work, s["nproc"], cfg, s["ours_model"], s["ours_steps"], a.timeout))


def part_speed(res: Results, work: str, a) -> None:
    """Stock, ours (defaults) and ours (overlapped), interleaved, `repeats` times; the first repeat
    also profiles one steady step of each (left out of its median)."""
    s = a.shapes
    variants = [("ours_1b_default", {}), ("ours_1b_overlapped", {"hetloco": {"pipeline": {"schedule": "overlapped"}}})]
    for r in range(a.first_repeat, a.first_repeat + a.repeats):
        prof = s["profile_step"] if r == 0 else 0
        res.add("speed", stock(f"stock_1b_s2_r{r}", work, s["nproc"], 2, s["model"], s["mb"], s["gas"], s["seq"],
                               s["stock_steps"], a.timeout, vocab=s["vocab"], profile_step=prof))
        for name, over in variants:
            cfg = deep_update(s["config"], deep_update(over, {"hetloco": {"train": {"profile_step": prof}}}))
            res.add("speed", ours(f"{name}_r{r}", work, s["nproc"], cfg, s["ours_model"], s["ours_steps"], a.timeout,
                                  stop_after=2 * s["ours_steps"]))


def part_memory(res: Results, work: str, a) -> None:
    """1B on one GPU, the same micro-batching: stock DeepSpeed's peak against ours with the outer
    state on the GPU and in pinned host memory (each run crosses an outer step)."""
    s = a.shapes
    one = deep_update(s["config"], {"pipeline": {"stages": 1}, "hetloco": {"subspace": {"compressed_replicas": "none"}}})
    inner = one["hetloco"]["sparseloco"]["inner_steps"]
    res.add("memory", stock("stock_1b_s1", work, 1, 1, s["model"], s["mb"], s["gas"], s["seq"], s["stock_steps"],
                            a.timeout, vocab=s["vocab"]))
    for place in ("gpu", "cpu"):
        cfg = deep_update(one, {"hetloco": {"sparseloco": {"outer_state_device": place}}})
        res.add("memory", ours(f"ours_1b_s1_outer_{place}", work, 1, cfg, s["ours_model"], inner + 4, a.timeout,
                               stop_after=inner + 3))


def part_outer_place(res: Results, work: str, a) -> None:
    """On one GPU, 1B (micro 4 x 8 at 1024) and 178M (micro 8 x 8 at 2048): ours with the outer
    state on the GPU against in pinned host memory, interleaved, `repeats` times; each run crosses
    two outer steps. Whether "cpu" may be the default: its tokens/s (outer steps amortised as the
    steady rule leaves them out, so also each run's outer-step seconds) and peak at both sizes."""
    s = a.shapes
    one = deep_update(s["config"], {"pipeline": {"stages": 1}, "hetloco": {"subspace": {"compressed_replicas": "none"}}})
    inner = one["hetloco"]["sparseloco"]["inner_steps"]
    sizes = [("1b", s["ours_model"], one),
             ("178m", s["model178"], deep_update(one, {"train_micro_batch_size_per_gpu": s["mb178"],
                                                       "hetloco": {"train": {"seq_len": s["seq178"]}}}))]
    for r in range(a.first_repeat, a.first_repeat + a.repeats):
        for size, model, base in sizes:
            for place in ("gpu", "cpu"):
                cfg = deep_update(base, {"hetloco": {"sparseloco": {"outer_state_device": place}}})
                res.add("outer_place", ours(f"ours_{size}_s1_outer_{place}_r{r}", work, 1, cfg, model, 2 * inner + 4,
                                            a.timeout, stop_after=2 * inner + 3))


def part_s178(res: Results, work: str, a) -> None:
    """178M, S = 2 on 2 GPUs (ANCHORS.md's micro 8 x 2048, 8 micro-batches): stock vs ours, interleaved."""
    s = a.shapes
    cfg = deep_update(s["config"], {"train_micro_batch_size_per_gpu": s["mb178"], "gradient_accumulation_steps": 8,
                                    "hetloco": {"subspace": {"compressed_replicas": "none"},
                                                "train": {"seq_len": s["seq178"]}}})
    for r in range(a.repeats):
        res.add("s178", stock(f"stock_178m_s2_r{r}", work, 2, 2, s["model178"], s["mb178"], 8, s["seq178"],
                              s["stock_steps"], a.timeout, vocab=s["vocab"]))
        res.add("s178", ours(f"ours_178m_s2_r{r}", work, 2, cfg, s["model178"], s["ours_steps"], a.timeout,
                             stop_after=s["ours_steps"]))


def part_8b(res: Results, work: str, a) -> None:
    """A Llama-3-8B shape in S = 4 stages on 4 GPUs, M = 1: stock DeepSpeed's pipeline, ours under
    the defaults with a checkpoint every 10 outer steps (`checkpoint_interval` counts outer steps;
    100 steps, longer than a write takes), the run ending once two are committed: the seconds
    training blocked for the first save (which allocates the host buffers) and a later one (which
    reuses them), their background writes, and the steps' seconds while they were written; and ours with the outer state on the GPU and
    on the host, without checkpoints (whose writes share the host), a pair. Sequences of 1024
    tokens: at 2048 `plan` puts the defaults' stage 0 at 74 GiB, past its margin on an H100."""
    s = a.shapes
    cfg = deep_update(s["config"], {
        "pipeline": {"stages": 4}, "train_micro_batch_size_per_gpu": s["mb8"], "gradient_accumulation_steps": s["gas8"],
        "hetloco": {"sparseloco": {"inner_steps": s["h8"]}, "subspace": {"compressed_replicas": "none"},
                    "train": {"seq_len": s["seq8"], "checkpoint_interval": s["ckpt8"], "keep_checkpoints": 1}}})
    steps = 4 * s["h8"]
    res.add("8b", stock("stock_8b_s4", work, 4, 4, s["model8"], s["mb8"], s["gas8"], s["seq8"], s["stock_steps"],
                        a.timeout, vocab=s["vocab"]))
    # Steps enough for two saves and their commits; the run stops at the second commit.
    res.add("8b", ours("ours_8b_s4_default", work, 4, cfg, s["model8"], 4 * s["ckpt8"] * s["h8"], a.timeout,
                       stop_after=2 * s["h8"] + 4, commits=2))
    for place in ("gpu", "cpu"):
        c = deep_update(cfg, {"hetloco": {"sparseloco": {"outer_state_device": place}, "train": {"checkpoint_interval": 0}}})
        res.add("8b", ours(f"ours_8b_s4_outer_{place}", work, 4, c, s["model8"], steps, a.timeout,
                           stop_after=2 * s["h8"] + 4))


def part_ckpt(res: Results, work: str, a) -> None:
    """1B on one GPU, a checkpoint at every outer step (H = 20), three commits: what a save blocks
    training for the first time (DCP's stager allocates its pinned buffers) and after (it reuses
    them), each write's seconds, and the steps' seconds while one is written."""
    s = a.shapes
    one = deep_update(s["config"], {"pipeline": {"stages": 1}, "hetloco": {
        "subspace": {"compressed_replicas": "none"}, "train": {"checkpoint_interval": 1, "keep_checkpoints": 1}}})
    inner = one["hetloco"]["sparseloco"]["inner_steps"]
    res.add("ckpt", ours("ours_1b_s1_ckpt", work, 1, one, s["ours_model"], 10 * inner, a.timeout,
                         stop_after=3 * inner + 2, commits=3))


def replica_rates(metrics_path: str, inner_steps: int, skip: int = 5) -> dict:
    """Per replica (its own step rows): median tokens/s over the steady steps (`steady_rates`' rule),
    bytes sent by link class over the whole run and per step, its outer steps' seconds and count."""
    rows = [json.loads(line) for line in open(metrics_path)]
    out = {}
    for m in sorted({r["replica"] for r in rows if r.get("kind") == "step"}):
        steps = [r for r in rows if r.get("kind") == "step" and r["replica"] == m]
        keep = [r for r in steps if r["step"] > skip and r["step"] % inner_steps not in (0, 1)]
        outer = [r["seconds"] for r in rows if r.get("kind") == "outer" and r.get("replica") == m]
        sent = {k: sum(r["bytes"][k]["sent"] for r in steps if k in r.get("bytes", {}))
                for k in sorted({k for r in steps for k in r.get("bytes", {})})}
        out[str(m)] = {
            "tokens_per_s": statistics.median(r["tokens"] / r["seconds"] for r in keep) if keep else None,
            "steady_steps": len(keep), "steps": len(steps), "outer_steps": len(outer),
            "sent_bytes": sent, "sent_bytes_per_step": {k: v / len(steps) for k, v in sent.items()},
            "outer_step_seconds": outer,
            "peak_memory_gib": max((r.get("peak_memory_bytes", 0) for r in steps), default=0) / 2**30,
        }
    return out


def part_mixed(res: Results, work: str, a) -> None:
    """Mixed pipeline depths (hetloco.replica_stages) on 4 GPUs, 178M (micro 8 x 8 at 2048 tokens,
    H = 20): replicas of depths (1, 1, 2) with the 2-stage one compressed at ratio 8, against
    (2, 2) with replica 1 compressed; interleaved, `repeats` times. Per replica: tokens/s, bytes
    sent per step and at the outer step by link class, outer-step seconds."""
    s = a.shapes
    base = deep_update(s["config"], {"train_micro_batch_size_per_gpu": s["mb178"], "gradient_accumulation_steps": 8,
                                     "hetloco": {"train": {"seq_len": s["seq178"]}}})
    inner = base["hetloco"]["sparseloco"]["inner_steps"]
    steps = 3 * inner + 2  # three outer steps and the steady steps between them
    variants = [("ours_178m_mixed_1_1_2", 3, deep_update(base, {"pipeline": {"stages": 2}, "hetloco": {
                    "replica_stages": [1, 1, 2], "subspace": {"compressed_replicas": [2]}}})),
                ("ours_178m_even_2_2", 2, deep_update(base, {"pipeline": {"stages": 2}, "hetloco": {
                    "subspace": {"compressed_replicas": [1]}}}))]
    for r in range(a.first_repeat, a.first_repeat + a.repeats):
        for name, replicas, cfg in variants:
            row = ours(f"{name}_r{r}", work, s["nproc"], cfg, s["model178"], steps, a.timeout,
                       stop_after=replicas * steps)
            if row is None:
                continue
            metrics = os.path.join(work, f"{name}_r{r}", "metrics.jsonl")
            if os.path.exists(metrics):
                row["replicas"] = replica_rates(metrics, inner)
            res.add("mixed", row)


# --------------------------------------------------------------------------- largest (issue 59, item 3)
STOCK_CHECKPOINTED = "--stock-pipe-checkpointed"
"""scale.py's first argument when it stands in for bench/stock_pipe.py under torchrun (`stock` with
an activation_checkpoint_interval): `stock_pipe_checkpointed`."""

PLAN_TOLERANCE = (-0.05, 0.10)
"""plan's prediction against a measured peak: below it by at most 5%, above by at most 10%
(tests/test_plan.py's MEMORY_TOLERANCE)."""


def stock_pipe_checkpointed(interval: int, argv: list[str]) -> None:
    """bench/stock_pipe.py with DeepSpeed's own activation checkpointing: its PipelineModule built
    with `activation_checkpoint_interval` = `interval` and only stock_pipe's decoder layers (`Block`)
    eligible (`checkpointable_layers`), as ours recomputes only decoder layers; DeepSpeed's default
    checkpoint function (reentrant, which would leave the embedding, fed token ids, without a
    gradient: it is not eligible). Everything else is stock_pipe.py's, run as its own __main__."""
    import runpy

    import deepspeed.pipe

    class CheckpointedPipelineModule(deepspeed.pipe.PipelineModule):
        def __init__(self, *args, **kwargs):
            kwargs.setdefault("activation_checkpoint_interval", interval)
            kwargs.setdefault("checkpointable_layers", ["Block"])
            super().__init__(*args, **kwargs)

    deepspeed.pipe.PipelineModule = CheckpointedPipelineModule  # stock_pipe.run imports it from there
    path = os.path.join(HERE, "stock_pipe.py")
    sys.argv = [path] + argv
    runpy.run_path(path, run_name="__main__")  # exits (stock_pipe.py ends in os._exit)


def row_ok(row: dict) -> bool:
    """A row counts as run: rc 0, or a run the part expected might not fit (`may_run_out_of_memory`)
    that ran out of memory, its outcome recorded."""
    return row.get("rc") == 0 or bool(row.get("may_run_out_of_memory") and row.get("outcome") == "out_of_memory")


def run_outcome(rc: int, log: str) -> dict:
    """How a run ended, from its rc and log: "ok" (rc 0; a run `ours` stopped after its step rows
    counts so), "out_of_memory" (the log says a device or host allocation failed), "refused_host_memory"
    (our launcher's host-memory check, before any rank started), "timeout" (rc 124), else "failed";
    the log's last error line (the last line naming an error, else its last line; torchrun's own
    summary may come after a rank's), and when out of memory the last line saying so."""
    try:
        with open(log, errors="replace") as f:
            lines = [line.rstrip() for line in f if line.strip()]
    except OSError:
        lines = []
    errors = [line for line in lines if "error" in line.lower() or "killed" in line.lower()
              or "out of memory" in line.lower()]
    text = "\n".join(lines).lower()
    if rc == 0:
        outcome = "ok"
    elif "out of memory" in text or "outofmemoryerror" in text:
        outcome = "out_of_memory"
    elif "of host memory" in text and "is available" in text:
        outcome = "refused_host_memory"
    elif rc == 124:
        outcome = "timeout"
    else:
        outcome = "failed"
    got = {"outcome": outcome, "last_error_line": (errors or lines or [None])[-1] if rc != 0 else None}
    if outcome == "out_of_memory":
        got["out_of_memory_line"] = [line for line in lines if "out of memory" in line.lower()
                                     or "outofmemoryerror" in line.lower()][-1]
    return got


def host_memory() -> dict:
    """This machine's host memory at the row's start: MemAvailable (what our launcher's check reads),
    and the cgroup's limit where one is set (a container's; MemAvailable may not show it)."""
    from hetloco_ds.runplan import mem_available

    avail = mem_available()
    limit = None
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            text = open(path).read().strip()
        except OSError:
            continue
        if text.isdigit() and int(text) < 2**60:
            limit = int(text)
        break
    return {"mem_available_gb": avail / 1e9 if avail else None, "cgroup_limit_gb": limit / 1e9 if limit else None}


def model_shape(fields: dict, seq: int):
    from hetloco_ds.plan.shapes import ModelShape

    return ModelShape(d=fields["hidden_size"], n_layers=fields["num_hidden_layers"],
                      n_heads=fields["num_attention_heads"], n_kv_heads=fields["num_key_value_heads"],
                      ffn=fields["intermediate_size"], vocab=fields["vocab_size"], seq_len=seq)


def plan_facts(fields: dict, cfg: dict, optimizer_state: str, sparseloco: bool = True) -> dict:
    """`plan.stage_memory_bytes` for a one-stage run of `fields` (LlamaConfig fields) under `cfg`:
    its micro-batch, accumulation, seq_len, bf16 and activation_checkpoint_interval, the "blocking"
    schedule (S = 1), the outer state on the host, `optimizer_state`; the weights' casts as the
    engine chooses them (`HetlocoEngine._step_casts_pay`'s rule, `sizes.step_casts_pay`, at S = 1).
    And the host bytes the run takes: our launcher's check (`sizes.host_state_bytes` under the default
    `train.checkpoint_staging` "auto", which counts no checkpoint copy: the outer state 8 B a
    parameter) plus what cpu_offload keeps there (`sizes.optimizer_state_bytes_per_param(..., "host")`)."""
    import math

    from hetloco_ds import plan, sizes
    from hetloco_ds.plan.shapes import stage_tensors

    h = cfg["hetloco"]["train"]
    seq, mb, gas = h["seq_len"], cfg["train_micro_batch_size_per_gpu"], cfg["gradient_accumulation_steps"]
    bf16, interval = cfg["bf16"]["enabled"], cfg["pipeline"].get("activation_checkpoint_interval", 0)
    m = model_shape(fields, seq)
    tensors = stage_tensors(m, 1)[0]
    params = sum(math.prod(shape) for _, shape in tensors)
    cast = sum(math.prod(shape) for name, shape in tensors if len(shape) == 2 and not name.startswith("embed_tokens"))
    parts = sizes.stage_parts(m.n_layers, 1)
    step_casts = bf16 and sizes.step_casts_pay(cast, gas, m.n_layers, mb * seq, m.d, m.ffn, m.kv_dim, bf16,
                                               sizes.recomputed_runs(m.n_layers, parts[0], parts[1], interval))
    kw = dict(micro_batch=mb, n_mb=gas, seq_len=seq, schedule="blocking", bf16=bf16, sparseloco=sparseloco,
              outer_state_device="cpu", autocast_cache=not step_casts, activation_checkpoint_interval=interval,
              optimizer_state=optimizer_state)
    peak = plan.stage_memory_bytes(m, 1, **kw)[0]
    host = sizes.host_state_bytes(params, True, sparseloco, bf16, sparseloco, checkpoint_copy=False)
    offload = params * sizes.optimizer_state_bytes_per_param(optimizer_state, "host")
    return {"params": params, "plan_peak_gib": peak / 2**30, "plan_inputs": dict(kw, stages=1),
            "host_check_gb": host / 1e9, "host_offload_gb": offload / 1e9}


def check_plan(row: dict, measured: bool) -> None:
    """plan's prediction over the run's peak (the metrics rows' peak_memory_bytes; on a GPU only: on
    the CPU that is the process's resident set) and whether it lies within PLAN_TOLERANCE."""
    peak = row.get("peak_memory_gib_writers") if row.get("system") == "ours" else \
        max(row.get("peak_allocated_gib_by_rank") or [0])
    if measured and peak and row.get("plan_peak_gib"):
        ratio = row["plan_peak_gib"] / peak
        row["plan_over_peak"] = ratio
        row["plan_within_tolerance"] = 1 + PLAN_TOLERANCE[0] <= ratio <= 1 + PLAN_TOLERANCE[1]


def part_largest(res: Results, work: str, a) -> None:
    """On one GPU, a whole replica (S = 1, the "blocking" schedule), every decoder layer recomputed in
    the backward (pipeline.activation_checkpoint_interval 1), bf16, micro 1 x 8, SparseLoCo's
    defaults at H = 20 (the outer state on the host), from scratch (no --model: weights initialised,
    as in part 8b), on the default data; the model from a LlamaConfig JSON written into the work
    folder and passed as --model-config:
      8b        the Llama-3-8B shape (d 4096, 32 layers, 32 / 8 heads, ffn 14336, vocab 128256,
                untied, 8.03B parameters) at seq 8192: ours with AdamW's moments in 8 bits
                (hetloco.train.optimizer_state "8bit") and on the host ("cpu_offload"); stock
                DeepSpeed's pipeline (bench/stock_pipe.py, bf16) checkpointing its decoder layers
                too (its PipelineModule's activation_checkpoint_interval 1: `stock_pipe_checkpointed`),
                whose fp32 AdamW alone is 64 GB and its master weights and gradients 64 more: its
                row records how it ended (`outcome`, `last_error_line`), out of memory included,
                which is not a failure of the part (`row_ok`).
      70b_stage one stage of the 70B preset as S = 8 would cut it: 10 of its 80 layers (d 8192, 64 /
                8 heads, ffn 28672, vocab 128256) at seq 4096, trained whole at S = 1, so holding
                both the embedding and the head: an upper bound of the first and of the last
                stage's memory (each holds one of them beside its layers; `plan`'s S = 8 stages of
                the whole preset are in the row as plan_peak_gib_70b_s8_by_stage). Ours with
                "cpu_offload" and "8bit".
    Every row: tokens/s and MFU (the median over the steady steps, `steady_rates`' rule: steps 6 to
    12), the peak the metrics rows carry (peak_memory_bytes), `plan`'s prediction for the row
    (plan_peak_gib, `plan_facts`; stock's: plan's rules without SparseLoCo and with fp32 AdamW,
    a rough guide, DeepSpeed's bf16 layout is not ours) and its ratio to the peak against
    PLAN_TOLERANCE; the host memory the run needs (our launcher refuses a run whose
    `sizes.host_state_bytes` exceeds MemAvailable: under `train.checkpoint_staging` "auto" the outer
    state alone, 64 GB at 8B and 85 GB at the 70B stage; with cpu_offload 193 and 256 GB, its 16 B a
    parameter on the host besides; a checkpoint's host copy, 16 B a parameter more, was counted until
    "auto" made a save on a host that cannot hold it write the live tensors instead)
    and what the machine had. Each ours run stops once 12 step rows are written (13 asked: no final
    save nor export), so none crosses an outer step (H = 20): unlike parts memory and 8b, which
    cross one, since at seq 8192 a step is estimated at 12-20 s (8B, MFU 30-40%, cpu_offload's
    host step on top), and 22 steps would not fit a device call with startup; the outer step's peak
    is below the inner step's at these shapes (plan: weights, moments and the outer step's
    transients without the activations, casts and gradients), so the peak is the one plan
    predicts, but the outer step's seconds are not measured here. Each run is bounded by --timeout
    (seconds); one run per device call (--only NAME)."""
    s = a.shapes
    base = deep_update(s["config"], {
        "pipeline": {"stages": 1, "activation_checkpoint_interval": 1},
        "train_micro_batch_size_per_gpu": s["mb_largest"], "gradient_accumulation_steps": s["gas_largest"],
        "hetloco": {"sparseloco": {"inner_steps": s["h_largest"], "outer_state_device": "cpu"},
                    "subspace": {"compressed_replicas": "none"}}})
    stop = s["steps_largest"]
    os.makedirs(work, exist_ok=True)

    def model_json(tag: str, fields: dict) -> str:
        path = os.path.join(work, f"model_{tag}.json")
        with open(path, "w") as f:
            json.dump(fields, f, indent=1)
        return path

    def finish(row: dict | None, fields: dict, extra: dict) -> dict | None:
        if row is None:
            return None
        row.update(extra)
        row["model_fields"] = fields
        row.update(run_outcome(row["rc"], os.path.join(work, f"{row['name']}.log")))
        check_plan(row, measured=not a.cpu_smoke)
        return row

    for tag, fields, seq, runs in (("8b", s["fields_8b"], s["seq_8b"], ("8bit", "cpu_offload")),
                                   ("70b_stage", s["fields_70b_stage"], s["seq_70b_stage"], ("cpu_offload", "8bit"))):
        model = model_json(tag, fields)
        cfg = deep_update(base, {"hetloco": {"train": {"seq_len": seq}}})
        extra = {}
        if tag == "70b_stage":
            from hetloco_ds import plan

            whole = model_shape(dict(fields, num_hidden_layers=s["layers_70b"]), seq)
            extra["upper_bound_of"] = (f"the first and last of S = 8 stages of a {s['layers_70b']}-layer model: "
                                       "this one-stage run holds both the embedding and the head")
            extra["plan_peak_gib_70b_s8_by_stage"] = {opt: [b / 2**30 for b in plan.stage_memory_bytes(
                whole, 8, micro_batch=s["mb_largest"], n_mb=s["gas_largest"], seq_len=seq, schedule="blocking",
                bf16=cfg["bf16"]["enabled"], outer_state_device="cpu", activation_checkpoint_interval=1,
                optimizer_state=opt)] for opt in runs}
        if tag == "8b":
            name = "stock_8b_s1_ckpt1"
            facts = {k: v for k, v in plan_facts(fields, cfg, "fp32", sparseloco=False).items()
                     if not k.startswith("host_")}  # our launcher's host check is not stock's
            facts["plan_note"] = ("plan's rules without SparseLoCo, fp32 AdamW: stock's bf16 layout (bf16 weights and "
                                  "gradients beside fp32 master weights and gradients) is not ours; a rough guide")
            host = host_memory() if wanted(name) else {}
            row = stock(name, work, 1, 1, s["stock_8b_model"], s["mb_largest"], s["gas_largest"], seq,
                        s["stock_steps"], a.timeout, vocab=fields["vocab_size"], bf16=cfg["bf16"]["enabled"],
                        activation_checkpoint_interval=1)
            res.add("largest", finish(row, fields, dict(extra, **facts, host_memory=host, seq_len=seq,
                                                        may_run_out_of_memory=True)))
        for opt in runs:
            name = f"ours_{tag}_s1_{opt}"
            c = deep_update(cfg, {"hetloco": {"train": {"optimizer_state": opt}}})
            host = host_memory() if wanted(name) else {}
            row = ours(name, work, 1, c, model, stop + 1, a.timeout, stop_after=stop)
            res.add("largest", finish(row, fields, dict(extra, **plan_facts(fields, c, opt), host_memory=host,
                                                        optimizer_state=opt)))


PARTS = {"profile": part_profile, "speed": part_speed, "memory": part_memory, "s178": part_s178, "8b": part_8b,
         "mixed": part_mixed, "outer_place": part_outer_place, "ckpt": part_ckpt, "largest": part_largest}


def shapes(cpu: bool) -> dict:
    if cpu:
        cfg = deep_update(HET_1B, {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4,
                                   "bf16": {"enabled": False},
                                   "hetloco": {"sparseloco": {"inner_steps": 3}, "train": {"seq_len": 32}}})
        return dict(nproc=4, model="tiny", ours_model="tiny", vocab=256, mb=2, gas=4, seq=32, stock_steps=4,
                    ours_steps=4, profile_step=3, config=cfg, model178="tiny", mb178=2, seq178=32,
                    model8="tiny", mb8=1, gas8=4, seq8=32, h8=4, ckpt8=1,
                    **largest_shapes(cpu))
    return dict(nproc=4, model="1B", ours_model="1B", vocab=8192, mb=4, gas=8, seq=1024, stock_steps=14,
                ours_steps=28, profile_step=12, config=HET_1B, model178="178M", mb178=8, seq178=2048,
                model8="8B", mb8=1, gas8=16, seq8=1024, h8=10, ckpt8=10, **largest_shapes(cpu))


def largest_shapes(cpu: bool) -> dict:
    """part largest's shapes: Llama-3-8B's and a 10-layer slice of the 70B preset at vocab 128256
    (LlamaConfig fields), or on the CPU the tiny preset's (stock_pipe's "tiny", vocab 8192: the
    default data's tokenizer) and a 2-layer one, a few steps of short sequences (7 step rows: the
    steady rule keeps steps 6 and 7)."""
    from hetloco_ds.presets import PRESETS

    if cpu:
        tiny = dict(PRESETS["tiny"], vocab_size=8192)
        return dict(fields_8b=tiny, stock_8b_model="tiny", seq_8b=32, fields_70b_stage=dict(tiny, num_hidden_layers=2),
                    layers_70b=16, seq_70b_stage=32, mb_largest=1, gas_largest=2, h_largest=20, steps_largest=7)
    return dict(fields_8b=dict(PRESETS["8B"], vocab_size=128256), stock_8b_model="8B", seq_8b=8192,
                fields_70b_stage=dict(PRESETS["70B"], num_hidden_layers=10, vocab_size=128256), layers_70b=80,
                seq_70b_stage=4096, mb_largest=1, gas_largest=8, h_largest=20, steps_largest=12)


def gpu_peak_gib(row: dict) -> float | None:
    """A run's peak allocated on its fullest GPU: stock's every rank; ours' every stage (metrics
    rows since they carry it, else a profiled step's ranks), else only the writers' (the last stage)."""
    for key in ("peak_allocated_gib_by_rank", "peak_memory_gib_by_stage"):
        if row.get(key):
            return max(row[key])
    ranks = [p["peak_allocated_gib"] for p in (row.get("profile") or {}).values() if "peak_allocated_gib" in p]
    return max(ranks + [row.get("peak_memory_gib_writers") or 0]) if ranks else row.get("peak_memory_gib_writers")


def summarize(files: list[str]) -> dict:
    """Medians over the repeats of every committed scale JSON given (repeats may span calls; each
    call ran its own stock baseline), the ratios to stock, and the memory rows."""
    rows, cards = [], set()
    for path in files:
        with open(path) as f:
            data = json.load(f)
        cards.add(data["card"])
        rows += [dict(r, file=os.path.basename(path)) for r in data["rows"] if r.get("part") in ("speed", "memory", "s178")]
    by: dict[tuple, list] = {}
    for r in rows:
        system = r["name"].rsplit("_r", 1)[0] if r["part"] != "memory" else r["name"]
        by.setdefault((r["part"], system), []).append(r)
    out = {"cards": sorted(cards), "files": [os.path.basename(f) for f in files], "systems": {}}
    for (part, system), rs in sorted(by.items()):
        rates = [r["global_tokens_per_s"] for r in rs if r.get("global_tokens_per_s")]
        peak = [gpu_peak_gib(r) for r in rs]
        fullest = max((p for p in peak if p is not None), default=None)
        out["systems"][f"{part}/{system}"] = {"global_tokens_per_s": rates, "median": statistics.median(rates),
                                              "peak_allocated_gib": peak, "peak_allocated_gib_fullest_gpu": fullest,
                                              "outer_step_seconds": [r.get("outer_step_seconds") for r in rs]}
    for part, stock_name in (("speed", "stock_1b_s2"), ("s178", "stock_178m_s2"), ("memory", "stock_1b_s1")):
        base = out["systems"].get(f"{part}/{stock_name}")
        for key, v in out["systems"].items():
            if base and key.startswith(part + "/") and not key.endswith(stock_name):
                v["vs_stock_median"] = v["median"] / base["median"]
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", default="profile")
    ap.add_argument("--out", required=True)
    ap.add_argument("--work", default="/tmp/hetloco_scale", help="run directories (large: checkpoints)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--first-repeat", type=int, default=0, help="number of the first repeat (runs split over calls)")
    ap.add_argument("--timeout", type=float, default=420.0, help="seconds for one run")
    ap.add_argument("--cpu-smoke", action="store_true")
    ap.add_argument("--only", default="", help="comma-separated prefixes of the run names to make (default: all)")
    ap.add_argument("--summarize", nargs="+", metavar="JSON", help="write OUT/summary.json from committed scale JSONs")
    a = ap.parse_args(argv)
    if a.summarize:
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, "summary.json"), "w") as f:
            json.dump(summarize(a.summarize), f, indent=1)
        return 0
    a.shapes = shapes(a.cpu_smoke)
    ONLY[:] = [p for p in a.only.split(",") if p]
    if a.cpu_smoke:
        a.repeats = 1
    import torch

    card = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    os.makedirs(a.out, exist_ok=True)
    os.makedirs(a.work, exist_ok=True)
    res = Results(os.path.join(a.out, "scale.json"), card)
    try:
        for part in a.parts.split(","):
            PARTS[part](res, a.work, a)
    finally:
        pack(a.work, a.out)
    return 0 if all(row_ok(r) for r in res.data["rows"]) else 1


def pack(work: str, out: str) -> None:
    """Runs' logs and metrics, and the chrome traces of each system's first two ranks, as two
    tarballs in `out` (a GPU machine may give back only a few files)."""
    import tarfile

    logs, traces = [], []
    for d, _, files in os.walk(work):
        for f in files:
            path = os.path.join(d, f)
            if f.endswith(".log") or f == "metrics.jsonl":
                logs.append(path)
            elif f in ("rank0.trace.json.gz", "rank2.trace.json.gz") and os.path.getsize(path) < 5 * 2**20:
                traces.append(path)
    for name, paths in (("logs.tgz", logs), ("traces.tgz", traces)):
        if paths:
            with tarfile.open(os.path.join(out, name), "w:gz") as tar:
                for path in paths:
                    tar.add(path, arcname=os.path.relpath(path, work))


if __name__ == "__main__":
    if sys.argv[1:2] == [STOCK_CHECKPOINTED]:  # a rank of `stock`'s checkpointed stock_pipe.py
        sys.path.insert(0, ROOT)
        stock_pipe_checkpointed(int(sys.argv[2]), sys.argv[3:])
    sys.exit(main())
