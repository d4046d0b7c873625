"""Checkpoints at outer-step boundaries, committed atomically across all ranks.

OUT/checkpoints holds:

    global_step<N>/              a committed checkpoint:
        layer_XX-model_states.pt     DeepSpeed's stage layers (written by replica 0's ranks)
        mp_rank_XX_model_states.pt   DeepSpeed's engine state per stage
        hetloco_rank<r>.pt           rank r's algorithm state (`collect_rank_state`)
        manifest.json                every file above with its size; written last
    .global_step<N>.partial/     a checkpoint being written: never read, removed by the next save
    latest                       tag of the newest commit (what `hetloco-ds export` reads)
    hf_meta/                     config and tokenizer (convert.save_hf_meta)

`save` is a collective. Every rank writes its files into the `.partial` directory and fsyncs
them; the ranks then exchange what each wrote (or the error that stopped it), so either all
confirm or nobody commits. Only then does rank 0 write the manifest, rename the directory to
`global_step<N>` (one rename) and replace `latest` (temp file, fsync, rename). A process killed
at any point leaves `latest` naming a complete checkpoint (or none), never a partial one.

`pick` chooses what `--resume` loads: the newest checkpoint whose manifest matches the files on
disk, with a line saying so when that is not what `latest` names.
"""
from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import os
import re
import shutil

import torch
from deepspeed import comm as dist

