"""Reading back a torch file without running anything it names, and what such a file may hold.

A torch file is a pickle, and unpickling calls whatever functions the pickle names: a checkpoint
downloaded to continue or fine-tune from, or one swapped in beside a manifest whose checksums are
its own, could run any command. Every torch file hetloco_ds reads (checkpoints' rank state and
layer files, a simulator row's saved state, the token cache) goes through `load`, that is
torch's `weights_only=True` unpickler: it builds tensors and plain data (dicts, lists, tuples,
strings, numbers, bytes) and refuses anything else before calling it. Metadata is JSON.

So what we write must be plain data: `plain_data_problem` finds what is not, before a file that
could not be read back is written (a user's `client_state` holding a numpy scalar, say).
Written against torch 2.11 (the GPU machines) and 2.13: `weights_only` and `mmap` are older.
"""
from __future__ import annotations

import collections
import pickle
import re

import torch


class UnreadableFile(ValueError):
    """A torch file that `load` refuses (it names something other than tensors and plain data) or
    cannot parse; the message is one line naming the file."""


_GLOBAL = re.compile(r"Unsupported global: GLOBAL (\S+)")


def _why(err: BaseException) -> tuple[bool, str]:
    """(refused, one line): whether the weights-only unpickler refused the file, and why."""
    text = str(err)
    found = _GLOBAL.search(text)
    if found:
        return True, f"loading it would call {found.group(1)}"
    if isinstance(err, pickle.UnpicklingError) and "WeightsUnpickler error:" in text:
        detail = next((line.strip() for line in text.split("WeightsUnpickler error:", 1)[1].splitlines()
                       if line.strip()), "")
        return True, f"it holds more than tensors and plain data ({detail})"
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return False, lines[0] if lines else type(err).__name__


def load(path, map_location="cpu", *, mmap: bool = True, what: str = "file"):
    """`torch.load(path, weights_only=True)`: tensors and plain data, nothing called. Raises
    UnreadableFile ("WHAT PATH is refused: ..." or "... is corrupt: ...") for a file that is not
    that; FileNotFoundError as it is."""
    try:
        return torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
    except FileNotFoundError:
        raise
    except Exception as err:  # noqa: BLE001 - unpickling, zip and torch errors alike
        refused, why = _why(err)
        if refused:
            raise UnreadableFile(f"{what} {path} is refused: {why}; only tensors and plain data are read from a "
                                 "file, and nothing in this one was run") from err
        raise UnreadableFile(f"{what} {path} is corrupt: {why}") from err


_LEAVES = (str, bytes, int, float, complex, bool, type(None), torch.dtype, torch.device, torch.Size)
_TENSORS = (torch.Tensor, torch.nn.Parameter)
_CONTAINERS = (dict, collections.OrderedDict, list, tuple, set)


def plain_data_problem(obj, where: str = "") -> str | None:
    """None if `obj` is tensors and plain data, which `load` reads back; else "WHERE is a TYPE"
    for the first part that is not (`where` the path to it, e.g. "['client_state']['best']").
    Exact types: a numpy float is a float subclass, and is pickled as numpy's."""
    kind = type(obj)
    if kind in _LEAVES or kind in _TENSORS:
        return None
    if kind not in _CONTAINERS:
        return f"{where or 'it'} is a {kind.__module__}.{kind.__qualname__}"
    if isinstance(obj, dict):
        for key, value in obj.items():
            problem = plain_data_problem(key, f"{where} key {key!r}") or plain_data_problem(value, f"{where}[{key!r}]")
            if problem:
                return problem
        return None
    for i, value in enumerate(obj):
        problem = plain_data_problem(value, f"{where}[{i}]")
        if problem:
            return problem
    return None
