"""Two GPUs, one process each: the stage link (S = 2) and the replica link (M = 2), ours vs stock DeepSpeed.

Configurations, each in 2 fresh processes (one per GPU, spawned by this script), in this order:
  a_ours_r1    HetlocoEngine, S = 2, M = 1, uncompressed boundary (subspace.compressed_replicas "none")
  a_ds         stock DeepSpeed PipelineEngine (deepspeed.initialize), S = 2: a plain
               deepspeed.pipe.PipelineModule over hetloco_ds.pipe.module.layer_specs(config),
               partition_method "type:DecoderLayer", bf16.enabled (bf16 weights, BF16_Optimizer), a torch
               AdamW passed in
  a_ours_r8    HetlocoEngine, S = 2, M = 1, subspace {"ratio": 8, "compressed_replicas": "all"}
  a_ours_r64   the same at ratio 64
  b_ours_sl    HetlocoEngine, S = 1, M = 2, SparseLoCo H = `--inner-steps` (50): inner steps timed on their
               own, then `--outer-repeats` outer steps (each after one untimed inner step) timed on their own
  b_ds_dp      stock DeepSpeed PipelineEngine, S = 1, M = 2 (data parallel; gradient all-reduce every step)

Every configuration: preset `--shape` (178M), vocab 32000, seq 2048, random tokens, micro-batch `--micro`
(4) x gradient_accumulation_steps `--gas` (8) per optimizer step and replica (so an S = 2 pipeline runs 8
micro-batches per step), gradient clipping 1.0, AdamW(lr 1e-3, betas (0.9, 0.95), wd 0.1), bf16.
Ours: bf16 autocast over fp32 weights; the stage link carries bf16 (ids int16 on compressed boundaries).
Stock: bf16 weights; its stage link carries the layers' (hidden bf16, ids int64) pair.

Two bench-side guards, each recorded per configuration in the JSON and a no-op once the package
no longer needs it (see their docstrings): `guard_nccl_int16_ids` (ours, compressed: NCCL cannot
send int16, so the int16 ids travel as their 2 raw bytes each) and `guard_stock_residual_dtype`
(stock: hetloco_ds.model.residual_dtype upcasts the embedding output to fp32 outside autocast, which
breaks DeepSpeed's bf16-weights mode).

Timing: each step is `train_batch` between a device synchronisation + barrier before and a device
synchronisation after, on each rank; a step's time is the slower rank's; reported: median of `--steps`
(8) steps after `--warmup` (3).

Bytes (per optimizer step):
  ours     StepRecord.bytes (hetloco_ds.meter: every pipeline p2p send/recv, by kind; summed over the
           replica's ranks); for (a) the analytic stage-link value next to it:
             activation      gas * (b*L*k*2 [bf16] + b*L*id_bytes [ids, compressed only])
             activation_grad gas * b*L*k*2                  (k = d / ratio; k = d uncompressed)
  stock    the same p2p meter (our patches wrap deepspeed.runtime.pipe.p2p.send/recv, which the stock
           engine calls too), unlabelled: on S = 2 stage 0 sends only activations and stage 1 only
           activation gradients; analytic: gas * (b*L*d*2 + b*L*8) forward, gas * b*L*d*2 backward.
  collectives  every torch.distributed all_reduce / all_gather / all_gather_into_tensor /
           reduce_scatter_tensor / broadcast call a timed step makes, wrapped here before DeepSpeed
           starts (payload convention: all_reduce of N bytes = N sent + N received per rank; all_gather
           = own part sent, the others' parts received). For b_ds_dp this is the measured data-parallel
           traffic; its analytic value: BF16_Optimizer (bf16 + ZeRO 0 + pipeline, grad_accum_dtype
           default = bf16) all-reduces the flat bf16 gradient buffer (P*2 bytes, communication_data_type
           bf16) and, after its step on its 1/M shard of fp32 master weights, all-gathers the bf16
           parameters (P*2/M sent, P*2*(M-1)/M received per rank): sent per rank = P*2 + P*2/M.
           Ring wire bytes per rank: 2(M-1)/M * P*2 + (M-1)/M * P*2 (= 3P at M = 2).
           For b_ours_sl the outer step is one all_gather of the SparseLoCo payload q (q sent, q*(M-1)
           received per rank); per step amortised: /H.

    python bench/gpu_two.py --out $OUT/gpu_two.json       # the GPU run (bench/run_gpu2.sh)
    python bench/gpu_two.py --cpu-smoke                   # tiny, seq 64, gloo, 2 ranks, 1+2 steps
"""
from __future__ import annotations

import argparse
import functools
import itertools
import json
import os
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

ADAMW = dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
WORLD = 2


