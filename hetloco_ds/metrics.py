"""`OUT/metrics.jsonl` (the contract benchmarks read), the progress bar and DeepSpeed's monitor.

One JSON object per line. Rows of kind "step" are written once per optimizer step per
replica; "outer" once per outer step per replica; "validation" whenever validation runs.
Each replica's rows are written by one rank of that replica with a single O_APPEND write,
so concurrent writers on one file system never interleave within a line.
"""
from __future__ import annotations

import json
import os
import time

from tqdm import tqdm

from .checkpoint import replace_text
from .engine import StepRecord


class MetricsWriter:
    def __init__(self, path: str | None):
        self.path = path
        self._fd = None
        if path is not None:
            self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def write(self, row: dict) -> None:
        if self._fd is not None:
            os.write(self._fd, (json.dumps(row, sort_keys=True) + "\n").encode())

    def step(self, rec: StepRecord) -> None:
        self.write({
            "kind": "step",
            "step": rec.step,
            "replica": rec.replica,
            "loss": rec.loss,
            "tokens": rec.tokens,
            "seconds": rec.seconds,
            "bytes": rec.bytes,
            "grad_norm": rec.extra.get("grad_norm"),
            "lr": rec.extra.get("lr"),
            "time": time.time(),
        })
        if rec.outer is not None:
            self.write({"kind": "outer", "step": rec.step, "replica": rec.replica, **rec.outer, "time": time.time()})

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def keep_rows_up_to(path: str, step: int) -> int:
    """Before a run resumed at `step` appends again: drop the rows a stopped run wrote past that
    step (they are about to be written again), so no (kind, step, replica) row is doubled.
    Rewrites the file atomically; returns how many rows were dropped."""
    if not os.path.exists(path):
        return 0
    with open(path) as f:
        lines = [line for line in f.read().split("\n") if line]
    keep = []
    for line in lines:
        try:
            row = json.loads(line)
        except ValueError:  # a line torn by a full disk
            continue
        if row.get("step", 0) <= step:
            keep.append(line)
    replace_text(path, "".join(line + "\n" for line in keep))
    return len(lines) - len(keep)


def validated_steps(path: str) -> set[int]:
    """Steps that already have a validation row."""
    if not os.path.exists(path):
        return set()
    with open(path) as f:
        return {row["step"] for row in map(json.loads, filter(None, f.read().split("\n")))
                if row.get("kind") == "validation"}


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f}{unit}" if unit == "B" else f"{n:.1f}{unit}"
        n /= 1000
    return f"{n:.1f}TB"


class Progress:
    """tqdm bar on one rank: step, loss, tokens/s and bytes sent so far by kind."""

    def __init__(self, total: int, initial: int, enabled: bool, monitor=None):
        self.enabled = enabled
        self.monitor = monitor if (monitor is not None and getattr(monitor, "enabled", False)) else None
        self.bar = tqdm(total=total, initial=initial, disable=not enabled, dynamic_ncols=True, desc="train")
        self.sent = {"activation": 0, "activation_grad": 0, "outer_sync": 0}
        self.tokens = 0
        self.seconds = 0.0

    def update(self, rec: StepRecord, val_loss: float | None = None) -> None:
        for k in self.sent:
            self.sent[k] += rec.bytes[k]["sent"]
        self.tokens += rec.tokens
        self.seconds += rec.seconds
        tps = rec.tokens / rec.seconds if rec.seconds > 0 else 0.0
        if self.enabled:
            self.bar.set_postfix_str(
                f"loss {rec.loss:.3f} | {tps:,.0f} tok/s | sent act {human_bytes(self.sent['activation'])} "
                f"grad {human_bytes(self.sent['activation_grad'])} sync {human_bytes(self.sent['outer_sync'])}",
                refresh=False,
            )
            self.bar.update(1)
        if self.monitor is not None:
            events = [("Train/loss", rec.loss, rec.step), ("Train/tokens_per_s", tps, rec.step)]
            events += [(f"Bytes/{k}_sent", float(v), rec.step) for k, v in self.sent.items()]
            self.monitor.write_events(events)

    def validation(self, step: int, loss: float) -> None:
        if self.enabled:
            self.bar.write(f"step {step}: validation loss {loss:.4f}")
        if self.monitor is not None:
            self.monitor.write_events([("Validation/loss", loss, step)])

    def close(self) -> None:
        self.bar.close()
