"""The run directory (`--out`) is owned by one job at a time.

What a run keeps there: `run_config.json` (the config and arguments it was started with, which
`--resume` checks and reuses), `metrics.jsonl`, `checkpoints/`, `hf/` and `.hetloco/` (the lock
and the watchdog's heartbeats). Other files (a job script's logs) are left alone.

One process owns the directory while the job runs, holding an exclusive `flock` on
`.hetloco/lock`: our launcher under `--nproc`, global rank 0 under an external launcher. The
kernel drops the lock when that process dies, so a killed run never leaves a stale lock.
Ownership is taken only after every check has passed; until then nothing here is written. What
those checks read of the directory is read again once the lock is held (`train.own_run`): two
runs started together both pass them before either holds the lock.
"""
from __future__ import annotations

import fcntl
import json
import os
import shutil
import socket
import time

from .checkpoint import replace_text
from .config import ConfigError

RUN_CONFIG = "run_config.json"
METRICS = "metrics.jsonl"
CHECKPOINTS = "checkpoints"
EXPORT = "hf"
STATE = ".hetloco"
OURS = (RUN_CONFIG, METRICS, CHECKPOINTS, EXPORT, STATE)
RECORD_FORMAT = 1

# Keys that may change between a run and its `--resume`: they do not change what is trained.
RESUME_MAY_CHANGE = (
    "hetloco.train.eval_interval", "hetloco.train.eval_batches", "hetloco.train.checkpoint_interval",
    "hetloco.train.keep_checkpoints", "hetloco.train.checkpoint_every_s", "hetloco.train.checkpoint_staging", "hetloco.train.preempt_grace_s",
    "hetloco.train.watchdog_timeout", "hetloco.train.max_nonfinite_outer_steps",
    "hetloco.train.compile", "hetloco.train.loss_chunk_tokens", "ds.steps_per_print", "ds.wall_clock_breakdown", "ds.memory_breakdown", "ds.dump_state",
    "ds.tensorboard", "ds.wandb", "ds.csv_monitor", "ds.comet", "ds.flops_profiler", "ds.comms_logger", "ds.timers",
    # How stage links are driven: the schedules train bit for bit alike; CTAs and the carveout are timing
    # (the carveout's cuBLASLt kernels round like another GEMM algorithm would, as train.compile does).
    "hetloco.pipeline",
    # (loss_chunk_tokens: the same loss up to the order of its sum over tokens, as train.compile's.)
    # Where the outer state waits between outer steps: the same bits either way.
    "hetloco.sparseloco.outer_state_device",
)


def used_entries(out: str) -> list[str]:
    """Which of a run's files `out` already holds."""
    return [name for name in OURS if os.path.lexists(os.path.join(out, name))]


def check_unused(out: str, under_lock: bool = False) -> None:
    """A new run's --out must hold no run; `under_lock`: this process holds the lock, whose own
    file (all that `.hetloco` then holds of a directory no run wrote to) does not count."""
    used = used_entries(out)
    if under_lock and STATE in used and set(os.listdir(os.path.join(out, STATE))) <= {"lock"}:
        used.remove(STATE)
    if used:
        raise ConfigError(f"--out {out} already holds a run ({', '.join(used)}); pass --resume to continue it "
                          "or --overwrite to replace it")


def read_record(out: str) -> dict:
    path = os.path.join(out, RUN_CONFIG)
    try:
        with open(path) as f:
            record = json.load(f)
    except FileNotFoundError:
        raise ConfigError(f"--resume: {out} holds no run to resume ({RUN_CONFIG} not found)") from None
    except json.JSONDecodeError as err:
        raise ConfigError(f"--resume: {path} is corrupt: {err}") from None
    if record.get("format") != RECORD_FORMAT:
        raise ConfigError(f"--resume: {path} was written by an older hetloco_ds (no format {RECORD_FORMAT} "
                          "record of the run's config and arguments); start a new run")
    return record


def write_record(out: str, record: dict) -> None:
    replace_text(os.path.join(out, RUN_CONFIG), json.dumps({"format": RECORD_FORMAT, **record}, indent=2, default=str))


def _flatten(tree, prefix: str = "") -> dict[str, object]:
    if isinstance(tree, dict) and tree:
        out: dict[str, object] = {}
        for key, value in tree.items():
            out.update(_flatten(value, f"{prefix}.{key}" if prefix else str(key)))
        return out
    return {prefix: tree}


def config_differences(run_now, run_then) -> list[str]:
    """Dotted keys whose values differ between two RunConfigs, as "key = now (the run had then)";
    keys in RESUME_MAY_CHANGE (and anything under them) are not differences."""
    def flat(run):
        return _flatten({"ds": run.ds, "hetloco": json.loads(run.hetloco.model_dump_json())})

    now, then = flat(run_now), flat(run_then)
    diffs = []
    for key in sorted(set(now) | set(then)):
        if any(key == k or key.startswith(k + ".") for k in RESUME_MAY_CHANGE):
            continue
        a, b = now.get(key, "<absent>"), then.get(key, "<absent>")
        if a != b:
            diffs.append(f"{key} = {json.dumps(a)} (the run has {json.dumps(b)})")
    return diffs


class RunLock:
    """An exclusive lock on `out/.hetloco/lock` for as long as this object lives (or `release`)."""

    def __init__(self, out: str):
        self.path = os.path.join(out, STATE, "lock")
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(self.fd, 512, 0).decode(errors="replace").strip() or "another process"
            os.close(self.fd)
            raise ConfigError(f"--out {out} is in use by another run ({holder})") from None
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, f"pid {os.getpid()} on {socket.gethostname()} since {time.strftime('%Y-%m-%d %H:%M:%S')}\n"
                  .encode(), 0)

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)  # closing drops the flock
            self.fd = None


def clear_previous_run(out: str) -> None:
    """`--overwrite`: remove what an earlier run left (our files only; the lock stays)."""
    for name in OURS:
        path = os.path.join(out, name)
        if name == STATE:
            for entry in os.listdir(path) if os.path.isdir(path) else []:
                if entry != "lock":
                    _remove(os.path.join(path, entry))
        elif os.path.lexists(path):
            _remove(path)


def _remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    else:
        os.unlink(path)


def state_dir(out: str, *parts: str) -> str:
    return os.path.join(out, STATE, *parts)
