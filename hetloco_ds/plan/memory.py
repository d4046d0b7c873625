"""Device memory a stage needs, and the largest named shape our defaults train on a GPU count and
memory (`hetloco-ds plan --largest`).

Every size rule is `sizes`'s: parameters, gradients, AdamW's moments, bf16 weight casts and the
outer state from `sizes.stage_state_bytes`; activations from `sizes.stage_activation_bytes`, with
each stage's micro-batches in flight from `pipe.order.depth` for the schedule in use.
tests/test_plan.py checks the sum against the peaks measured on H100s (bench/results/scale_h100x4/).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from .. import sizes
from ..pipe.order import depth
from .model import check_positive
from .shapes import PRESETS, ModelShape, stage_tensors

LARGEST_GPUS = (1, 2, 4, 8)
"""GPU counts of the `--largest` table's rows."""
LARGEST_MEMORY_GB = (24, 40, 80, 141)
"""Per-GPU memory (GB, 1e9 bytes) of its columns."""
MEMORY_HEADROOM = 0.9
"""Fraction of a device's memory the planners let a stage's predicted peak take (the rest: the CUDA
context, the allocator's cached blocks, communication buffers)."""


def stage_memory_bytes(model: ModelShape, stages: int, *, micro_batch: int = 1, n_mb: int = 32,
                       seq_len: int | None = None, schedule: str = "overlapped", bf16: bool = True,
                       sparseloco: bool = True, outer_state_device: str = "gpu",
                       autocast_cache: bool = False, activation_checkpoint_interval: int = 0,
                       optimizer_state: str = "fp32", loss_chunk_tokens: int = 0) -> list[int]:
    """Peak device bytes of each stage of one replica in `stages` stages: `sizes.stage_state_bytes`
    of its parameters plus `sizes.stage_activation_bytes` of its layers, with `pipe.order.depth`
    micro-batches of micro_batch x seq_len tokens in flight (of `n_mb` a step) under `schedule`.
    `autocast_cache`: the weights' casts come from autocast's own cache (`train.compile`'s layers,
    and every run before `casts.step_casts`), so the backward defers the bf16 gradients of every
    cast matrix (all but the token embedding, which is looked up: `sizes.deferred_cast_grad_bytes`).
    `activation_checkpoint_interval`: pipeline.activation_checkpoint_interval; each stage's runs of
    decoder layers that keep only their input (`sizes.recomputed_runs`). `optimizer_state`:
    hetloco.train.optimizer_state, AdamW's bytes a parameter on the device
    (`sizes.optimizer_state_bytes_per_param`). `loss_chunk_tokens`: hetloco.train.loss_chunk_tokens,
    the last stage's loss a chunk of tokens at a time (`sizes.loss_tokens`).
    Under SparseLoCo the peak is the larger of the inner step's and the outer step's (weights,
    moments and the outer state beside `sizes.outer_step_transient_bytes`, at the default codec): the
    outer step's sets it where activations are small (recomputed layers, short sequences).
    Both peaks hold cuBLAS's workspaces (`sizes.CUBLAS_WORKSPACE_BYTES`, Hopper's size).
    Left out: a compressed replica's basis U and T_perp buffer (d x k and V x d fp32 on its stages)."""
    L = model.seq_len if seq_len is None else seq_len
    tokens = micro_batch * L
    act_bytes = 2 if bf16 else 4
    layers = sizes.decoder_layers_per_stage(model.n_layers, stages)
    parts = sizes.stage_parts(model.n_layers, stages)
    out = []
    for s, (tensors, nl) in enumerate(zip(stage_tensors(model, stages), layers)):
        recomputed = sizes.recomputed_runs(model.n_layers, parts[s], parts[s + 1], activation_checkpoint_interval)
        params = sum(math.prod(shape) for _, shape in tensors)
        deferred = 0
        if autocast_cache:
            cast = sum(math.prod(shape) for name, shape in tensors if len(shape) == 2 and not name.startswith("embed_tokens"))
            deferred = sizes.deferred_cast_grad_bytes(cast, n_mb, bf16)
        act = sizes.stage_activation_bytes(tokens, nl, depth(schedule, stages, s, n_mb), model.d, model.ffn,
                                           model.kv_dim, model.vocab if s == stages - 1 else None, act_bytes, deferred,
                                           recomputed, loss_chunk_tokens)
        peak = sizes.stage_state_bytes(params, bf16, sparseloco, outer_state_device,
                                       optimizer_state=optimizer_state) + act
        if sparseloco:
            # The outer step runs after the inner step has freed its gradients and casts: weights and
            # moments, the outer state where it lives, and the outer step's own transients.
            resident = sizes.stage_state_bytes(params, False, True, outer_state_device,
                                               optimizer_state=optimizer_state) - 4 * params
            peak = max(peak, resident + sizes.outer_step_transient_bytes([shape for _, shape in tensors],
                                                                         on_host=outer_state_device == "cpu"))
        out.append(peak + sizes.CUBLAS_WORKSPACES * sizes.CUBLAS_WORKSPACE_BYTES)
    return out


