"""DeepSpeed's PipelineEngine with the private seams hetloco_ds uses turned into named hooks.

DeepSpeed's stock instruction map holds PipelineEngine's own functions, so a subclass's
`_exec_*` override would never run: the map here dispatches by name. Each private `_exec_*`
method below only moves DeepSpeed's buffers in and out of a hook that `hetloco_ds.engine`
implements with its own sends, receives and collectives, where the bytes are counted.
"""
from __future__ import annotations

import torch
from deepspeed.runtime.pipe.engine import PipelineEngine

from .checks import check_instance


def _by_name(name: str):
    label = f"pipe.{name.lstrip('_')}"

    def call(self, **kwargs):
        # Named in a profile (hetloco_ds.profiling's timeline); nothing is recorded otherwise.
        if torch.autograd._profiler_enabled():
            with torch.profiler.record_function(label):
                return getattr(self, name)(**kwargs)
        return getattr(self, name)(**kwargs)

    call.__name__ = name
    return call


def _map_tensors(fn, batch):
    """`fn` on a tensor, or on each tensor of a tuple or list (as DeepSpeed's load accepts)."""
    return fn(batch) if torch.is_tensor(batch) else tuple(fn(t) for t in batch)


def labelled_instruction_map() -> dict:
    """DeepSpeed's instruction map dispatching by method name, each instruction a `pipe.<name>`
    range in a profile: ours (the adapter below) and stock DeepSpeed's in the bench's comparison
    (bench/stock_pipe.py) are labelled by this one rule."""
    return {cmd: _by_name(fn.__name__) for cmd, fn in PipelineEngine._INSTRUCTION_MAP.items()}


