"""`OUT/metrics.jsonl` (the contract benchmarks read), the progress bar and DeepSpeed's monitor.

One JSON object per line. Rows of kind "step" are written once per optimizer step per
replica; "outer" once per outer step per replica; "validation" whenever validation runs.
Each replica's rows are written by one rank of that replica with a single O_APPEND write,
so concurrent writers on one file system never interleave within a line.

Throughput fields (`RunFacts`): global tokens/s, MFU and peak memory (the writer's own,
`peak_memory_bytes`, and every stage's of the replica, `peak_memory_bytes_by_stage`). MFU counts model FLOPs
as PaLM does (appendix B) and as bench/ and shared/ANCHORS.md do, so the numbers compare: per
token, 6N for the matmuls of forward and backward, N = every parameter, the input embedding
included (a tied table once), plus 12 * layers * heads * head_dim * seq_len for attention's
score and value matmuls (the full square, not halved for the causal mask). A replica's FLOPs
of a step are spread over its S GPUs; the peak is the GPU's dense bf16 tensor-core rate,
looked up from its name.
"""
from __future__ import annotations

import dataclasses
import json
import os
import time

import torch
from tqdm import tqdm

from .checkpoint import replace_text
from .engine import StepRecord
from .model import head_dim, parameter_count

# Dense (no sparsity) bf16 tensor-core peak per GPU from NVIDIA's datasheets, matched as a
# substring of torch.cuda.get_device_name(); the first match wins, so variants come first.
PEAK_BF16_FLOPS: tuple[tuple[str, float], ...] = (
    ("H100 PCIe", 756e12),
    ("H100 NVL", 835e12),
    ("GH200", 989e12),
    ("H100", 989e12),
    ("H200", 989e12),
    ("H800", 989e12),
    ("B200", 2250e12),
    ("A100", 312e12),
    ("A800", 312e12),
    ("L40S", 362e12),
    ("L40", 181e12),
    ("L4", 121e12),
)
PEAK_ENV = "HETLOCO_PEAK_TFLOPS"
"""Overrides the lookup (per GPU, TFLOP/s), e.g. for a GPU not in PEAK_BF16_FLOPS."""


def peak_flops_for(device_name: str) -> float | None:
    """Dense bf16 peak FLOP/s of a GPU by its name (PEAK_BF16_FLOPS); None if not listed."""
    name = device_name.lower()
    return next((peak for key, peak in PEAK_BF16_FLOPS if key.lower() in name), None)


def peak_flops(device: torch.device) -> float | None:
    """Per-GPU peak FLOP/s for MFU: $HETLOCO_PEAK_TFLOPS, else by name; None on CPU or unknown GPUs."""
    if device.type != "cuda":
        return None
    if os.environ.get(PEAK_ENV):
        try:
            return float(os.environ[PEAK_ENV]) * 1e12
        except ValueError:
            raise ValueError(f"{PEAK_ENV}={os.environ[PEAK_ENV]!r} is not a number (TFLOP/s per GPU)") from None
    return peak_flops_for(torch.cuda.get_device_name(device))


def training_flops_per_token(config, seq_len: int) -> float:
    """6N + 12 * layers * heads * head_dim * seq_len (see the module docstring)."""
    attention = 12.0 * config.num_hidden_layers * config.num_attention_heads * head_dim(config) * seq_len
    return 6.0 * parameter_count(config) + attention


@dataclasses.dataclass(frozen=True)
class RunFacts:
    """What turns a StepRecord into global tokens/s, MFU and peak memory."""

    num_replicas: int
    num_stages: int
    flops_per_token: float
    peak_flops: float | None
    """Per-GPU peak FLOP/s; None (CPU, unknown GPU) leaves MFU out."""

    @classmethod
    def from_engine(cls, engine) -> "RunFacts":
        # The replicas this job runs: an elastic replica (a job of its own) counts its own tokens/s.
        return cls(num_replicas=engine.module.replica[1], num_stages=engine.num_stages,
                   flops_per_token=training_flops_per_token(engine.module.llama_config, engine.seq_len),
                   peak_flops=peak_flops(torch.device(engine.device)))

    def rates(self, tokens: float, seconds: float) -> dict:
        """global_tokens_per_s and, on a known GPU, mfu, for `tokens` of one replica in `seconds`.

        All replicas take the same number of equally sized steps and wait for each other at
        outer steps, so M times one replica's rate is the job's.
        """
        if seconds <= 0:
            return {}
        out = {"global_tokens_per_s": self.num_replicas * tokens / seconds}
        if self.peak_flops is not None:
            out["mfu"] = self.flops_per_token * tokens / seconds / self.num_stages / self.peak_flops
        return out

    def fields(self, rec: StepRecord) -> dict:
        # The writer is the replica's last stage: its own peak is the record's last entry.
        return {**self.rates(rec.tokens, rec.seconds),
                "peak_memory_bytes": rec.extra["peak_memory_bytes_by_stage"][-1]}


