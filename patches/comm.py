"""Skip DeepSpeed's JIT build of its CPU shared-memory collective op (`deepspeed.comm.torch.build_shm_op`).

On the CPU accelerator, `TorchBackend.__init__` compiles `deepspeed_shm_comm` at process-group
creation (~80 s on 2 cores, fails without a compiler, and concurrent ranks race on the build
cache). We use gloo for every CPU collective, which does not need that op. On GPU the CUDA
accelerator reports the op incompatible and the original returns None anyway.
"""
import importlib

# `deepspeed.comm.torch` is shadowed by the `torch` attribute of `deepspeed.comm`.
_ds_torch_comm = importlib.import_module("deepspeed.comm.torch")


def _no_shm_op():
    return None


def skip_shm_build() -> None:
    _ds_torch_comm.build_shm_op = _no_shm_op
