"""Pieces shared by the GPU benches (gpu_two.py, gpu_four.py, gpu_throughput.py).

Each bench used to carry its own copy of these; a fix to one copy (a timing fence, a byte
convention, a worker clean-up) then had to be made three times, and the copies drifted. They
live here once, one job a function.

Stdlib-only at import: torch, transformers and deepspeed are imported inside the functions, so a
driver process (which only spawns workers and writes JSON) never pays for them, and the worker's
process-group set-up stays in the order the benches need (collective counter before DeepSpeed).
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import itertools
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
import traceback

BENCH = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(BENCH)
if REPO not in sys.path:
    sys.path.insert(0, REPO)

# Every system in every bench trains with the same AdamW, so the comparisons are like for like.
ADAMW = dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
# The NVLink-multicast / accelerator switches bench/gpu.sh exports; recorded in each JSON
# so a result says under which settings it was taken.
ENV_KEYS = ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS", "DS_ACCELERATOR")


# ============================================================================ device
def device():
    """The current CUDA device, or the CPU (the --cpu-smoke runs)."""
    import torch

    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def sync():
    """Wait for queued device work, so a wall-clock interval covers the kernels it launched."""
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def profiled(step_fn):
    """(profiler, wall seconds) of one `step_fn()` under torch.profiler (CPU, and CUDA when present),
    the device drained before and after so the wall time covers the step's kernels."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    sync()
    t = time.perf_counter()
    with profile(activities=acts) as prof:
        step_fn()
        sync()
    return prof, time.perf_counter() - t


def device_time_us(evt, self_: bool = True) -> float:
    """A profiler event's device time in microseconds, self or inclusive, under whichever name this
    torch gives it (device_* since 2.4, cuda_* before)."""
    names = ("self_device_time_total", "self_cuda_time_total") if self_ else ("device_time_total", "cuda_time_total")
    for n in names:
        v = getattr(evt, n, None)
        if v is not None:
            return float(v)
    return 0.0


def close_process_group() -> None:
    """Destroy the process group a single-process bench opened, if any (teardown: errors ignored)."""
    with contextlib.suppress(Exception):
        from deepspeed import comm as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def barrier():
    """Line the ranks up before a timed step, so the slowest rank's time is the step's time."""
    from deepspeed import comm as dist

    dist.barrier()


def deterministic_kernels() -> None:
    """Kernels that give the same bits run after run (before the first CUDA work of the process): torch's
    deterministic algorithms (warn_only), a fixed cuBLAS workspace and the math attention backend."""
    import torch

    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # read when cuBLAS first starts
    torch.use_deterministic_algorithms(True, warn_only=True)
    # Under warn_only, flash and cuDNN attention keep their non-deterministic backward (they only
    # warn: the first GPU bit check, two blocking runs, differed from step 1 on); the math backend
    # is plain GEMMs and softmax, deterministic under the fixed cuBLAS workspace.
    for backend in ("flash", "mem_efficient", "cudnn"):
        getattr(torch.backends.cuda, f"enable_{backend}_sdp")(False)
    torch.backends.cuda.enable_math_sdp(True)


def mem_gib(kind: str) -> float | None:
    """Device memory in GiB, "peak" (max allocated since the last reset) or now; None on the CPU."""
    import torch

    if not torch.cuda.is_available():
        return None
    value = torch.cuda.max_memory_allocated() if kind == "peak" else torch.cuda.memory_allocated()
    return round(value / 2**30, 3)


def peak_gib() -> float | None:
    """Peak allocated device memory in GiB (None on the CPU)."""
    return mem_gib("peak")


# ============================================================================ what ran where
def versions(nccl: bool = True) -> dict:
    """Library versions for the JSON; `nccl` adds NCCL's (multi-GPU benches: it carries their links)."""
    import torch
    import transformers

    out = {"python": sys.version.split()[0], "torch": torch.__version__, "transformers": transformers.__version__,
           "cuda": torch.version.cuda}
    if nccl:
        try:
            out["nccl"] = ".".join(str(x) for x in torch.cuda.nccl.version()) if torch.cuda.is_available() else None
        except Exception as err:  # noqa: BLE001
            out["nccl"] = f"? {err}"
    try:
        import deepspeed

        out["deepspeed"] = deepspeed.__version__
    except Exception as err:  # noqa: BLE001
        out["deepspeed"] = f"unavailable: {err}"
    return out


