"""Our overrides of DeepSpeed internals, one concern per module.

Each module names the DeepSpeed function it replaces and the DeepSpeed versions it was
checked against, and `apply()` is idempotent. `apply_all()` is called once per process
before DeepSpeed creates process groups or engines.
"""
from . import no_shm_build, p2p_meter


def apply_all() -> None:
    no_shm_build.apply()
    p2p_meter.apply()
