"""A checkpoint directory's layout and reading it back: tags, `latest`, the manifest, `verify`,
`pick` (what `--resume` loads: the newest checkpoint whose manifest matches the files on disk,
sizes and checksums, with a line saying so when that is not what `latest` names) and `load`.
`checkpoint.py` writes and commits what this module reads; its docstring draws the layout.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import zlib

import torch
from deepspeed import comm as dist

from . import safe_load
from .patches import layer_checkpoint_name

STATE_FILE = "hetloco_rank{rank:05d}.pt"
MANIFEST = "manifest.json"
LATEST = "latest"
FORMAT = 2
_TAG = re.compile(r"^global_step(\d+)$")
RESERVED = {LATEST, "hf_meta"}


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be written or read; the message names the file.

    `report` is False on the ranks that only learnt of another rank's failure, so that one
    line is printed for the job, by the rank that saw it."""

    def __init__(self, message: str, report: bool = True):
        super().__init__(message)
        self.report = report


# ------------------------------------------------------------------ per-rank algorithm state


def restore_rank_state(engine, state: dict, *, optimizer: bool = True, lr_scheduler: bool = True) -> int:
    """Inverse of `collect_rank_state` on a freshly built engine, once `state["algorithm"]` is
    whole again (`load` fills in what was stored once); returns the data position."""
    if optimizer:
        engine.optimizer.load_state_dict(state["optimizer"])
    if lr_scheduler and engine.lr_scheduler is not None and state["lr_scheduler"] is not None:
        engine.lr_scheduler.load_state_dict(state["lr_scheduler"])
    engine.algorithm.load_state_dict(state["algorithm"])
    engine.local_steps = state["local_steps"]
    engine.global_steps = state["local_steps"]
    engine.meter.total = state["meter"]
    engine.meter.since_mark()
    engine.client_state = state.get("client_state", {})
    if state.get("transport") is not None:
        engine.transport.load_state_dict(state["transport"])
    return state["data_position"]


# ------------------------------------------------------------------------------ file writes


def tag_for(step: int) -> str:
    return f"global_step{step}"


def step_of(tag: str) -> int | None:
    m = _TAG.match(tag)
    return int(m.group(1)) if m else None


def file_crc32(path: str) -> int:
    """crc32 of a file's bytes, read in blocks (right after its write they are in the page cache)."""
    crc = 0
    with open(path, "rb") as f:
        while block := f.read(1 << 24):
            crc = zlib.crc32(block, crc)
    return crc


def first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


# ------------------------------------------------------------------------------------ save


def latest_tag(ckpt_dir: str) -> str | None:
    path = os.path.join(ckpt_dir, LATEST)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return f.read().strip() or None


def _manifest(path: str) -> dict:
    with open(os.path.join(path, MANIFEST)) as f:
        return json.load(f)


def verify(ckpt_dir: str, tag: str, world_size: int | None = None, checksums: bool = True) -> str | None:
    """None if `ckpt_dir/tag` is a complete checkpoint (of `world_size` ranks, if given), else why
    not: every file of its manifest present, of its size and (`checksums`) its crc32."""
    path = os.path.join(ckpt_dir, tag)
    if not os.path.isdir(path):
        return f"{path} does not exist"
    try:
        manifest = _manifest(path)
        # format 1 (before checksums): {name: bytes}
        files = {n: e if isinstance(e, dict) else {"bytes": e} for n, e in manifest["files"].items()}
    except FileNotFoundError:
        return f"{path} has no {MANIFEST} (it was never committed)"
    except (ValueError, KeyError, TypeError, AttributeError) as err:
        return f"{os.path.join(path, MANIFEST)} is corrupt: {first_line(err)}"
    if world_size is not None and manifest.get("world_size") != world_size:
        return f"{path} was written by {manifest.get('world_size')} ranks, this run has {world_size}"
    for name, entry in files.items():
        file = os.path.join(path, name)
        if not os.path.isfile(file):
            return f"{file} is missing"
        if os.path.getsize(file) != entry["bytes"]:
            return f"{file} has {os.path.getsize(file)} bytes, its manifest says {entry['bytes']}"
    for name, entry in files.items() if checksums else ():
        if "crc32" in entry and (crc := file_crc32(os.path.join(path, name))) != entry["crc32"]:
            return f"{os.path.join(path, name)} fails its checksum (crc32 {crc:08x}, its manifest says {entry['crc32']:08x})"
    return None


@dataclasses.dataclass(frozen=True)
class Pick:
    tag: str
    step: int
    note: str | None
    """A line for the user when the pick is not what `latest` names."""


def _candidates(ckpt_dir: str, latest: str | None) -> list[tuple[int, str]]:
    """(step, tag) of every checkpoint directory, newest first: global_step<N> by name, a user's
    tag by its manifest (unreadable: not a candidate); at one step, the one `latest` names first."""
    found = []
    for name in os.listdir(ckpt_dir) if os.path.isdir(ckpt_dir) else []:
        step = step_of(name)
        if step is None and not name.startswith(".") and name not in RESERVED \
                and os.path.isdir(os.path.join(ckpt_dir, name)):
            with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
                step = int(_manifest(os.path.join(ckpt_dir, name))["step"])
        if step is not None:
            found.append((step, name != latest, name))
    return [(step, name) for step, _, name in sorted(found, key=lambda c: (-c[0], c[1], c[2]))]


