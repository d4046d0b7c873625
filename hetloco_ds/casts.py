"""One bf16 cast of each weight matrix per optimizer step, whose gradient is converted and
accumulated as soon as each micro-batch's backward makes it.

Autocast's own cache (an outer autocast region around the step) also casts each weight once per
step, but the cast's backward node is made in the step's first micro-batch. In every later
micro-batch it then has a lower sequence number than all of that micro-batch's nodes, and autograd
runs it last: every weight's bf16 gradient waits for the end of the backward while the activations
are freed, 2 bytes a weight at once (`sizes.deferred_cast_grad_bytes`; 3.3 GiB on a stage of 8
Llama-3-8B layers, which then peaked 1.6 GiB above its activations' height). Here each micro-batch's
use of the cached cast goes through a node of its own (`_StepCast`), made in that micro-batch's
forward, so autograd runs it right after the layer's backward, as it does a per-micro-batch cast.
The values are the same bits: the same fp32 -> bf16 rounding once per step, the same bf16 -> fp32
conversion of each gradient, the same fp32 accumulation. The engine uses it only where the piled-up
gradients would be the stage's peak (`sizes.step_casts_pay`): elsewhere it changes no peak and its
autograd Function per weight and micro-batch costs host time.
"""
from __future__ import annotations

import contextlib
from typing import Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import nn


class _StepCast(torch.autograd.Function):
    """`cast` (the step's bf16 copy of `weight`) as a new tensor with a backward node of its own,
    which hands `weight` the gradient in fp32 as autocast's cast (aten._to_copy) does."""

    @staticmethod
    def forward(ctx, weight: torch.Tensor, cast: torch.Tensor) -> torch.Tensor:
        ctx.dtype = weight.dtype
        return cast.view_as(cast)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad.to(ctx.dtype), None


def cast_linears(modules: Iterable[nn.Module]) -> list[nn.Linear]:
    """The layers `step_casts` serves: plain `nn.Linear`s (a subclass may compute otherwise)."""
    return [m for m in modules if type(m) is nn.Linear]


@contextlib.contextmanager
def step_casts(modules: Iterable[nn.Module], dtype: torch.dtype) -> Iterator[dict]:
    """For one optimizer step: every layer of `cast_linears(modules)` computes, under autocast to `dtype`
    with gradients on, with its weight cast to `dtype` once (on first use) and reached through
    `_StepCast`; anything else (no autocast, no gradient: validation) as `nn.Linear` does. The casts
    are dropped when the step ends (the weights change at its end). Yields the cache (weight -> cast)."""
    cache: dict[torch.Tensor, torch.Tensor] = {}
    linears = cast_linears(modules)

    def forward(lin: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        w = lin.weight
        if not (w.requires_grad and w.dtype != dtype and torch.is_grad_enabled()
                and torch.is_autocast_enabled(x.device.type) and torch.get_autocast_dtype(x.device.type) == dtype):
            return F.linear(x, w, lin.bias)
        cast = cache.get(w)
        if cast is None:
            with torch.no_grad():
                cast = cache[w] = w.to(dtype)
        return F.linear(x, _StepCast.apply(w, cast), lin.bias)

    for lin in linears:
        lin.forward = forward.__get__(lin)  # this instance only, this step only
    try:
        yield cache
    finally:
        for lin in linears:
            del lin.forward
        cache.clear()
