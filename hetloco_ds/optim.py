"""The inner optimizer's pieces shared by the engine and the simulator, so both compute the
same numbers: AdamW from DeepSpeed's `optimizer` section with its moments held as
`hetloco.train.optimizer_state` says, a step's decoupled decay and clipping by the replica's norm."""
from __future__ import annotations

import functools
import logging
import warnings

import torch

from .config import ConfigError, OptimizerSettings
from .sizes import LOWBIT_BLOCK, LOWBIT_MIN_NUMEL, OPTIMIZER_STATES


def build_optimizer(params, settings: OptimizerSettings, state: str = "fp32", replicas: int = 1) -> torch.optim.Optimizer:
    """AdamW with the run's settings, its moments held as `state` (`hetloco.train.optimizer_state`):
    "fp32" torch.optim.AdamW, fused on CUDA, so no DeepSpeed op has to be JIT-built and the step is
    one kernel; "bf16" and "8bit" torchao's AdamW (moments in bf16, or AdamW8bit's block-quantised
    codes), imported only here; "cpu_offload" `HostAdamW`. `replicas`: the batched simulator's
    parameters stack that many replicas along dim 0, and 8-bit moments are quantised by one
    replica's slice, so its blocks are each replica's own and match the engine's."""
    params = list(params)
    kwargs = dict(lr=settings.lr, betas=settings.betas, eps=settings.eps, weight_decay=settings.weight_decay)
    if state == "fp32":
        fused = bool(params) and all(q.is_cuda for q in params)
        return torch.optim.AdamW(params, **kwargs, fused=fused)
    if state == "cpu_offload":
        return HostAdamW(params, **kwargs)
    if state not in OPTIMIZER_STATES:
        raise ConfigError(f"hetloco.train.optimizer_state = {state!r} must be one of {list(OPTIMIZER_STATES)}")
    bf16, eight = _lowbit_classes(state)
    return bf16(params, **kwargs) if state == "bf16" else eight(params, **kwargs, replicas=replicas)


def decoupled_decay(optimizer: torch.optim.Optimizer) -> float:
    """lr x weight_decay of the step the optimizer takes next (read it before the step: the LR
    schedule moves after): the fraction AdamW's decoupled decay takes off each parameter.
    `StageAlgorithm.after_inner_step` gives T_perp the same share."""
    groups = {(float(g["lr"]), float(g["weight_decay"])) for g in optimizer.param_groups}
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


class HostAdamW(torch.optim.Optimizer):
    """`hetloco.train.optimizer_state` "cpu_offload": torch's AdamW on host copies, its moments on
    the host only. Each step copies every weight and (clipped) gradient to pinned host memory,
    steps there (fused CPU AdamW) and copies the weights back; the device keeps no moments.

    Not torchao's CPUOffloadOptimizer, which keeps the host copy of each weight as the truth and
    writes it over the device's after every step, and copies each gradient in a backward hook:
    SparseLoCo writes the weights outside the optimizer (the outer step, T_S's projection and
    decay, a checkpoint's load) and clips after the backward, so it would undo the outer step and
    step on unclipped gradients. Here the device's weights are the truth, at the price of a copy of
    the weights to the host each step and no overlap with the backward.

    On the CPU (a CPU-only run, the tests) the copies are host to host and the step is the
    non-fused AdamW "fp32" uses there, so the numbers are fp32's bit for bit. The state dict is the
    inner torch AdamW's: plain tensors, in the same layout as "fp32"'s.

    A torch Optimizer by type (DeepSpeed and its LR schedules check it) whose `param_groups` and
    `state` are the inner AdamW's, as torchao's CPUOffloadOptimizer does; Optimizer.__init__ is
    not called."""

    def __init__(self, params, lr: float, betas, eps: float, weight_decay: float):
        self.params = [p for p in params]
        if not self.params:
            raise ValueError("optimizer got an empty parameter list")
        self.on_device = any(not p.device.type == "cpu" for p in self.params)
        pin = self.on_device and torch.cuda.is_available()
        self.host = [torch.empty_like(p, device="cpu", pin_memory=pin) for p in self.params]
        self.host_grads = [torch.empty_like(h, pin_memory=pin) for h in self.host]
        with torch.no_grad():
            for h, p in zip(self.host, self.params):
                h.copy_(p.detach())
        self.inner = torch.optim.AdamW(self.host, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                                       fused=self.on_device)
        self._optimizer_step_pre_hooks = {}
        self._optimizer_step_post_hooks = {}

    @property
    def param_groups(self):
        return self.inner.param_groups

    @property
    def state(self):
        return self.inner.state

    @property
    def defaults(self):
        return self.inner.defaults

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        live = [i for i, p in enumerate(self.params) if p.grad is not None]
        for i, (h, p) in enumerate(zip(self.host, self.params)):
            h.grad = self.host_grads[i] if p.grad is not None else None
        for i in live:  # device -> host: the weights as the outer step left them, the clipped gradients
            self.host[i].copy_(self.params[i].detach(), non_blocking=True)
            self.host_grads[i].copy_(self.params[i].grad, non_blocking=True)
        if self.on_device:
            torch.cuda.current_stream().synchronize()
        self.inner.step()
        for i in live:  # host -> device, ordered before the next step's kernels on the same stream
            self.params[i].copy_(self.host[i], non_blocking=True)
        return loss

    def zero_grad(self, set_to_none: bool = True):
        for p in self.params:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()

    def state_dict(self):
        return self.inner.state_dict()

    def load_state_dict(self, state_dict):
        self.inner.load_state_dict(state_dict)

    def __repr__(self):
        return f"HostAdamW({self.inner!r})"


