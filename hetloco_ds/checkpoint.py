"""Checkpoints at outer-step boundaries: each tensor stored once, written in the background,
committed atomically across all ranks.

OUT/checkpoints holds:

    global_step<N>/              a committed checkpoint (or a user's tag: engine.save_checkpoint(tag=...)):
        layer_XX-model_states.pt     the stage layers in DeepSpeed's layout (replica 0's ranks), T_perp
                                     inside layer 0 (the embedding's buffer): what export reads
        hetloco_rank<r>.pt           rank r's own state (`collect_rank_state`)
        manifest.json                every file above with its size and crc32, the ranks' layout and
                                     the save's timings; written last
    .global_step<N>.partial/     a checkpoint being written: never read, removed by the next save
    latest                       tag of the newest commit (what `hetloco-ds export` reads)
    hf_meta/                     config and tokenizer (hf_export.save_hf_meta)

What is stored once: at an outer boundary every replica holds the synced weights and theta_prev
equals them, so the weights are replica 0's layer files and theta_prev is not stored; T_perp is
the same on every stage and replica and is in layer 0's file; the outer momentum is the same on
every replica, stored by the stage's replica-0 rank. Per rank: AdamW moments, error feedback,
counters, LR schedule, data position, meter, transport state. A save between boundaries (the
API's) adds the rank's own weights and theta_prev, which then differ.

`save` is a collective. Every rank copies its state to host memory (DCP's stager; the only part
training waits for) and a background thread writes its files into the `.partial` directory,
fsyncs them and takes their crc32; under `train.checkpoint_staging` "none" (or "auto" on a host
that cannot hold the copy, `pick_staging`) the rank writes its live tensors itself, torch.save
taking each to the host in turn, and training waits for the write. The commit waits until every rank's background write ended:
at the next save, at an outer boundary where all have (`settle`), or at the end of training
(`settle(block=True)`). The ranks then exchange what each wrote (or the error that stopped it),
so either all confirm or nobody commits; rank 0 writes the manifest, renames the directory to
its tag (one rename) and replaces `latest` (temp file, fsync, rename). A process killed at any
point, the background write included, leaves `latest` naming a complete checkpoint (or none).

Reading back (`verify`, `pick`, `load`) is `checkpoint_read.py`'s, re-exported here.
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import errno
import json
import os
import shutil
import time

import torch
from deepspeed import comm as dist

from . import safe_load
# The layout's names and the reading side, re-exported: callers and tests use checkpoint.pick, .load, ...
from .checkpoint_read import (FORMAT, LATEST, MANIFEST, RESERVED, STATE_FILE, CheckpointError, Pick,  # noqa: F401
                              check_readable, file_crc32, first_line, latest_tag, load, pick, restore_rank_state,
                              step_of, tag_for, verify)
from .patches import layer_checkpoint_name

def collect_rank_state(engine, data_position: int, *, writes_shared: bool, synced: bool) -> dict:
    """What this rank needs, beyond the layer files, to continue exactly where it stopped: its
    own AdamW moments, the SparseLoCo error buffers, the LR schedule, step counters, the data
    position and, in elastic mode, the transport's state (torchft's step counter and the
    fleet's history). The outer momentum only where `writes_shared`; theta_prev and the weights
    only when not `synced` (between boundaries they are this replica's own)."""
    algorithm = engine.algorithm.state_dict()
    outer = algorithm["outer"]
    if outer is not None:
        def strip(state: dict) -> dict:
            return {k: v for k, v in state.items()
                    if not (k == "theta_prev" and synced) and not (k == "momentum" and not writes_shared)}

        outer = {"blocks": [strip(b) for b in outer["blocks"]]} if "blocks" in outer else strip(outer)
    return {
        "local_steps": engine.local_steps,
        "data_position": data_position,
        "optimizer": engine.optimizer.state_dict(),
        "lr_scheduler": engine.lr_scheduler.state_dict() if engine.lr_scheduler is not None else None,
        "algorithm": {"outer": outer, "outer_steps": algorithm["outer_steps"]},
        "params": None if synced else [p.detach() for p in engine.algorithm.params],
        "meter": engine.meter.snapshot(),
        "client_state": getattr(engine, "client_state", {}),
        # elastic mode: the transport's committed-step counter and history (static: nothing)
        "transport": engine.transport.state_dict(),
    }


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


def _not_plain(name: str, obj) -> str | None:
    """Why file `name` holding `obj` could not be read back (`_read` builds tensors and plain data
    only), or None. Checked before writing, in the background write: no file is committed that a
    resume would refuse."""
    problem = safe_load.plain_data_problem(obj)
    if problem is None:
        return None
    hint = "; pass client_state as plain data (e.g. float(x), x.tolist())" if "['client_state']" in problem else ""
    return (f"{name} would not load back: its {problem}, and a checkpoint holds only tensors and plain data (dict, "
            f"list, tuple, str, int, float, bool, None, bytes){hint}")


def _write_files(directory: str, files: dict) -> dict:
    """The background half of a save: `files` ({name: staged object}) written durably into
    `directory`; {"files": {name: [bytes, crc32]}, "error": one line or None, "write_s"}. A
    failed write is returned, not raised: the commit's exchange tells every rank."""
    t0, done = time.perf_counter(), {}
    for name, obj in files.items():
        path = os.path.join(directory, name)
        problem = _not_plain(name, obj)
        if problem is not None:
            return {"files": done, "error": problem, "write_s": time.perf_counter() - t0}
        try:
            size = write_durably(path, lambda f, obj=obj: torch.save(obj, f))
            done[name] = [size, file_crc32(path)]
        except (OSError, RuntimeError) as err:
            return {"files": done, "error": describe_os_error(err, path), "write_s": time.perf_counter() - t0}
    return {"files": done, "error": None, "write_s": time.perf_counter() - t0}


@dataclasses.dataclass
class _Pending:
    """This rank's share of a save whose background write has not been committed yet."""

    ckpt_dir: str
    tag: str
    step: int
    keep: int
    layout: dict
    future: concurrent.futures.Future
    blocked_s: float
    started: float
    """time.time() when the save began (for the manifest's seconds to commit)."""
    first: bool
    """This process's first save: its staging allocated the host buffers."""
    staging_s: float
    """Of `blocked_s`, the stager's copy to host memory (with the first save's buffer allocation)."""
    waited_s: float = 0.0
    """Before `blocked_s`: training waiting for the previous save's write to end (saves closer
    together than a write takes)."""


STAGER = ("torch.distributed.checkpoint._state_dict_stager", "StateDictStager")
"""The private torch class `_Writer` copies through (see there), with the parameters it is called
with; written against torch 2.11 (the GPU machines) and 2.13 (CPU)."""
STAGER_PARAMETERS = {"__init__": ("pin_memory", "share_memory"), "stage": ("state_dict", "non_blocking")}


class TorchMismatch(ImportError):
    """A private torch name the checkpoint writer relies on is gone or has changed."""


def _stager_class():
    import importlib

    return getattr(importlib.import_module(STAGER[0]), STAGER[1])


def check_torch() -> None:
    """Raise TorchMismatch, naming the name and torch's version, unless `STAGER` exists with the
    parameters `_Writer` passes: checked before any rank starts, not at a run's first save."""
    import inspect

    where = f"torch {torch.__version__}: {'.'.join(STAGER)}"
    try:
        cls = _stager_class()
    except (ImportError, AttributeError):
        raise TorchMismatch(f"{where} is gone; hetloco_ds's checkpoints copy through it (written against torch "
                            f"2.11 and 2.13)") from None
    for method, wanted in STAGER_PARAMETERS.items():
        have = tuple(inspect.signature(getattr(cls, method, None) or (lambda: None)).parameters)
        missing = [p for p in wanted if p not in have]
        if missing:
            raise TorchMismatch(f"{where}.{method} lacks {', '.join(missing)} (has {', '.join(have) or 'nothing'}); "
                                f"hetloco_ds's checkpoints call it so (written against torch 2.11 and 2.13)")


class _Writer:
    """Per engine: the device-to-host copy (DCP's StateDictStager, into host buffers kept between
    saves, pinned on a GPU) and one background thread that writes the staged copy.

    The StateDictStager is used directly rather than through DefaultStager: torch 2.11's
    DefaultStager closes it after every copy, which frees the buffers (every save pays the first
    save's allocation again) and empties its type table, so that the next save fails on its first
    dict (KeyError: <class 'type'>; the second save of an 8B run on torch 2.11 did)."""

    def __init__(self, device, staging: str):
        self._stager = _stager_class()(pin_memory=torch.device(device).type == "cuda", share_memory=False)
        self.thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="hetloco-ckpt")
        self.staging = staging
        """`train.checkpoint_staging`; "auto" until the first save picks (`pick_staging`)."""
        self.pending: _Pending | None = None
        self.saves = 0
        self.commits: list[dict] = []
        """What each commit cost (`committed`), on every rank, until taken."""

    def stage(self, files: dict) -> dict:
        """`files` copied to host memory, tensors into the buffers of the previous save's same
        tensors; returns when the copy is complete (synchronous copies)."""
        return self._stager.stage(files, non_blocking=False)