STATE_FILE = "hetloco_rank{rank:05d}.pt"
MANIFEST = "manifest.json"
LATEST = "latest"
_TAG = re.compile(r"^global_step(\d+)$")


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be written or read; the message names the file.

    `report` is False on the ranks that only learnt of another rank's failure, so that one
    line is printed for the job, by the rank that saw it."""

    def __init__(self, message: str, report: bool = True):
        super().__init__(message)
        self.report = report


# ------------------------------------------------------------------ per-rank algorithm state


def collect_rank_state(engine, data_position: int) -> dict:
    """What this rank needs, beyond DeepSpeed's files, to continue exactly where it stopped:
    its own AdamW moments (DeepSpeed keeps replica 0's only), the SparseLoCo error buffers and
    theta at the last sync, T_perp, the LR schedule, step counters, the data position and, in
    elastic mode, the transport's state (torchft's step counter and the fleet's history)."""
    return {
        "local_steps": engine.local_steps,
        "data_position": data_position,
        "optimizer": engine.optimizer.state_dict(),
        "lr_scheduler": engine.lr_scheduler.state_dict() if engine.lr_scheduler is not None else None,
        "algorithm": engine.algorithm.state_dict(),
        "meter": engine.meter.snapshot(),
        "client_state": getattr(engine, "client_state", {}),
        # elastic mode: the transport's committed-step counter and history (static: nothing)
        "transport": engine.transport.state_dict(),
    }


def restore_rank_state(engine, state: dict) -> int:
    """Inverse of `collect_rank_state` on a freshly built engine; returns the data position."""
    engine.optimizer.load_state_dict(state["optimizer"])
    if engine.lr_scheduler is not None and state["lr_scheduler"] is not None:
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


def _partial(tag: str) -> str:
    return f".{tag}.partial"


def device_of(path: str) -> str:
    """'SOURCE (mounted at MOUNTPOINT)' of the file system holding `path`, for error lines."""
    probe = os.path.abspath(path)
    while not os.path.exists(probe) and os.path.dirname(probe) != probe:
        probe = os.path.dirname(probe)
    probe = os.path.realpath(probe)
    best = ("", "?")
    try:
        with open("/proc/self/mounts") as f:
            for line in f:
                source, mount = line.split()[:2]
                mount = mount.replace("\\040", " ")
                inside = probe == mount or probe.startswith(mount.rstrip("/") + "/")
                if inside and len(mount) >= len(best[0]):
                    best = (mount, source)
    except OSError:
        return f"the device holding {probe}"
    return f"{best[1]} (mounted at {best[0]})"


def describe_os_error(err: BaseException, path: str) -> str:
    """One line for a failed write; a full disk is named as such, with its device."""
    e, seen = err, 0
    # torch's writers raise their own errors: the zip writer over the OSError, the legacy one
    # with the C library's message ("write(): fd 12 failed with No space left on device").
    while e is not None and seen < 8:
        if (isinstance(e, OSError) and e.errno == errno.ENOSPC) or os.strerror(errno.ENOSPC) in str(e):
            return f"no space left on {device_of(path)} while writing {path}"
        e, seen = e.__cause__ or e.__context__, seen + 1
    return f"writing {path} failed: {err}"


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_durably(path: str, write) -> int:
    """`write(f)` into a new file at `path`, flushed and fsynced; returns its size. Writing through
    a Python file object makes a full disk an OSError(ENOSPC) rather than a zip-writer message."""
    with open(path, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())
        return f.tell()


def replace_text(path: str, text: str) -> None:
    """Atomically replace a small text file: temp name, fsync, rename, fsync the directory."""
    tmp = f"{path}.tmp-{os.getpid()}"
    write_durably(tmp, lambda f: f.write(text.encode()))
    os.replace(tmp, path)
    _fsync_dir(os.path.dirname(os.path.abspath(path)))


@contextlib.contextmanager
def _deepspeed_writes(engine, written: dict[str, int], errors: list[str]):
    """Route DeepSpeed's checkpoint writes through `write_durably`, recording each file.

    A failed write is recorded, not raised: DeepSpeed's save is itself a collective (barriers),
    and a rank leaving it early would leave the others waiting in it."""
    ce = engine.checkpoint_engine
    original = ce.save
    zipfile = getattr(ce, "zipfile_serialization", True)
    plain_torch = type(ce).__name__ == "TorchCheckpointEngine"

    def save(state_dict, path):
        if errors:
            return
        try:
            if plain_torch:
                written[path] = write_durably(
                    path, lambda f: torch.save(state_dict, f, _use_new_zipfile_serialization=zipfile))
            else:  # another engine writes its own way; we only make it durable
                original(state_dict, path)
                fd = os.open(path, os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
                written[path] = os.path.getsize(path)
        except (OSError, RuntimeError) as err:
            errors.append(describe_os_error(err, path))

    ce.save = save
    try:
        yield
    finally:
        del ce.save


@contextlib.contextmanager
def _deepspeed_reads(engine):
    """Name the file when DeepSpeed's load of a checkpoint file fails."""
    ce = engine.checkpoint_engine
    original = ce.load

    def load(path, map_location=None):
        try:
            return original(path, map_location=map_location)
        except Exception as err:  # noqa: BLE001 - pickle, zip and torch errors alike
            raise CheckpointError(f"checkpoint file {path} is corrupt: {_first_line(err)}") from err

    ce.load = load
    try:
        yield
    finally:
        del ce.load


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


# ------------------------------------------------------------------------------------ save


def save(engine, ckpt_dir: str, step: int, data_position: int, keep: int = 0) -> str:
    """Collective over all ranks; call at an outer-step boundary. Returns the committed tag.

    `keep` > 0 deletes committed checkpoints older than the newest `keep` once this one is."""
    tag = tag_for(step)
    partial = os.path.join(ckpt_dir, _partial(tag))
    rank, world = dist.get_rank(), dist.get_world_size()
    if rank == 0:
        os.makedirs(ckpt_dir, exist_ok=True)
        shutil.rmtree(partial, ignore_errors=True)  # a save of this step that was killed
        os.makedirs(partial)
    dist.barrier()

    written: dict[str, int] = {}
    errors: list[str] = []
    state_path = os.path.join(partial, STATE_FILE.format(rank=rank))
    state = collect_rank_state(engine, data_position)
    state.update(world_size=world, stages=engine.num_stages, replica=engine.replica, stage=engine.stage_id)
    try:
        written[state_path] = write_durably(state_path, lambda f: torch.save(state, f))
    except (OSError, RuntimeError) as err:
        errors.append(describe_os_error(err, state_path))
    with _deepspeed_writes(engine, written, errors):
        engine.ds_save_checkpoint(ckpt_dir, tag=_partial(tag), save_latest=False)

    # Every rank reaches this gather whatever happened above: all confirm, or nobody commits.
    outcomes: list = [None] * world
    dist.all_gather_object(outcomes, {"files": {os.path.basename(p): n for p, n in written.items()},
                                      "error": errors[0] if errors else None})
    failed = [(r, o["error"]) for r, o in enumerate(outcomes) if o["error"] is not None]
    if failed:
        if rank == 0:
            shutil.rmtree(partial, ignore_errors=True)  # frees the space a full disk needs back
        first_rank, message = failed[0]
        raise CheckpointError(f"rank {first_rank}: {message}; checkpoint {tag} was not committed",
                              report=rank == first_rank)

    result = [None]
    if rank == 0:
        files: dict[str, int] = {}
        for o in outcomes:
            files.update(o["files"])
        try:
            _commit(ckpt_dir, tag, step, files, world, engine.num_stages, keep)
        except (OSError, RuntimeError) as err:
            result[0] = describe_os_error(err, os.path.join(ckpt_dir, tag))
    dist.broadcast_object_list(result, src=0)
    if result[0] is not None:
        raise CheckpointError(f"rank 0: {result[0]}; checkpoint {tag} was not committed", report=rank == 0)
    return tag


def _commit(ckpt_dir: str, tag: str, step: int, files: dict[str, int], world: int, stages: int, keep: int) -> None:
    """Rank 0, after every rank confirmed: manifest, one rename, then `latest`."""
    partial, final = os.path.join(ckpt_dir, _partial(tag)), os.path.join(ckpt_dir, tag)
    for name, size in files.items():  # what each rank reported is what the directory holds
        found = os.path.getsize(os.path.join(partial, name))
        if found != size:
            raise RuntimeError(f"{name} has {found} bytes after its rank wrote {size}")
    manifest = {"format": 1, "tag": tag, "step": step, "world_size": world, "stages": stages,
                "files": dict(sorted(files.items()))}
    write_durably(os.path.join(partial, MANIFEST), lambda f: f.write(json.dumps(manifest, indent=1).encode()))
    _fsync_dir(partial)
    stale = None
    if os.path.exists(final):  # from a run that went further before a resume went back in time
        stale = os.path.join(ckpt_dir, f".{tag}.replaced")
        shutil.rmtree(stale, ignore_errors=True)
        os.rename(final, stale)
    os.rename(partial, final)
    _fsync_dir(ckpt_dir)
    replace_text(os.path.join(ckpt_dir, LATEST), tag)
    if stale is not None:
        shutil.rmtree(stale, ignore_errors=True)
    _rotate(ckpt_dir, step, keep)


def _rotate(ckpt_dir: str, committed: int, keep: int) -> None:
    """Delete committed checkpoints older than the newest `keep` (up to `committed`) and the
    leftovers of killed saves."""
    for name in os.listdir(ckpt_dir):
        if name.startswith(".global_step") and name.endswith((".partial", ".replaced", ".deleting")):
            if name != _partial(tag_for(committed)):
                shutil.rmtree(os.path.join(ckpt_dir, name), ignore_errors=True)
    if keep <= 0:
        return
    older = sorted((s for s in map(step_of, os.listdir(ckpt_dir)) if s is not None and s <= committed), reverse=True)
    for s in older[keep:]:
        doomed = os.path.join(ckpt_dir, f".{tag_for(s)}.deleting")
        os.rename(os.path.join(ckpt_dir, tag_for(s)), doomed)  # never a half-deleted global_stepN
        shutil.rmtree(doomed, ignore_errors=True)


# ------------------------------------------------------------------------------ verify, pick


def latest_tag(ckpt_dir: str) -> str | None:
    path = os.path.join(ckpt_dir, LATEST)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return f.read().strip() or None


def verify(ckpt_dir: str, tag: str, world_size: int | None = None) -> str | None:
    """None if `ckpt_dir/tag` is a complete checkpoint (of `world_size` ranks, if given), else why not."""
    path = os.path.join(ckpt_dir, tag)
    if not os.path.isdir(path):
        return f"{path} does not exist"
    try:
        with open(os.path.join(path, MANIFEST)) as f:
            manifest = json.load(f)
        files = manifest["files"]
    except FileNotFoundError:
        return f"{path} has no {MANIFEST} (it was never committed)"
    except (ValueError, KeyError, TypeError) as err:
        return f"{os.path.join(path, MANIFEST)} is corrupt: {_first_line(err)}"
    for name, size in files.items():
        file = os.path.join(path, name)
        if not os.path.isfile(file):
            return f"{file} is missing"
        if os.path.getsize(file) != size:
            return f"{file} has {os.path.getsize(file)} bytes, its manifest says {size}"
    if world_size is not None and manifest.get("world_size") != world_size:
        return f"{path} was written by {manifest.get('world_size')} ranks, this run has {world_size}"
    return None


@dataclasses.dataclass(frozen=True)
class Pick:
    tag: str
    step: int
    note: str | None
    """A line for the user when the pick is not what `latest` names."""


def pick(ckpt_dir: str, world_size: int | None = None) -> Pick:
    """The newest complete checkpoint in `ckpt_dir`; CheckpointError when there is none."""
    latest = latest_tag(ckpt_dir)
    names = os.listdir(ckpt_dir) if os.path.isdir(ckpt_dir) else []
    candidates = sorted(((step_of(n), n) for n in names if step_of(n) is not None), reverse=True)
    reasons: dict[str, str] = {}
    for step, tag in candidates:
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


def load(engine, ckpt_dir: str, tag: str | None = None) -> int:
    """Restore everything `save` wrote under `tag` (default: `pick`'s); returns the data position."""
    if tag is None:
        tag = pick(ckpt_dir, dist.get_world_size()).tag
    path = os.path.join(ckpt_dir, tag, STATE_FILE.format(rank=dist.get_rank()))
    if not os.path.exists(path):
        raise CheckpointError(f"{path} is missing: the checkpoint was written by a different world size")
    try:
        state = torch.load(path, map_location=engine.device, weights_only=False)
    except Exception as err:  # noqa: BLE001 - pickle, zip and torch errors alike
        raise CheckpointError(f"checkpoint file {path} is corrupt: {_first_line(err)}") from err
    if state["world_size"] != dist.get_world_size() or state["stages"] != engine.num_stages:
        raise CheckpointError(
            f"checkpoint {ckpt_dir}/{tag} was written by {state['world_size']} ranks in {state['stages']} stages; "
            f"this run has {dist.get_world_size()} ranks in {engine.num_stages} stages"
        )
    with _deepspeed_reads(engine):
        engine.ds_load_checkpoint(ckpt_dir, tag=tag, load_module_only=True, load_optimizer_states=False,
                                  load_lr_scheduler_states=False)
    return restore_rank_state(engine, state)