def config_list(ratios: list[int]) -> list[dict]:
    out = [dict(name="a_ours_r1", system="ours", stages=2, ratio=1)]
    out.append(dict(name="a_ds", system="ds", stages=2, ratio=1))
    out += [dict(name=f"a_ours_r{r}", system="ours", stages=2, ratio=r) for r in ratios]
    out.append(dict(name="b_ours_sl", system="ours", stages=1, ratio=1))
    out.append(dict(name="b_ds_dp", system="ds", stages=1, ratio=1))
    return out


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="178M", help="hetloco_ds.presets name")
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--micro", type=int, default=4, help="micro-batch per GPU")
    p.add_argument("--gas", type=int, default=8, help="gradient_accumulation_steps (pipeline micro-batches)")
    p.add_argument("--ratios", default="8,64", help="compressed S = 2 configurations")
    p.add_argument("--configs", default="", help="comma-separated subset of the configuration names")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--inner-steps", type=int, default=50, help="H of b_ours_sl")
    p.add_argument("--outer-repeats", type=int, default=4, help="outer steps timed in b_ours_sl (first dropped)")
    p.add_argument("--no-bf16", action="store_true", help="fp32 everywhere (fallback)")
    p.add_argument("--ids-as-bytes", action="store_true",
                   help="carry int16 ids as uint8 bytes on gloo too (always on under NCCL; see guard_nccl_int16_ids)")
    p.add_argument("--config-timeout", type=float, default=120.0, help="seconds per configuration (both ranks)")
    p.add_argument("--time-budget", type=float, default=300.0,
                   help="seconds; a configuration that would start after this is skipped")
    p.add_argument("--out", default=None, help="JSON path (default $OUT/gpu_two.json or bench/results/)")
    p.add_argument("--cpu-smoke", action="store_true", help="preset tiny, vocab 1024, seq 64, micro 2, gas 2, 1+2 steps, gloo")
    # internal: one rank of one configuration
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--part", default=None, help=argparse.SUPPRESS)
    if "--cpu-smoke" in (sys.argv[1:] if argv is None else argv):  # defaults only: explicit flags win
        p.set_defaults(shape="tiny", vocab=1024, seq=64, micro=2, gas=2, warmup=1, steps=2, outer_repeats=2,
                       config_timeout=400.0, time_budget=3000.0)
    return p.parse_args(argv)


# ============================================================================ worker side
class CollectiveCounter:
    """Payload bytes of torch.distributed collectives while `active` (see the module docstring)."""

    def __init__(self) -> None:
        self.active = False
        self.ops: dict = {}

    def take(self) -> dict:
        ops, self.ops = self.ops, {}
        return ops

    def add(self, name: str, sent: int, recv: int) -> None:
        o = self.ops.setdefault(name, {"calls": 0, "sent": 0, "recv": 0})
        o["calls"] += 1
        o["sent"] += int(sent)
        o["recv"] += int(recv)


COUNTER = CollectiveCounter()


def _nb(t) -> int:
    return t.numel() * t.element_size()


def _arg(a, k, i, name):
    return k[name] if name in k else a[i]


def install_collective_counter() -> None:
    """Wrap torch.distributed's collectives; before DeepSpeed's backend caches all_gather_into_tensor."""
    import torch.distributed as td

    def broadcast_bytes(*a, **k):
        t, src = _arg(a, k, 0, "tensor"), _arg(a, k, 1, "src")
        return (_nb(t), 0) if td.get_rank() == src else (0, _nb(t))

    def all_gather_bytes(*a, **k):
        lst, t = _arg(a, k, 0, "tensor_list"), _arg(a, k, 1, "tensor")
        return _nb(t), sum(_nb(x) for x in lst) - _nb(t)

    def into_tensor_bytes(*a, **k):
        out, inp = _arg(a, k, 0, "output_tensor"), _arg(a, k, 1, "input_tensor")
        return _nb(inp), _nb(out) - _nb(inp)

    def reduce_scatter_bytes(*a, **k):
        out, inp = _arg(a, k, 0, "output"), _arg(a, k, 1, "input")
        return _nb(inp), _nb(out)

    def all_reduce_bytes(*a, **k):
        n = _nb(_arg(a, k, 0, "tensor"))
        return n, n

    def coalesced_bytes(*a, **k):
        n = sum(_nb(t) for t in _arg(a, k, 0, "tensors"))
        return n, n

    measures = {"all_reduce": all_reduce_bytes, "broadcast": broadcast_bytes, "all_gather": all_gather_bytes,
                "all_gather_into_tensor": into_tensor_bytes, "reduce_scatter_tensor": reduce_scatter_bytes,
                "all_reduce_coalesced": coalesced_bytes}
    for name, measure in measures.items():
        orig = getattr(td, name, None)
        if orig is None or getattr(orig, "_gpu_two_wrapped", False):
            continue

        def make(orig=orig, name=name, measure=measure):
            @functools.wraps(orig)
            def wrapped(*a, **k):
                if COUNTER.active:
                    try:
                        s, r = measure(*a, **k)
                    except Exception:  # noqa: BLE001 - counting must never break the call
                        s, r = -1, -1
                    COUNTER.add(name, s, r)
                return orig(*a, **k)

            wrapped._gpu_two_wrapped = True
            return wrapped

        setattr(td, name, make())


def device():
    import torch

    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def sync():
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def barrier():
    from deepspeed import comm as dist

    dist.barrier()


def llama_config(shape: str, vocab: int, seq: int):
    from hetloco_ds.presets import model_config_for

    cfg = model_config_for(shape, vocab)
    cfg.max_position_embeddings = max(cfg.max_position_embeddings, seq)
    return cfg


def batches(cfg, micro: int, seq: int, seed: int, n: int = 4):
    """An endless cycle of `n` random (ids, labels) batches on the device; same seed = same batches."""
    import torch

    g = torch.Generator(device="cpu").manual_seed(seed)
    data = []
    for _ in range(n):
        ids = torch.randint(0, cfg.vocab_size, (micro, seq), generator=g).to(device())
        data.append((ids, ids))
    return itertools.cycle(data)