class MetricsWriter:
    def __init__(self, path: str | None, facts: RunFacts | None = None):
        self.path = path
        self.facts = facts
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
            "compute_seconds": rec.extra.get("compute_seconds"),
            "peak_memory_bytes_by_stage": rec.extra.get("peak_memory_bytes_by_stage"),
            "time": time.time(),
            **(self.facts.fields(rec) if self.facts is not None else {}),
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
    """tqdm bar on one rank: step, loss, global tokens/s, MFU, peak memory and bytes sent by kind (every kind the
    meter counts: a dense tensor on a stage link shows, whatever it is labelled).

    Rates are over the run so far (all steps' tokens over all steps' seconds), so outer steps
    do not make them jump.
    """

    def __init__(self, total: int, initial: int, enabled: bool, monitor=None, facts: RunFacts | None = None):
        self.enabled = enabled
        self.facts = facts
        self.monitor = monitor if (monitor is not None and getattr(monitor, "enabled", False)) else None
        self.bar = tqdm(total=total, initial=initial, disable=not enabled, dynamic_ncols=True, desc="train")
        self.sent = {"activation": 0, "activation_grad": 0, "outer_sync": 0, "embedding_sync": 0, "control": 0}
        self.tokens = 0
        self.seconds = 0.0

    def update(self, rec: StepRecord, val_loss: float | None = None) -> None:
        for k in self.sent:
            self.sent[k] += rec.bytes[k]["sent"]
        self.tokens += rec.tokens
        self.seconds += rec.seconds
        tps = rec.tokens / rec.seconds if rec.seconds > 0 else 0.0
        rates = self.facts.rates(self.tokens, self.seconds) if self.facts is not None else {}
        # The most any stage of the replica holds: the GPU nearest its limit need not be this one.
        memory = max(rec.extra["peak_memory_bytes_by_stage"]) if self.facts is not None else None
        if self.enabled:
            parts = [f"loss {rec.loss:.3f}"]
            if "global_tokens_per_s" in rates:
                parts.append(f"{rates['global_tokens_per_s']:,.0f} tok/s global")
            else:
                parts.append(f"{tps:,.0f} tok/s")
            if "mfu" in rates:
                parts.append(f"MFU {100 * rates['mfu']:.1f}%")
            if memory is not None:
                parts.append(f"mem {human_bytes(memory)}")
            parts.append(f"sent act {human_bytes(self.sent['activation'])} "
                         f"grad {human_bytes(self.sent['activation_grad'])} sync {human_bytes(self.sent['outer_sync'])} "
                         f"emb {human_bytes(self.sent['embedding_sync'])} ctl {human_bytes(self.sent['control'])}")
            self.bar.set_postfix_str(" | ".join(parts), refresh=False)
            self.bar.update(1)
        if self.monitor is not None:
            events = [("Train/loss", rec.loss, rec.step), ("Train/tokens_per_s", tps, rec.step)]
            events += [(f"Train/{k}", float(v), rec.step) for k, v in rates.items()]
            if memory is not None:
                events.append(("Train/peak_memory_bytes", float(memory), rec.step))
            events += [(f"Bytes/{k}_sent", float(v), rec.step) for k, v in self.sent.items()]
            self.monitor.write_events(events)

    def validation(self, step: int, loss: float) -> None:
        if self.enabled:
            self.bar.write(f"step {step}: validation loss {loss:.4f}")
        if self.monitor is not None:
            self.monitor.write_events([("Validation/loss", loss, step)])

    def close(self) -> bool:
        """End the bar (its line too); whether it was shown."""
        self.bar.close()
        return not self.bar.disable
