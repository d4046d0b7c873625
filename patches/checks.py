"""Every private DeepSpeed name we rely on, and whether this DeepSpeed still has it.

A module of its own so that the adapters (engine.py, module.py) import `check_instance` at the
top, with no import back to the package that imports them."""
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
    ("deepspeed.runtime.pipe.module", "PipelineModule._index_tied_modules", ("self",)),
    ("deepspeed.runtime.pipe.module", "PipelineModule._synchronize_tied_weights", ("self",)),
    ("deepspeed.runtime.pipe.topology", "PipelineParallelGrid.stage_to_global", ("self", "stage_id", "kwargs")),
    ("deepspeed.runtime.pipe.topology", "ProcessTopology.__init__", ("self", "axes", "dims")),
    ("deepspeed.runtime.utils", "set_random_seed", ("seed",)),
    ("deepspeed.comm.torch", "build_shm_op", ()),
)

INSTANCE_ATTRIBUTES = {
    "PipelineEngine": ("pipe_buffers", "total_loss", "grad_layer"),
    "PipelineEngine after _exec_schedule": ("fwd_outputs",),
    "PipelineModule": ("forward_funcs", "tied_comms", "_local_start", "_topo", "seed_layers"),
    # patches.grid: what the replica's grid sets in place of DeepSpeed's, read by its methods
    "PipelineModule with a replica grid": ("_grid", "_layer_specs", "tied_modules", "tied_weight_attrs", "num_stages",
                                           "stage_id", "parts"),
    "ProcessTopology": ("mapping", "axes", "dims"),
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