def timed_loop(step_fn, warmup: int, steps: int, after_step=None) -> tuple[list, list, list]:
    """Per step: sync + barrier, time step_fn(), sync. Returns (warm-up s, timed s, timed extras)."""
    warm, timed, extras = [], [], []
    for i in range(warmup + steps):
        sync()
        barrier()
        COUNTER.take()
        COUNTER.active = i >= warmup
        t = time.perf_counter()
        out = step_fn()
        sync()
        dt = time.perf_counter() - t
        COUNTER.active = False
        extra = after_step(out) if after_step else {}
        extra["collectives"] = COUNTER.take()
        if i < warmup:
            warm.append(dt)
        else:
            timed.append(dt)
            extras.append(extra)
    return warm, timed, extras


def peak_gib():
    import torch

    return round(torch.cuda.max_memory_allocated() / 2**30, 3) if torch.cuda.is_available() else None


def worker_versions() -> dict:
    import torch
    import transformers

    out = {"python": sys.version.split()[0], "torch": torch.__version__, "transformers": transformers.__version__,
           "cuda": torch.version.cuda}
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


def worker_card() -> dict:
    import torch

    if not torch.cuda.is_available():
        return {"name": "cpu", "count": 0}
    names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    p = torch.cuda.get_device_properties(0)
    return {"name": names[0], "names": names, "count": len(names), "total_mem_gib": round(p.total_memory / 2**30, 1),
            "sms": p.multi_processor_count}


def guard_nccl_int16_ids(args, part) -> None:
    """NCCL has no 16-bit integer type: torch's ProcessGroupNCCL send of an int16 tensor fails
    ("Unconvertible NCCL type Short"), and hetloco_ds.pipe.module.id_dtype_for gives int16 ids for
    vocab <= 32768 (32000 here). On NCCL (or with --ids-as-bytes) a compressed boundary's int16 ids
    cross the link as their raw bytes (uint8, [b, 2L]) and are viewed back as int16 before decoding:
    the same 2 bytes per id, so the metered bytes and the analytic b*L*2 are unchanged. Recorded in
    the JSON; does nothing when the codec no longer emits int16."""
    import torch
    import torch.distributed as td

    from hetloco_ds.pipe import module as pm

    part["ids_as_bytes_guard"] = False
    if not (args.ids_as_bytes or td.get_backend() == "nccl"):
        return
    codec = pm.BoundaryCodec
    if getattr(codec.encode, "_gpu_two_guard", False):
        return
    orig_encode, orig_decode = codec.encode, codec.decode

    def encode(self, outputs):
        out = orig_encode(self, outputs)
        if isinstance(out, tuple) and len(out) == 2 and out[1].dtype == torch.int16:
            return out[0], out[1].contiguous().view(torch.uint8)
        return out

    def decode(self, message):
        if (isinstance(message, (tuple, list)) and len(message) == 2 and message[1].dtype == torch.uint8
                and self.id_dtype == torch.int16):
            message = (message[0], message[1].contiguous().view(torch.int16))
        return orig_decode(self, message)

    encode._gpu_two_guard = True
    codec.encode, codec.decode = encode, decode
    part["ids_as_bytes_guard"] = True


def run_ours(spec, cfg, args, part) -> None:
    import torch

    from hetloco_ds.config import parse_config
    from hetloco_ds.initialize import build_engine, build_module
    from hetloco_ds.meter import get_meter
    from hetloco_ds.pipe.module import id_dtype_for

    stages, ratio = spec["stages"], spec["ratio"]
    b_part = stages == 1
    subspace = ({"ratio": ratio, "compressed_replicas": "all"} if ratio > 1 else {"compressed_replicas": "none"})
    raw = {
        "train_micro_batch_size_per_gpu": args.micro,
        "gradient_accumulation_steps": args.gas,
        "gradient_clipping": 1.0,
        "steps_per_print": 10**9,
        "pipeline": {"stages": stages},
        "optimizer": {"type": "AdamW", "params": {"lr": ADAMW["lr"], "betas": list(ADAMW["betas"]),
                                                  "eps": ADAMW["eps"], "weight_decay": ADAMW["weight_decay"]}},
        "bf16": {"enabled": not args.no_bf16},
        "hetloco": {
            # (a): M = 1, the outer step has no link to cross: H out of reach. (b): H = --inner-steps,
            # never reached inside the timed steps; the outer steps are timed on their own.
            "sparseloco": {"enabled": True, "inner_steps": args.inner_steps if b_part else 10**9,
                           "outer_lr": 1.0, "error_decay": 0.95, "topk": 32, "chunk_size": 4096},
            "subspace": subspace,
            "train": {"seq_len": args.seq, "vocab_size": max(256, cfg.vocab_size)},
        },
    }
    part["ds_config"] = raw
    if ratio > 1:
        guard_nccl_int16_ids(args, part)
    run = parse_config(raw, source="bench/gpu_two.py")
    torch.manual_seed(0)
    module = build_module(run, cfg)
    engine = build_engine(run, module, seq_len=args.seq)
    part.update(stage=engine.stage_id, replica=engine.replica, num_stages=engine.num_stages,
                num_replicas=engine.num_replicas, ratio_engine=engine.ratio,
                n_params_local=sum(p.numel() for p in engine.trainable_params()),
                k=cfg.hidden_size // engine.ratio,
                id_bytes=torch.empty((), dtype=id_dtype_for(cfg.vocab_size)).element_size(),
                parts=list(getattr(module, "parts", [])), optimizer=type(engine.optimizer).__name__)
    seed = 1234 + (engine.replica if b_part else 0)  # stages of one replica read the same batches
    data = batches(cfg, args.micro, args.seq, seed)

    def step():
        return engine.train_batch(data)

    def after(rec):
        return {"loss": rec.loss, "bytes": rec.bytes, "outer": rec.outer, "tokens": rec.tokens}

    warm, timed, extras = timed_loop(step, args.warmup, args.steps, after)
    part.update(warm_s=warm, step_s=timed, steps=extras, peak_mem_gib=peak_gib())
    if b_part:
        meter = get_meter()
        outer = []
        for _ in range(args.outer_repeats):
            engine.train_batch(data)  # a fresh pseudo-gradient; this step's bytes are in its own record
            meter.since_mark()
            sync()
            barrier()
            COUNTER.take()
            COUNTER.active = True
            t = time.perf_counter()
            rep = engine.outer_step()
            sync()
            dt = time.perf_counter() - t
            COUNTER.active = False
            outer.append({"seconds": dt, "engine_seconds": rep["seconds"], "payload_bytes": rep["payload_bytes"],
                          "excluded": rep["excluded"], "bytes": meter.since_mark(), "collectives": COUNTER.take()})
        part["outer"] = outer
        part["outer_steps_done"] = engine.outer_steps
    part["peak_mem_gib_incl_outer"] = peak_gib()
    part["local_steps"] = engine.local_steps