def cards() -> dict:
    """Every visible GPU's name, and the first one's memory and SM count (a multi-GPU run's machine)."""
    import torch

    if not torch.cuda.is_available():
        return {"name": "cpu", "count": 0}
    names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    p = torch.cuda.get_device_properties(0)
    return {"name": names[0], "names": names, "count": len(names), "total_mem_gib": round(p.total_memory / 2**30, 1),
            "sms": p.multi_processor_count}


# ============================================================================ model and data
def add_model_args(p) -> None:
    """The model and batch flags of the multi-GPU benches (defaults: the paper's 178M GPU shape)."""
    p.add_argument("--shape", default="178M", help="hetloco_ds.presets name")
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--micro", type=int, default=4, help="micro-batch per GPU")
    p.add_argument("--gas", type=int, default=8, help="gradient_accumulation_steps (pipeline micro-batches)")


def llama_config(shape: str, vocab: int, seq: int):
    """The preset's LlamaConfig, its position table stretched to at least `seq`."""
    from hetloco_ds.presets import model_config_for

    cfg = model_config_for(shape, vocab)
    cfg.max_position_embeddings = max(cfg.max_position_embeddings, seq)
    return cfg


def batches(cfg, micro: int, seq: int, seed: int = 1234, n: int = 4):
    """An endless cycle of `n` random (ids, labels) batches on the device; same seed = same batches.
    Few distinct batches, made up front: the timed steps never wait on data."""
    import torch

    g = torch.Generator(device="cpu").manual_seed(seed)
    data = []
    for _ in range(n):
        ids = torch.randint(0, cfg.vocab_size, (micro, seq), generator=g).to(device())
        data.append((ids, ids))
    return itertools.cycle(data)


# ============================================================================ the two systems
def base_config(micro: int, gas: int) -> dict:
    """The DeepSpeed config keys both systems share: batch shape, clipping 1.0, DeepSpeed's own step
    prints off (they would land inside timed steps)."""
    return {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": gas,
        "gradient_clipping": 1.0,
        "steps_per_print": 10**9,
    }


def ours_config(micro: int, gas: int, stages: int, bf16: bool, inner_steps: int, subspace: dict, seq: int,
                vocab_size: int, **train) -> dict:
    """Our engine's DeepSpeed-style config as every bench runs it: clipping 1.0, ADAMW, SparseLoCo
    (outer lr 1, error decay 0.95, top-32 of 4096-chunks) every `inner_steps`; `train` adds
    hetloco.train keys (e.g. compile)."""
    return {
        **base_config(micro, gas),
        "pipeline": {"stages": stages},
        "optimizer": {"type": "AdamW", "params": {"lr": ADAMW["lr"], "betas": list(ADAMW["betas"]),
                                                  "eps": ADAMW["eps"], "weight_decay": ADAMW["weight_decay"]}},
        "bf16": {"enabled": bf16},
        "hetloco": {
            "sparseloco": {"enabled": True, "inner_steps": inner_steps, "outer_lr": 1.0, "error_decay": 0.95,
                           "topk": 32, "chunk_size": 4096},
            "subspace": subspace,
            "train": {"seq_len": seq, "vocab_size": vocab_size, **train},
        },
    }


def build_ours(raw: dict, cfg, seq: int, source: str):
    """(module, engine) of our HetlocoEngine from `raw`, weights from seed 0 (as the stock build)."""
    import torch

    from hetloco_ds.config import parse_config
    from hetloco_ds.build import build_engine, build_module

    run = parse_config(raw, source=source)
    torch.manual_seed(0)
    module = build_module(run, cfg)
    return module, build_engine(run, module, seq_len=seq)


