"""The overlapped pipeline schedule: a pure generator of instructions, as DeepSpeed's schedules are.

DeepSpeed's TrainSchedule issues blocking SendActivation / RecvActivation / SendGrad /
RecvGrad around each pass, so a stage idles for every transfer. This schedule splits each
transfer into a post and a wait:

    PostRecvActivation(i)   irecv micro-batch i's message from the previous stage: the first
                            depth(s - 1) at the start, then i + depth(s - 1) right after
                            SendGradAsync(i)
    WaitRecvActivation(i)   just before ForwardPass(i): its inputs
    SendActivationAsync(i)  isend right after ForwardPass(i); PostRecvGrad(i) follows at once
    WaitRecvGrad(i)         just before BackwardPass(i)
    SendGradAsync(i)        isend right after BackwardPass(i)
    WaitSends()             at the end of the step: every send has completed

in the order of `order.link_ops("overlapped", ...)` (the cost model times that same list). Why the posting distances
cannot deadlock and always find a receive waiting:

* stage s posts the receive of micro-batch i + depth(s - 1) right after sending its gradient
  of i. The previous stage sends i + depth(s - 1) only after its backward of i, which needs
  that gradient: the receive is posted before the send can start, so rendezvous transports
  (gloo, NCCL) never hold a ready send back for want of a posted receive. And a posted
  receive never waits on this stage's own later work. On NCCL a posted receive is a kernel
  spinning on the device; one that did wait on this stage's later work would deadlock both
  stages whenever something synchronised the whole device in between. Posting it earlier,
  when i is consumed, gains nothing for that reason too: the send cannot come sooner.
* a gradient receive is posted as soon as the activation it answers is sent.
* depth(s) >= depth(s + 1) (order.depth), so stage s has sent every activation stage s + 1
  waits for before stage s itself waits for a gradient: the wait graph has no cycle.

Each instruction carries the micro-batch index so the engine can check that messages arrive
in order; buffers are `micro_batch % depth`, freed by BackwardPass before reuse.
"""
from __future__ import annotations

from deepspeed.runtime.pipe.schedule import (
    BackwardPass,
    BufferOpInstruction,
    ForwardPass,
    LoadMicroBatch,
    OptimizerStep,
    PipeInstruction,
    PipeSchedule,
    ReduceGrads,
    ReduceTiedGrads,
)

from .order import depth, link_ops


class PostRecvActivation(PipeInstruction):
    """Post the receive of micro-batch `micro_batch`'s message from the previous stage."""

    def __init__(self, micro_batch: int):
        super().__init__(micro_batch=micro_batch)


class WaitRecvActivation(BufferOpInstruction):
    """Wait for micro-batch `micro_batch`'s message; it becomes the inputs of `buffer_id`."""

    def __init__(self, buffer_id: int, micro_batch: int):
        super().__init__(buffer_id, micro_batch=micro_batch)


class SendActivationAsync(BufferOpInstruction):
    """isend the outputs of `buffer_id` (micro-batch `micro_batch`) to the next stage."""

    def __init__(self, buffer_id: int, micro_batch: int):
        super().__init__(buffer_id, micro_batch=micro_batch)


class PostRecvGrad(PipeInstruction):
    """Post the receive of micro-batch `micro_batch`'s gradient from the next stage."""

    def __init__(self, micro_batch: int):
        super().__init__(micro_batch=micro_batch)


class WaitRecvGrad(BufferOpInstruction):
    """Wait for micro-batch `micro_batch`'s gradient; BackwardPass(`buffer_id`) uses it."""

    def __init__(self, buffer_id: int, micro_batch: int):
        super().__init__(buffer_id, micro_batch=micro_batch)


class SendGradAsync(BufferOpInstruction):
    """isend the input gradients of `buffer_id` (micro-batch `micro_batch`) to the previous stage."""

    def __init__(self, buffer_id: int, micro_batch: int):
        super().__init__(buffer_id, micro_batch=micro_batch)


class WaitSends(PipeInstruction):
    """Complete every send still in flight."""


LINK_INSTRUCTIONS = (PostRecvActivation, WaitRecvActivation, SendActivationAsync, PostRecvGrad, WaitRecvGrad,
                     SendGradAsync, WaitSends)


class OverlappedTrainSchedule(PipeSchedule):
    """One optimizer step of one stage with non-blocking stage links (module docstring)."""

    def num_pipe_buffers(self) -> int:
        return depth("overlapped", self.stages, self.stage_id, self.micro_batches)

    def steps(self):
        first, last = self.is_first_stage, self.is_last_stage
        w = self.num_pipe_buffers()
        make = {
            "post_act": lambda i: PostRecvActivation(i),
            "wait_act": lambda i: WaitRecvActivation(i % w, i),
            "isend_act": lambda i: SendActivationAsync(i % w, i),
            "post_grad": lambda i: PostRecvGrad(i),
            "wait_grad": lambda i: WaitRecvGrad(i % w, i),
            "isend_grad": lambda i: SendGradAsync(i % w, i),
            "B": lambda i: BackwardPass(i % w),
        }
        for op, i in link_ops("overlapped", self.stages, self.stage_id, self.micro_batches):
            if op == "F":
                yield ([LoadMicroBatch(i % w)] if first or last else []) + [ForwardPass(i % w)]
            else:
                yield [make[op](i)]
        yield [ReduceTiedGrads(), ReduceGrads(), OptimizerStep(), WaitSends()]
