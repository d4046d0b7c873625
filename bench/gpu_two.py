"""Two GPUs, one process each: the stage link (S = 2) and the replica link (M = 2), ours vs stock DeepSpeed.

Configurations, each in 2 fresh processes (one per GPU, spawned by this script). The four compared
pairs run `--repeats` (3) times, interleaved (a_ours_r1, a_ds, b_ours_sl, b_ds_dp, then again), so
a slow spell of the machine hits one repeat of each, not one system; then the compressed rows once:
  a_ours_r1    HetlocoEngine, S = 2, M = 1, uncompressed boundary (subspace.compressed_replicas "none"),
               the overlapped pipeline schedule (hetloco.pipeline.schedule "overlapped", `--schedule`), its
               messages moved by the product's default transport ("auto": the copy engines on GPUs of one
               host; `--link-transport process_group` for NCCL's)
  a_ds         stock DeepSpeed PipelineEngine (deepspeed.initialize), S = 2: a plain
               deepspeed.pipe.PipelineModule over hetloco_ds.pipe.module.layer_specs(config),
               partition_method "type:DecoderLayer", bf16.enabled (bf16 weights, BF16_Optimizer), a torch
               AdamW passed in
  a_ours_r8    HetlocoEngine, S = 2, M = 1, subspace {"ratio": 8, "compressed_replicas": "all"}
  a_ours_r64   the same at ratio 64
  b_ours_sl    HetlocoEngine, S = 1, M = 2, SparseLoCo H = `--inner-steps` (50): inner steps timed on their
               own, then `--outer-repeats` outer steps (each after one untimed inner step) timed on their own
  b_ds_dp      stock DeepSpeed PipelineEngine, S = 1, M = 2 (data parallel; gradient all-reduce every step)
With `--compiled-rows` (opt-in; off by default, and then rows, keys and order are as without it), after those:
  a_ours_r1_compiled  a_ours_r1 with hetloco.train.compile (torch.compile of each decoder layer and the loss,
                      hetloco_ds.build.compile_stage)
  a_ours_r8_compiled  a_ours_r8 (ratio 8, whatever `--ratios` says) with hetloco.train.compile
  b_ours_sl_compiled  b_ours_sl with hetloco.train.compile
  Their rows have the eager rows' fields; every row then also has "compile" (true / false). Compilation
  happens in the untimed warm-up steps (at least 1 even under `--warmup 0`; see warmup_s_all), and a
  compiled row may run `--compiled-timeout` (300 s) instead of `--config-timeout` (about 2 minutes more
  in all on 2 H100s).

Every configuration: preset `--shape` (178M), vocab 32000, seq 2048, random tokens, micro-batch `--micro`
(4) x gradient_accumulation_steps `--gas` (8) per optimizer step and replica (so an S = 2 pipeline runs 8
micro-batches per step), gradient clipping 1.0, AdamW(lr 1e-3, betas (0.9, 0.95), wd 0.1), bf16.
Ours: bf16 autocast over fp32 weights; the stage link carries bf16 (on compressed boundaries also the
int16 ids, as their 2 raw bytes: uint8 [b, 2L], hetloco_ds.boundary.BoundaryCodec; NCCL has no int16).
Stock: bf16 weights; its stage link carries the layers' (hidden bf16, ids int64) pair.

Timing: each step is `train_batch` between a device synchronisation + barrier before and a device
synchronisation after, on each rank; a step's time is the slower rank's; per run: median of `--steps`
(8) steps after `--warmup` (3); per configuration: the median of its repeats' medians. `comparison`
gives ours / stock (tokens/s) for S = 2 (a_ours_r1 vs a_ds) and M = 2 (b_ours_sl inner steps vs
b_ds_dp), per repeat and as the ratio of the medians.

Profile (`--profile`, on by default; the last repeat of each compared configuration): one more step
after the timed ones under torch.profiler (CPU + CUDA), summarised per rank into the JSON: the device
time by kernel class (gemm, attention, nccl, optimizer, cast/copy, elementwise, reduction/norm,
other; by kernel name), the 25 kernels with the most device time, the 15 host ops with the most
self CPU time, and the step's wall and summed device time. What differs between b_ours_sl and
b_ds_dp (neither sends anything between replicas in an inner step except stock's gradient
all-reduce) shows there: fp32 master weights under autocast (a bf16 cast of every weight each
micro-batch, fp32 gradient accumulation, an fp32 AdamW over all P) against stock's bf16 weights and
BF16_Optimizer (1/M of the fp32 step, then a bf16 all-gather).

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

    OUT=... bash bench/gpu.sh --gpus 2 gpu_two.py         # the GPU run
    python bench/gpu_two.py --cpu-smoke                   # tiny, seq 64, gloo, 2 ranks, 1+2 steps, 1 repeat
    python bench/gpu_two.py --compiled-rows ...           # + the 3 compiled rows of ours (see above)
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

BENCH = os.path.dirname(os.path.abspath(__file__))
if BENCH not in sys.path:
    sys.path.insert(0, BENCH)

from _common import (  # noqa: E402 - stdlib-only at import; torch / deepspeed are imported inside
    CollectiveCounter, add_model_args, batches, build_ours, build_stock, config_row, deterministic_kernels,
    device_time_us, driver_setup,
    finish_report, fmt_bytes, new_report, ours_config, ours_part_info, peak_gib, pick_configs, profiled, run_main, run_worker, same,
    spawn_workers, stage_hash, stock_config, stock_p2p_meter, stock_part_info, timed_call, versions_line, worker_argv,
    write_report,
)

WORLD = 2


COMPILED_ROWS = (("a_ours_r1", 2, 1), ("a_ours_r8", 2, 8), ("b_ours_sl", 1, 1))  # (eager name, S, ratio)


PAIRS = ("a_ours_r1", "a_ds", "b_ours_sl", "b_ds_dp")
"""The compared configurations, run --repeats times, interleaved."""


def config_list(ratios: list[int], compiled_rows: bool = False) -> list[dict]:
    """The configurations (the compared pairs first); `compiled_rows` appends the compiled rows of ours and
    gives every spec a "compile" key (without it no spec has one: the eager rows' JSON stays as it was)."""
    out = [dict(name="a_ours_r1", system="ours", stages=2, ratio=1)]
    out.append(dict(name="a_ds", system="ds", stages=2, ratio=1))
    out.append(dict(name="b_ours_sl", system="ours", stages=1, ratio=1))
    out.append(dict(name="b_ds_dp", system="ds", stages=1, ratio=1))
    out += [dict(name=f"a_ours_r{r}", system="ours", stages=2, ratio=r) for r in ratios]
    if compiled_rows:
        for spec in out:
            spec["compile"] = False
        out += [dict(name=f"{name}_compiled", system="ours", stages=s, ratio=r, compile=True, eager=name)
                for name, s, r in COMPILED_ROWS]
    return out


def args_configs(args) -> list[dict]:
    return config_list([int(r) for r in args.ratios.split(",") if r], args.compiled_rows)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p)
    p.add_argument("--ratios", default="8", help="compressed S = 2 configurations (run once, after the repeats)")
    p.add_argument("--repeats", type=int, default=3, help="runs of each compared configuration (a_ours_r1, a_ds, "
                                                           "b_ours_sl, b_ds_dp), interleaved; medians reported")
    p.add_argument("--schedule", default="overlapped", choices=("overlapped", "blocking", "auto"),
                   help="our pipeline schedule (hetloco.pipeline.schedule; the one run shows in each rank's part)")
    p.add_argument("--link-max-ctas", type=int, default=None,
                   help="hetloco.pipeline.link_max_ctas: NCCL CTAs of the overlapped schedule's link groups "
                        "(0: NCCL's choice; default: the config's default)")
    p.add_argument("--sm-carveout", type=lambda v: v if v == "auto" else int(v), default=None,
                   help="ours only: hetloco.pipeline.gemm_sm_carveout (N or auto): persistent cuBLASLt GEMMs "
                        "sized to the SMs the resident link CTAs leave (wave quantisation of persistent kernels); each rank's part "
                        "records what its engine applied")
    p.add_argument("--link-transport", default=None, choices=("auto", "process_group", "copy_engine"),
                   help="ours only: hetloco.pipeline.link_transport (default: the product's, auto; copy_engine: the "
                        "overlapped schedule's messages moved by the copy engines, nothing resident on an SM)")
    p.add_argument("--blas", default=None, choices=("cublas", "cublaslt"),
                   help="ours only: torch.backends.cuda.preferred_blas_library (the carveout reaches cuBLASLt "
                        "calls only); recorded in each rank's part")
    p.add_argument("--no-profile", dest="profile", action="store_false",
                   help="skip the profiled step of the last repeat")
    p.add_argument("--profile-worker", action="store_true", help=argparse.SUPPRESS)  # internal: this run profiles
    p.add_argument("--deterministic", action="store_true",
                   help="torch's deterministic algorithms (warn_only), the math attention backend and a fixed cuBLAS "
                        "workspace, so that two runs of one configuration can end with the same bits; each row then "
                        "has every step's loss and each rank's parameter hash after the timed steps (param_sha256), "
                        "to compare schedules and transports")
    p.add_argument("--bind-cores", action="store_true",
                   help="pin each rank of every configuration (ours and stock alike) to its own share of the cores")
    p.add_argument("--configs", default="", help="comma-separated subset of the configuration names")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--inner-steps", type=int, default=50, help="H of b_ours_sl")
    p.add_argument("--outer-repeats", type=int, default=4, help="outer steps timed in b_ours_sl (first dropped)")
    p.add_argument("--no-bf16", action="store_true", help="fp32 everywhere (fallback)")
    p.add_argument("--ids-as-bytes", action="store_true",
                   help="no-op, kept so older command lines parse: ids always cross a compressed boundary as "
                        "uint8 bytes (hetloco_ds.boundary.BoundaryCodec)")
    p.add_argument("--config-timeout", type=float, default=120.0, help="seconds per configuration (both ranks)")
    p.add_argument("--time-budget", type=float, default=300.0,
                   help="seconds; a configuration that would start after this is skipped")
    p.add_argument("--compiled-rows", action="store_true",
                   help="append a_ours_r1_compiled, a_ours_r8_compiled, b_ours_sl_compiled (hetloco.train.compile)")
    p.add_argument("--compiled-timeout", type=float, default=300.0,
                   help="seconds per compiled configuration (both ranks; compilation in the warm-up steps)")
    p.add_argument("--out", default=None, help="JSON path (default $OUT/gpu_two.json or bench/results/)")
    p.add_argument("--cpu-smoke", action="store_true", help="preset tiny, vocab 1024, seq 64, micro 2, gas 2, 1+2 steps, gloo")
    # internal: one rank of one configuration
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--part", default=None, help=argparse.SUPPRESS)
    if "--cpu-smoke" in (sys.argv[1:] if argv is None else argv):  # defaults only: explicit flags win
        p.set_defaults(shape="tiny", vocab=1024, seq=64, micro=2, gas=2, warmup=1, steps=2, outer_repeats=2,
                       repeats=1, config_timeout=400.0, time_budget=3000.0, compiled_timeout=1500.0)
    args = p.parse_args(argv)
    if args.cpu_smoke and args.blas:
        p.error(f"--blas {args.blas}: a CUDA setting; --cpu-smoke runs on the CPU")
    if args.link_transport == "copy_engine" and args.cpu_smoke:
        p.error("--link-transport copy_engine: GPUs' copy engines; --cpu-smoke runs on the CPU")
    if args.link_transport == "copy_engine" and args.schedule == "blocking":
        p.error("--link-transport copy_engine moves the overlapped schedule's messages; --schedule is blocking")
    return args