def min_stages(model: ModelShape, memory_bytes: float, most: int | None = None, **mem_kw) -> int | None:
    """Smallest S (at most `most`, and at most one decoder layer a stage) whose every stage fits
    `memory_bytes`; None if none does."""
    for s in range(1, min(model.n_layers, most or model.n_layers) + 1):
        if max(stage_memory_bytes(model, s, **mem_kw)) <= memory_bytes:
            return s
    return None


@dataclass(frozen=True)
class Largest:
    """The largest preset one replica trains on `gpus` GPUs of `memory_gb` each, in `stages` stages."""

    gpus: int
    memory_gb: float
    outer_state_device: str
    preset: str | None
    """None: not even the smallest preset fits."""
    stages: int | None
    params: int | None
    peak_gb: float | None
    """Its busiest stage's predicted peak."""


def largest_preset(gpus: int, memory_gb: float, vocab: int, *, presets: Sequence[str] | None = None,
                   headroom: float = MEMORY_HEADROOM, **mem_kw) -> Largest:
    """The preset with the most parameters (at vocabulary `vocab`, its own sequence length unless
    mem_kw names one) that one replica of at most `gpus` stages trains with every stage's
    `stage_memory_bytes` within `headroom` x `memory_gb`, and its fewest stages."""
    check_positive("gpus", gpus, integer=True)
    check_positive("memory_gb", memory_gb)
    shapes = [ModelShape.preset(name, vocab=vocab) for name in (presets or PRESETS)]
    device = mem_kw.get("outer_state_device", "gpu")
    for m in sorted(shapes, key=lambda x: x.n_params(), reverse=True):
        S = min_stages(m, memory_gb * 1e9 * headroom, most=gpus, **mem_kw)
        if S is not None:
            return Largest(gpus, memory_gb, device, m.name, S, m.n_params(), max(stage_memory_bytes(m, S, **mem_kw)) / 1e9)
    return Largest(gpus, memory_gb, device, None, None, None, None)


def largest_table(vocab: int, gpus: Sequence[int] = LARGEST_GPUS, memory_gb: Sequence[float] = LARGEST_MEMORY_GB,
                  devices: Sequence[str] = ("gpu", "cpu"), **mem_kw) -> list[list[tuple[Largest, ...]]]:
    """`largest_preset` for every GPU count (rows) and memory (columns), one entry per outer-state
    placement in `devices`."""
    return [[tuple(largest_preset(g, mem, vocab, outer_state_device=dev, **mem_kw) for dev in devices)
             for mem in memory_gb] for g in gpus]


def format_largest(table: list[list[tuple[Largest, ...]]], vocab: int, micro_batch: int, n_mb: int,
                   seq_len: int | None, schedule: str, activation_checkpoint_interval: int = 0,
                   optimizer_state: str = "fp32", loss_chunk_tokens: int = 0) -> str:
    """The `--largest` table: per cell "preset S=n" for each outer-state placement, "/"-separated."""
    mems = [row[0].memory_gb for row in table[0]]
    places = " / ".join(f'"{c.outer_state_device}"' for c in table[0][0])
    seq = (f"seq_len {seq_len}" if seq_len else "each preset's own seq_len ("
           + ", ".join(f"{n} {m.seq_len}" for n, m in PRESETS.items()) + ")")
    head = (f"Largest preset one replica trains (fewest stages S <= GPUs; every stage's predicted peak "
            f"<= {MEMORY_HEADROOM:g} x the GPU's memory), {schedule} schedule, micro-batch {micro_batch} x "
            f"{n_mb} a step, {seq}, vocab {vocab}, bf16, AdamW"
            + ("" if optimizer_state == "fp32" else f" with optimizer_state {optimizer_state!r}")
            + (f", the loss {loss_chunk_tokens} tokens at a time (train.loss_chunk_tokens)" if loss_chunk_tokens else "")
            + f"; outer state {places} "
            f"(sparseloco.outer_state_device)"
            + (f"; decoder layers recomputed in runs of {activation_checkpoint_interval} "
               f"(pipeline.activation_checkpoint_interval):" if activation_checkpoint_interval else ":"))
    cols = ["GPUs"] + [f"{m:g} GB" for m in mems]
    rows = [cols]
    for row in table:
        cells = [" / ".join("-" if c.preset is None else f"{c.preset} S={c.stages}" for c in cell) for cell in row]
        rows.append([str(row[0][0].gpus)] + cells)
    w = [max(len(r[i]) for r in rows) for i in range(len(cols))]
    lines = ["  ".join(c.ljust(w[i]) for i, c in enumerate(r)).rstrip() for r in rows]
    return head + "\n\n" + "\n".join(lines)