def _storage_bytes(t: torch.Tensor) -> int:
    """Bytes of `t`'s storage; a wrapper subclass (torchao's 8-bit optimizer state) by its inner
    tensors, whose storages are what a copy copies (its own would count 4 bytes an element)."""
    if type(t) is not torch.Tensor and hasattr(t, "__tensor_flatten__"):
        names, _ = t.__tensor_flatten__()
        return sum(_storage_bytes(getattr(t, name)) for name in names)
    return t.untyped_storage().nbytes()


def host_bytes(files: dict) -> int:
    """Bytes of every tensor in `files`: what the stager's host copy of them takes."""
    from torch.utils._pytree import tree_flatten

    return sum(_storage_bytes(t) for t in tree_flatten(files)[0] if isinstance(t, torch.Tensor))


def mem_available() -> int | None:
    """Bytes of host memory the kernel says are available (MemAvailable), None where it does not say."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def pick_staging(setting: str, copy_bytes: int, local_ranks: int, available: int | None) -> str:
    """`train.checkpoint_staging` for this rank: "auto" is "host" where this host's available memory
    holds every local rank's copy (this rank's `copy_bytes` each) with a tenth to spare, else "none";
    a host whose memory cannot be read stages."""
    if setting != "auto":
        return setting
    return "host" if available is None or copy_bytes * local_ranks <= 0.9 * available else "none"


def committed(engine) -> list[dict]:
    """The commits since the last call, oldest first, the same on every rank: tag, step, bytes on
    disk, whether it was this process's first save (DCP's stager then allocates its host buffers,
    pinned on a GPU, which later saves reuse) and the manifest's seconds (`_commit`)."""
    writer = getattr(engine, "_checkpoint_writer", None)
    if writer is None:
        return []
    out, writer.commits = writer.commits, []
    return out


