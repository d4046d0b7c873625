"""DeepSpeed's own keys of a run's JSON, checked before any rank starts: every top-level key one
DeepSpeed's parser reads, the inner AdamW's settings from its `optimizer` section, its LR
`scheduler` by name and signature; the one error every part of the configuration raises, and
pydantic's errors as one line (`config.py` types and validates the `hetloco` section).
"""
from __future__ import annotations

import collections.abc
import difflib
import json
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError


class ConfigError(ValueError):
    """A configuration that cannot run; the message names the bad value and where it came from."""



@dataclass(frozen=True)
class OptimizerSettings:
    """The inner AdamW, from DeepSpeed's `optimizer` section (the paper's defaults otherwise)."""

    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.1


_QUOTED = {"int_type": "written without quotes", "float_type": "written without quotes",
           "bool_type": "true or false, without quotes"}
"""Strict types refuse a string that lax parsing would have read: say how to write the value."""


def _dotted(prefix: str, loc: tuple) -> str:
    """`loc` as the key a user wrote: `a.b[0]`; a union member's or a dict key's tag, which pydantic
    appends to the field's location, is not part of it."""
    where = prefix
    for part in loc:
        if isinstance(part, int):
            where += f"[{part}]"
        elif part.isidentifier():
            where = f"{where}.{part}" if where else part
        else:
            break
    return where


def format_pydantic(err: ValidationError, source: str, prefix: str = "hetloco") -> str:
    """All of pydantic's errors as one line, each naming the dotted key, the value and the file."""
    parts = []
    for e in err.errors():
        loc = [str(p) for p in e["loc"]]
        where = _dotted(prefix, e["loc"])
        if e["type"] == "extra_forbidden":
            parts.append(f"unknown key '{where}'")
        elif e["type"] == "value_error":
            msg = str(e["ctx"]["error"])
            field = msg.split(" ", 1)[0].split("[", 1)[0]
            if loc and field == loc[-1]:  # "replica_ratios[1] = 0 ..." under ...replica_ratios
                where = where.rsplit(".", 1)[0]
            parts.append(f"{where}.{msg}" if " = " in msg.split(",")[0] else f"{where}: {msg}")
        else:
            hint = f" ({_QUOTED[e['type']]})" if e["type"] in _QUOTED and isinstance(e.get("input"), str) else ""
            part = f"{where} = {e.get('input')!r}: {e['msg']}{hint}"
            if part not in parts:
                parts.append(part)
    return f"{source}: " + "; ".join(parts)


class _RecordingDict(dict):
    """A dict that records every key looked up in it, however DeepSpeed's parser asks."""

    def __init__(self, data, seen: list[str]):
        super().__init__(data)
        self.seen = seen

    def _note(self, key):
        self.seen.append(key)

    def get(self, key, *default):
        self._note(key)
        return super().get(key, *default)

    def __getitem__(self, key):
        self._note(key)
        return super().__getitem__(key)

    def __contains__(self, key):
        self._note(key)
        return super().__contains__(key)

    def keys(self):
        return _RecordingKeys(self)

    def __copy__(self):
        return _RecordingDict(self, self.seen)


class _RecordingKeys(collections.abc.KeysView):
    def __contains__(self, key):
        self._mapping._note(key)
        return dict.__contains__(self._mapping, key)

    def __iter__(self):
        return dict.__iter__(self._mapping)


def check_deepspeed_section(ds: dict[str, Any], source: str) -> None:
    """DeepSpeed's own parser (`DeepSpeedConfig`) over the user's DeepSpeed keys, once, here.

    DeepSpeed ignores a top-level key it does not read, so a misspelt one silently changes the
    run. Its parser is the authority on which keys exist: every top-level key it looks up while
    parsing this very dict is known (its typed sections, `DeepSpeedConfigModel` with
    extra="forbid", reject unknown keys inside them by themselves). Any other key is an error.
    """
    import logging

    import deepspeed
    from deepspeed.runtime.config import DeepSpeedConfig
    from deepspeed.utils import logger

    seen: list[str] = []
    # train_batch_size is never used (a replica's batch is micro x accumulation); DeepSpeed would
    # check it against a world size of 1 here.
    probe = {k: v for k, v in ds.items() if k != "train_batch_size"}
    level = logger.level
    logger.setLevel(logging.WARNING)
    try:
        DeepSpeedConfig(_RecordingDict(probe, seen))
    except ValidationError as err:
        section = next((k for k in reversed(seen) if k in probe), None)
        raise ConfigError(format_pydantic(err, source, prefix=section or "")) from None
    except Exception as err:  # noqa: BLE001 - DeepSpeed raises asserts, ValueError, its own errors
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ConfigError(f"{source}: DeepSpeed {deepspeed.__version__} rejects the config: {first}") from None
    finally:
        logger.setLevel(level)
    known = set(seen)
    for key in ds:
        if key not in known:
            near = difflib.get_close_matches(key, sorted(k for k in known if isinstance(k, str)), n=1)
            hint = f"; did you mean '{near[0]}'?" if near else ""
            raise ConfigError(f"{source}: unknown DeepSpeed key '{key}' (DeepSpeed {deepspeed.__version__} "
                              f"does not read it){hint}")


