"""The one helper every multi-process test uses: run a function in N gloo ranks on CPU.

Each rank is a process forked from a server that has imported torch, DeepSpeed, transformers
and our package once (PRELOAD): a spawned rank would spend several seconds importing them,
N at a time on a 2-core machine. The rank gets the environment a launcher would give it (a
free port is found, never hard-coded). The function's return value comes back to the test;
an exception in any rank fails the test with that rank's traceback, and a hang is killed at
the timeout instead of blocking the suite.
"""
from __future__ import annotations

import io
import multiprocessing as mp
import os
import subprocess
import time
import traceback

from hetloco_ds.launch import free_port

TIMEOUT_S = 300

PRELOAD = ["hetloco_ds.transport.elastic", "hetloco_ds.cli", "hetloco_ds.train", "hetloco_ds.elastic.replica", "hetloco_ds.engine",
           "hetloco_ds.build", "hetloco_ds.convert", "hetloco_ds.hf_export", "hetloco_ds.corpus", "hetloco_ds.batches",
           "hetloco_ds.metrics", "deepspeed", "transformers"]
"""What the fork server imports once. It is one server per test process, started by whichever test
forks first, so every helper that forks from it asks for this same list."""


def fork_context():
    """The multiprocessing context of the preloaded fork server."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def _child(fn, rank, world, port, args, queue):
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    try:
        import torch

        torch.set_num_threads(1)
        from hetloco_ds.build import init_distributed

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
    ctx = fork_context()
    queue = ctx.Queue()
    port = free_port()
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


def fork_job(log, world: int, argv: list, env: dict, fault: str | None = None) -> list:
    """`world` ranks of `hetloco_ds.cli.main(argv)` forked from the preloaded server, with the environment
    torchrun gives its ranks; their output goes to LOG.rank<r>.out/.err."""
    import elastic_ranks

    ctx = fork_context()
    port = free_port()
    procs = []
    for rank in range(world):
        env_r = dict(env, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                     MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
        p = ctx.Process(target=elastic_ranks.run, daemon=True, args=([str(a) for a in argv], env_r, f"{log}.rank{rank}",
                                                                     fault))
        p.start()
        procs.append(p)
    return procs


class Launcher(mp.context.ForkServerProcess):
    """A launcher process of `start_launcher`: a multiprocessing process (exitcode, is_alive, join,
    kill), also seen as `subprocess.Popen` sees its child (poll, wait, send_signal, communicate:
    its stdout and stderr, from LOG.out/.err)."""

    def __init__(self, log, argv: list[str], env: dict, cwd):
        import elastic_ranks

        super().__init__(target=elastic_ranks.launcher, daemon=True, args=(argv, env, str(log), str(cwd)))
        self.log, self.argv = log, argv

    @property
    def returncode(self):
        return self.exitcode

    def poll(self):
        return self.exitcode

    def wait(self, timeout=None):
        self.join(timeout)
        if self.exitcode is None:
            raise subprocess.TimeoutExpired(self.argv, timeout)
        return self.exitcode

    def send_signal(self, sig: int) -> None:
        os.kill(self.pid, sig)

    def communicate(self, timeout=None) -> tuple[str, str]:
        self.wait(timeout)
        return open(f"{self.log}.out").read(), open(f"{self.log}.err").read()


def start_launcher(log, argv: list, env: dict, cwd) -> Launcher:
    """`python -m hetloco_ds.cli ARGV` (a `--nproc` or `--elastic` launcher) started as a process
    forked from the preloaded server, its ranks forked in turn (elastic_ranks.launcher), instead
    of an interpreter starting for each. The launcher's own work is all real: its checks, the
    ranks' environment, supervising them, stopping the others when one fails or when it is
    signalled, its lines and exit code; only the interpreters' start-up is skipped. Ranks exec'd
    fresh by `--nproc` are test_examples' and test_packaging's. Its output goes to LOG.out/.err."""
    fork_context()  # the server's preload list
    for suffix in (".out", ".err"):
        open(f"{log}{suffix}", "w").close()
    proc = Launcher(log, [str(a) for a in argv], env, cwd)
    proc.start()
    return proc


def launch_job(log, argv: list, env: dict, cwd, timeout: float = TIMEOUT_S) -> subprocess.CompletedProcess:
    """`start_launcher` to its end, as `subprocess.run` runs a command: a CompletedProcess (exit
    code, stdout, stderr), or TimeoutExpired past `timeout` (the launcher killed)."""
    proc = start_launcher(log, argv, env, cwd)
    try:
        out, err = proc.communicate(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.join()
        raise
    return subprocess.CompletedProcess(proc.argv, proc.exitcode, out, err)


def until_a_rank_ends(procs, timeout: float) -> list:
    """Wait until a rank exits non-zero (or all exit 0), then stop the others, as a launcher does;
    returns the exit codes in the order the ranks ended (those stopped here last, as None)."""
    deadline = time.monotonic() + timeout
    ended: list = []
    try:
        while len(ended) < len(procs) and not any(c not in (None, 0) for _, c in ended):
            assert time.monotonic() < deadline, f"no rank failed within {timeout} s"
            for r, p in enumerate(procs):
                if p.exitcode is not None and r not in [e for e, _ in ended]:
                    ended.append((r, p.exitcode))
            time.sleep(0.05)
    finally:
        for p in procs:
            if p.exitcode is None:
                p.kill()
            p.join(10)
    return [c for _, c in ended] + [None] * (len(procs) - len(ended))


def running(pid: int) -> bool:
    """The process exists and is not a zombie (a zombie is dead: its parent has not reaped it yet)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def job_stderr(log, world: int) -> str:
    return "".join(open(f"{log}.rank{r}.err").read() for r in range(world))


def run_job(log, world: int, argv: list, env: dict, timeout: float = TIMEOUT_S) -> None:
    """`fork_job` to the end: every rank must exit 0 within `timeout` (the others are killed then)."""
    procs = fork_job(log, world, argv, env)
    deadline = time.monotonic() + timeout
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
    codes = [p.exitcode for p in procs]
    assert codes == [0] * world, f"exit codes {codes}\n{job_stderr(log, world)[-4000:]}"



def build_from_hf(hf_dir: str, ds_cfg: dict, seq_len: int):
    """Inside a rank: (engine, module, llama_config) for a DeepSpeed dict and an HF directory,
    the way `hetloco-ds train --model` builds them."""
    from hetloco_ds import convert
    from hetloco_ds.config import parse_config
    from hetloco_ds.build import build_engine, build_module

    run = parse_config(ds_cfg)
    cfg = convert.read_hf_config(hf_dir)
    module = build_module(run, cfg, hf_dir=hf_dir)
    return build_engine(run, module, seq_len=seq_len), module, cfg
