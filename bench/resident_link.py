"""Do a stage's GEMMs slow down beside a resident stage-link kernel, and does an SM carveout undo it?

The overlapped schedule posts its NCCL receives ahead, and each stays on the device as a kernel (one
CTA per communicator with `pipeline.link_max_ctas` 1) until its message comes. Hopper's cuBLAS GEMMs are
often persistent: one CTA per SM, each working through many tiles. With one SM taken, such a grid
runs in two waves and the GEMM takes up to twice as long (wave quantisation of persistent kernels). On 2 H100s the
overlapped S = 2 stayed 4-7% behind the blocking one whatever the cores (docs/bench-notes.md); this
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
              ce:    one receive by the copy engine (CUDA only), which holds no SM while it waits: a
                     side stream waits on a 32-bit flag (cuStreamWaitValue32); rank 1 copies the
                     message into rank 0's slot (CUDA IPC, a peer copy over NVLink) and sets the flag
                     (cuStreamWriteValue32); rank 0 checks every element it got
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
def ce_pattern(n: int, seq: int, device):
    """The message of the seq-th copy-engine transfer: distinct per element and per transfer."""
    import torch

    return ((torch.arange(n, device=device) % 251) + seq % 7).to(torch.bfloat16)


def open_ce_link(rank: int, dev, n: int, side):
    """Rank 0 exports a message slot and a flag, rank 1 maps them: the product's own primitives
    (`hetloco_ds.pipe.copy_engine.CudaBackend`). Returns (backend, slot, flag, error): every rank gets
    the same error (None when both sides are ready), so a machine that refuses CUDA IPC or stream
    memory operations skips the ce condition instead of hanging the run."""
    import torch
    import torch.distributed as tdist

    from hetloco_ds.pipe.copy_engine import CudaBackend

    backend = slot = flag = shared = err = None
    try:
        backend = CudaBackend(dev)
        if rank == 0:
            slot, flag = backend.zeros(n, torch.bfloat16), backend.zeros(1, torch.int32)
            shared = [backend.export(slot), backend.export(flag)]
    except Exception as e:  # noqa: BLE001 - reported in the JSON, the other conditions still run
        err = f"rank {rank}: {type(e).__name__}: {e}"
    box = [shared]
    tdist.broadcast_object_list(box, src=0, group=side)
    if rank == 1 and err is None:
        try:
            if box[0] is None:
                raise RuntimeError("rank 0 exported nothing")
            slot, flag = backend.map_peer(box[0][0], torch.bfloat16, n, 0), backend.map_peer(box[0][1], torch.int32, 1, 0)
        except Exception as e:  # noqa: BLE001
            err = f"rank {rank}: {type(e).__name__}: {e}"
    errors = [None, None]
    tdist.all_gather_object(errors, err, group=side)
    err = "; ".join(e for e in errors if e) or None
    return backend, slot, flag, err


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


def conditions(cuda: bool, carveout: int, ce: bool = False) -> list[tuple[str, int, str]]:
    """(blas, carveout, resident) of every condition; the CPU has one BLAS, no SMs to carve and no
    copy engine."""
    blases = ("cublas", "cublaslt") if cuda else ("cpu",)
    carveouts = (0, carveout) if cuda else (0,)
    resident = RESIDENT + (("ce",) if cuda and ce else ())
    return [(b, c, r) for b in blases for c in carveouts for r in resident]


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

    ce = ce_slot = ce_flag = ce_error = None
    if cuda:
        ce, ce_slot, ce_flag, ce_error = open_ce_link(rank, dev, n, side)
    ce_ok = cuda and ce_error is None
    ce_seq, ce_copy_ms, ce_bad = 0, [], []
    if ce_ok and rank == 0:
        ce_side, ce_dst, ce_done = torch.cuda.Stream(dev), torch.empty_like(ce_slot), torch.cuda.Event()
    if ce_ok and rank == 1:
        ce_msgs = {}
    conds = conditions(cuda, args.carveout, ce_ok)
    results: dict[str, list[float]] = {}
    for rep in range(args.repeats + 1):  # repeat 0 warms every path up (cuBLAS(Lt) handles, heuristics) and is dropped
        for blas, carve, resident in conds:
            if cuda:
                torch.backends.cuda.preferred_blas_library(blas)
                torch._C._set_sm_carveout_experimental(carve)
            groups = {"none": [], "recv1": capped[:1], "recv2": capped, "recvN": [free], "ce": []}[resident]
            if resident == "ce":
                ce_seq += 1
            tdist.barrier(group=side)
            if rank == 0:
                works = [tdist.irecv(buffers[id(grp)], 1, group=grp) for grp in groups]
                if resident == "ce":  # posted ahead like the overlapped schedule's receive, on its own stream
                    ce.after_compute(ce_side)
                    ce.wait_geq(ce_side, ce_flag, 0, ce_seq)
                    ce.copy(ce_side, ce_dst, ce_slot)
                    ce_done.record(ce_side)
                ms = timed()
                tdist.barrier(group=side)  # now rank 1 sends
                for wk in works:
                    wk.wait()
                if resident == "ce":
                    deadline = time.monotonic() + 60
                    while not ce_done.query():  # bounded: a flag that never comes must not hang the run
                        if time.monotonic() > deadline:
                            raise RuntimeError(f"copy-engine transfer {ce_seq}: flag not set after 60 s")
                        time.sleep(0.001)
                    if not torch.equal(ce_dst, ce_pattern(n, ce_seq, dev)):
                        ce_bad.append(ce_seq)
                if cuda:
                    torch.cuda.synchronize()
                if rep:
                    results.setdefault(f"{blas}/carveout{carve}/{resident}", []).append(ms)
            else:
                tdist.barrier(group=side)
                for grp in groups:
                    tdist.send(buffers[id(grp)], 0, group=grp)
                if resident == "ce":
                    msg = ce_msgs.setdefault(ce_seq % 7, ce_pattern(n, ce_seq, dev))
                    stream = torch.cuda.current_stream(dev)
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record(stream)
                    ce.copy(stream, ce_slot, msg)  # into rank 0's slot, mapped here: a peer copy
                    ce.write(stream, ce_flag, 0, ce_seq)
                    end.record(stream)
                    end.synchronize()
                    ce_copy_ms.append(start.elapsed_time(end))
                if cuda:
                    torch.cuda.synchronize()
    copy_ms = [None, None]
    tdist.all_gather_object(copy_ms, ce_copy_ms, group=side)
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
            "copy_engine": {"error": ce_error, "transfers": ce_seq, "transfers_with_wrong_data": ce_bad,
                            "copy_ms_median": statistics.median(copy_ms[1]) if copy_ms[1] else None,
                            "message_bytes": 2 * n} if cuda else None,
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
    ce = report.get("copy_engine")
    if ce:
        print(f"copy engine: {ce['error'] or 'ok'}; {ce['transfers']} transfers, wrong data in "
              f"{len(ce['transfers_with_wrong_data'])}; {ce['message_bytes']} bytes in {ce['copy_ms_median']} ms")
    print(f"[resident_link] wrote {out_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
