"""The inner optimizer's pieces shared by the engine and the simulator, so both compute the
same numbers: AdamW from DeepSpeed's `optimizer` section, a step's decoupled decay and clipping
by the replica's norm."""
from __future__ import annotations

import torch

from .config import OptimizerSettings


def build_optimizer(params, settings: OptimizerSettings) -> torch.optim.Optimizer:
    """torch.optim.AdamW with the run's settings; fused on CUDA, so no DeepSpeed op has to be
    JIT-built and the step is one kernel."""
    params = list(params)
    fused = bool(params) and all(q.is_cuda for q in params)
    return torch.optim.AdamW(params, lr=settings.lr, betas=settings.betas, eps=settings.eps,
                             weight_decay=settings.weight_decay, fused=fused)


def decoupled_decay(optimizer: torch.optim.Optimizer) -> float:
    """lr x weight_decay of the step the optimizer takes next (read it before the step: the LR
    schedule moves after): the fraction AdamW's decoupled decay takes off each parameter.
    `StageAlgorithm.after_inner_step` gives T_perp the same share."""
    groups = {(g["lr"], g["weight_decay"]) for g in optimizer.param_groups}
    if len(groups) != 1:
        raise ValueError(f"the inner optimizer's param groups differ in lr or weight_decay: {sorted(groups)}")
    lr, weight_decay = groups.pop()
    return float(lr) * float(weight_decay)


def build_scheduler(scheduler: dict | None, optimizer: torch.optim.Optimizer):
    """DeepSpeed's LR schedule from the run's (resolved) `scheduler` section, as its engine
    builds it, for drivers without a DeepSpeed engine (the simulator); None without one."""
    if not scheduler:
        return None
    from deepspeed.runtime import lr_schedules

    return getattr(lr_schedules, scheduler["type"])(optimizer, **scheduler.get("params", {}))


def grad_sq_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """Sum of squares of the gradients, as a float32 tensor on their device (no host sync)."""
    if not grads:
        return torch.zeros((), dtype=torch.float32)
    norms = torch._foreach_norm([g.detach().float() if g.dtype != torch.float32 else g.detach() for g in grads])
    return torch.stack(norms).pow(2).sum()


def clip_(grads: list[torch.Tensor], sq_norm: torch.Tensor, max_norm: float) -> torch.Tensor:
    """torch.nn.utils.clip_grad_norm_'s rule with a given (replica-wide) squared norm; returns the norm."""
    norm = sq_norm.sqrt()
    if max_norm > 0 and grads:
        coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
        torch._foreach_mul_(grads, coef.to(grads[0].dtype))
    return norm