def ours_part_info(engine, module, cfg, compressed: bool = False) -> dict:
    """A worker's layout and sizes under our engine (k = the stage link's width, id_bytes = its ids');
    `compressed` adds whether this replica's boundary codec compresses."""
    from hetloco_ds import sizes

    width = engine.module.codec.width
    info = dict(stage=engine.stage_id, replica=engine.replica, num_stages=engine.num_stages,
                num_replicas=engine.num_replicas, ratio_engine=cfg.hidden_size // width,
                schedule=engine.schedule)
    if compressed:
        info["compressed"] = engine.module.codec.compressed
    info.update(n_params_local=sum(p.numel() for p in engine.trainable_params()),
                k=width, id_bytes=sizes.id_bytes(cfg.vocab_size),
                parts=list(getattr(module, "parts", [])), optimizer=type(engine.optimizer).__name__)
    return info


def stock_config(micro: int, gas: int, bf16: bool) -> dict:
    """Stock DeepSpeed's config as every bench runs it: clipping 1.0, bf16.enabled (bf16 weights,
    BF16_Optimizer), ZeRO 0 (the pipeline engine's only stage)."""
    return {**base_config(micro, gas), "bf16": {"enabled": bf16}, "zero_optimization": {"stage": 0}}


def build_stock(cfg, config: dict, partition_method: str, **layout):
    """(module, params, engine) of stock DeepSpeed's PipelineEngine over our LayerSpecs, weights from
    seed 0; `layout` is PipelineModule's num_stages= or topology=. A torch AdamW is passed in:
    DeepSpeed wraps it (BF16_Optimizer under bf16) and builds no fused op (no JIT build on the card)."""
    import deepspeed
    import torch
    from deepspeed.pipe import PipelineModule

    from hetloco_ds.model import causal_lm_loss
    from hetloco_ds.pipe.module import layer_specs

    torch.manual_seed(0)
    module = PipelineModule(layers=layer_specs(cfg), loss_fn=causal_lm_loss, partition_method=partition_method,
                            activation_checkpoint_interval=0, **layout)
    params = [p for p in module.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, **ADAMW)
    engine, _, _, _ = deepspeed.initialize(model=module, optimizer=optimizer, model_parameters=params,
                                           config=config, dist_init_required=False)
    return module, params, engine


def stock_p2p_meter():
    """A ByteMeter that counts the *stock* DeepSpeed engine's pipeline sends and receives (kind
    "control"), for comparison rows: wraps deepspeed.runtime.pipe.p2p.send/recv once per process.
    Measurement instrumentation of the baseline only; hetloco_ds's engine counts its own bytes."""
    import deepspeed.runtime.pipe.p2p as ds_p2p

    from hetloco_ds.meter import ByteMeter, nbytes as tensor_bytes

    meter = getattr(ds_p2p, "_bench_meter", None)
    if meter is not None:
        return meter
    meter = ByteMeter()
    send, recv = ds_p2p.send, ds_p2p.recv

    def counted_send(tensor, dest_stage, async_op=False):
        meter.add("sent", tensor_bytes(tensor), "control")
        return send(tensor, dest_stage, async_op=async_op)

    def counted_recv(tensor, src_stage, async_op=False):
        result = recv(tensor, src_stage, async_op=async_op)
        meter.add("recv", tensor_bytes(tensor), "control")
        return result

    ds_p2p.send, ds_p2p.recv, ds_p2p._bench_meter = counted_send, counted_recv, meter
    return meter


def stock_part_info(engine, module, params, cfg) -> dict:
    """A worker's layout and sizes under stock DeepSpeed, with the dtypes its bf16 mode picked; its
    stage link is the full hidden (k = d) plus int64 ids (8 bytes)."""
    opt = engine.optimizer
    return dict(stage=engine.stage_id, replica=engine.grid.data_parallel_id, num_stages=engine.num_stages,
                num_replicas=engine.grid.data_parallel_size, n_params_local=sum(p.numel() for p in params),
                parts=list(module.parts), optimizer=type(opt).__name__,
                param_dtype=str(next(module.parameters()).dtype),
                grad_acc_dtype=str(getattr(opt, "grad_acc_dtype", None)),
                communication_data_type=str(engine.communication_data_type), k=cfg.hidden_size, id_bytes=8)