def pick(ckpt_dir: str, world_size: int | None = None) -> Pick:
    """The newest complete checkpoint in `ckpt_dir`; CheckpointError when there is none."""
    latest = latest_tag(ckpt_dir)
    reasons: dict[str, str] = {}
    for step, tag in _candidates(ckpt_dir, latest):
        reason = verify(ckpt_dir, tag, world_size)
        if reason is None:
            break
        reasons[tag] = reason
    else:
        why = f" ({reasons[latest]})" if latest in reasons else ""
        raise CheckpointError(f"{ckpt_dir} holds no complete checkpoint to resume from{why}")
    note = None
    if latest is None:
        note = f"{os.path.join(ckpt_dir, LATEST)} is missing; resuming from {tag}, the newest complete checkpoint"
    elif latest in reasons:
        note = f"{latest} (named by latest) is incomplete: {reasons[latest]}; resuming from {tag}, the newest complete checkpoint"
    elif latest != tag:
        note = f"resuming from {tag}, the newest complete checkpoint (latest names {latest}: the run stopped before updating it)"
    return Pick(tag, step, note)


# ------------------------------------------------------------------------------------ load


def _read(path: str, device, what: str = "") -> dict:
    """A checkpoint file's tensors and plain data; nothing it names is called (`safe_load`)."""
    if not os.path.exists(path):
        raise CheckpointError(f"{path} is missing{what}")
    try:
        return safe_load.load(path, device, what="checkpoint file")
    except safe_load.UnreadableFile as err:
        raise CheckpointError(str(err)) from err


def check_readable(ckpt_dir: str, tag: str) -> None:
    """Every torch file of checkpoint `tag` read as `load` will read it (memory-mapped: only the
    pickles are parsed), before any rank starts: a file that would run code, or that its checksum
    passed but does not parse, is CheckpointError naming it, not a rank's failure mid-load."""
    path = os.path.join(ckpt_dir, tag)
    for name in sorted(_manifest(path)["files"]):
        if name.endswith(".pt"):
            _read(os.path.join(path, name), "cpu")


@torch.no_grad()
def load(engine, ckpt_dir: str, tag: str | None = None, *, module_only: bool = False, optimizer: bool = True,
         lr_scheduler: bool = True) -> int:
    """Restore what `save` wrote under `tag` (default: `pick`'s); returns the data position.

    `module_only`: the weights alone (theta_prev set to them, everything else as it is; returns
    0); `optimizer` / `lr_scheduler` False keep this engine's AdamW moments / LR schedule."""
    if tag is None:
        tag = pick(ckpt_dir, dist.get_world_size()).tag
    path = os.path.join(ckpt_dir, tag)
    state = _read(os.path.join(path, STATE_FILE.format(rank=dist.get_rank())), "cpu",
                  ": the checkpoint was written by a different world size")
    if state["world_size"] != dist.get_world_size() or state["stages"] != engine.num_stages:
        raise CheckpointError(
            f"checkpoint {ckpt_dir}/{tag} was written by {state['world_size']} ranks in {state['stages']} stages; "
            f"this run has {dist.get_world_size()} ranks in {engine.num_stages} stages"
        )
    engine.module.load_layer_files(path, lambda file: _read(file, "cpu"))
    algorithm = engine.algorithm
    if state.get("params") is not None:  # saved between boundaries: this replica's own weights
        for p, t in zip(algorithm.params, state["params"]):
            p.copy_(t)
    if algorithm.perp is not None:  # stored once, as layer 0's buffer (the tied head's stage reads it too)
        algorithm.perp.copy_(_read(os.path.join(path, layer_checkpoint_name(0)), "cpu")["perp"])
    outer = state["algorithm"].get("outer")
    if module_only:
        for i, p in enumerate(algorithm.params if algorithm.outer is not None else ()):
            algorithm.outer.rebase(i, p)
        return 0
    if outer is not None:
        parts = [dict(b) for b in outer["blocks"]] if "blocks" in outer else [dict(outer)]
        for part, block in zip(parts, algorithm.blocks):  # synced: theta_prev is the weights
            part.setdefault("theta_prev", [algorithm.params[i].detach() for i in block])
        if algorithm.outer.momentum is not None and "momentum" not in parts[0]:  # one block: replica 0's
            parts[0]["momentum"] = _shared_state(engine, ckpt_dir, tag)["algorithm"]["outer"]["momentum"]
        outer = {"blocks": parts} if "blocks" in outer else parts[0]
    state["algorithm"] = {"outer": outer, "perp": algorithm.perp, "outer_steps": state["algorithm"]["outer_steps"]}
    return restore_rank_state(engine, state, optimizer=optimizer, lr_scheduler=lr_scheduler)


def _shared_state(engine, ckpt_dir: str, tag: str) -> dict:
    """The state file of this stage's replica-0 rank, which holds what every replica shares."""
    ranks = _manifest(os.path.join(ckpt_dir, tag))["ranks"]
    writer = ranks.index({"stage": engine.stage_id, "data": 0})
    return _read(os.path.join(ckpt_dir, tag, STATE_FILE.format(rank=writer)), "cpu")