# ============================================================================ worker side
COUNTER = CollectiveCounter()


def timed_loop(step_fn, warmup: int, steps: int, after_step=None) -> tuple[list, list, list]:
    """Per step: sync + barrier, time step_fn(), sync. Returns (warm-up s, timed s, timed extras)."""
    warm, timed, extras = [], [], []
    for i in range(warmup + steps):
        out, dt, collectives = timed_call(step_fn, COUNTER, count=i >= warmup)
        extra = after_step(out) if after_step else {}
        extra["collectives"] = collectives
        if i < warmup:
            warm.append(dt)
        else:
            timed.append(dt)
            extras.append(extra)
    return warm, timed, extras


KERNEL_CLASSES = (  # first match wins; by lower-cased kernel name
    ("nccl", ("nccl",)),
    ("attention", ("flash", "fmha", "attention", "sdpa", "softmax")),
    ("gemm", ("gemm", "cutlass", "sm90", "sm80", "cublas", "matmul", "xmma", "addmm", "mm")),
    ("optimizer", ("adam", "multi_tensor", "foreach")),
    ("cast/copy", ("copy", "cast", "to_copy", "convert")),
    ("reduction/norm", ("reduce", "norm", "sum", "mean")),
    ("elementwise", ("elementwise", "vectorized", "unrolled", "pointwise", "mul", "add", "silu", "exp")),
)