# ============================================================================ collective bytes
class CollectiveCounter:
    """Payload bytes of torch.distributed collectives while `active`: by op, or, with `classify`
    (group -> label), by that label then op. Payload convention: all_reduce of N bytes = N sent + N
    received per rank; all_gather = own part sent, the others' parts received."""

    def __init__(self, classify=None) -> None:
        self.active = False
        self.ops: dict = {}
        self.classify = classify

    def take(self) -> dict:
        """What was counted since the last take, and a fresh start."""
        ops, self.ops = self.ops, {}
        return ops

    def add(self, name: str, sent: int, recv: int, where: str | None = None) -> None:
        ops = self.ops if where is None else self.ops.setdefault(where, {})
        o = ops.setdefault(name, {"calls": 0, "sent": 0, "recv": 0})
        o["calls"] += 1
        o["sent"] += int(sent)
        o["recv"] += int(recv)


def nbytes(t) -> int:
    """Payload bytes of one tensor."""
    return t.numel() * t.element_size()


def _arg(a, k, i, name, default=None):
    if name in k:
        return k[name]
    return a[i] if len(a) > i else default


def install_collective_counter(counter: CollectiveCounter) -> None:
    """Wrap torch.distributed's collectives to feed `counter`. Call it before DeepSpeed starts: its
    backend caches all_gather_into_tensor, and a later wrap would miss those calls."""
    import torch.distributed as td

    def broadcast_bytes(*a, **k):
        t, src = _arg(a, k, 0, "tensor"), _arg(a, k, 1, "src")
        return (nbytes(t), 0) if td.get_rank() == src else (0, nbytes(t))

    def all_gather_bytes(*a, **k):
        lst, t = _arg(a, k, 0, "tensor_list"), _arg(a, k, 1, "tensor")
        return nbytes(t), sum(nbytes(x) for x in lst) - nbytes(t)

    def into_tensor_bytes(*a, **k):
        out, inp = _arg(a, k, 0, "output_tensor"), _arg(a, k, 1, "input_tensor")
        return nbytes(inp), nbytes(out) - nbytes(inp)

    def reduce_scatter_bytes(*a, **k):
        out, inp = _arg(a, k, 0, "output"), _arg(a, k, 1, "input")
        return nbytes(inp), nbytes(out)

    def all_reduce_bytes(*a, **k):
        n = nbytes(_arg(a, k, 0, "tensor"))
        return n, n

    def coalesced_bytes(*a, **k):
        n = sum(nbytes(t) for t in _arg(a, k, 0, "tensors"))
        return n, n

    # (payload measure, positional index of `group`)
    measures = {"all_reduce": (all_reduce_bytes, 2), "broadcast": (broadcast_bytes, 2),
                "all_gather": (all_gather_bytes, 2), "all_gather_into_tensor": (into_tensor_bytes, 2),
                "reduce_scatter_tensor": (reduce_scatter_bytes, 3), "all_reduce_coalesced": (coalesced_bytes, 2)}
    for name, (measure, gpos) in measures.items():
        orig = getattr(td, name, None)
        if orig is None or getattr(orig, "_bench_wrapped", False):
            continue

        def make(orig=orig, name=name, measure=measure, gpos=gpos):
            @functools.wraps(orig)
            def wrapped(*a, **k):
                if counter.active:
                    where = None
                    try:
                        s, r = measure(*a, **k)
                        if counter.classify is not None:
                            where = counter.classify(_arg(a, k, gpos, "group"))
                    except Exception:  # noqa: BLE001 - counting must never break the call
                        s, r = -1, -1
                        where = "unknown" if counter.classify is not None else None
                    counter.add(name, s, r, where)
                return orig(*a, **k)

            wrapped._bench_wrapped = True
            return wrapped

        setattr(td, name, make())


# ============================================================================ timing
def timed_call(fn, counter: CollectiveCounter, count: bool = True):
    """(fn()'s result, seconds, collectives) of one call between a device sync + barrier before and a
    device sync after; the counter counts only inside the interval, and only when `count`."""
    sync()
    barrier()
    counter.take()
    counter.active = count
    t = time.perf_counter()
    out = fn()
    sync()
    dt = time.perf_counter() - t
    counter.active = False
    return out, dt, counter.take()


