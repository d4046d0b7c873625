"""Inner-step throughput on one GPU: our engine vs stock DeepSpeed vs a plain transformers loop.

Systems (all in this one process, one after another, memory freed in between):
  ours        HetlocoEngine, S = 1, M = 1, SparseLoCo enabled, bf16 = autocast over fp32 weights.
              Timed steps never include the outer step (H is set out of reach); the outer step is
              then timed on its own (`engine.outer_step()`, M = 1, no collective).
  ds          stock DeepSpeed PipelineEngine (deepspeed.initialize) on the same LayerSpecs in a
              plain deepspeed.pipe.PipelineModule, bf16.enabled (bf16 weights, BF16_Optimizer with
              fp32 master copies), a torch AdamW passed in (no fused-op JIT build).
  hf          transformers LlamaForCausalLM, fp32 weights + bf16 autocast, torch AdamW(fused=True).
  hf_compile  the same model under torch.compile (default mode).
  ours_compile  `ours` with `hetloco.train.compile` (torch.compile'd decoder layers and loss).

`--profile-shapes` (default 178M): after its timed steps, each system runs one more step under
torch.profiler; the JSON gets the kernel time by class (hetloco_ds.profiling.kernel_class: matmul,
attention, elementwise, cast, optimizer, ...), the top kernels and aten ops, launches per step,
and kernel time / step time.

Every system: random tokens, `--micro` x `--seq` tokens per step, no gradient accumulation,
gradient clipping at 1.0 (each system's own way), AdamW(lr 1e-3, betas (0.9, 0.95), wd 0.1).
A step is timed from before the call to after a device synchronisation (every system reads the
loss back to the host once per step); the reported step time is the median of `--steps` steps
after `--warmup` warm-up steps.

MFU = flops / step_time / peak, flops per token = 6 * N + 12 * L * d * seq (PaLM's convention:
N counts every parameter, the input embedding included; attention counted as non-causal), the
convention of shared/ANCHORS.md. `mfu_no_embed` drops the input embedding from N. Peak:
989e12 (H100/H200 SXM dense bf16).

    python bench/gpu_throughput.py --out $OUT/gpu_throughput.json
    python bench/gpu_throughput.py --cpu-smoke          # tiny shapes on the CPU, end to end
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import shlex
import statistics
import sys
import time
import traceback

BENCH = os.path.dirname(os.path.abspath(__file__))
if BENCH not in sys.path:
    sys.path.insert(0, BENCH)

from _common import (  # noqa: E402 - stdlib-only at import; torch / deepspeed are imported inside
    ADAMW, batches, build_ours, build_stock, close_process_group, default_out, device, device_time_us, llama_config,
    mem_gib, ours_config, profiled, stock_config, sync, versions,
)

PEAK_FLOPS = 989e12
ALL_SYSTEMS = ("ours", "ds", "hf", "hf_compile", "ours_compile")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="178M,512M", help="comma-separated hetloco_ds.presets names")
    p.add_argument("--systems", default="ours,ds,hf,ours_compile,hf_compile",
                   help=f"comma-separated subset of {ALL_SYSTEMS}")
    p.add_argument("--extra", default="",
                   help="diagnostic SYSTEM:SHAPE pairs run after the compile pairs, budget permitting ('' for none)")
    p.add_argument("--profile-shapes", default="178M", help="shapes whose systems get one profiled step ('' for none)")
    p.add_argument("--micro", default="178M=8,512M=8", help="micro-batch per shape, NAME=B,...; others use --micro-default")
    p.add_argument("--micro-default", type=int, default=8)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first (compile happens here)")
    p.add_argument("--steps", type=int, default=10, help="timed steps (median reported)")
    p.add_argument("--outer-repeats", type=int, default=3, help="outer steps timed for `ours`")
    p.add_argument("--time-budget", type=float, default=240.0,
                   help="seconds; a (shape, system) pair that would start after this is skipped")
    p.add_argument("--trace-dir", default=None, help="also write each profiled step's chrome trace here (gzip)")
    p.add_argument("--no-bf16", action="store_true", help="fp32 everywhere (CPU smoke fallback)")
    p.add_argument("--out", default=None, help="JSON path (default $OUT/gpu_throughput.json or bench/results/)")
    p.add_argument("--cpu-smoke", action="store_true",
                   help="preset tiny, vocab 1024, seq 64, micro 2, 1+2 steps, on the CPU; the eager systems "
                        "(compiling on a CPU takes minutes)")
    if "--cpu-smoke" in (sys.argv[1:] if argv is None else argv):  # defaults only: explicit flags win
        p.set_defaults(shapes="tiny", vocab=1024, seq=64, micro="", micro_default=2, warmup=1, steps=2,
                       outer_repeats=2, profile_shapes="tiny", systems="ours,ds,hf")
    return p.parse_args(argv)


# ----------------------------------------------------------------------------- helpers
def setup_process_group():
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("LOCAL_WORLD_SIZE", "1")
    from hetloco_ds.build import init_distributed

    init_distributed()


def free_memory():
    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def flops_per_token(cfg, seq: int, n_params: int, with_embedding: bool = True) -> float:
    n = n_params if with_embedding else n_params - cfg.vocab_size * cfg.hidden_size
    return 6.0 * n + 12.0 * cfg.num_hidden_layers * cfg.hidden_size * seq


def time_steps(step_fn, warmup: int, steps: int) -> tuple[list[float], list[float], float]:
    """(warm-up step seconds, timed step seconds, last loss)."""
    warm, timed, loss = [], [], float("nan")
    for i in range(warmup + steps):
        sync()
        t = time.perf_counter()
        loss = step_fn()
        sync()
        (warm if i < warmup else timed).append(time.perf_counter() - t)
    return warm, timed, loss


def summarize(cfg, seq: int, micro: int, n_params: int, warm, timed, loss) -> dict:
    step = statistics.median(timed)
    tokens = micro * seq
    tps = tokens / step
    f = flops_per_token(cfg, seq, n_params)
    f0 = flops_per_token(cfg, seq, n_params, with_embedding=False)
    return {
        "step_s_median": step,
        "step_s_min": min(timed),
        "step_s_max": max(timed),
        "step_s_all": [round(x, 6) for x in timed],
        "warmup_s_all": [round(x, 4) for x in warm],
        "tokens_per_step": tokens,
        "tokens_per_s": tps,
        "tflops_per_s": f * tps / 1e12,
        "mfu": f * tps / PEAK_FLOPS,
        "mfu_no_embed": f0 * tps / PEAK_FLOPS,
        "last_loss": loss,
        "peak_mem_gib": mem_gib("peak"),
    }


def idle_gaps(prof, top: int = 8) -> dict:
    """Device time with no kernel running inside the profiled step, and its largest gaps with
    the kernels on either side (where the GPU waited on the host)."""
    from torch.autograd import DeviceType

    spans = sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                   if getattr(e, "device_type", None) == DeviceType.CUDA)
    if not spans:
        return {}
    gaps, busy_end, prev = [], spans[0][0], spans[0][2]
    for start, end, name in spans:
        if start > busy_end:
            gaps.append((start - busy_end, prev, name))
        if end > busy_end:
            busy_end, prev = end, name
    gaps.sort(reverse=True)
    return {
        "span_ms": round((busy_end - spans[0][0]) / 1e3, 3),
        "idle_ms": round(sum(g for g, _, _ in gaps) / 1e3, 3),
        "gaps_over_50us": sum(1 for g, _, _ in gaps if g > 50),
        "largest": [{"us": round(g, 1), "after": a[:90], "before": b[:90]} for g, a, b in gaps[:top]],
    }


def profile_step(step_fn, step_s: float, trace_path: str | None = None) -> dict:
    """One step under torch.profiler: where the device time goes (microsecond sums -> ms)."""
    from torch.autograd import DeviceType

    from hetloco_ds.profiling import kernel_class

    prof, wall = profiled(step_fn)
    if trace_path:
        import gzip
        import shutil

        os.makedirs(os.path.dirname(trace_path), exist_ok=True)
        prof.export_chrome_trace(trace_path)
        with open(trace_path, "rb") as src, gzip.open(trace_path + ".gz", "wb") as dst:
            shutil.copyfileobj(src, dst)
        os.remove(trace_path)
    events = prof.key_averages()
    kernels = [e for e in events if getattr(e, "device_type", None) == DeviceType.CUDA]
    total_us = sum(device_time_us(e) for e in kernels)
    cats: dict[str, float] = {}
    for e in kernels:
        cls = kernel_class(e.key)
        cats[cls] = cats.get(cls, 0.0) + device_time_us(e)
    top_k = sorted(kernels, key=device_time_us, reverse=True)[:12]
    cpu_ops = [e for e in events if getattr(e, "device_type", None) != DeviceType.CUDA and e.key.startswith("aten::")]
    if kernels:
        top_ops = sorted(cpu_ops, key=lambda e: device_time_us(e, self_=False), reverse=True)[:12]
        op_rows = [{"op": e.key, "calls": e.count, "device_ms": round(device_time_us(e, self_=False) / 1e3, 3)} for e in top_ops]
    else:
        top_ops = sorted(cpu_ops, key=lambda e: e.self_cpu_time_total, reverse=True)[:8]
        op_rows = [{"op": e.key, "calls": e.count, "self_cpu_ms": round(e.self_cpu_time_total / 1e3, 3)} for e in top_ops]
    return {
        "profiled_wall_s": wall,
        "kernel_ms": total_us / 1e3,
        "kernel_launches": sum(e.count for e in kernels),
        "kernel_time_over_step_time": (total_us / 1e6) / step_s if step_s else None,
        "kernel_ms_by_category": {k: round(v / 1e3, 3) for k, v in sorted(cats.items(), key=lambda kv: -kv[1])},
        "top_kernels": [{"kernel": e.key[:120], "calls": e.count, "ms": round(device_time_us(e) / 1e3, 3)} for e in top_k],
        "top_aten_ops_inclusive": op_rows,
        "device_idle": idle_gaps(prof),
        "note": "one step after the timed ones; categories by hetloco_ds.profiling.kernel_class",
    }


def profile_line(result: dict) -> str | None:
    """A result's `profile_step` in one line (kernel time against the step's, by category), or None
    where it has none (not profiled, or on the CPU)."""
    prof = result.get("profile")
    if not (prof and "kernel_ms" in prof and prof["kernel_launches"]):
        return None
    cats = "  ".join(f"{k} {v:.1f}" for k, v in prof["kernel_ms_by_category"].items())
    return (f"kernels {prof['kernel_ms']:.1f} ms / step {1e3 * result['step_s_median']:.1f} ms "
            f"({prof['kernel_launches']} launches): {cats}")


# ----------------------------------------------------------------------------- systems
def run_ours(cfg, shape, micro, seq, args, result, compile_: bool = False):
    # H out of reach: timed steps never run the outer step; it is timed below on its own.
    raw = ours_config(micro, 1, 1, not args.no_bf16, 10**9, {"compressed_replicas": "none"}, seq,
                      max(256, cfg.vocab_size), compile=compile_)
    module, engine = build_ours(raw, cfg, seq, source="bench/gpu_throughput.py")
    assert engine.num_stages == 1 and engine.num_replicas == 1 and engine.algorithm.outer is not None
    n_params = sum(p.numel() for p in engine.trainable_params())
    data = batches(cfg, micro, seq)

    def step():
        return engine.train_step(data).loss

    warm, timed, loss = time_steps(step, args.warmup, args.steps)
    result.update(summarize(cfg, seq, micro, n_params, warm, timed, loss))
    maybe_profile(step, shape, args, result, "ours_compile" if compile_ else "ours")
    result["n_params"] = n_params
    result["outer_steps_in_timed"] = engine.outer_steps
    outer = []
    for _ in range(args.outer_repeats):
        engine.train_step(data)  # a fresh pseudo-gradient for each outer step
        sync()
        t = time.perf_counter()
        rec = engine.outer_step()
        sync()
        outer.append(time.perf_counter() - t)
    if outer:
        steady = outer[1:] or outer
        result["outer_step_s_all"] = [round(x, 6) for x in outer]
        result["outer_step_s_median"] = statistics.median(steady)
        result["outer_step_note"] = ("engine.outer_step(): prepare + finish, M = 1 (no collective); "
                                     "median excludes the first call (allocations)")
        result["outer_payload_bytes"] = rec["payload_bytes"]
        result["outer_over_H50_inner"] = result["outer_step_s_median"] / (50 * result["step_s_median"])
    result["peak_mem_gib_incl_outer"] = mem_gib("peak")
    result["optimizer"] = type(engine.optimizer).__name__
    for g in engine.optimizer.param_groups:
        result["optimizer_foreach"] = g.get("foreach")
        result["optimizer_fused"] = g.get("fused")
        break
    with contextlib.suppress(Exception):
        engine.destroy()
    del engine, module, data  # the process group stays for the next system


def maybe_profile(step_fn, shape, args, result, system: str) -> None:
    if shape not in [x for x in args.profile_shapes.split(",") if x]:
        return
    trace = os.path.join(args.trace_dir, f"trace_{shape}_{system}.json") if args.trace_dir else None
    try:
        result["profile"] = profile_step(step_fn, result.get("step_s_median"), trace)
    except Exception as err:  # noqa: BLE001 - the profile is extra
        result["profile"] = {"error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc()[-2000:]}


def run_ds(cfg, shape, micro, seq, args, result):
    module, params, engine = build_stock(cfg, stock_config(micro, 1, not args.no_bf16), "uniform", num_stages=1)
    n_params = sum(p.numel() for p in params)
    data = batches(cfg, micro, seq)

    def step():
        return float(engine.train_batch(data))

    warm, timed, loss = time_steps(step, args.warmup, args.steps)
    result.update(summarize(cfg, seq, micro, n_params, warm, timed, loss))
    maybe_profile(step, shape, args, result, "ds")
    result["n_params"] = n_params
    result["optimizer"] = type(engine.optimizer).__name__
    result["param_dtype"] = str(next(module.parameters()).dtype)
    with contextlib.suppress(Exception):
        engine.destroy()
    del engine, module, params, data


def run_hf(cfg, shape, micro, seq, args, result, compile_: bool):
    import torch
    from transformers import LlamaForCausalLM

    from hetloco_ds.model import stage_config

    torch.manual_seed(0)
    hcfg = stage_config(cfg)  # sdpa attention, no cache
    dev = device()
    try:
        with dev:  # initialise on the device: seconds instead of a CPU init of every weight
            model = LlamaForCausalLM(hcfg)
    except Exception:  # noqa: BLE001 - fall back to a CPU init
        model = LlamaForCausalLM(hcfg)
    model.to(dev).float().train()
    n_params = sum(p.numel() for p in model.parameters())
    params = list(model.parameters())
    fused = dev.type == "cuda"
    optimizer = torch.optim.AdamW(params, fused=fused, **ADAMW)
    fwd = torch.compile(model) if compile_ else model
    data = batches(cfg, micro, seq)
    autocast = (torch.autocast(device_type=dev.type, dtype=torch.bfloat16) if not args.no_bf16
                else contextlib.nullcontext())

    def step():
        ids, labels = next(data)
        with autocast:
            loss = fwd(input_ids=ids, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return float(loss.detach())

    warm, timed, loss = time_steps(step, args.warmup, args.steps)
    result.update(summarize(cfg, seq, micro, n_params, warm, timed, loss))
    maybe_profile(step, shape, args, result, "hf_compile" if compile_ else "hf")
    result["n_params"] = n_params
    result["param_dtype"] = str(next(model.parameters()).dtype)
    result["optimizer"] = f"torch.optim.AdamW(fused={fused})"
    result["attn_implementation"] = hcfg._attn_implementation
    del fwd, model, optimizer, params, data
    if compile_:
        torch._dynamo.reset()


# ----------------------------------------------------------------------------- main
def card() -> dict:
    import torch

    if not torch.cuda.is_available():
        return {"name": "cpu", "peak_flops_assumed": PEAK_FLOPS}
    p = torch.cuda.get_device_properties(0)
    return {"name": torch.cuda.get_device_name(0), "total_mem_gib": round(p.total_memory / 2**30, 1),
            "sms": p.multi_processor_count, "peak_flops_assumed": PEAK_FLOPS}


def main(argv=None) -> int:
    args = parse_args(argv)
    t0 = time.perf_counter()
    if args.cpu_smoke:
        import torch

        torch.set_num_threads(1)  # 2 shared cores here: oversubscribed OpenMP is far slower
    out_path = args.out or default_out("gpu_throughput.json")
    os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
    import torch

    if torch.cuda.is_available():
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    setup_process_group()
    shapes = [s for s in args.shapes.split(",") if s]
    systems = [s for s in args.systems.split(",") if s]
    bad = [s for s in systems if s not in ALL_SYSTEMS]
    if bad:
        raise SystemExit(f"unknown systems {bad}; choose from {ALL_SYSTEMS}")
    micro_by_shape = dict(kv.split("=") for kv in args.micro.split(",") if kv)
    report = {
        "card": card(),
        "versions": versions(nccl=False),
        "command": " ".join(shlex.quote(a) for a in [sys.executable] + sys.argv),
        "settings": {k: v for k, v in vars(args).items()},
        "flops_convention": "6*N_all_params + 12*L*d*seq per token (PaLM, non-causal attention); "
                            "mfu_no_embed drops the input embedding from N",
        "results": [],
    }
    # Order: the plain systems on every shape; both compiled systems on the first shape; the
    # diagnostic extras; compile on the other shapes (the first to drop under the budget).
    compile_systems = ("ours_compile", "hf_compile")
    pairs = [(sh, sy) for sy in systems if sy not in compile_systems for sh in shapes]
    compiled = [(sh, sy) for sh in shapes for sy in compile_systems if sy in systems]
    pairs += compiled[:2]
    for item in [x for x in args.extra.split(",") if x]:
        sy, sh = item.split(":")
        if sy not in ALL_SYSTEMS:
            raise SystemExit(f"--extra {item}: unknown system")
        if (sh, sy) not in pairs:
            pairs.append((sh, sy))
    pairs += compiled[2:]
    for shape, system in pairs:
        micro = int(micro_by_shape.get(shape, args.micro_default))
        cfg = llama_config(shape, args.vocab, args.seq)
        result = {"shape": shape, "system": system, "micro_batch": micro, "seq": args.seq,
                  "vocab": cfg.vocab_size, "bf16": not args.no_bf16}
        elapsed = time.perf_counter() - t0
        if elapsed > args.time_budget:
            result["skipped"] = f"time budget: {elapsed:.0f} s elapsed > {args.time_budget:.0f} s"
            report["results"].append(result)
            print(f"[bench] skip {shape} {system}: {result['skipped']}", flush=True)
            continue
        free_memory()
        result["mem_before_gib"] = mem_gib("now")
        start = time.perf_counter()
        print(f"[bench] {shape} {system} micro {micro} ...", flush=True)
        try:
            if system in ("ours", "ours_compile"):
                run_ours(cfg, shape, micro, args.seq, args, result, compile_=(system == "ours_compile"))
            elif system == "ds":
                run_ds(cfg, shape, micro, args.seq, args, result)
            else:
                run_hf(cfg, shape, micro, args.seq, args, result, compile_=(system == "hf_compile"))
        except Exception as err:  # noqa: BLE001 - one failing system must not lose the others
            result["error"] = f"{type(err).__name__}: {err}"
            result["traceback"] = traceback.format_exc()[-4000:]
            print(result["traceback"], flush=True)
        result["wall_s"] = time.perf_counter() - start
        free_memory()
        result["mem_after_gib"] = mem_gib("now")
        report["results"].append(result)
        report["elapsed_s"] = time.perf_counter() - t0
        with open(out_path, "w") as f:
            json.dump(report, f, indent=2, default=str)
        if "tokens_per_s" in result:
            extra = ""
            if "outer_step_s_median" in result:
                extra = f"  outer {result['outer_step_s_median'] * 1e3:.1f} ms"
            print(f"[bench] {shape} {system}: {result['tokens_per_s'] / 1e3:.1f}K tok/s  "
                  f"step {result['step_s_median'] * 1e3:.1f} ms  MFU {100 * result['mfu']:.1f}%  "
                  f"peak {result['peak_mem_gib']} GiB  wall {result['wall_s']:.0f} s{extra}", flush=True)
    report["elapsed_s"] = time.perf_counter() - t0
    with open(out_path, "w") as f:
        json.dump(report, f, indent=2, default=str)

    print(f"\n{report['card']['name']}  torch {report['versions']['torch']}  transformers "
          f"{report['versions']['transformers']}  deepspeed {report['versions']['deepspeed']}")
    print(f"{'shape':6} {'system':12} {'micro':>5} {'tok/s':>10} {'step ms':>9} {'MFU':>6} {'peakGiB':>8} {'outer ms':>9}")
    for r in report["results"]:
        if "tokens_per_s" not in r:
            why = r.get("skipped") or r.get("error", "?")
            print(f"{r['shape']:6} {r['system']:12} {r['micro_batch']:>5}  -- {why[:80]}")
            continue
        outer = f"{r['outer_step_s_median'] * 1e3:9.1f}" if "outer_step_s_median" in r else f"{'':9}"
        print(f"{r['shape']:6} {r['system']:12} {r['micro_batch']:>5} {r['tokens_per_s']:10.0f} "
              f"{r['step_s_median'] * 1e3:9.1f} {100 * r['mfu']:5.1f}% {str(r['peak_mem_gib']):>8} {outer}")
    for r in report["results"]:
        if line := profile_line(r):
            print(f"profile {r['shape']} {r['system']}: {line}")
    print(f"[bench] wrote {out_path} ({report['elapsed_s']:.0f} s)", flush=True)
    close_process_group()
    return 0 if all("error" not in r for r in report["results"]) else 1


if __name__ == "__main__":
    sys.exit(main())