def profile_step(step_fn) -> dict:
    """One step under torch.profiler, summarised (module docstring, Profile)."""
    prof, wall = profiled(step_fn)
    events = list(prof.key_averages())
    kernels = [e for e in events if device_time_us(e) > 0]
    by_class: dict = {}
    for e in kernels:
        low = e.key.lower()
        cls = next((c for c, keys in KERNEL_CLASSES if any(k in low for k in keys)), "other")
        by_class[cls] = by_class.get(cls, 0.0) + device_time_us(e)
    top = sorted(kernels, key=device_time_us, reverse=True)[:25]
    host = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:15]
    return {"wall_s": wall, "device_time_ms_total": sum(device_time_us(e) for e in kernels) / 1e3,
            "device_ms_by_class": {k: round(v / 1e3, 3) for k, v in sorted(by_class.items(), key=lambda x: -x[1])},
            "top_kernels": [{"name": e.key[:160], "count": e.count, "device_ms": round(device_time_us(e) / 1e3, 3)} for e in top],
            "top_host_ops": [{"name": e.key[:120], "count": e.count, "self_cpu_ms": round(e.self_cpu_time_total / 1e3, 3),
                              "cpu_ms": round(e.cpu_time_total / 1e3, 3)} for e in host]}


def run_ours(spec, cfg, args, part) -> None:
    stages, ratio = spec["stages"], spec["ratio"]
    b_part = stages == 1
    subspace = ({"ratio": ratio, "compressed_replicas": "all"} if ratio > 1 else {"compressed_replicas": "none"})
    # Compiled rows: hetloco.train.compile; eager rows' config exactly as before (no compile key).
    train = {"compile": True} if spec.get("compile") else {}
    # (a): M = 1, the outer step has no link to cross: H out of reach. (b): H = --inner-steps,
    # never reached inside the timed steps; the outer steps are timed on their own.
    raw = ours_config(args.micro, args.gas, stages, not args.no_bf16, args.inner_steps if b_part else 10**9,
                      subspace, args.seq, max(256, cfg.vocab_size), **train)
    raw["hetloco"]["pipeline"] = {"schedule": args.schedule}
    if args.link_max_ctas is not None:
        raw["hetloco"]["pipeline"]["link_max_ctas"] = args.link_max_ctas or None
    if args.link_transport is not None:
        raw["hetloco"]["pipeline"]["link_transport"] = args.link_transport
    part["ds_config"] = raw
    if args.blas is not None:
        import torch

        torch.backends.cuda.preferred_blas_library(args.blas)
        part["blas"] = args.blas
    if args.sm_carveout is not None:
        raw["hetloco"]["pipeline"]["gemm_sm_carveout"] = args.sm_carveout
    module, engine = build_ours(raw, cfg, args.seq, source="bench/gpu_two.py")
    part["sm_carveout"] = engine.gemm_sm_carveout
    part["link_transport"] = engine.link_transport
    part.update(ours_part_info(engine, module, cfg))
    seed = 1234 + (engine.replica if b_part else 0)  # stages of one replica read the same batches
    data = batches(cfg, args.micro, args.seq, seed)

    def step():
        return engine.train_step(data)

    def after(rec):
        return {"loss": rec.loss, "bytes": rec.bytes, "outer": rec.outer, "tokens": rec.tokens}

    # Compiled: torch.compile compiles in the first step(s), so at least one untimed warm-up step.
    warmup = max(args.warmup, 1) if spec.get("compile") else args.warmup
    warm, timed, extras = timed_loop(step, warmup, args.steps, after)
    part.update(warm_s=warm, step_s=timed, steps=extras, peak_mem_gib=peak_gib())
    if args.deterministic:
        part["param_sha256"] = stage_hash(engine.trainable_params())["sha256"]
    if args.profile_worker:
        part["profile"] = profile_step(step)
    if b_part:
        meter = engine.meter
        outer = []
        for _ in range(args.outer_repeats):
            engine.train_step(data)  # a fresh pseudo-gradient; this step's bytes are in its own record
            meter.since_mark()
            rep, dt, collectives = timed_call(engine.outer_step, COUNTER)
            outer.append({"seconds": dt, "engine_seconds": rep["seconds"], "payload_bytes": rep["payload_bytes"],
                          "excluded": rep["excluded"], "bytes": meter.since_mark(), "collectives": collectives})
        part["outer"] = outer
        part["outer_steps_done"] = engine.outer_steps
    part["peak_mem_gib_incl_outer"] = peak_gib()
    part["local_steps"] = engine.local_steps


