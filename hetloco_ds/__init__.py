"""hetloco_ds: SparseLoCo + subspace-compressed pipeline parallelism for Hugging Face LLaMA on DeepSpeed.

    engine, optimizer, training_dataloader, lr_scheduler = hetloco_ds.initialize(model=..., config=...)
    # as deepspeed.initialize; see api.py
"""
import os as _os

__version__ = "0.2.0"


def _deepspeed_accelerator_from_torch() -> None:
    """Tell DeepSpeed it runs on CPU when torch sees no CUDA device, before DeepSpeed is imported.

    We run on CUDA or on CPU (gloo), by `torch.cuda.is_available()`. Left to guess, DeepSpeed
    logs "Setting accelerator to CPU. If you have GPU or other accelerator, we were unable to
    detect it." in every process of every CPU run; DS_ACCELERATOR=cpu is its documented way to
    say so instead. A DS_ACCELERATOR the user set wins.
    """
    if "DS_ACCELERATOR" in _os.environ:
        return
    import torch

    if not torch.cuda.is_available():
        _os.environ["DS_ACCELERATOR"] = "cpu"


_deepspeed_accelerator_from_torch()

from .api import initialize  # noqa: E402  (after the accelerator is settled: DeepSpeed reads it at import)

__all__ = ["__version__", "initialize"]
