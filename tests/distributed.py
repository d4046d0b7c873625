"""The one helper every multi-process test uses: run a function in N gloo ranks on CPU.

Each rank is a spawned process with the environment a launcher would give it (a free
port is found, never hard-coded). The function's return value comes back to the test;
an exception in any rank fails the test with that rank's traceback, and a hang is killed
at the timeout instead of blocking the suite.
"""
from __future__ import annotations

import io
import multiprocessing as mp
import os
import socket
import traceback

TIMEOUT_S = 300


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child(fn, rank, world, port, args, queue):
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    try:
        import torch

        torch.set_num_threads(1)
        from hetloco_ds.initialize import init_distributed

        init_distributed()
        result = fn(rank, *args)
        # Serialised here: tensors sent through the queue would share memory with a process
        # that is about to exit.
        buf = io.BytesIO()
        torch.save(result, buf)
        queue.put((rank, "ok", buf.getvalue()))
    except BaseException:  # noqa: BLE001 - report everything to the parent
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        try:
            from deepspeed import comm as dist

            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception:  # noqa: BLE001
            pass


def run_ranks(fn, world: int, *args, timeout: float = TIMEOUT_S) -> list:
    """Run `fn(rank, *args)` in `world` processes; return the results ordered by rank."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_child, args=(fn, r, world, port, args, queue), daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    results: dict[int, object] = {}
    errors: list[str] = []
    try:
        for _ in range(world):
            rank, status, payload = queue.get(timeout=timeout)
            if status == "ok":
                import torch

                results[rank] = torch.load(io.BytesIO(payload), weights_only=False)
            else:
                errors.append(f"rank {rank} failed:\n{payload}")
                break
    except Exception as err:  # queue.Empty on timeout
        errors.append(f"timed out after {timeout}s waiting for ranks ({type(err).__name__}); got {sorted(results)}")
    finally:
        for p in procs:
            p.join(timeout=5 if not errors else 0.1)
            if p.is_alive():
                p.kill()
    if errors:
        raise AssertionError("\n".join(errors))
    return [results[r] for r in range(world)]


def build_from_hf(hf_dir: str, ds_cfg: dict, seq_len: int):
    """Inside a rank: (engine, module, llama_config) for a DeepSpeed dict and an HF directory,
    the way `hetloco-ds train --model` builds them."""
    from hetloco_ds import convert
    from hetloco_ds.config import parse_config
    from hetloco_ds.initialize import build_engine, build_module

    run = parse_config(ds_cfg)
    cfg = convert.read_hf_config(hf_dir)
    module = build_module(run, cfg, hf_dir=hf_dir)
    return build_engine(run, module, seq_len=seq_len), module, cfg