def stage_hash(params) -> dict:
    """sha256 over the bytes of `p.detach().cpu()` of `params`, in order."""
    import torch

    t = time.perf_counter()
    h = hashlib.sha256()
    n, dtypes = 0, set()
    for p in params:
        a = p.detach().cpu().contiguous()
        dtypes.add(str(a.dtype))
        h.update(a.reshape(-1).view(torch.uint8).numpy())
        n += nbytes(a)
    return {"sha256": h.hexdigest(), "tensors": len(params), "bytes": n, "dtypes": sorted(dtypes),
            "seconds": round(time.perf_counter() - t, 3)}


def same(values) -> bool:
    """True when every value (JSON-comparable) is equal: per-step byte records should not vary."""
    return len(set(json.dumps(v, sort_keys=True) for v in values)) <= 1


# ============================================================================ worker side
def run_worker(args, counter: CollectiveCounter, body, system: str | None = None, spec: dict | None = None) -> int:
    """One rank of configuration args.worker: threads / TF32, the collective counter, our process
    group; then `body(cfg, part)`, its errors caught into the rank's `part` (the driver stops the
    peers); `part` written to args.part; a clean exit tears the process group down. `system` and
    `spec` go into `part` as given. Returns the exit code."""
    import faulthandler

    import torch

    # A hung rank's Python stacks on request: spawn_workers sends SIGUSR1 before stopping a timed-out one.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    if args.cpu_smoke:
        torch.set_num_threads(1)  # 2 shared cores here: oversubscribed OpenMP is far slower
    if torch.cuda.is_available():
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    install_collective_counter(counter)
    from hetloco_ds.build import init_distributed

    init_distributed()  # our patches (p2p meter, no CPU shm build), then deepspeed.init_distributed
    rank = int(os.environ["RANK"])
    part = {"config": args.worker, "cpu_cores": len(os.sched_getaffinity(0))}
    if system is not None:
        part["system"] = system
    part["rank"] = rank
    if spec is not None:
        part["spec"] = spec
    part.update(local_rank=int(os.environ.get("LOCAL_RANK", 0)), device=str(device()))
    code = 0
    t0 = time.perf_counter()
    try:
        cfg = llama_config(args.shape, args.vocab, args.seq)
        part.update(hidden_size=cfg.hidden_size, num_layers=cfg.num_hidden_layers, vocab=cfg.vocab_size)
        if rank == 0:
            part.update(card=cards(), versions=versions())
        body(cfg, part)
    except Exception as err:  # noqa: BLE001 - reported; the driver stops the peers
        part["error"] = f"{type(err).__name__}: {err}"
        part["traceback"] = traceback.format_exc()[-4000:]
        print(part["traceback"], flush=True)
        code = 1
    part["wall_s"] = time.perf_counter() - t0
    with open(args.part, "w") as f:
        json.dump(part, f, default=str)
    if code == 0:
        try:
            from deepspeed import comm as dist

            dist.barrier()
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001
            pass
    return code


# ============================================================================ driver side
def worker_argv(args, options: list[str], switches: list[str]) -> list[str]:
    """The driver's flags a worker needs: `options` with their values (left out when None: the
    worker takes the same default), `switches` when set. Workers never get --out / --configs or
    other driver-only flags."""
    out = []
    for opt in options:
        value = getattr(args, opt[2:].replace("-", "_"))
        out += [] if value is None else [opt, str(value)]
    return out + [sw for sw in switches if getattr(args, sw[2:].replace("-", "_"))]