def guard_stock_residual_dtype(args, part) -> None:
    """Stock DeepSpeed's bf16 mode runs bf16 weights with no autocast. hetloco_ds.model's
    `residual_dtype` (commit d51a6a0) answers float32 outside autocast, so TokenEmbedding would hand
    a float32 hidden state to bf16 linears ("expected m1 and m2 to have the same dtype"). In this
    stock-only process the residual stream keeps the weights' dtype instead (what it did before that
    commit); recorded in the JSON. Does nothing once the package no longer upcasts outside autocast."""
    import torch

    from hetloco_ds import model as hmodel

    fn = getattr(hmodel, "residual_dtype", None)
    part["stock_residual_dtype_guard"] = False
    try:
        upcasts = fn is not None and fn(torch.device("cpu")) == torch.float32
    except Exception:  # noqa: BLE001 - a changed signature: not the function this guards
        upcasts = False
    if not upcasts or args.no_bf16:
        return
    hmodel.residual_dtype = lambda device: (torch.get_autocast_dtype(device.type)
                                            if torch.is_autocast_enabled(device.type) else torch.bfloat16)
    part["stock_residual_dtype_guard"] = True


def run_ds(spec, cfg, args, part) -> None:
    import deepspeed
    import torch
    from deepspeed.pipe import PipelineModule

    from hetloco_ds.meter import get_meter
    from hetloco_ds.model import causal_lm_loss
    from hetloco_ds.pipe.module import layer_specs

    stages = spec["stages"]
    guard_stock_residual_dtype(args, part)
    torch.manual_seed(0)
    module = PipelineModule(layers=layer_specs(cfg), loss_fn=causal_lm_loss, num_stages=stages,
                            partition_method="type:DecoderLayer", activation_checkpoint_interval=0)
    params = [p for p in module.parameters() if p.requires_grad]
    # A torch optimizer passed in: DeepSpeed wraps it (BF16_Optimizer under bf16) and builds no op.
    optimizer = torch.optim.AdamW(params, **ADAMW)
    config = {
        "train_micro_batch_size_per_gpu": args.micro,
        "gradient_accumulation_steps": args.gas,
        "gradient_clipping": 1.0,
        "steps_per_print": 10**9,
        "bf16": {"enabled": not args.no_bf16},
        "zero_optimization": {"stage": 0},
    }
    part["ds_config"] = config
    engine, _, _, _ = deepspeed.initialize(model=module, optimizer=optimizer, model_parameters=params,
                                           config=config, dist_init_required=False)
    opt = engine.optimizer
    part.update(stage=engine.stage_id, replica=engine.grid.data_parallel_id, num_stages=engine.num_stages,
                num_replicas=engine.grid.data_parallel_size, n_params_local=sum(p.numel() for p in params),
                parts=list(module.parts), optimizer=type(opt).__name__,
                param_dtype=str(next(module.parameters()).dtype),
                grad_acc_dtype=str(getattr(opt, "grad_acc_dtype", None)),
                communication_data_type=str(engine.communication_data_type),
                k=cfg.hidden_size, id_bytes=8)
    seed = 1234 + (engine.grid.data_parallel_id if stages == 1 else 0)
    data = batches(cfg, args.micro, args.seq, seed)
    meter = get_meter()  # counts the stock engine's p2p too (patches.p2p_meter), kind "control"

    def step():
        meter.since_mark()
        return float(engine.train_batch(data))

    def after(loss):
        return {"loss": loss, "p2p": meter.since_mark()}

    warm, timed, extras = timed_loop(step, args.warmup, args.steps, after)
    part.update(warm_s=warm, step_s=timed, steps=extras, peak_mem_gib=peak_gib())