class PipelineEngineAdapter(PipelineEngine):
    _INSTRUCTION_MAP = labelled_instruction_map()
    INSTRUCTIONS: dict = {}
    """Instruction classes of a subclass's own schedules -> the method that executes them."""

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        cls._INSTRUCTION_MAP = {**cls._INSTRUCTION_MAP,
                                **{cmd: _by_name(name) for cmd, name in cls.INSTRUCTIONS.items()}}

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        check_instance(self, "PipelineEngine")

    # ---------------------------------------------------------- hooks (implemented by hetloco_ds)
    def send_activations(self, outputs) -> None:
        raise NotImplementedError

    def recv_activations(self):
        """The previous stage's message, its floating tensors requiring grad."""
        raise NotImplementedError

    def send_grads(self, inputs) -> None:
        """Send the gradients of the floating tensors of `inputs` (what recv_activations returned)."""
        raise NotImplementedError

    def recv_grads(self, outputs):
        """The next stage's gradients for the floating tensors of `outputs` (a tensor or a list)."""
        raise NotImplementedError

    def reduce_tied_grads(self) -> None:
        raise NotImplementedError

    def reduce_grads(self) -> None:
        raise NotImplementedError

    def optimizer_step(self, lr_kwargs=None) -> None:
        raise NotImplementedError

    def replica_loss(self) -> torch.Tensor:
        """What train_batch returns on every stage of the replica."""
        raise NotImplementedError

    def train_schedule(self):
        """The schedule of one training step (DeepSpeed's TrainSchedule by default)."""
        return PipelineEngine._train_schedule(self)

    # non-blocking stage links (a subclass's own schedule maps its instructions to the
    # exec_* methods below, which move DeepSpeed's buffers in and out of these hooks)
    def wait_recv_activations(self, micro_batch: int):
        """Micro-batch `micro_batch`'s message from the previous stage (posted earlier), as
        recv_activations returns it."""
        raise NotImplementedError

    def isend_activations(self, outputs, micro_batch: int) -> None:
        raise NotImplementedError

    def wait_recv_grads(self, outputs, micro_batch: int):
        """As recv_grads, for a receive posted earlier."""
        raise NotImplementedError

    def isend_grads(self, inputs, micro_batch: int) -> None:
        raise NotImplementedError

    def batch_to_device(self, tensor: torch.Tensor) -> torch.Tensor:
        """One tensor of a loaded micro-batch on this stage's device (DeepSpeed: a blocking copy)."""
        return tensor.clone().detach().to(self.device)

    def forward_pass(self, buffer_id: int) -> None:
        """DeepSpeed's forward of one buffer (loss and its accumulation on the last stage)."""
        PipelineEngine._exec_forward_pass(self, buffer_id)

    def backward_pass(self, buffer_id: int) -> None:
        """DeepSpeed's backward of one buffer."""
        PipelineEngine._exec_backward_pass(self, buffer_id)

    def exec_wait_recv_activation(self, buffer_id, micro_batch):
        self.pipe_buffers["inputs"][buffer_id] = self.wait_recv_activations(micro_batch)

    def exec_send_activation_async(self, buffer_id, micro_batch):
        self.isend_activations(self.pipe_buffers["outputs"][buffer_id], micro_batch)

    def exec_wait_recv_grad(self, buffer_id, micro_batch):
        self.grad_layer = self.wait_recv_grads(self.pipe_buffers["outputs"][buffer_id], micro_batch)

    def exec_send_grad_async(self, buffer_id, micro_batch):
        self.isend_grads(self.pipe_buffers["inputs"][buffer_id], micro_batch)
        self.pipe_buffers["inputs"][buffer_id] = None  # as _exec_send_grads: the input is no longer needed

    # ---------------------------------------------------------- DeepSpeed's own behaviour
    def ds_reduce_grads(self) -> None:
        """DeepSpeed's data-parallel gradient all-reduce."""
        PipelineEngine._exec_reduce_grads(self)

    def ds_optimizer_step(self, lr_kwargs=None) -> None:
        """DeepSpeed's optimizer step (optimizer, LR schedule, step counters, monitor)."""
        PipelineEngine._exec_optimizer_step(self, lr_kwargs)

    def gas_scaled_loss(self) -> torch.Tensor:
        """The last stage's loss of this step: micro-batch losses summed, divided by their count."""
        return self._scale_loss_by_gas(self.total_loss)

    def run_inference(self, micro_batches: int) -> list[torch.Tensor]:
        """DeepSpeed's inference schedule over `micro_batches`; the last stage's losses."""
        self._compute_loss = True  # what eval_batch sets: the last stage computes the loss
        self._exec_schedule(self._inference_schedule(micro_batches))
        check_instance(self, "PipelineEngine after _exec_schedule")
        return list(self.fwd_outputs)

    # ---------------------------------------------------------- DeepSpeed's private methods
    def _exec_send_activations(self, buffer_id):
        self.send_activations(self.pipe_buffers["outputs"][buffer_id])

    def _exec_recv_activations(self, buffer_id):
        self.pipe_buffers["inputs"][buffer_id] = self.recv_activations()

    def _exec_send_grads(self, buffer_id):
        self.send_grads(self.pipe_buffers["inputs"][buffer_id])
        self.pipe_buffers["inputs"][buffer_id] = None  # as DeepSpeed does: the input is no longer needed

    def _exec_recv_grads(self, buffer_id):
        self.grad_layer = self.recv_grads(self.pipe_buffers["outputs"][buffer_id])

    def _exec_load_micro_batch(self, buffer_id):
        # DeepSpeed's own load, less its timers and reentrant-checkpointing flags (we run
        # neither), with the copy to the device behind a hook.
        batch = self._next_batch()
        if self.is_first_stage():
            self.pipe_buffers["inputs"][buffer_id] = _map_tensors(self.batch_to_device, batch[0])
        if self.is_last_stage():
            self.pipe_buffers["labels"][buffer_id] = _map_tensors(self.batch_to_device, batch[1])

    def _exec_forward_pass(self, buffer_id):
        self.forward_pass(buffer_id)

    def _exec_backward_pass(self, buffer_id):
        self.backward_pass(buffer_id)

    def _exec_reduce_tied_grads(self):
        self.reduce_tied_grads()

    def _exec_reduce_grads(self):
        self.reduce_grads()

    def _exec_optimizer_step(self, lr_kwargs=None):
        self.optimizer_step(lr_kwargs)

    def _aggregate_total_loss(self):
        return self.replica_loss()

    def _train_schedule(self):
        return self.train_schedule()