def run_ds(spec, cfg, args, part) -> None:
    stages = spec["stages"]
    config = stock_config(args.micro, args.gas, not args.no_bf16)
    part["ds_config"] = config
    module, params, engine = build_stock(cfg, config, "type:DecoderLayer", num_stages=stages)
    part.update(stock_part_info(engine, module, params, cfg))
    seed = 1234 + (engine.grid.data_parallel_id if stages == 1 else 0)
    data = batches(cfg, args.micro, args.seq, seed)
    meter = stock_p2p_meter()  # the stock engine's pipeline p2p, kind "control"

    def step():
        meter.since_mark()
        return float(engine.train_batch(data))

    def after(loss):
        return {"loss": loss, "p2p": meter.since_mark()}

    warm, timed, extras = timed_loop(step, args.warmup, args.steps, after)
    part.update(warm_s=warm, step_s=timed, steps=extras, peak_mem_gib=peak_gib())
    if args.profile_worker:
        part["profile"] = profile_step(step)


def worker_main(args) -> int:
    if args.deterministic:
        deterministic_kernels()
    spec = {c["name"]: c for c in args_configs(args)}[args.worker]
    run = run_ours if spec["system"] == "ours" else run_ds
    return run_worker(args, COUNTER, lambda cfg, part: run(spec, cfg, args, part), system=spec["system"], spec=spec)


