"""The one adapter between hetloco_ds and DeepSpeed's internals (installed as `hetloco_ds.patches`).

Every private DeepSpeed name hetloco_ds overrides, calls or reads is used in this package and
nowhere else, and is listed in `REQUIRED` (classes and functions, checked at import) or
`INSTANCE_ATTRIBUTES` (attributes DeepSpeed sets in `__init__`, checked on the first engine and
module). A DeepSpeed release that renames one, or changes the parameters of a method we
override, fails here with one error naming the name and both versions, instead of silently
skipping our override (a subclass method whose base method was renamed is never called).

    engine.py   PipelineEngineAdapter: DeepSpeed's private pipeline instructions turned into
                named hooks (send/recv activations and gradients, tied and data-parallel
                gradient reduction, the optimizer step, the loss, the training schedule) that
                hetloco_ds.engine implements; a subclass's own instructions join the map
    module.py   PipelineModuleAdapter: the layer build and the stage partition as hooks; the
                stage's layers; DeepSpeed's per-layer seeding and checkpoint file names
    comm.py     the CPU shared-memory op DeepSpeed would JIT-build at process-group creation
"""
from __future__ import annotations

import importlib
import inspect

import deepspeed

CHECKED_AGAINST = "0.19.8"
"""The DeepSpeed version every entry below was written and tested against."""


class DeepSpeedMismatch(ImportError):
    """A DeepSpeed internal hetloco_ds relies on is gone or has changed."""


# (module, attribute path, expected parameter names or None for a non-callable / any signature)
REQUIRED: tuple[tuple[str, str, tuple[str, ...] | None], ...] = (
    ("deepspeed.runtime.pipe.engine", "PipelineEngine._INSTRUCTION_MAP", None),
    ("deepspeed.runtime.pipe.engine", "PipelineEngine._exec_send_activations", ("self", "buffer_id")),
    ("deepspeed.runtime.pipe.engine", "PipelineEngine._exec_recv_activations", ("self", "buffer_id")),
    ("deepspeed.runtime.pipe.engine", "PipelineEngine._exec_send_grads", ("self", "buffer_id")),
    ("deepspeed.runtime.pipe.engine", "PipelineEngine._exec_recv_grads", ("self", "buffer_id")),
    ("deepspeed.runtime.pipe.engine", "PipelineEngine._exec_reduce_tied_grads", ("self",)),
    ("deepspeed.runtime.pipe.engine", "PipelineEngine._exec_reduce_grads", ("self",)),
    ("deepspeed.runtime.pipe.engine", "PipelineEngine._exec_optimizer_step", ("self", "lr_kwargs")),
    ("deepspeed.runtime.pipe.engine", "PipelineEngine._aggregate_total_loss", ("self",)),
    ("deepspeed.runtime.pipe.engine", "PipelineEngine._exec_schedule", ("self", "pipe_schedule")),
    ("deepspeed.runtime.pipe.engine", "PipelineEngine._inference_schedule", ("self", "micro_batches")),
    ("deepspeed.runtime.pipe.engine", "PipelineEngine._train_schedule", ("self",)),
    ("deepspeed.runtime.pipe.engine", "PipelineEngine._exec_forward_pass", ("self", "buffer_id")),
    ("deepspeed.runtime.pipe.engine", "PipelineEngine._exec_backward_pass", ("self", "buffer_id")),
    ("deepspeed.runtime.pipe.engine", "PipelineEngine._exec_load_micro_batch", ("self", "buffer_id")),
    ("deepspeed.runtime.pipe.engine", "PipelineEngine._next_batch", ("self",)),
    ("deepspeed.runtime.pipe.engine", "PipelineEngine._scale_loss_by_gas", ("self", "prescaled_loss", "eval_micro_batches")),
    ("deepspeed.runtime.pipe.module", "PipelineModule._build", ("self",)),
    ("deepspeed.runtime.pipe.module", "PipelineModule._partition_layers", ("self", "method")),
    ("deepspeed.runtime.pipe.module", "PipelineModule._set_bounds", ("self", "start", "stop")),
    ("deepspeed.runtime.pipe.module", "PipelineModule.ckpt_layer_path", ("self", "ckpt_dir", "local_layer_idx")),
    ("deepspeed.runtime.utils", "set_random_seed", ("seed",)),
    ("deepspeed.comm.torch", "build_shm_op", ()),
)

INSTANCE_ATTRIBUTES = {
    "PipelineEngine": ("pipe_buffers", "total_loss", "grad_layer"),
    "PipelineEngine after _exec_schedule": ("fwd_outputs",),
    "PipelineModule": ("forward_funcs", "tied_comms", "_local_start", "_topo", "seed_layers"),
}


def _resolve(module: str, path: str):
    obj = importlib.import_module(module)
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


def check(required=REQUIRED) -> None:
    """Raise DeepSpeedMismatch unless every entry of `required` exists with its parameters."""
    found = deepspeed.__version__
    for module, path, params in required:
        try:
            obj = _resolve(module, path)
        except (ImportError, AttributeError):
            raise DeepSpeedMismatch(
                f"DeepSpeed {found}: {module}.{path} is gone; hetloco_ds overrides or reads it "
                f"(written against DeepSpeed {CHECKED_AGAINST})") from None
        if params is not None:
            have = tuple(inspect.signature(obj).parameters)
            if have != params:
                raise DeepSpeedMismatch(
                    f"DeepSpeed {found}: {module}.{path} takes {have}, hetloco_ds expects {params} "
                    f"(written against DeepSpeed {CHECKED_AGAINST})")


def check_instance(obj, kind: str) -> None:
    """The attributes DeepSpeed's `__init__` sets that we read, on a constructed object."""
    missing = [a for a in INSTANCE_ATTRIBUTES[kind] if not hasattr(obj, a)]
    if missing:
        raise DeepSpeedMismatch(
            f"DeepSpeed {deepspeed.__version__}: {kind} instances no longer have {missing}; hetloco_ds "
            f"reads them (written against DeepSpeed {CHECKED_AGAINST})")


check()

from . import comm  # noqa: E402  (after the check: the modules subclass what it verified)
from .engine import PipelineEngineAdapter  # noqa: E402
from .module import PipelineModuleAdapter, layer_checkpoint_name, seed_layer  # noqa: E402

__all__ = ["CHECKED_AGAINST", "DeepSpeedMismatch", "PipelineEngineAdapter", "PipelineModuleAdapter",
           "apply_all", "check", "check_instance", "layer_checkpoint_name", "seed_layer"]


def apply_all() -> None:
    """Process-wide changes, once per process before DeepSpeed creates process groups."""
    comm.skip_shm_build()