def spawn_workers(script: str, name: str, world: int, argv: list[str], tmp: str, timeout: float,
                  cpu_smoke: bool, tag: str, tail_chars: int,
                  bind_cores: bool = False) -> tuple[list[dict], str | None, float]:
    """Every rank of one configuration in fresh processes (`script` --worker name); returns (parts,
    error, wall seconds). Rank 0 prints live; the others log to files whose tails are printed and
    kept when a rank fails. The first failure or the timeout stops the rest; so does SIGTERM to the
    driver (the workers share its process group, which `timeout` in bench/gpu.sh signals).
    `bind_cores`: each rank pinned to its own share of the cores (`launch.core_shares`), OpenMP sized
    to it; otherwise unpinned, OpenMP sized to the driver's cores shared out (`launch.threads_per_rank`,
    as `hetloco-ds train --nproc` does: the machine's count shared out would oversubscribe a `taskset`
    driver)."""
    from hetloco_ds.launch import core_shares, free_port, threads_per_rank

    port = free_port()
    shares = core_shares(world) if bind_cores else None
    procs, logs, parts, handles = [], [], [], []
    start = time.perf_counter()
    try:
        for rank in range(world):
            env = dict(os.environ)
            env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                       MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), PYTHONUNBUFFERED="1")
            # As `hetloco-ds train --nproc` sizes them: from the cores this driver may use, not the machine's.
            env.setdefault("OMP_NUM_THREADS", "1" if cpu_smoke else str(threads_per_rank(world)))
            if shares:
                env["OMP_NUM_THREADS"] = "1" if cpu_smoke else str(len(shares[rank]))
            env["PYTHONPATH"] = REPO + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
            part = os.path.join(tmp, f"{name}.rank{rank}.json")
            parts.append(part)
            cmd = [sys.executable, os.path.abspath(script), *argv, "--worker", name, "--part", part]
            if rank == 0:
                out, log = None, None  # live on the driver's stdout
            else:
                log = os.path.join(tmp, f"{name}.rank{rank}.log")
                out = open(log, "w")
                handles.append(out)
            logs.append(log)
            pin = (lambda cores=shares[rank]: os.sched_setaffinity(0, cores)) if shares else None
            procs.append(subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT if out else None,
                                          preexec_fn=pin))
        error = None
        pending = list(range(world))
        while pending:
            for r in list(pending):
                rc = procs[r].poll()
                if rc is None:
                    continue
                pending.remove(r)
                if rc != 0 and error is None:
                    error = f"rank {r} exited with {rc}"
                    time.sleep(3)  # let the peers finish writing their parts if they can
                    for o in pending:
                        stop(procs[o])
            if pending and time.perf_counter() - start > timeout:
                error = error or f"timeout after {timeout:.0f} s"
                stacks = dump_stacks([procs[o] for o in pending], tmp, name, list(pending))
                for o in pending:
                    stop(procs[o])
                if stacks:
                    print(f"[{tag}] {name}: stacks of the hung ranks in {stacks}", flush=True)
            time.sleep(0.2)
    finally:  # SIGTERM (driver_setup turns it into SystemExit) or any error: no worker outlives us
        for p in procs:
            stop(p)
        for f in handles:
            f.close()
    wall = time.perf_counter() - start
    loaded = []
    for r, path in enumerate(parts):
        if os.path.exists(path):
            with open(path) as f:
                loaded.append(json.load(f))
        else:
            loaded.append({"rank": r, "error": "no part written"})
    if error:
        for r, log in enumerate(logs):
            if log and os.path.exists(log):
                with open(log) as f:
                    tail = f.read()[-tail_chars:]
                print(f"[{tag}] {name}: rank {r} log tail:\n{tail}", flush=True)
                loaded[r]["log_tail"] = tail
    return loaded, error, wall


def dump_stacks(procs: list, tmp: str, name: str, ranks: list[int]) -> list[str]:
    """Before a timed-out configuration is stopped: each hung rank's Python stacks (SIGUSR1 to
    faulthandler, into its log or the driver's stdout) and, where py-spy is installed, its native
    and Python stacks into TMP/NAME.rankR.stack.txt; returns those files. A hang then says where."""
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGUSR1)
    time.sleep(2)
    spy = shutil.which("py-spy") or (os.path.exists("/tmp/site/bin/py-spy") and "/tmp/site/bin/py-spy")
    files = []
    for p, r in zip(procs, ranks):
        if not spy or p.poll() is not None:
            continue
        path = os.path.join(tmp, f"{name}.rank{r}.stack.txt")
        try:
            res = subprocess.run([spy, "dump", "--native", "--pid", str(p.pid)], capture_output=True, text=True,
                                 timeout=30)
            text = res.stdout + res.stderr
        except (OSError, subprocess.TimeoutExpired) as e:
            text = f"py-spy failed: {e}"
        with open(path, "w") as f:
            f.write(text)
        print(f"[stacks] {name} rank {r}:\n{text[-6000:]}", flush=True)
        files.append(path)
    return files


def stop(proc) -> None:
    """SIGTERM, then SIGKILL, to one worker this driver started (by its pid)."""
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def default_out(filename: str) -> str:
    """$OUT/<filename> on the device machine, else bench/results/<filename>."""
    if os.environ.get("OUT"):
        return os.path.join(os.environ["OUT"], filename)
    return os.path.join(REPO, "bench", "results", filename)


