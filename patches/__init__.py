"""The one adapter between hetloco_ds and DeepSpeed's internals (installed as `hetloco_ds.patches`).

Every private DeepSpeed name hetloco_ds overrides, calls or reads is used in this package and
nowhere else, and is listed in `REQUIRED` (classes and functions, checked at import) or
`INSTANCE_ATTRIBUTES` (attributes DeepSpeed sets in `__init__`, checked on the first engine and
module). A DeepSpeed release that renames one, or changes the parameters of a method we
override, fails here with one error naming the name and both versions, instead of silently
skipping our override (a subclass method whose base method was renamed is never called).

    checks.py   REQUIRED, INSTANCE_ATTRIBUTES and the checks over them (`check` runs at import)
    engine.py   PipelineEngineAdapter: DeepSpeed's private pipeline instructions turned into
                named hooks (send/recv activations and gradients, tied and data-parallel
                gradient reduction, the optimizer step, the loss, the training schedule) that
                hetloco_ds.engine implements; a subclass's own instructions join the map
    module.py   PipelineModuleAdapter: the layer build and the stage partition as hooks; the
                stage's layers and their load from a checkpoint through the caller's reader (not
                DeepSpeed's checkpoint engine, which unpickles with weights_only=False);
                DeepSpeed's per-layer seeding and checkpoint file names
    comm.py     the CPU shared-memory op DeepSpeed would JIT-build at process-group creation
    logs.py     DeepSpeed's log lines a user cannot act on, each dropped exactly and explained
                (the filter goes on DeepSpeed's logger when this package is imported)
"""
from __future__ import annotations

from .checks import CHECKED_AGAINST, INSTANCE_ATTRIBUTES, REQUIRED, DeepSpeedMismatch, check, check_instance

check()

from . import comm  # noqa: E402  (after the check: the modules subclass what it verified)
from . import logs  # noqa: E402
from .engine import PipelineEngineAdapter  # noqa: E402
from .module import PipelineModuleAdapter, layer_checkpoint_name, seed_layer  # noqa: E402

# At import, not in apply_all: the simulator and the public API build DeepSpeed schedulers too.
logs.quiet_scheduler_start()

__all__ = ["CHECKED_AGAINST", "DeepSpeedMismatch", "INSTANCE_ATTRIBUTES", "REQUIRED", "PipelineEngineAdapter", "PipelineModuleAdapter",
           "apply_all", "check", "check_instance", "layer_checkpoint_name", "seed_layer"]


def apply_all() -> None:
    """Process-wide changes, once per process before DeepSpeed creates process groups."""
    comm.skip_shm_build()