# ============================================================================ driver side
def summarize(name: str, parts: list[dict], args) -> dict:
    """One configuration's row from both ranks' parts."""
    p0 = parts[0]
    res = {"config": name, "system": p0.get("system"), "stages": p0.get("num_stages"),
           "replicas": p0.get("num_replicas"), "micro_batch": args.micro, "gas": args.gas, "seq": args.seq,
           "parts_layers": p0.get("parts"), "optimizer": p0.get("optimizer"),
           "ranks": [{k: v for k, v in p.items() if k not in ("steps", "card", "versions", "ds_config")} for p in parts]}
    for key in ("param_dtype", "grad_acc_dtype", "communication_data_type", "ds_config"):
        if key in p0:
            res[key] = p0[key]
    if "compile" in p0["spec"]:  # only under --compiled-rows
        res["compile"] = p0["spec"]["compile"]
        if p0["spec"].get("eager"):
            res["eager_config"] = p0["spec"]["eager"]
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
    if args.deterministic:
        res.update(losses=[s.get("loss") for s in p0["steps"]], param_sha256=[p.get("param_sha256") for p in parts])
    d, k, idb = p0["hidden_size"], p0.get("k"), p0.get("id_bytes")
    b, L, gas = args.micro, args.seq, args.gas
    ratio = p0["spec"]["ratio"]

    if S == 2:
        if p0["system"] == "ours":
            recs = [s["bytes"] for s in p0["steps"]]  # replica sum (both stages), identical on both ranks
            rec = recs[-1]
            act, grad = rec["activation"]["sent"], rec["activation_grad"]["sent"]
            res["stage_link_source"] = "StepRecord.bytes (hetloco_ds.meter), summed over the replica's 2 ranks"
            res["bytes_constant_over_timed_steps"] = same(recs)
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
            res["bytes_constant_over_timed_steps"] = same(p2p0) and same(p2p1)
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


