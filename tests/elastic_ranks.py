"""One rank of a real `hetloco-ds train` job, forked from a server that has imported torch,
DeepSpeed, transformers and torchft once (tests/test_elastic_training.py): each rank starts in a
fraction of a second instead of several on a 2-core machine. The rank gets the environment a
launcher gives it (RANK, WORLD_SIZE, MASTER_ADDR/PORT) and runs `hetloco_ds.cli.main(argv)`, so
it is the same code path as under torchrun; faults come from tests/fault_inject/sitecustomize.py,
armed in-process (a forked child never imports sitecustomize itself).
"""
from __future__ import annotations

import importlib.util
import os
import sys

FAULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fault_inject", "sitecustomize.py")


def _arm(spec: str) -> None:
    """HETLOCO_FAULT's grammar (<rank>:<event>:<n>[:<action>]) for this process's RANK."""
    load = importlib.util.spec_from_file_location("hetloco_fault_inject", FAULTS)
    inject = importlib.util.module_from_spec(load)
    load.loader.exec_module(inject)  # HETLOCO_FAULT is not in the environment here: arms nothing by itself
    rank, event, n, action = inject._parse(spec)
    if rank == os.environ["RANK"]:  # _parse keeps the rank a string ("launcher" names no rank)
        inject._install(inject._Fault(event, n, action))


def run(argv: list[str], env: dict, log: str, fault: str | None = None) -> None:
    out = os.open(log + ".out", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    err = os.open(log + ".err", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.dup2(out, 1)
    os.dup2(err, 2)
    os.environ.clear()
    os.environ.update(env)
    import torch

    torch.set_num_threads(1)
    if fault:
        _arm(fault)
    from hetloco_ds import cli

    code = cli.main(list(argv))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # no interpreter teardown: torchft's threads, gloo's sockets