def optimizer_settings(section: dict | None, source: str) -> OptimizerSettings:
    if not section:
        return OptimizerSettings()
    kind = str(section.get("type", "AdamW"))
    if kind.lower() not in ("adamw", "adam"):
        raise ConfigError(f"{source}: optimizer.type = {kind!r}: the inner optimizer is AdamW (type \"AdamW\", or "
                          "DeepSpeed's \"Adam\", whose adam_w_mode is on by default)")
    p = dict(section.get("params") or {})
    unknown = set(p) - {"lr", "betas", "eps", "weight_decay", "torch_adam", "adam_w_mode"}
    if unknown:
        raise ConfigError(f"{source}: unknown key(s) {sorted(unknown)} in optimizer.params")
    if p.get("adam_w_mode") is False:  # DeepSpeed's Adam would then add weight decay to the gradient (L2)
        raise ConfigError(f"{source}: optimizer.params.adam_w_mode = false (Adam with L2 weight decay): the inner "
                          "optimizer is AdamW (decoupled weight decay); remove adam_w_mode")
    d = OptimizerSettings()

    def number(key: str, value):
        # As strict as the hetloco section: float("1e-3") would read a quoted number silently.
        if type(value) not in (int, float):
            quoted = ", written without quotes" if isinstance(value, str) else ""
            raise ConfigError(f"{source}: optimizer.params.{key} = {value!r} must be a number{quoted}")
        return float(value)

    betas = p.get("betas", list(d.betas))
    if not isinstance(betas, (list, tuple)):
        raise ConfigError(f"{source}: optimizer.params.betas = {betas!r} must be two numbers in [0, 1)")
    out = OptimizerSettings(lr=number("lr", p.get("lr", d.lr)),
                            betas=tuple(number(f"betas[{i}]", b) for i, b in enumerate(betas)),
                            eps=number("eps", p.get("eps", d.eps)),
                            weight_decay=number("weight_decay", p.get("weight_decay", d.weight_decay)))
    if not out.lr > 0:
        raise ConfigError(f"{source}: optimizer.params.lr = {out.lr} must be > 0")
    if len(out.betas) != 2 or not all(0 <= b < 1 for b in out.betas):
        raise ConfigError(f"{source}: optimizer.params.betas = {list(out.betas)} must be two numbers in [0, 1)")
    if out.eps <= 0 or out.weight_decay < 0:
        raise ConfigError(f"{source}: optimizer.params eps = {out.eps} must be > 0 and weight_decay = "
                          f"{out.weight_decay} >= 0")
    return out


def resolve_scheduler(section: dict | None, optimizer: OptimizerSettings) -> dict | None:
    """DeepSpeed's scheduler section with the "auto" values HF users write resolved."""
    if not section:
        return None
    section = json.loads(json.dumps(section))
    params = section.setdefault("params", {})
    if params.get("warmup_max_lr") == "auto":
        params["warmup_max_lr"] = optimizer.lr
    if params.get("warmup_min_lr") == "auto":
        params["warmup_min_lr"] = 0.0
    return section


WARMUP_TYPES = ("log", "linear")


def check_scheduler(section: dict | None, source: str) -> dict | None:
    """DeepSpeed builds the scheduler by name inside every rank, after the run directory is written;
    a misspelt name or parameter is caught here instead, against DeepSpeed's own list and the
    scheduler's signature, and the scheduler is built once on a throwaway optimizer so that its own
    value checks run too. Returns `section`."""
    if section is None:
        return None
    import inspect

    import deepspeed
    import torch
    from deepspeed.runtime import lr_schedules

    kind, params = section.get("type"), section.get("params") or {}
    valid = lr_schedules.VALID_LR_SCHEDULES
    unknown = set(section) - {"type", "params"}
    if unknown:
        raise ConfigError(f"{source}: unknown key(s) {sorted(unknown)} in scheduler (it holds type and params)")
    if kind not in valid:
        near = difflib.get_close_matches(str(kind), valid, n=1)
        hint = f"; did you mean {near[0]!r}?" if near else ""
        raise ConfigError(f"{source}: scheduler.type = {kind!r} is not a DeepSpeed {deepspeed.__version__} scheduler "
                          f"({', '.join(valid)}){hint}")
    accepted = {name: p for name, p in inspect.signature(getattr(lr_schedules, kind)).parameters.items()
                if name not in ("optimizer", "last_batch_iteration")}
    where = f"{source}: scheduler.params"
    for name, value in params.items():
        if name not in accepted:
            near = difflib.get_close_matches(name, accepted, n=1)
            hint = f"; did you mean '{near[0]}'?" if near else ""
            raise ConfigError(f"{where}.{name}: {kind} has no such parameter ({', '.join(accepted)}){hint}")
        if value == "auto":  # HF's Trainer fills these in; we resolve only the learning rates
            raise ConfigError(f'{where}.{name} = "auto": only warmup_min_lr and warmup_max_lr may be "auto" here; '
                              "give a number")
    missing = [n for n, p in accepted.items() if p.default is inspect.Parameter.empty and n not in params]
    if missing:
        raise ConfigError(f"{where}: {kind} needs {', '.join(missing)}")
    if "warmup_type" in accepted and params.get("warmup_type", "log") not in WARMUP_TYPES:
        # DeepSpeed would log a warning and warm up logarithmically.
        raise ConfigError(f"{where}.warmup_type = {params['warmup_type']!r}: one of {', '.join(WARMUP_TYPES)}")
    # The run's optimizer (AdamW: OneCycle would warn that SGD has no betas to cycle), and a probe
    # built as at its first step: at -1 DeepSpeed's warmup schedulers ask themselves for the
    # learning rate before any step and warn "before it has started". The constructor runs
    # every value check either way; only the initial learning rate it sets differs.
    probe = torch.optim.AdamW([torch.zeros(1, requires_grad=True)], lr=1e-3)
    try:
        getattr(lr_schedules, kind)(probe, last_batch_iteration=0, **params)
    except Exception as err:  # noqa: BLE001 - DeepSpeed's schedulers raise ValueError, TypeError, asserts
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ConfigError(f"{where}: DeepSpeed's {kind} rejects them: {first}") from None
    return section