def print_tables(report: dict) -> None:
    print(versions_line(report))
    s = report["settings"]
    print(f"shape {s['shape']}  vocab {s['vocab']}  seq {s['seq']}  micro {s['micro']}  gas {s['gas']}  "
          f"bf16 {not s['no_bf16']}  median of {s['steps']} steps after {s['warmup']}")
    rows = report["results"]
    w = max([12] + [len(r["config"]) for r in rows])  # config column: 12 unless compiled rows are there
    print("\n(a) S = 2, M = 1: stage link, bytes per optimizer step (measured / analytic)")
    print(f"{'config':{w}} {'step ms':>8} {'tok/s/GPU':>10} {'activation sent':>23} {'activation_grad sent':>23} "
          f"{'match':>5} {'link x':>6} {'peakGiB':>7}")
    base = next((r.get("stage_link_bytes_per_step") for r in rows if r["config"] == "a_ours_r1"), None)
    for r in rows:
        if not r["config"].startswith("a_"):
            continue
        if "step_s_median" not in r:
            print(f"{r['config']:{w}}  -- {str(r.get('error') or r.get('skipped'))[:100]}")
            continue
        sl = r["stage_link"]
        a = f"{sl['activation_sent']} / {sl['activation_sent_analytic']}"
        g = f"{sl['activation_grad_sent']} / {sl['activation_grad_sent_analytic']}"
        x = f"{base / r['stage_link_bytes_per_step']:6.1f}" if base and r.get("stage_link_bytes_per_step") else f"{'-':>6}"
        print(f"{r['config']:{w}} {r['step_s_median'] * 1e3:8.1f} {r['tokens_per_s_per_gpu']:10.0f} {a:>23} {g:>23} "
              f"{str(sl['match']):>5} {x} {str(r['peak_mem_gib']):>7}")
    print(f"{'':{w}} link x = a_ours_r1's stage-link bytes / this row's; analytic per micro-batch: forward "
          "b*L*k*2 (+ b*L*2 int16 ids when compressed; stock: + b*L*8 int64 ids), backward b*L*k*2")
    print("\n(b) S = 1, M = 2: replica link (bytes sent per GPU; payload convention, see JSON)")
    print(f"{'config':{w}} {'step ms':>8} {'tok/s/GPU':>10} {'outer ms':>8} {'tok/s/GPU H':>11} "
          f"{'B/step/GPU':>11} {'B/outer':>9} {'peakGiB':>7}")
    for r in rows:
        if not r["config"].startswith("b_"):
            continue
        if "step_s_median" not in r:
            print(f"{r['config']:{w}}  -- {str(r.get('error') or r.get('skipped'))[:100]}")
            continue
        outer = f"{r['outer_step_s_median'] * 1e3:8.1f}" if r.get("outer_step_s_median") is not None else f"{'-':>8}"
        amort = (f"{r['tokens_per_s_per_gpu_amortized']:11.0f}" if "tokens_per_s_per_gpu_amortized" in r
                 else f"{r['tokens_per_s_per_gpu']:11.0f}")
        print(f"{r['config']:{w}} {r['step_s_median'] * 1e3:8.1f} {r['tokens_per_s_per_gpu']:10.0f} {outer} {amort} "
              f"{fmt_bytes(r.get('dp_bytes_per_step_per_gpu')):>11} {fmt_bytes(r.get('outer_bytes_sent_per_gpu')):>9} "
              f"{str(r['peak_mem_gib']):>7}")
        if "dp_analytic" in r:
            a = r["dp_analytic"]
            print(f"{'':{w}} analytic: grad all-reduce {fmt_bytes(a['grad_all_reduce_payload'])} + param all-gather "
                  f"{fmt_bytes(a['param_all_gather_sent'])} sent = {fmt_bytes(a['sent_per_gpu'])} "
                  f"(P = {r['n_params']}; ring wire {fmt_bytes(a['ring_wire_sent_per_gpu'])})")
            ops = {k: (o["calls"], fmt_bytes(o["sent"])) for k, o in r["collectives_per_step_rank"][0].items()}
            print(f"{'':{w}} measured ops (calls, sent): {ops}")
        if "H" in r:
            print(f"{'':{w}} H = {r['H']}: tok/s/GPU H = (H inner + 1 outer) amortised; B/step/GPU = outer/H "
                  f"(inner steps send {r['inner_step_bytes_sent_per_gpu']} B); payload {r['outer_payload_bytes']} B")
    by = {r["config"]: r for r in rows}
    ours, ds = by.get("b_ours_sl", {}), by.get("b_ds_dp", {})
    if ours.get("dp_bytes_per_step_per_gpu") and ds.get("dp_bytes_per_step_per_gpu"):
        print(f"{'':{w}} replica-link bytes per step per GPU, stock / ours: "
              f"{ds['dp_bytes_per_step_per_gpu'] / ours['dp_bytes_per_step_per_gpu']:.0f}x")
    for label, c in report.get("comparison", {}).items():
        print(f"{label}: ratio of medians {c['ratio_of_medians']}  per repeat {c['per_repeat']}")
    for r in rows:
        for rank, prof in enumerate(r.get("profile") or []):
            print(f"profile {r['config']} rank {rank}: wall {prof['wall_s'] * 1e3:.1f} ms, device "
                  f"{prof['device_time_ms_total']:.1f} ms {prof['device_ms_by_class']}")
    pairs = [(r, by.get(r.get("eager_config"), {})) for r in rows if r.get("compile") and "step_s_median" in r]
    if pairs:
        print("\ncompiled vs eager (hetloco.train.compile; compile time is in the untimed warm-up, warmup_s_all)")
        print(f"{'config':{w}} {'step ms':>8} {'eager ms':>8} {'speed-up':>8} {'warm-up s':>9} {'same bytes':>10} "
              f"{'loss':>9} {'eager loss':>10}")
        for r, e in pairs:
            key = "stage_link_bytes_per_step" if r["config"].startswith("a_") else "dp_bytes_per_step_per_gpu"
            warm = max(sum(x) for x in r["warmup_s_all"])  # the slower rank's untimed warm-up
            e_ms = f"{e['step_s_median'] * 1e3:8.1f}" if "step_s_median" in e else f"{'-':>8}"
            speed = f"{e['step_s_median'] / r['step_s_median']:8.2f}" if "step_s_median" in e else f"{'-':>8}"
            same_b = str(r.get(key) == e.get(key)) if "step_s_median" in e else "-"
            e_loss = f"{e['last_loss'][-1]:10.4f}" if "step_s_median" in e else f"{'-':>10}"
            print(f"{r['config']:{w}} {r['step_s_median'] * 1e3:8.1f} {e_ms} {speed} {warm:9.1f} {same_b:>10} "
                  f"{r['last_loss'][-1]:9.4f} {e_loss}")


