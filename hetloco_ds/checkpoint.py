"""Checkpoints at outer-step boundaries: DeepSpeed's layer files plus our algorithm state.

DeepSpeed writes one copy of each stage's layers (from data-parallel rank 0) and replica 0's
optimizer. A replica needs more to continue exactly: its own AdamW moments, its error
buffers and theta at the last sync, T_perp, the LR schedule, its data position and step
counters. Those go to one file per rank, written before DeepSpeed updates `latest`, so a
checkpoint that `latest` names is always complete.
"""
from __future__ import annotations

import os

import torch
from deepspeed import comm as dist

STATE_FILE = "hetloco_rank{rank:05d}.pt"


def tag_for(step: int) -> str:
    return f"global_step{step}"


def _state_path(ckpt_dir: str, tag: str, rank: int) -> str:
    return os.path.join(ckpt_dir, tag, STATE_FILE.format(rank=rank))


def save(engine, ckpt_dir: str, step: int, data_position: int) -> str:
    """Collective over all ranks; call at an outer-step boundary."""
    tag = tag_for(step)
    rank = dist.get_rank()
    os.makedirs(os.path.join(ckpt_dir, tag), exist_ok=True)
    state = {
        "world_size": dist.get_world_size(),
        "stages": engine.num_stages,
        "replica": engine.replica,
        "stage": engine.stage_id,
        "local_steps": engine.local_steps,
        "data_position": data_position,
        "optimizer": engine.optimizer.state_dict(),
        "lr_scheduler": engine.lr_scheduler.state_dict() if engine.lr_scheduler is not None else None,
        "algorithm": engine.algorithm.state_dict(),
        "meter": engine.meter.snapshot(),
    }
    path = _state_path(ckpt_dir, tag, rank)
    torch.save(state, path + ".tmp")
    os.replace(path + ".tmp", path)
    dist.barrier()
    engine.save_checkpoint(ckpt_dir, tag=tag)
    return tag


def latest_tag(ckpt_dir: str) -> str | None:
    path = os.path.join(ckpt_dir, "latest")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return f.read().strip()


def load(engine, ckpt_dir: str) -> int:
    """Restore everything `save` wrote; returns the data position."""
    tag = latest_tag(ckpt_dir)
    if tag is None:
        raise FileNotFoundError(f"no checkpoint to resume from in {ckpt_dir} (no 'latest' file)")
    path = _state_path(ckpt_dir, tag, dist.get_rank())
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path} is missing: the checkpoint was written by a different world size")
    state = torch.load(path, map_location=engine.device, weights_only=False)
    if state["world_size"] != dist.get_world_size() or state["stages"] != engine.num_stages:
        raise ValueError(
            f"checkpoint {ckpt_dir}/{tag} was written by {state['world_size']} ranks in {state['stages']} stages; "
            f"this run has {dist.get_world_size()} ranks in {engine.num_stages} stages"
        )
    engine.load_checkpoint(ckpt_dir, tag=tag, load_module_only=True, load_optimizer_states=False,
                           load_lr_scheduler_states=False)
    engine.optimizer.load_state_dict(state["optimizer"])
    if engine.lr_scheduler is not None and state["lr_scheduler"] is not None:
        engine.lr_scheduler.load_state_dict(state["lr_scheduler"])
    engine.algorithm.load_state_dict(state["algorithm"])
    engine.local_steps = state["local_steps"]
    engine.global_steps = state["local_steps"]
    engine.meter.total = state["meter"]
    engine.meter.since_mark()
    return state["data_position"]
