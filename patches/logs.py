"""DeepSpeed's log lines that say nothing a user can act on, each dropped exactly, and why.

"Attempting to get learning rate from scheduler before it has started" (WARNING): DeepSpeed's
`WarmupLR` (so `WarmupDecayLR`) and `WarmupCosineLR` set the optimizer's learning rate to the
schedule's starting value in their own `__init__`, by calling their own `get_lr()` while
`last_batch_iteration` is still -1; `get_lr()` logs this warning whenever it sees -1 and returns
exactly the starting value (`warmup_min_lr`, or 0.0 for the cosine schedule) the constructor
wants. So every scheduler DeepSpeed's engine builds from the config (once per rank) and every one
the simulator builds logs it, and nothing is wrong. `SchedulerStartFilter` drops the message only
when the `get_lr` that logs it was called by that scheduler's own constructor; anyone else asking
a scheduler for its learning rate before its first step (a real mistake) still sees it, as does
every other message of DeepSpeed's logger (e.g. "total_num_steps 10 is less than
warmup_num_steps 20").
"""
from __future__ import annotations

import logging
import sys

from deepspeed.runtime import lr_schedules
from deepspeed.utils import logger as ds_logger

SCHEDULER_START = "Attempting to get learning rate from scheduler before it has started"
"""The message, as DeepSpeed's lr_schedules logs it."""

_WARNS_AT_START = (lr_schedules.WarmupLR, lr_schedules.WarmupCosineLR)
"""The schedulers whose constructor calls `get_lr()` at iteration -1 (`WarmupDecayLR` is a `WarmupLR`)."""


class SchedulerStartFilter(logging.Filter):
    """Drops SCHEDULER_START when a scheduler's own `__init__` called the `get_lr` that logs it."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.getMessage() != SCHEDULER_START:
            return True
        frame = sys._getframe(1)
        while frame is not None and frame.f_code.co_name != "get_lr":
            frame = frame.f_back
        if frame is None:
            return True
        scheduler, caller = frame.f_locals.get("self"), frame.f_back
        from_constructor = (caller is not None and caller.f_code.co_name == "__init__"
                            and caller.f_locals.get("self") is scheduler)
        return not (isinstance(scheduler, _WARNS_AT_START) and from_constructor)


def quiet_scheduler_start(logger: logging.Logger = ds_logger) -> None:
    """Put SchedulerStartFilter on DeepSpeed's logger (once, however often called)."""
    if not any(isinstance(f, SchedulerStartFilter) for f in logger.filters):
        logger.addFilter(SchedulerStartFilter())
