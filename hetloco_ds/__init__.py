"""hetloco_ds: SparseLoCo + subspace-compressed pipeline parallelism for Hugging Face LLaMA on DeepSpeed.

    engine, optimizer, training_dataloader, lr_scheduler = hetloco_ds.initialize(model=..., config=...)
    # as deepspeed.initialize; see api.py
"""
import os as _os
import sys as _sys

from .version import __version__


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


class _BeforeDeepSpeed:
    """Settles the accelerator when DeepSpeed is first looked up, not when hetloco_ds is imported:
    the config and the cost model (`plan`) run without torch, and asking torch for CUDA imports it.
    It stays on sys.meta_path, spent (removing a finder while the import system walks that list
    would skip the next one)."""

    pending = True

    @classmethod
    def find_spec(cls, name, path=None, target=None):
        if cls.pending and name == "deepspeed":
            cls.pending = False
            _deepspeed_accelerator_from_torch()
        return None  # the ordinary finders import it


if "deepspeed" in _sys.modules:
    _deepspeed_accelerator_from_torch()  # DeepSpeed has chosen; the processes this one starts have not
else:
    _sys.meta_path.insert(0, _BeforeDeepSpeed)

from .api import initialize  # noqa: E402

__all__ = ["__version__", "initialize"]