def _writer(engine) -> _Writer:
    if getattr(engine, "_checkpoint_writer", None) is None:
        engine._checkpoint_writer = _Writer(engine.device, engine.run.hetloco.train.checkpoint_staging)
    return engine._checkpoint_writer


def check_tag(tag: str) -> None:
    """A user's tag must be one plain directory name beside the others."""
    if not isinstance(tag, str) or not tag or tag in RESERVED or tag.startswith(".") or os.sep in tag \
            or (os.altsep and os.altsep in tag):
        raise ValueError(f"checkpoint tag {tag!r} is not a plain directory name (no '/', no leading '.', "
                         f"not {' or '.join(sorted(RESERVED))})")


def save(engine, ckpt_dir: str, step: int, data_position: int, keep: int = 0, *, tag: str | None = None,
         wait: bool = True) -> str:
    """Collective over all ranks; call at an outer-step boundary. Returns the tag (default
    global_step<step>), committed on return when `wait`, else once `settle` commits it.

    Commits the previous save first (its background write is waited for). `keep` > 0 deletes
    committed global_step checkpoints older than the newest `keep` once this one is."""
    tag = tag_for(step) if tag is None else tag
    check_tag(tag)
    t_wait = time.perf_counter()
    settle(engine, block=True)
    waited = time.perf_counter() - t_wait
    partial = os.path.join(ckpt_dir, _partial(tag))
    rank = dist.get_rank()
    if rank == 0:
        os.makedirs(ckpt_dir, exist_ok=True)
        shutil.rmtree(partial, ignore_errors=True)  # a save of this step that was killed
        os.makedirs(partial)
    dist.barrier()

    started, t0 = time.time(), time.perf_counter()
    writer = _writer(engine)
    # Replica 0's ranks write what every replica holds alike (stage layers, outer momentum). With
    # replicas of their own depths no other rank holds a replica-0 rank's blocks: each keeps its momentum.
    writes_shared = engine.module.replica_id == 0
    synced = engine.algorithm.at_sync()  # per rank: at a boundary theta_prev is not stored again
    state = collect_rank_state(engine, data_position, synced=synced,
                               writes_shared=writes_shared or engine.replica_stages is not None)
    state.update(world_size=dist.get_world_size(), stages=engine.num_stages, replica=engine.replica,
                 stage=engine.stage_id)
    files = {STATE_FILE.format(rank=rank): state}
    if writes_shared:
        files.update({layer_checkpoint_name(i): m.state_dict() for i, m in engine.module.checkpoint_layers().items()})
    if writer.staging == "auto":
        copy = host_bytes(files)
        writer.staging = pick_staging("auto", copy, int(os.environ.get("LOCAL_WORLD_SIZE", 1)), mem_available())
        if writer.staging == "none":
            print(f"hetloco checkpoint: rank {rank}: this host's available memory holds no second copy of its "
                  f"ranks' state ({copy / 1e9:.1f} GB a rank), so each save writes the live tensors and training "
                  f"waits for the write (hetloco.train.checkpoint_staging)", flush=True)
    t_stage = time.perf_counter()
    if writer.staging == "host":
        staged = writer.stage(files)  # the device-to-host copy: all that training waits for
        future = writer.thread.submit(_write_files, partial, staged)
    else:  # the write itself, from the live tensors (torch.save takes each to the host in turn)
        future = concurrent.futures.Future()
        future.set_result(_write_files(partial, files))
    blocked = time.perf_counter() - t0
    staging = time.perf_counter() - t_stage
    layout = {"stage": engine.stage_id, "data": engine.module.replica_id}
    writer.saves += 1
    writer.pending = _Pending(ckpt_dir, tag, step, keep, layout, future, blocked, started, writer.saves == 1, staging,
                              waited)
    if wait:
        settle(engine, block=True)
    return tag