def compare(results: list[dict]) -> dict:
    """ours / stock tokens per second per GPU, per repeat and as the ratio of the medians over repeats."""
    def per_repeat(name):
        return {r["repeat"]: r["tokens_per_s_per_gpu"] for r in results
                if r.get("config") == name and "tokens_per_s_per_gpu" in r}

    out = {}
    for label, ours, ds in (("S2_pipeline_ours_over_deepspeed", "a_ours_r1", "a_ds"),
                            ("M2_inner_step_ours_over_deepspeed_dp", "b_ours_sl", "b_ds_dp")):
        a, b = per_repeat(ours), per_repeat(ds)
        if not a or not b:
            continue
        both = sorted(set(a) & set(b))
        out[label] = {
            "per_repeat": [round(a[k] / b[k], 4) for k in both],
            "median_ours_tokens_per_s_per_gpu": statistics.median(a.values()),
            "median_ds_tokens_per_s_per_gpu": statistics.median(b.values()),
            "ratio_of_medians": round(statistics.median(a.values()) / statistics.median(b.values()), 4),
        }
    return out


def driver_main(args) -> int:
    t0 = time.perf_counter()
    out_path = driver_setup(args, "gpu_two.json")
    configs = args_configs(args)
    compiled = {c["name"] for c in configs if c.get("compile")}
    names = pick_configs([c["name"] for c in configs], args.configs, sorted(c["name"] for c in configs))
    report = new_report(
        args, "this script spawns 2 processes per configuration (fresh), one per GPU; the driver writes this file",
        __doc__.split("Bytes (per optimizer step):")[1].split("    python")[0].strip())
    if not args.compiled_rows:  # flag off: the JSON exactly as before the flag existed
        for key in ("compiled_rows", "compiled_timeout"):
            report["settings"].pop(key)
    passthru = worker_argv(args, ["--shape", "--vocab", "--seq", "--micro", "--gas", "--ratios", "--warmup", "--steps",
                                  "--inner-steps", "--outer-repeats", "--schedule", "--link-max-ctas",
                                  "--sm-carveout", "--blas", "--link-transport"],
                           ["--no-bf16", "--cpu-smoke", "--compiled-rows", "--deterministic"])
    runs = [(name, rep) for rep in range(args.repeats) for name in PAIRS if name in names]
    runs += [(name, 0) for name in names if name not in PAIRS]
    ok = True
    with tempfile.TemporaryDirectory(prefix="gpu_two_") as tmp:
        for name, rep in runs:
            elapsed = time.perf_counter() - t0
            if elapsed > args.time_budget:
                res = {"config": name, "repeat": rep,
                       "skipped": f"time budget: {elapsed:.0f} s elapsed > {args.time_budget:.0f} s"}
                print(f"[gpu_two] skip {name} #{rep}: {res['skipped']}", flush=True)
                report["results"].append(res)
                ok = False
                continue
            profiled = args.profile and name in PAIRS and rep == args.repeats - 1
            print(f"[gpu_two] {name} #{rep}{' (profiled)' if profiled else ''} ({elapsed:.0f} s) ...", flush=True)
            limit = args.compiled_timeout if name in compiled else args.config_timeout  # room to compile
            parts, error, wall = spawn_workers(__file__, name, WORLD, passthru + (["--profile-worker"] if profiled else []),
                                               tmp, limit, args.cpu_smoke, "gpu_two", tail_chars=8000,
                                               bind_cores=args.bind_cores)
            res, row_ok = config_row(report, name, parts, error, lambda: summarize(name, parts, args))
            ok = ok and row_ok
            res["repeat"] = rep
            res["wall_s"] = wall
            if profiled and all("profile" in p for p in parts):
                res["profile"] = [p["profile"] for p in parts]
                for r in res.get("ranks", []):
                    r.pop("profile", None)
            report["results"].append(res)
            report["comparison"] = compare(report["results"])
            write_report(report, out_path, t0)
            if "step_s_median" in res:
                print(f"[gpu_two] {name} #{rep}: step {res['step_s_median'] * 1e3:.1f} ms  "
                      f"{res['tokens_per_s_per_gpu']:.0f} tok/s/GPU  wall {wall:.0f} s", flush=True)
            else:
                print(f"[gpu_two] {name} #{rep}: FAILED {res.get('error')}  wall {wall:.0f} s", flush=True)
    return finish_report(report, out_path, t0, print_tables, "gpu_two", ok)


if __name__ == "__main__":
    sys.exit(run_main(parse_args, worker_main, driver_main))
