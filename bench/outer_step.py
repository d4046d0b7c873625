"""Cost of SparseLoCo's outer step on one device, for the real parameter shapes of a preset.

The parameter list is the model's own (a `transformers` LlamaForCausalLM of the preset built on
the meta device, in `parameters()` order, which is our engine's `trainable_params()` order for
S = 1): embedding, per layer q/k/v/o, gate/up/down, two norms, final norm, LM head.

Timed with device events (median over `--repeats`, after one warm-up outer step):
  prepare          SparseLoCoState.prepare(params): error feedback, per-chunk top-k, pack
  finish (M = 1)   SparseLoCoState.finish(params, [own payload])
  finish (M = 8)   the same with 8 distinct payloads (made by this one state from 8 different
                   pseudo-gradients; finish never checks who made them)
  breakdown        the passes inside, re-run on the stacked same-shape groups with the public
                   compress API (TensorCodec.select / pack_ / unpack), best effort

Memory-bandwidth floor, from a device-to-device copy measured in the same run (bytes read plus
bytes written over time). With P fp32 parameters (4 bytes each), n_sel selected values:
  prepare: read theta_prev, read param, read e, write e, read e again for top-k = 5 passes of 4P,
           plus the payload written;
  finish:  read theta_prev, write param, write theta_prev = 3 passes of 4P (as briefed), plus the
           M payloads read and a read+write of theta_prev at the M*n_sel selected positions.
           theta_prev changes only at selected positions, so 2 dense passes is the true minimum;
           `floor_ms_min` uses that count.
The top-k itself is counted as one read; the implementation's |.| buffer adds a write and a read.

    python bench/outer_step.py --throughput-json $OUT/gpu_throughput.json --out $OUT/outer_step.json
    python bench/outer_step.py --cpu-smoke
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import shlex
import statistics
import sys
import time
import traceback

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

import torch  # noqa: E402

H = 50


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="512M")
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--replicas", type=int, default=8, help="fake M for the second finish timing")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--topk", type=int, default=32)
    p.add_argument("--chunk-size", type=int, default=4096)
    p.add_argument("--quant-bits", type=int, default=None)
    p.add_argument("--copy-mib", type=int, default=1024, help="size of each buffer of the bandwidth copy")
    p.add_argument("--throughput-json", default=None, help="gpu_throughput.json for the H = 50 comparison")
    p.add_argument("--out", default=None)
    p.add_argument("--cpu-smoke", action="store_true", help="preset tiny, vocab 1024, M 2, 1 repeat, on the CPU")
    if "--cpu-smoke" in (sys.argv[1:] if argv is None else argv):  # defaults only: explicit flags win
        p.set_defaults(shape="tiny", vocab=1024, replicas=2, repeats=1, copy_mib=4)
    return p.parse_args(argv)


# ----------------------------------------------------------------------------- timing
class Timer:
    """Device events on CUDA, perf_counter elsewhere; `ms()` after the region closes."""

    def __init__(self, dev: torch.device):
        self.cuda = dev.type == "cuda"

    @contextlib.contextmanager
    def region(self, sink: list):
        if self.cuda:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            yield
            b.record()
            b.synchronize()
            sink.append(a.elapsed_time(b))
        else:
            t = time.perf_counter()
            yield
            sink.append((time.perf_counter() - t) * 1e3)


def med(xs: list) -> float | None:
    return statistics.median(xs) if xs else None


def stats(xs: list) -> dict:
    return {"median_ms": med(xs), "min_ms": min(xs) if xs else None, "all_ms": [round(x, 4) for x in xs]}


def copy_bandwidth(dev, mib: int, timer: Timer, reps: int = 20) -> dict:
    n = mib * 2**20 // 4
    src = torch.randn(n, device=dev)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    ts: list = []
    for _ in range(reps):
        with timer.region(ts):
            dst.copy_(src)
    ms = med(ts)
    moved = 2 * src.numel() * 4
    del src, dst
    return {"buffer_mib": mib, "bytes_moved_per_copy": moved, "median_ms": ms, "bytes_per_s": moved / (ms / 1e3),
            "note": "read + write counted"}


# ----------------------------------------------------------------------------- shapes
def model_shapes(shape: str, vocab: int) -> list[tuple[str, tuple[int, ...]]]:
    from transformers import LlamaForCausalLM

    from hetloco_ds.model import stage_config
    from hetloco_ds.presets import model_config_for

    cfg = stage_config(model_config_for(shape, vocab))
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    return [(name, tuple(p.shape)) for name, p in model.named_parameters()]


def make_params(shapes, dev, seed=0):
    torch.manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, device=dev) * 0.02) for _, s in shapes]


@torch.no_grad()
def perturb(params, scale=1e-3):
    """Stand-in for H inner steps: a fresh dense pseudo-gradient on every parameter."""
    for p in params:
        p.add_(torch.randn_like(p), alpha=scale)


# ----------------------------------------------------------------------------- breakdown
@torch.no_grad()
def breakdown(state_cfg, shapes, dev, timer: Timer, repeats: int, m: int) -> dict:
    """Each pass of the outer step on the stacked same-shape groups (as outer.py stacks them),
    through the public TensorCodec API; times are summed over groups, median over repeats."""
    from hetloco_ds.sparseloco.compress import TensorCodec

    groups: dict[tuple, int] = {}
    for _, s in shapes:
        groups[s] = groups.get(s, 0) + 1
    phases = ["ef_dense", "select", "pack", "error_update", "unpack_xM", "accumulate_apply_xM", "param_copy"]
    totals = {k: [] for k in phases}
    for r in range(repeats + 1):
        per = {k: [] for k in phases}
        for s, count in groups.items():
            codec = TensorCodec(s, state_cfg.chunk_size, state_cfg.topk, state_cfg.quant_bits,
                                getattr(torch, state_cfg.value_dtype))
            tp = torch.randn(count, *s, device=dev) * 0.02
            par = tp + 1e-3 * torch.randn_like(tp)
            err = 1e-3 * torch.randn_like(tp)
            e_new = torch.empty_like(tp)
            with timer.region(per["ef_dense"]):
                torch.sub(tp, par, out=e_new)
                e_new.add_(err, alpha=state_cfg.error_decay)
            with timer.region(per["select"]):
                sel = codec.select(e_new)
            rows = torch.zeros(count, codec.nbytes, dtype=torch.uint8, device=dev)
            with timer.region(per["pack"]):
                sent = codec.pack_(rows, sel)
            with timer.region(per["error_update"]):
                e_new.view(count, -1).scatter_(1, sel.pos, sel.values - sent)
            acc = torch.zeros(count, tp[0].numel(), device=dev)
            with timer.region(per["unpack_xM"]):
                decoded = [codec.unpack(rows) for _ in range(m)]
            with timer.region(per["accumulate_apply_xM"]):
                for pos, values in decoded:
                    acc.scatter_(1, pos, acc.gather(1, pos) + values)
                pos = torch.cat([d[0] for d in decoded], 1)
                avg = acc.gather(1, pos) / m
                theta = tp.view(count, -1)
                theta.scatter_(1, pos, torch.sub(theta.gather(1, pos), avg, alpha=state_cfg.outer_lr))
                acc.scatter_(1, pos, 0.0)
            with timer.region(per["param_copy"]):
                par.copy_(tp)
            del tp, par, err, e_new, sel, rows, sent, acc, decoded, pos, avg, theta
        if r > 0:  # the first round is warm-up
            for k in phases:
                totals[k].append(sum(per[k]))
    out = {k: stats(v) for k, v in totals.items()}
    out["note"] = (f"summed over {len(groups)} same-shape groups; unpack and accumulate for M = {m} copies of one "
                   "payload; allocations of the stacked inputs are outside the timed regions")
    return out


# ----------------------------------------------------------------------------- main
def inner_step_times(path: str | None, shape: str) -> dict:
    if not path or not os.path.exists(path):
        return {}
    with open(path) as f:
        report = json.load(f)
    return {r["system"]: r["step_s_median"] for r in report.get("results", [])
            if r.get("shape") == shape and "step_s_median" in r}


def main(argv=None) -> int:
    args = parse_args(argv)
    t0 = time.perf_counter()
    if args.cpu_smoke:
        torch.set_num_threads(1)  # 2 shared cores here: oversubscribed OpenMP is far slower
    out_path = args.out or (os.path.join(os.environ["OUT"], "outer_step.json") if os.environ.get("OUT")
                            else os.path.join(REPO, "bench", "results", "outer_step.json"))
    os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
    from hetloco_ds.config import SparseLoCoConfig
    from hetloco_ds.sparseloco.outer import SparseLoCoState
    from hetloco_ds.sparseloco.payload import payload_nbytes, tensor_codec

    dev = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    timer = Timer(dev)
    cfg = SparseLoCoConfig(preset="paper", topk=args.topk, chunk_size=args.chunk_size, quant_bits=args.quant_bits)
    shapes = model_shapes(args.shape, args.vocab)
    n_elems = sum(math.prod(s) for _, s in shapes)
    report = {
        "card": torch.cuda.get_device_name(0) if dev.type == "cuda" else "cpu",
        "versions": {"torch": torch.__version__, "python": sys.version.split()[0]},
        "command": " ".join(shlex.quote(a) for a in [sys.executable] + sys.argv),
        "shape": args.shape,
        "vocab": args.vocab,
        "n_params": n_elems,
        "n_tensors": len(shapes),
        "distinct_shapes": sorted({s for _, s in shapes}, key=lambda s: -math.prod(s)),
        "config": {"topk": cfg.topk, "chunk_size": cfg.chunk_size, "quant_bits": cfg.quant_bits,
                   "value_dtype": str(cfg.value_dtype), "error_decay": cfg.error_decay},
    }
    print(f"[outer] {args.shape}: {n_elems / 1e6:.1f}M parameters in {len(shapes)} tensors, "
          f"{len(report['distinct_shapes'])} shapes", flush=True)

    bw = copy_bandwidth(dev, args.copy_mib, timer)
    report["copy_bandwidth"] = bw
    print(f"[outer] device copy: {bw['bytes_per_s'] / 1e12:.2f} TB/s (read + write)", flush=True)

    params = make_params(shapes, dev)
    state = SparseLoCoState(params, cfg)
    payload_bytes = payload_nbytes([s for _, s in shapes], cfg)
    report["payload_bytes"] = payload_bytes  # the size rule; payload_bytes_made: what prepare() made

    # M distinct payloads: this state's own, from M different pseudo-gradients.
    payloads = []
    for _ in range(args.replicas):
        perturb(params)
        p = state.prepare(params)
        payloads.append(p.clone())
        state.finish(params, [p])
    report["payload_bytes_made"] = sorted({p.numel() * p.element_size() for p in payloads})
    if dev.type == "cuda":
        torch.cuda.synchronize()

    prep, fin1, finm = [], [], []
    for which, sink in (("1", fin1), (str(args.replicas), finm)):
        gathered = None
        for r in range(args.repeats + 1):
            perturb(params)
            tmp: list = []
            with timer.region(tmp):
                own = state.prepare(params)
            gathered = [own] if which == "1" else payloads
            with timer.region(tmp):
                state.finish(params, gathered)
            if r > 0:
                prep.append(tmp[0])
                sink.append(tmp[1])
    report["prepare"] = stats(prep)
    report["finish_M1"] = stats(fin1)
    report[f"finish_M{args.replicas}"] = stats(finm)
    report["outer_M1_ms"] = med(prep) + med(fin1)
    report[f"outer_M{args.replicas}_ms"] = med(prep) + med(finm)
    report["peak_mem_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 3) if dev.type == "cuda" else None

    # Bandwidth floor.
    P4 = 4 * n_elems
    n_sel = sum(tensor_codec(cfg, s).n_selected for _, s in shapes)
    prep_bytes = 5 * P4 + payload_bytes
    bps = bw["bytes_per_s"]

    def fin_bytes(m: int, dense_passes: int) -> int:
        return dense_passes * P4 + m * payload_bytes + m * n_sel * 2 * 4

    floor = {
        "assumed": "prepare 5 dense passes (read theta_prev, param, e; write e; read e for top-k) + payload write; "
                   "finish 3 dense passes (read theta_prev; write param; write theta_prev) + M payload reads + "
                   "read/write of theta_prev at M*n_sel positions; floor_ms_min counts finish as 2 dense passes",
        "n_selected": n_sel,
        "prepare_bytes": prep_bytes,
        "prepare_floor_ms": prep_bytes / bps * 1e3,
    }
    for m, fin in ((1, fin1), (args.replicas, finm)):
        b3, b2 = fin_bytes(m, 3), fin_bytes(m, 2)
        floor[f"finish_M{m}_bytes"] = b3
        floor[f"finish_M{m}_floor_ms"] = b3 / bps * 1e3
        floor[f"finish_M{m}_floor_ms_min"] = b2 / bps * 1e3
        floor[f"outer_M{m}_floor_ms"] = (prep_bytes + b3) / bps * 1e3
        floor[f"outer_M{m}_floor_ms_min"] = (prep_bytes + b2) / bps * 1e3
        floor[f"outer_M{m}_measured_over_floor"] = (med(prep) + med(fin)) / floor[f"outer_M{m}_floor_ms"]
    floor["prepare_measured_over_floor"] = med(prep) / floor["prepare_floor_ms"]
    report["bandwidth_floor"] = floor

    inner = inner_step_times(args.throughput_json, args.shape)
    if inner:
        report["inner_step_s"] = inner
        report[f"outer_over_H{H}_inner"] = {
            sys_: {f"M{m}": report[f"outer_M{m}_ms"] / 1e3 / (H * step) for m in (1, args.replicas)}
            for sys_, step in inner.items()
        }
    else:
        report[f"outer_over_H{H}_inner"] = (f"no {args.shape} throughput result found at {args.throughput_json}; "
                                            "see the ms numbers")

    with open(out_path, "w") as f:
        json.dump(report, f, indent=2, default=str)

    try:
        del state, payloads
        if dev.type == "cuda":
            torch.cuda.empty_cache()
        report["breakdown"] = breakdown(cfg, shapes, dev, timer, max(2, args.repeats // 2), args.replicas)
    except Exception as err:  # noqa: BLE001 - the breakdown is extra; the main numbers are written
        report["breakdown"] = {"error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc()[-3000:]}
        print(report["breakdown"]["traceback"], flush=True)
    report["elapsed_s"] = time.perf_counter() - t0
    with open(out_path, "w") as f:
        json.dump(report, f, indent=2, default=str)

    m = args.replicas
    print(f"\n{report['card']}  torch {torch.__version__}  {args.shape}: {n_elems / 1e6:.1f}M params, "
          f"payload {payload_bytes / 2**20:.2f} MiB, copy {bps / 1e12:.2f} TB/s")
    print(f"{'phase':22} {'median ms':>10} {'floor ms':>9} {'x floor':>8}")
    rows = [("prepare", med(prep), floor["prepare_floor_ms"]),
            ("finish M=1", med(fin1), floor["finish_M1_floor_ms"]),
            (f"finish M={m}", med(finm), floor[f"finish_M{m}_floor_ms"]),
            ("outer M=1", report["outer_M1_ms"], floor["outer_M1_floor_ms"]),
            (f"outer M={m}", report[f"outer_M{m}_ms"], floor[f"outer_M{m}_floor_ms"])]
    for name, ms, fl in rows:
        print(f"{name:22} {ms:10.2f} {fl:9.2f} {ms / fl:8.1f}")
    if isinstance(report.get("breakdown"), dict) and "error" not in report["breakdown"]:
        for k, v in report["breakdown"].items():
            if isinstance(v, dict):
                print(f"  {k:20} {v['median_ms']:10.2f}")
    if inner:
        for sys_, frac in report[f"outer_over_H{H}_inner"].items():
            print(f"outer / ({H} x {sys_} inner step {inner[sys_] * 1e3:.1f} ms): "
                  + ", ".join(f"{k} {100 * v:.2f}%" for k, v in frac.items()))
    print(f"[outer] wrote {out_path} ({report['elapsed_s']:.0f} s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