def settle(engine, block: bool = False) -> str | None:
    """Collective: commit the pending save once every rank's background write has ended
    (`block`: wait for them); returns the tag committed, or None (nothing pending, or not all
    done). Raises CheckpointError, with nothing committed, when any rank's write failed."""
    writer = getattr(engine, "_checkpoint_writer", None)
    pending = writer.pending if writer is not None else None
    if pending is None:  # every rank saves together, so every rank agrees
        return None
    if not block:
        done = torch.tensor([1 if pending.future.done() else 0], dtype=torch.int32, device=engine.device)
        dist.all_reduce(done, op=dist.ReduceOp.MIN)
        if not int(done.item()):
            return None
    writer.pending = None
    try:
        outcome = pending.future.result()
    except Exception as err:  # noqa: BLE001 - the writer thread's own failure, reported like a write's
        outcome = {"files": {}, "error": f"writing {pending.tag} failed: {first_line(err)}", "write_s": 0.0}
    outcome.update(blocked_s=pending.blocked_s, staging_s=pending.staging_s, waited_s=pending.waited_s,
                   layout=pending.layout)
    tag, rank, world = pending.tag, dist.get_rank(), dist.get_world_size()
    partial = os.path.join(pending.ckpt_dir, _partial(tag))
    # Every rank reaches this gather whatever happened above: all confirm, or nobody commits.
    outcomes: list = [None] * world
    dist.all_gather_object(outcomes, outcome)
    failed = [(r, o["error"]) for r, o in enumerate(outcomes) if o["error"] is not None]
    if failed:
        if rank == 0:
            shutil.rmtree(partial, ignore_errors=True)  # frees the space a full disk needs back
        first_rank, message = failed[0]
        raise CheckpointError(f"rank {first_rank}: {message}; checkpoint {tag} was not committed",
                              report=rank == first_rank)

    result: list = [None, None]
    if rank == 0:
        try:
            seconds = _commit(pending, outcomes, engine.num_stages)
            result[1] = {"tag": tag, "step": pending.step, "first_save": pending.first,
                         "bytes": sum(f["bytes"] for f in _files(outcomes).values()), "seconds": seconds}
        except (OSError, RuntimeError) as err:
            result[0] = describe_os_error(err, os.path.join(pending.ckpt_dir, tag))
    dist.broadcast_object_list(result, src=0)
    if result[0] is not None:
        raise CheckpointError(f"rank 0: {result[0]}; checkpoint {tag} was not committed", report=rank == 0)
    writer.commits.append(result[1])
    return tag


