"""One training step recorded with torch.profiler, and what it says in numbers.

`train.profile_step` (the CLI) and the stock-DeepSpeed bench both call `record_step`, so our
engine and the anchor are profiled and summarised the same way. The summary is a small JSON per
rank: the device's busy and idle time within the step, kernel time by class, the pipeline
instructions as a timeline (host range and the device range of the kernels each launched), the
host's waits on the device, and the allocator's retries. The full trace (chrome format, gzipped)
is written beside it for a closer look.
"""
from __future__ import annotations

import contextlib
import gzip
import json
import os
import re
import shutil
import time

import torch

STEP_RANGE = "hetloco.step"
"""The record_function range around the profiled step (the window every number refers to)."""

# First match wins; names are those CUPTI reports for the kernels torch, cuBLAS, cuDNN and NCCL launch.
# Inductor names a kernel after every op it fused (`triton_poi_fused__to_copy_add_bmm_cat_...` is
# one pointwise pass), so its prefix, not those op names, says what it does. Attention precedes
# matmul because flash kernels carry cutlass types in their template arguments.
KERNEL_CLASSES = (
    ("nccl", re.compile(r"nccl", re.I)),
    ("memcpy", re.compile(r"^Memcpy|^Memset|copy_engine", re.I)),
    ("elementwise", re.compile(r"^triton_poi_")),
    ("reduce", re.compile(r"^triton_(red|per)_")),
    ("matmul", re.compile(r"^triton_tem_")),
    ("attention", re.compile(r"flash|fmha|attention|cudnn.*sdpa|sdpa", re.I)),
    ("matmul", re.compile(r"gemm|cutlass|xmma|sm90_|nvjet|cublas|matmul|splitK", re.I)),
    ("optimizer", re.compile(r"adam|multi_tensor|foreach", re.I)),
    ("cast", re.compile(r"direct_copy|to_copy|convert|bfloat16_copy|copy_kernel", re.I)),
    ("reduce", re.compile(r"reduce|norm|softmax|cross_entropy|nll|log_softmax", re.I)),
    ("elementwise", re.compile(r"elementwise|vectorized|unrolled|add|mul|silu|cat|index|embedding|gather", re.I)),
)

# Host calls that wait for the device (or a peer) before returning.
HOST_WAITS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy")
_PAGEABLE = re.compile(r"Pageable", re.I)


def kernel_class(name: str) -> str:
    for cls, pattern in KERNEL_CLASSES:
        if pattern.search(name):
            return cls
    return "other"


def _union_us(intervals: list[tuple[float, float]]) -> float:
    """Total length of the union of [start, end) intervals (kernels of several streams overlap)."""
    total, end = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if s >= end:
            total += e - s
            end = e
        elif e > end:
            total += e - end
            end = e
    return total


