"""Do a stage's GEMMs slow down beside a resident stage-link kernel, and does an SM carveout undo it?

The overlapped schedule posts its NCCL receives ahead, and each stays on the device as a kernel (one
CTA per communicator with `pipeline.link_max_ctas` 1) until its message comes. Hopper's cuBLAS GEMMs are
often persistent: one CTA per SM, each working through many tiles. With one SM taken, such a grid
runs in two waves and the GEMM takes up to twice as long (pytorch issue 143988). On 2 H100s the
overlapped S = 2 stayed 4-7% behind the blocking one whatever the cores (bench/README.md); this
measures the suspected mechanism alone, without a pipeline.

Two ranks, one GPU each. Rank 0 times a stage's GEMMs (a 178M layer's projections and the LM head at
4 x 2048 tokens, bf16: [T, d] x [d, f] and back, [T, d] x [d, d], [T, d] x [d, V]) with CUDA events on
its own stream, in each condition:
  blas        cublas | cublaslt   (torch.backends.cuda.preferred_blas_library)
  carveout    0 | --carveout      (torch._C._set_sm_carveout_experimental; reaches cuBLASLt calls)
  resident    none: nothing else on the device
              recv1: one receive posted on a link communicator capped at 1 CTA (the product's
                     `pipe.links.nccl_link_options(1)`), its sender held back until the timing ends
              recv2: two such receives on two communicators (a stage's receive and send at once)
              recvN: one receive on a communicator at NCCL's own CTA count
Rank 1 only sends, after rank 0 has finished timing (a gloo barrier), so the receives stay resident
through every timed GEMM. Conditions are interleaved over `--repeats`; each reports the median
milliseconds of one pass over the GEMMs, and its ratio to (same blas, carveout 0, none).

    python bench/resident_link.py --out $OUT/resident_link.json     # 2 GPUs, NCCL (about a minute)
    python bench/resident_link.py --cpu-smoke                       # gloo, tiny shapes: the protocol only
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

BENCH = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(BENCH)
for p in (BENCH, REPO):
    if p not in sys.path:
        sys.path.insert(0, p)

RESIDENT = ("none", "recv1", "recv2", "recvN")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=4 * 2048)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--ffn", type=int, default=2688)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--iters", type=int, default=20, help="passes over the GEMMs in one timed condition")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--carveout", type=int, default=2, help="SMs left to the link kernels in the carveout conditions")
    p.add_argument("--message-mib", type=float, default=16.0, help="size of each held-back message")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds before the run is stopped")
    p.add_argument("--out", default=None, help="JSON path (default $OUT/resident_link.json or bench/results/)")
    p.add_argument("--cpu-smoke", action="store_true", help="gloo on the CPU, tiny shapes, 2 repeats")
    args = p.parse_args(argv)
    if args.cpu_smoke:
        args.tokens, args.hidden, args.ffn, args.vocab, args.iters, args.repeats = 64, 32, 48, 128, 2, 2
        args.message_mib = 0.01
    for name in ("tokens", "hidden", "ffn", "vocab", "iters", "repeats"):
        if getattr(args, name) < 1:
            p.error(f"--{name} {getattr(args, name)}: must be at least 1")
    if args.carveout < 1:
        p.error(f"--carveout {args.carveout}: must be at least 1 (0 is always measured)")
    return args


def conditions(cuda: bool, carveout: int) -> list[tuple[str, int, str]]:
    """(blas, carveout, resident) of every condition; the CPU has one BLAS and no SMs to carve."""
    blases = ("cublas", "cublaslt") if cuda else ("cpu",)
    carveouts = (0, carveout) if cuda else (0,)
    return [(b, c, r) for b in blases for c in carveouts for r in RESIDENT]


def worker(rank: int, args, port: int, out_path: str) -> None:
    import torch
    import torch.distributed as tdist

    from hetloco_ds.pipe.links import nccl_link_options

    cuda = torch.cuda.is_available() and not args.cpu_smoke
    dev = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(dev)
    tdist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                             world_size=2, device_id=dev if cuda else None)
    side = tdist.new_group([0, 1], backend="gloo")  # host-side barriers, never behind a held receive
    capped = [tdist.new_group([0, 1], pg_options=nccl_link_options(1)) for _ in range(2)]
    free = tdist.new_group([0, 1])
    n = max(1, int(args.message_mib * 2**20) // 2)
    buffers = {id(grp): torch.zeros(n, dtype=torch.bfloat16, device=dev) for grp in capped + [free]}
    for grp in capped + [free]:  # NCCL connects on first use; a first use inside a timed condition would block
        (tdist.send if rank == 1 else tdist.recv)(buffers[id(grp)], 1 - rank, group=grp)
    dtype = torch.bfloat16 if cuda else torch.float32
    t, d, f, v = args.tokens, args.hidden, args.ffn, args.vocab
    g = torch.Generator(device="cpu").manual_seed(0)
    x, h = (torch.randn(t, d, generator=g).to(dev, dtype), torch.randn(t, f, generator=g).to(dev, dtype))
    w = [torch.randn(d, f, generator=g).to(dev, dtype), torch.randn(f, d, generator=g).to(dev, dtype),
         torch.randn(d, d, generator=g).to(dev, dtype), torch.randn(d, v, generator=g).to(dev, dtype)]

    def gemms():
        torch.matmul(x, w[0])
        torch.matmul(h, w[1])
        torch.matmul(x, w[2])
        torch.matmul(x, w[3])

    def timed() -> float:
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(args.iters):
                gemms()
            end.record()
            end.synchronize()  # this stream's event only: a device-wide sync would wait for the held receives
            return start.elapsed_time(end) / args.iters
        t0 = time.perf_counter()
        for _ in range(args.iters):
            gemms()
        return (time.perf_counter() - t0) * 1e3 / args.iters

    conds = conditions(cuda, args.carveout)
    results: dict[str, list[float]] = {}
    for rep in range(args.repeats + 1):  # repeat 0 warms every path up (cuBLAS(Lt) handles, heuristics) and is dropped
        for blas, carve, resident in conds:
            if cuda:
                torch.backends.cuda.preferred_blas_library(blas)
                torch._C._set_sm_carveout_experimental(carve)
            groups = {"none": [], "recv1": capped[:1], "recv2": capped, "recvN": [free]}[resident]
            tdist.barrier(group=side)
            if rank == 0:
                works = [tdist.irecv(buffers[id(grp)], 1, group=grp) for grp in groups]
                ms = timed()
                tdist.barrier(group=side)  # now rank 1 sends
                for wk in works:
                    wk.wait()
                if cuda:
                    torch.cuda.synchronize()
                if rep:
                    results.setdefault(f"{blas}/carveout{carve}/{resident}", []).append(ms)
            else:
                tdist.barrier(group=side)
                for grp in groups:
                    tdist.send(buffers[id(grp)], 0, group=grp)
                if cuda:
                    torch.cuda.synchronize()
    if rank == 0:
        rows = {}
        for blas, carve, resident in conds:
            key = f"{blas}/carveout{carve}/{resident}"
            base = statistics.median(results[f"{blas}/carveout0/none"])
            med = statistics.median(results[key])
            rows[key] = {"blas": blas, "carveout": carve, "resident": resident, "ms_median": med,
                         "ms_all": results[key], "vs_same_blas_alone": med / base}
        report = {
            "card": (torch.cuda.get_device_name(0) if cuda else "cpu"),
            "sms": (torch.cuda.get_device_properties(0).multi_processor_count if cuda else None),
            "torch": torch.__version__,
            "nccl": (".".join(map(str, torch.cuda.nccl.version())) if cuda else None),
            "command": " ".join([sys.executable] + sys.argv),
            "settings": vars(args),
            "gemms": {"tokens": t, "hidden": d, "ffn": f, "vocab": v, "dtype": str(dtype),
                      "flop_per_pass": 2 * t * (d * f + f * d + d * d + d * v)},
            "conventions": __doc__.split("Rank 1 only sends")[0].split("Two ranks, one GPU each. ")[1].strip(),
            "results": rows,
        }
        tmp = out_path + ".tmp"
        with open(tmp, "w") as fh:
            json.dump(report, fh, indent=2)
        os.replace(tmp, out_path)
    tdist.barrier(group=side)
    tdist.destroy_process_group()


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch.multiprocessing as mp

    from _common import default_out
    from hetloco_ds.launch import free_port

    out_path = args.out or default_out("resident_link.json")
    os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
    ctx = mp.start_processes(worker, args=(args, free_port(), out_path), nprocs=2, join=False, start_method="spawn")
    deadline = time.monotonic() + args.timeout
    while not ctx.join(timeout=5):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            print(f"[resident_link] stopped after {args.timeout:.0f} s: a rank hung (a held receive never matched?)",
                  file=sys.stderr)
            return 1
    with open(out_path) as fh:
        report = json.load(fh)
    print(f"{report['card']} ({report['sms']} SMs)  torch {report['torch']}  nccl {report['nccl']}")
    print(f"{'blas':9} {'carveout':>8} {'resident':>8} {'ms/pass':>9} {'vs alone':>9}")
    for r in report["results"].values():
        print(f"{r['blas']:9} {r['carveout']:8d} {r['resident']:>8} {r['ms_median']:9.3f} {r['vs_same_blas_alone']:9.3f}")
    print(f"[resident_link] wrote {out_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