def _files(outcomes: list[dict]) -> dict[str, dict]:
    files: dict[str, dict] = {}
    for o in outcomes:
        files.update({name: {"bytes": size, "crc32": crc} for name, (size, crc) in o["files"].items()})
    return files


def _commit(pending: _Pending, outcomes: list[dict], stages: int) -> dict:
    """Rank 0, after every rank confirmed: manifest, one rename, then `latest`; the manifest's seconds."""
    ckpt_dir, tag = pending.ckpt_dir, pending.tag
    partial, final = os.path.join(ckpt_dir, _partial(tag)), os.path.join(ckpt_dir, tag)
    files = _files(outcomes)
    for name, entry in files.items():  # what each rank reported is what the directory holds
        found = os.path.getsize(os.path.join(partial, name))
        if found != entry["bytes"]:
            raise RuntimeError(f"{name} has {found} bytes after its rank wrote {entry['bytes']}")
    # blocked: the longest a rank's training waited (state collected, copied to host memory);
    # staging: the longest copy to host memory alone (DCP's stager; the first save allocates);
    # waited_for_previous: before that, the longest wait for the previous save's write; written:
    # the longest background write; to_commit: from the save's start to this commit
    # (it waits for the first outer boundary at which every rank's write had ended).
    manifest = {"format": FORMAT, "tag": tag, "step": pending.step, "world_size": len(outcomes), "stages": stages,
                "ranks": [o["layout"] for o in outcomes], "files": dict(sorted(files.items())),
                "seconds": {"blocked": max(o["blocked_s"] for o in outcomes),
                            "staging": max(o["staging_s"] for o in outcomes),
                            "waited_for_previous": max(o["waited_s"] for o in outcomes),
                            "written": max(o["write_s"] for o in outcomes),
                            "to_commit": time.time() - pending.started}}
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
    _rotate(ckpt_dir, pending.step, pending.keep)
    return manifest["seconds"]


def _rotate(ckpt_dir: str, committed: int, keep: int) -> None:
    """Delete committed checkpoints older than the newest `keep` (up to `committed`), the
    leftovers of killed saves and the temp files of killed `latest` writers."""
    for name in os.listdir(ckpt_dir):
        if name.startswith(".") and name.endswith((".partial", ".replaced", ".deleting")):
            shutil.rmtree(os.path.join(ckpt_dir, name), ignore_errors=True)
        elif name.startswith(f"{LATEST}.tmp-"):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(ckpt_dir, name))
    if keep <= 0:
        return
    older = sorted((s for s in map(step_of, os.listdir(ckpt_dir)) if s is not None and s <= committed), reverse=True)
    for s in older[keep:]:
        doomed = os.path.join(ckpt_dir, f".{tag_for(s)}.deleting")
        os.rename(os.path.join(ckpt_dir, tag_for(s)), doomed)  # never a half-deleted global_stepN
        shutil.rmtree(doomed, ignore_errors=True)


# ------------------------------------------------------------------------------ verify, pick