def driver_setup(args, filename: str) -> str:
    """SIGTERM becomes SystemExit (so spawn_workers' clean-up runs); returns the JSON path, its folder made."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    out_path = args.out or default_out(filename)
    os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
    return out_path


def pick_configs(names: list[str], wanted_csv: str, choices) -> list[str]:
    """`names` in their order, cut to the comma-separated `wanted_csv` when given; unknown names stop the run."""
    if not wanted_csv:
        return list(names)
    wanted = [c for c in wanted_csv.split(",") if c]
    bad = [w for w in wanted if w not in names]
    if bad:
        raise SystemExit(f"unknown configs {bad}; choose from {choices}")
    return [n for n in names if n in wanted]


def new_report(args, launch: str, conventions: str) -> dict:
    """A multi-GPU report's head: card and versions (filled from rank 0's part), the command line, the
    driver's settings, the NVLink/accelerator env, how it was launched, the byte conventions."""
    return {
        "card": None, "versions": None,
        "command": " ".join(shlex.quote(a) for a in [sys.executable] + sys.argv),
        "settings": {k: v for k, v in vars(args).items() if k not in ("worker", "part")},
        "env": {k: os.environ.get(k) for k in ENV_KEYS},
        "launch": launch,
        "conventions": conventions,
        "results": [],
    }


def config_row(report: dict, name: str, parts: list[dict], error: str | None, summarize) -> tuple[dict, bool]:
    """(row, ok) of one configuration from its workers' parts: the error row if any rank failed, else
    summarize(); a summarize failure keeps the raw parts. Takes card/versions from the first rank 0 that has them."""
    errors = [p.get("error") for p in parts if p.get("error")]
    if report["card"] is None and parts[0].get("card"):
        report["card"], report["versions"] = parts[0]["card"], parts[0]["versions"]
    if error or errors:
        return {"config": name, "error": error or errors[0], "rank_errors": errors,
                "tracebacks": [p.get("traceback") for p in parts if p.get("traceback")]}, False
    try:
        return summarize(), True
    except Exception as err:  # noqa: BLE001 - keep the raw parts
        return {"config": name, "error": f"summarize: {type(err).__name__}: {err}",
                "traceback": traceback.format_exc()[-3000:], "raw_parts": parts}, False


def finish_report(report: dict, out_path: str, t0: float, print_tables, tag: str, ok: bool) -> int:
    """The driver's last act: the final JSON, the printed tables, where it went; the exit code."""
    write_report(report, out_path, t0)
    if report["card"] is None:  # no rank 0 ever reported: print with empty cells
        report["card"], report["versions"] = {}, {}
    print_tables(report)
    print(f"[{tag}] wrote {out_path} ({report['elapsed_s']:.0f} s)", flush=True)
    return 0 if ok else 1


def run_main(parse_args, worker_main, driver_main, argv=None) -> int:
    """A bench script's entry: one rank's work under --worker (the driver spawns those), else the driver."""
    args = parse_args(argv)
    return worker_main(args) if args.worker else driver_main(args)


def write_report(report: dict, out_path: str, t0: float) -> None:
    """Stamp elapsed_s and (re)write the JSON: after every configuration, so a killed run keeps the rows it has."""
    report["elapsed_s"] = time.perf_counter() - t0
    with open(out_path, "w") as f:
        json.dump(report, f, indent=2, default=str)


def fmt_bytes(n) -> str:
    """MiB / KiB / bytes, for the printed table (the JSON has exact integers)."""
    if n is None:
        return "-"
    return f"{n / 2**20:.2f}M" if n >= 2**20 else (f"{n / 2**10:.1f}K" if n >= 2**10 else f"{n:.0f}")


def versions_line(report: dict) -> str:
    """The printed tables' first line: the cards and the library versions."""
    c = report.get("card") or {}
    v = report.get("versions") or {}
    return (f"\n{c.get('names', c.get('name'))}  torch {v.get('torch')}  deepspeed {v.get('deepspeed')}  "
            f"transformers {v.get('transformers')}  nccl {v.get('nccl')}")