def summarize(events, rank: int, extra: dict | None = None) -> dict:
    """The numbers of one profiled step from torch.profiler's `events()` (FunctionEvents)."""
    from torch.autograd import DeviceType

    step = [e for e in events if e.name == STEP_RANGE and e.device_type == DeviceType.CPU]
    if not step:
        raise ValueError(f"no {STEP_RANGE!r} range in the profile")
    t0, t1 = step[0].time_range.start, step[0].time_range.end
    wall_us = t1 - t0
    cpu = [e for e in events if e.device_type == DeviceType.CPU]
    # record_function ranges appear twice: on the host, and on the device spanning the kernels
    # they launched; the device copies are no kernels.
    ranges = {e.name for e in cpu if getattr(e, "is_user_annotation", False)} | {STEP_RANGE}
    device = [e for e in events if e.device_type == DeviceType.CUDA]
    kernels = [e for e in device if e.name not in ranges and not e.name.startswith(("pipe.", "gpu_user_annotation"))
               and e.time_range.end > e.time_range.start]
    by_class: dict[str, float] = {}
    top: dict[str, float] = {}
    inside: dict[bool, list] = {True: [], False: []}  # within the step window, by "is an NCCL kernel"
    for k in kernels:
        start, end = k.time_range.start, k.time_range.end
        cls = kernel_class(k.name)
        by_class[cls] = by_class.get(cls, 0.0) + end - start
        top[k.name[:120]] = top.get(k.name[:120], 0.0) + end - start
        if end > t0 and start < t1:
            inside[cls == "nccl"].append((max(start, t0), min(end, t1)))
    non_nccl_busy_us = _union_us(inside[False])
    busy_us = _union_us(inside[False] + inside[True])
    waits: dict[str, dict] = {}
    for e in cpu:
        if e.name in HOST_WAITS:
            w = waits.setdefault(e.name, {"count": 0, "ms": 0.0})
            w["count"] += 1
            w["ms"] += (e.time_range.end - e.time_range.start) / 1e3
    pageable = sum(1 for k in kernels if _PAGEABLE.search(k.name))
    items = sum(1 for e in cpu if e.name == "aten::_local_scalar_dense")
    syncs = sorted(e.time_range.start for e in cpu if e.name in HOST_WAITS or e.name == "aten::_local_scalar_dense")
    on_device = sorted((e for e in device if e.name.startswith("pipe.")), key=lambda e: e.time_range.start)
    on_host = sorted((e for e in cpu if e.name.startswith("pipe.")), key=lambda e: e.time_range.start)
    timeline = []
    for i, e in enumerate(on_host):
        a, b = e.time_range.start, e.time_range.end
        row = [e.name[5:], round((a - t0) / 1e3, 3), round((b - a) / 1e3, 3), None, None,
               sum(1 for t in syncs if a <= t < b)]
        if len(on_device) == len(on_host) and on_device[i].name == e.name:
            g = on_device[i].time_range
            row[3:5] = [round((g.start - t0) / 1e3, 3), round((g.end - g.start) / 1e3, 3)]
        timeline.append(row)
    out = {
        "rank": rank,
        "step_ms": round(wall_us / 1e3, 3),
        "device_busy_ms": round(busy_us / 1e3, 3),
        "device_idle_ms": round((wall_us - busy_us) / 1e3, 3),
        "device_busy_without_nccl_ms": round(non_nccl_busy_us / 1e3, 3),
        "kernel_ms_by_class": {k: round(v / 1e3, 3) for k, v in sorted(by_class.items(), key=lambda kv: -kv[1])},
        "top_kernels_ms": {k: round(v / 1e3, 3) for k, v in sorted(top.items(), key=lambda kv: -kv[1])[:25]},
        "kernels": len(kernels),
        "host_waits": waits,
        "pageable_copies": pageable,
        "item_calls": items,
        "timeline": timeline,
        "timeline_columns": ["instruction", "host_start_ms", "host_ms", "device_start_ms", "device_ms", "host_syncs"],
    }
    out.update(extra or {})
    return out


@contextlib.contextmanager
def record_step(out_dir: str, rank: int, device: torch.device, trace: bool = True):
    """Profile the body (one training step) on this rank; writes OUT_DIR/rank<r>.json (summary)
    and, with `trace`, OUT_DIR/rank<r>.trace.json.gz. The device is synchronised before and
    after, so the window holds the step's work and nothing else."""
    from torch.profiler import ProfilerActivity, profile, record_function

    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    sync = (lambda: torch.cuda.synchronize(device)) if cuda else (lambda: None)
    retries0 = torch.cuda.memory_stats(device).get("num_alloc_retries", 0) if cuda else 0
    sync()
    held = torch.cuda.memory_allocated(device) if cuda else 0  # what lives between steps: weights, optimizer, ...
    with profile(activities=activities) as prof:
        with record_function(STEP_RANGE):
            start = time.perf_counter()
            yield
            sync()
            seconds = time.perf_counter() - start
    extra = {"seconds": seconds}
    if cuda:
        stats = torch.cuda.memory_stats(device)
        extra.update(alloc_retries=stats.get("num_alloc_retries", 0) - retries0,
                     allocated_between_steps_gib=round(held / 2**30, 3),
                     peak_allocated_gib=round(torch.cuda.max_memory_allocated(device) / 2**30, 3),
                     peak_reserved_gib=round(torch.cuda.max_memory_reserved(device) / 2**30, 3))
    os.makedirs(out_dir, exist_ok=True)
    summary = summarize(prof.events(), rank, extra)
    path = os.path.join(out_dir, f"rank{rank}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(summary, f, indent=1)
    os.replace(path + ".tmp", path)
    if trace:
        raw = os.path.join(out_dir, f".rank{rank}.trace.json")
        prof.export_chrome_trace(raw)
        with open(raw, "rb") as src, gzip.open(os.path.join(out_dir, f"rank{rank}.trace.json.gz"), "wb") as dst:
            shutil.copyfileobj(src, dst)
        os.remove(raw)