_TORCHAO_NOISE = ("torchao", "torch.utils._pytree")
"""Loggers whose warnings torchao 0.18's import prints on a machine without its CUDA kernels ("Failed
to load .../_C_mxfp8...so", a pytree registration deprecation): nothing a user can act on."""


def _import_torchao(state: str):
    levels = {name: logging.getLogger(name).level for name in _TORCHAO_NOISE}
    try:
        for name in _TORCHAO_NOISE:
            logging.getLogger(name).setLevel(logging.ERROR)
        import torchao.optim as tao
    except ImportError as err:
        raise ConfigError(f"hetloco.train.optimizer_state = {state!r} needs torchao ({err}): "
                          "pip install torchao==0.18.0 (or pip install 'hetloco_ds[lowbit]')") from None
    finally:
        for name, level in levels.items():
            logging.getLogger(name).setLevel(level)
    return tao


@functools.cache
def _lowbit_classes(state: str):
    """(bf16 AdamW, 8-bit AdamW), torchao's optimizers made to fit the drivers: the LR a float in
    `param_groups` as DeepSpeed's schedules and logs expect (torchao keeps a tensor, made for the
    step only here), the state dict plain tensors (8-bit moments as their codes, scales and code
    map, read back by safe_load's weights-only unpickler), bf16 moments that stay bf16 on load."""
    tao = _import_torchao(state)
    from torchao.optim.subclass_8bit import OptimState8bit

    class _Fitted:
        def add_param_group(self, param_group: dict) -> None:
            lr = param_group.get("lr", self.defaults["lr"])  # torchao makes it a float32 tensor
            super().add_param_group(param_group)
            self.param_groups[-1]["lr"] = lr

        @torch.no_grad()
        def step(self, closure=None):
            lrs = [g["lr"] for g in self.param_groups]
            for g in self.param_groups:
                g["lr"] = torch.tensor(float(g["lr"]), dtype=torch.float32)
            try:
                with warnings.catch_warnings():
                    # torch.compile's cache asks every tensor subclass for a hash torchao 0.18's lacks.
                    warnings.filterwarnings("ignore", message=".*_stable_hash_for_caching")
                    return super().step(closure)
            finally:
                for g, lr in zip(self.param_groups, lrs):
                    g["lr"] = lr

        def state_dict(self):
            out = super().state_dict()
            out["state"] = {k: {name: _plain(v) for name, v in st.items()} for k, st in out["state"].items()}
            return out

        def load_state_dict(self, state_dict):
            state_dict = dict(state_dict)
            state_dict["state"] = {k: {name: _subclass(v) for name, v in st.items()}
                                   for k, st in state_dict["state"].items()}
            super().load_state_dict(state_dict)
            for p, st in self.state.items():  # torch casts every state tensor to its parameter's dtype
                for name in ("exp_avg", "exp_avg_sq"):
                    if name in st and not isinstance(st[name], OptimState8bit):
                        st[name] = st[name].to(self._moment_dtype(p))

        def _moment_dtype(self, p: torch.Tensor) -> torch.dtype:
            return p.dtype

    def _plain(v):
        if isinstance(v, OptimState8bit):
            return {"codes": v.codes, "scale": v.scale, "qmap": v.qmap, "signed": v.signed}
        return v

    def _subclass(v):
        if isinstance(v, dict) and set(v) == {"codes", "scale", "qmap", "signed"}:
            return OptimState8bit(v["codes"], v["scale"], v["qmap"], v["signed"], dtype=torch.float32)
        return v

    class Bf16AdamW(_Fitted, tao._AdamW):
        """Both moments in bf16 (rounded to nearest when written; the step computes in fp32), fp32
        weights. torchao's `_AdamW` keeps its moments in the weights' dtype; this one in bf16."""

        def _new_buffer(self, p: torch.Tensor, signed: bool):
            return torch.zeros_like(p, dtype=torch.bfloat16)

        def _moment_dtype(self, p):
            return torch.bfloat16

    class AdamW8bit(_Fitted, tao.AdamW8bit):
        """torchao's AdamW8bit (dynamic-tree 8-bit codes, one fp32 scale per 256 values) with its
        quantise-or-not rule applied to one replica's slice of a batched simulator's parameter."""

        def __init__(self, params, *, replicas: int = 1, **kwargs):
            self.replicas = replicas
            super().__init__(params, block_size=LOWBIT_BLOCK, **kwargs)

        def _new_buffer(self, p: torch.Tensor, signed: bool):
            n = p.numel() // self.replicas
            if n >= LOWBIT_MIN_NUMEL and n % self.block_size == 0:
                return OptimState8bit.zeros(p.shape, signed, self.block_size, p.device, dtype=p.dtype)
            return torch.zeros_like(p)

    return Bf16AdamW, AdamW8bit