def worker_main(args) -> int:
    import torch

    if args.cpu_smoke:
        torch.set_num_threads(1)  # 2 shared cores here
    if torch.cuda.is_available():
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    install_collective_counter()
    from hetloco_ds.initialize import init_distributed

    init_distributed()  # our patches (p2p meter, no CPU shm build), then deepspeed.init_distributed
    rank = int(os.environ["RANK"])
    spec = {c["name"]: c for c in config_list([int(r) for r in args.ratios.split(",") if r])}[args.worker]
    part = {"config": spec["name"], "system": spec["system"], "rank": rank, "spec": spec,
            "local_rank": int(os.environ.get("LOCAL_RANK", 0)), "device": str(device())}
    code = 0
    t0 = time.perf_counter()
    try:
        cfg = llama_config(args.shape, args.vocab, args.seq)
        part.update(hidden_size=cfg.hidden_size, num_layers=cfg.num_hidden_layers, vocab=cfg.vocab_size)
        if rank == 0:
            part.update(card=worker_card(), versions=worker_versions())
        (run_ours if spec["system"] == "ours" else run_ds)(spec, cfg, args, part)
    except Exception as err:  # noqa: BLE001 - reported; the driver stops the peer
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
def spawn_config(name: str, args, tmp: str, argv: list[str]) -> tuple[list[dict], str | None, float]:
    """Both ranks of one configuration in fresh processes; returns (parts, error, wall seconds)."""
    from hetloco_ds.launch import free_port

    port = free_port()
    procs, logs, parts, handles = [], [], [], []
    start = time.perf_counter()
    for rank in range(WORLD):
        env = dict(os.environ)
        env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_WORLD_SIZE=str(WORLD),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), PYTHONUNBUFFERED="1")
        env.setdefault("OMP_NUM_THREADS", "1" if args.cpu_smoke else str(max(1, (os.cpu_count() or 2) // WORLD)))
        env["PYTHONPATH"] = REPO + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        part = os.path.join(tmp, f"{name}.rank{rank}.json")
        parts.append(part)
        cmd = [sys.executable, os.path.abspath(__file__), *argv, "--worker", name, "--part", part]
        if rank == 0:
            out, log = None, None  # live on the driver's stdout
        else:
            log = os.path.join(tmp, f"{name}.rank{rank}.log")
            out = open(log, "w")
            handles.append(out)
        logs.append(log)
        # Same process group as the driver: `timeout` (bench/run_gpu2.sh) signals the whole group.
        procs.append(subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT if out else None))
    error = None
    pending = list(range(WORLD))
    try:
        while pending:
            for r in list(pending):
                rc = procs[r].poll()
                if rc is None:
                    continue
                pending.remove(r)
                if rc != 0 and error is None:
                    error = f"rank {r} exited with {rc}"
                    time.sleep(3)  # let the peer finish writing its part if it can
                    for o in pending:
                        _stop(procs[o])
            if pending and time.perf_counter() - start > args.config_timeout:
                error = error or f"timeout after {args.config_timeout:.0f} s"
                for o in pending:
                    _stop(procs[o])
            time.sleep(0.2)
    finally:  # SIGTERM (driver_main turns it into SystemExit) or any error: no worker outlives us
        for p in procs:
            _stop(p)
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
    if error and logs[1] and os.path.exists(logs[1]):
        with open(logs[1]) as f:
            tail = f.read()[-3000:]
        print(f"[gpu_two] {name}: rank 1 log tail:\n{tail}", flush=True)
        loaded[1]["log_tail"] = tail
    return loaded, error, wall


def _stop(proc) -> None:
    """SIGTERM, then SIGKILL, to one worker this driver started (by its pid)."""
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _same(values) -> bool:
    return len(set(json.dumps(v, sort_keys=True) for v in values)) <= 1


def summarize(name: str, parts: list[dict], args) -> dict:
    """One configuration's row from both ranks' parts."""
    p0 = parts[0]
    res = {"config": name, "system": p0.get("system"), "stages": p0.get("num_stages"),
           "replicas": p0.get("num_replicas"), "micro_batch": args.micro, "gas": args.gas, "seq": args.seq,
           "parts_layers": p0.get("parts"), "optimizer": p0.get("optimizer"),
           "ranks": [{k: v for k, v in p.items() if k not in ("steps", "card", "versions", "ds_config")} for p in parts]}
    for key in ("param_dtype", "grad_acc_dtype", "communication_data_type", "stock_residual_dtype_guard",
                "ids_as_bytes_guard", "ds_config"):
        if key in p0:
            res[key] = p0[key]
    step_lists = [p["step_s"] for p in parts]
    per_step = [max(xs) for xs in zip(*step_lists)]
    step = statistics.median(per_step)
    S, M = res["stages"], res["replicas"]
    tokens_replica = args.micro * args.gas * args.seq
    res.update(step_s_median=step, step_s_min=min(per_step), step_s_max=max(per_step),
               step_s_all=[round(x, 5) for x in per_step],
               step_s_rank_medians=[statistics.median(x) for x in step_lists],
               warmup_s_all=[[round(x, 3) for x in p["warm_s"]] for p in parts],
               tokens_per_step_per_replica=tokens_replica,
               tokens_per_s_per_gpu=tokens_replica * M / step / (S * M),
               peak_mem_gib=max((p.get("peak_mem_gib") or 0) for p in parts) or None,
               last_loss=[p["steps"][-1].get("loss") for p in parts])
    d, k, idb = p0["hidden_size"], p0.get("k"), p0.get("id_bytes")
    b, L, gas = args.micro, args.seq, args.gas
    ratio = p0["spec"]["ratio"]

    if S == 2:
        if p0["system"] == "ours":
            recs = [s["bytes"] for s in p0["steps"]]  # replica sum (both stages), identical on both ranks
            rec = recs[-1]
            act, grad = rec["activation"]["sent"], rec["activation_grad"]["sent"]
            res["stage_link_source"] = "StepRecord.bytes (hetloco_ds.meter), summed over the replica's 2 ranks"
            res["bytes_constant_over_timed_steps"] = _same(recs)
            res["control_bytes_sent"] = rec["control"]["sent"]
            res["step_bytes_record"] = rec
            fwd_micro = b * L * k * 2 + (b * L * idb if ratio > 1 else 0)
            formula_fwd = "b*L*k*2 + b*L*id_bytes" if ratio > 1 else "b*L*d*2"
        else:
            by_rank = {p["stage"]: p for p in parts}
            p2p0 = [s["p2p"] for s in by_rank[0]["steps"]]
            p2p1 = [s["p2p"] for s in by_rank[1]["steps"]]
            act = p2p0[-1]["control"]["sent"]  # stage 0 sends only activations
            grad = p2p1[-1]["control"]["sent"]  # stage 1 sends only activation gradients
            res["stage_link_source"] = ("patches.p2p_meter around deepspeed.runtime.pipe.p2p send/recv: stage 0's sent "
                                        "= activations, stage 1's sent = activation gradients")
            res["bytes_constant_over_timed_steps"] = _same(p2p0) and _same(p2p1)
            fwd_micro = b * L * d * 2 + b * L * 8
            formula_fwd = "b*L*d*2 + b*L*8 (hidden bf16 + ids int64)"
        bwd_micro = b * L * k * 2
        res["stage_link"] = {
            "k": k, "ratio": ratio, "id_bytes": idb if (p0["system"] == "ds" or ratio > 1) else 0,
            "activation_sent": act, "activation_sent_analytic": gas * fwd_micro,
            "activation_grad_sent": grad, "activation_grad_sent_analytic": gas * bwd_micro,
            "per_micro_batch_forward_analytic": fwd_micro, "per_micro_batch_backward_analytic": bwd_micro,
            "formula_forward": f"gas * ({formula_fwd})", "formula_backward": "gas * b*L*k*2",
            "match": act == gas * fwd_micro and grad == gas * bwd_micro,
        }
        res["stage_link_bytes_per_step"] = act + grad
    else:
        P = p0["n_params_local"]
        coll_rank = [p["steps"][-1]["collectives"] for p in parts]
        res["collectives_per_step_rank"] = coll_rank
        res["collective_sent_per_step_per_gpu"] = max(sum(o["sent"] for o in c.values()) for c in coll_rank)
        res["collective_recv_per_step_per_gpu"] = max(sum(o["recv"] for o in c.values()) for c in coll_rank)
        res["n_params"] = P
        if p0["system"] == "ds":
            res["dp_bytes_per_step_per_gpu"] = res["collective_sent_per_step_per_gpu"]
            res["dp_analytic"] = {
                "grad_all_reduce_payload": P * 2, "param_all_gather_sent": P * 2 // M,
                "param_all_gather_recv": P * 2 * (M - 1) // M,
                "sent_per_gpu": P * 2 + P * 2 // M,
                "ring_wire_sent_per_gpu": int(2 * (M - 1) / M * P * 2 + (M - 1) / M * P * 2),
                "how": ("BF16_Optimizer (bf16.enabled, ZeRO 0, pipeline engine; grad_accum_dtype default = model "
                        "dtype bf16): one all_reduce of the flat bf16 gradient buffer in communication_data_type "
                        "bf16 (P*2 bytes, + alignment padding), then after the fp32 master-shard step an "
                        "all_gather_into_tensor of the bf16 parameters (P*2/M own shard sent); plus scalar "
                        "all-reduces (loss, grad norm)"),
            }
        else:
            recs = [[s["bytes"] for s in p["steps"]] for p in parts]
            inner_sent = max(sum(v["sent"] for v in r[-1].values()) for r in recs)
            res["inner_step_bytes_sent_per_gpu"] = inner_sent
            res["inner_step_record"] = recs[0][-1]
            res["outer_in_timed_steps"] = any(s.get("outer") for p in parts for s in p["steps"])
            outs = [p.get("outer", []) for p in parts]
            per_rep = [max(o["seconds"] for o in reps) for reps in zip(*outs)]
            steady = per_rep[1:] or per_rep
            H = args.inner_steps
            outer_s = statistics.median(steady) if steady else None
            if outs and outs[0]:
                o0 = outs[0][-1]
                sent = max(reps[-1]["bytes"]["outer_sync"]["sent"] for reps in outs if reps)
                recv = max(reps[-1]["bytes"]["outer_sync"]["recv"] for reps in outs if reps)
                res.update(
                    H=H, outer_step_s_all=[round(x, 5) for x in per_rep], outer_step_s_median=outer_s,
                    outer_step_note="engine.outer_step() after one untimed inner step; median drops the first",
                    outer_payload_bytes=o0["payload_bytes"], outer_bytes_sent_per_gpu=sent,
                    outer_bytes_recv_per_gpu=recv, outer_collectives_rank0=o0["collectives"],
                    outer_meter_rank0=o0["bytes"],
                    dp_bytes_per_step_per_gpu=sent / H + inner_sent,
                    amortized_step_s=(H * step + outer_s) / H,
                    tokens_per_s_per_gpu_amortized=tokens_replica * H / (H * step + outer_s),
                )
    return res


def fmt_bytes(n) -> str:
    """MiB / KiB / bytes, for the printed table (the JSON has exact integers)."""
    if n is None:
        return "-"
    return f"{n / 2**20:.2f}M" if n >= 2**20 else (f"{n / 2**10:.1f}K" if n >= 2**10 else f"{n:.0f}")


def print_tables(report: dict) -> None:
    c = report.get("card", {})
    v = report.get("versions", {})
    print(f"\n{c.get('names', c.get('name'))}  torch {v.get('torch')}  deepspeed {v.get('deepspeed')}  "
          f"transformers {v.get('transformers')}  nccl {v.get('nccl')}")
    s = report["settings"]
    print(f"shape {s['shape']}  vocab {s['vocab']}  seq {s['seq']}  micro {s['micro']}  gas {s['gas']}  "
          f"bf16 {not s['no_bf16']}  median of {s['steps']} steps after {s['warmup']}")
    rows = report["results"]
    print("\n(a) S = 2, M = 1: stage link, bytes per optimizer step (measured / analytic)")
    print(f"{'config':12} {'step ms':>8} {'tok/s/GPU':>10} {'activation sent':>23} {'activation_grad sent':>23} "
          f"{'match':>5} {'link x':>6} {'peakGiB':>7}")
    base = next((r.get("stage_link_bytes_per_step") for r in rows if r["config"] == "a_ours_r1"), None)
    for r in rows:
        if not r["config"].startswith("a_"):
            continue
        if "step_s_median" not in r:
            print(f"{r['config']:12}  -- {str(r.get('error') or r.get('skipped'))[:100]}")
            continue
        sl = r["stage_link"]
        a = f"{sl['activation_sent']} / {sl['activation_sent_analytic']}"
        g = f"{sl['activation_grad_sent']} / {sl['activation_grad_sent_analytic']}"
        x = f"{base / r['stage_link_bytes_per_step']:6.1f}" if base and r.get("stage_link_bytes_per_step") else f"{'-':>6}"
        print(f"{r['config']:12} {r['step_s_median'] * 1e3:8.1f} {r['tokens_per_s_per_gpu']:10.0f} {a:>23} {g:>23} "
              f"{str(sl['match']):>5} {x} {str(r['peak_mem_gib']):>7}")
    print(f"{'':12} link x = a_ours_r1's stage-link bytes / this row's; analytic per micro-batch: forward "
          "b*L*k*2 (+ b*L*2 int16 ids when compressed; stock: + b*L*8 int64 ids), backward b*L*k*2")
    print("\n(b) S = 1, M = 2: replica link (bytes sent per GPU; payload convention, see JSON)")
    print(f"{'config':12} {'step ms':>8} {'tok/s/GPU':>10} {'outer ms':>8} {'tok/s/GPU H':>11} "
          f"{'B/step/GPU':>11} {'B/outer':>9} {'peakGiB':>7}")
    for r in rows:
        if not r["config"].startswith("b_"):
            continue
        if "step_s_median" not in r:
            print(f"{r['config']:12}  -- {str(r.get('error') or r.get('skipped'))[:100]}")
            continue
        outer = f"{r['outer_step_s_median'] * 1e3:8.1f}" if r.get("outer_step_s_median") is not None else f"{'-':>8}"
        amort = (f"{r['tokens_per_s_per_gpu_amortized']:11.0f}" if "tokens_per_s_per_gpu_amortized" in r
                 else f"{r['tokens_per_s_per_gpu']:11.0f}")
        print(f"{r['config']:12} {r['step_s_median'] * 1e3:8.1f} {r['tokens_per_s_per_gpu']:10.0f} {outer} {amort} "
              f"{fmt_bytes(r.get('dp_bytes_per_step_per_gpu')):>11} {fmt_bytes(r.get('outer_bytes_sent_per_gpu')):>9} "
              f"{str(r['peak_mem_gib']):>7}")
        if "dp_analytic" in r:
            a = r["dp_analytic"]
            print(f"{'':12} analytic: grad all-reduce {fmt_bytes(a['grad_all_reduce_payload'])} + param all-gather "
                  f"{fmt_bytes(a['param_all_gather_sent'])} sent = {fmt_bytes(a['sent_per_gpu'])} "
                  f"(P = {r['n_params']}; ring wire {fmt_bytes(a['ring_wire_sent_per_gpu'])})")
            ops = {k: (o["calls"], fmt_bytes(o["sent"])) for k, o in r["collectives_per_step_rank"][0].items()}
            print(f"{'':12} measured ops (calls, sent): {ops}")
        if "H" in r:
            print(f"{'':12} H = {r['H']}: tok/s/GPU H = (H inner + 1 outer) amortised; B/step/GPU = outer/H "
                  f"(inner steps send {r['inner_step_bytes_sent_per_gpu']} B); payload {r['outer_payload_bytes']} B")
    by = {r["config"]: r for r in rows}
    ours, ds = by.get("b_ours_sl", {}), by.get("b_ds_dp", {})
    if ours.get("dp_bytes_per_step_per_gpu") and ds.get("dp_bytes_per_step_per_gpu"):
        print(f"{'':12} replica-link bytes per step per GPU, stock / ours: "
              f"{ds['dp_bytes_per_step_per_gpu'] / ours['dp_bytes_per_step_per_gpu']:.0f}x")


def default_out() -> str:
    if os.environ.get("OUT"):
        return os.path.join(os.environ["OUT"], "gpu_two.json")
    return os.path.join(REPO, "bench", "results", "gpu_two.json")


def driver_main(args, argv: list[str]) -> int:
    t0 = time.perf_counter()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwinds spawn_config's cleanup
    out_path = args.out or default_out()
    os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
    ratios = [int(r) for r in args.ratios.split(",") if r]
    configs = config_list(ratios)
    if args.configs:
        wanted = [c for c in args.configs.split(",") if c]
        known = {c["name"] for c in configs}
        bad = [w for w in wanted if w not in known]
        if bad:
            raise SystemExit(f"unknown configs {bad}; choose from {sorted(known)}")
        configs = [c for c in configs if c["name"] in wanted]
    report = {
        "card": None, "versions": None,
        "command": " ".join(shlex.quote(a) for a in [sys.executable] + sys.argv),
        "settings": {k: v for k, v in vars(args).items() if k not in ("worker", "part")},
        "env": {k: os.environ.get(k) for k in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST",
                                              "NVSHMEM_DISABLE_NVLS", "DS_ACCELERATOR")},
        "launch": "this script spawns 2 processes per configuration (fresh), one per GPU; the driver writes this file",
        "conventions": __doc__.split("Bytes (per optimizer step):")[1].split("    python")[0].strip(),
        "results": [],
    }
    # The workers get the same flags (never --out / --configs / driver-only ones).
    passthru = ["--shape", args.shape, "--vocab", str(args.vocab), "--seq", str(args.seq), "--micro", str(args.micro),
                "--gas", str(args.gas), "--ratios", args.ratios, "--warmup", str(args.warmup), "--steps",
                str(args.steps), "--inner-steps", str(args.inner_steps), "--outer-repeats", str(args.outer_repeats)]
    if args.no_bf16:
        passthru.append("--no-bf16")
    if args.ids_as_bytes:
        passthru.append("--ids-as-bytes")
    if args.cpu_smoke:
        passthru.append("--cpu-smoke")
    ok = True
    with tempfile.TemporaryDirectory(prefix="gpu_two_") as tmp:
        for spec in configs:
            name = spec["name"]
            elapsed = time.perf_counter() - t0
            if elapsed > args.time_budget:
                res = {"config": name, "skipped": f"time budget: {elapsed:.0f} s elapsed > {args.time_budget:.0f} s"}
                print(f"[gpu_two] skip {name}: {res['skipped']}", flush=True)
                report["results"].append(res)
                ok = False
                continue
            print(f"[gpu_two] {name} ({elapsed:.0f} s) ...", flush=True)
            parts, error, wall = spawn_config(name, args, tmp, passthru)
            errors = [p.get("error") for p in parts if p.get("error")]
            if report["card"] is None and parts[0].get("card"):
                report["card"], report["versions"] = parts[0]["card"], parts[0]["versions"]
            if error or errors:
                res = {"config": name, "error": error or errors[0], "rank_errors": errors,
                       "tracebacks": [p.get("traceback") for p in parts if p.get("traceback")]}
                ok = False
            else:
                try:
                    res = summarize(name, parts, args)
                except Exception as err:  # noqa: BLE001 - keep the raw parts
                    res = {"config": name, "error": f"summarize: {type(err).__name__}: {err}",
                           "traceback": traceback.format_exc()[-3000:], "raw_parts": parts}
                    ok = False
            res["wall_s"] = wall
            report["results"].append(res)
            report["elapsed_s"] = time.perf_counter() - t0
            with open(out_path, "w") as f:
                json.dump(report, f, indent=2, default=str)
            if "step_s_median" in res:
                print(f"[gpu_two] {name}: step {res['step_s_median'] * 1e3:.1f} ms  "
                      f"{res['tokens_per_s_per_gpu']:.0f} tok/s/GPU  wall {wall:.0f} s", flush=True)
            else:
                print(f"[gpu_two] {name}: FAILED {res.get('error')}  wall {wall:.0f} s", flush=True)
    report["elapsed_s"] = time.perf_counter() - t0
    with open(out_path, "w") as f:
        json.dump(report, f, indent=2, default=str)
    if report["card"] is None:
        report["card"], report["versions"] = {}, {}
    print_tables(report)
    print(f"[gpu_two] wrote {out_path} ({report['elapsed_s']:.0f} s)", flush=True)
    return 0 if ok else 1


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        return worker_main(args)
    return driver_main(args, argv if argv is not None else sys.argv)


if __name__ == "__main__":
    sys.exit(main())
