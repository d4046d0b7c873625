"""The paper's Tables 1, 2, 4 and 5a in shape, at small scale, with the simulator on GPUs.

M = 8 replicas x S = 4 virtual stages, H = 50, a LLaMA of ~20M parameters on the embedded
corpus (the Python standard library, BPE 8192, carried as a pre-tokenised tensor file so
the GPU machine needs no `datasets`), the same token budget for every row.

The rows x seeds are spread over every visible GPU and `--procs-per-gpu` worker processes on
each (one replica set is too small to keep a GPU busy: the host launching kernels is the
limit). Workers take the next unclaimed row, longest first, and rewrite their own
`paper_tables_<tag>_g<gpu>p<proc>.json` under `--out` after every row, so a killed call keeps
what finished. `bench/summarize_tables.py` merges them.

    python bench/paper_tables.py --data .benchdata/stdlib_bpe8192_seq256.pt --seeds 0,1 \\
        --steps 1500 --procs-per-gpu 6 --out $OUT
    python bench/paper_tables.py --data ... --calibrate --steps 20 --procs 1,4,8 --out $OUT
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from hetloco_ds.config import parse_config  # noqa: E402
from hetloco_ds.data import Corpus  # noqa: E402
from hetloco_ds.presets import model_config_for  # noqa: E402
from hetloco_ds.simulate import degradation_table, parse_variants, simulate_variant  # noqa: E402

# Rows in priority order: Table 1/2 (uniform vs het at three ratios), Table 4 (AdamW H=1),
# Table 5a (embedding adaptation off).
DEFAULT_ROWS = ("sparseloco,pp:8,het:8,pp:24,het:24,pp:96,het:96,adamw,adamw-pp:8,adamw-het:8,"
                "pp:8:noadapt,het:8:noadapt")


def run_config(steps: int, micro: int, lr: float, seq_len: int, bf16: bool, inner_steps: int = 50) -> dict:
    return {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "bf16": {"enabled": bf16},
        "optimizer": {"type": "AdamW", "params": {"lr": lr, "betas": [0.9, 0.95], "weight_decay": 0.1}},
        "scheduler": {"type": "WarmupCosineLR",
                      "params": {"total_num_steps": steps, "warmup_num_steps": max(1, steps // 10),
                                 "warmup_min_ratio": 0.0, "cos_min_ratio": 0.1}},
        "hetloco": {"sparseloco": {"inner_steps": inner_steps, "outer_lr": 1.0, "error_decay": 0.95, "topk": 32},
                    "train": {"seq_len": seq_len, "eval_batches": 16, "seed": 0}},
    }


def ordered_variants(args) -> list:
    """Every (row, seed), longest first: rows with more compressed replicas (the codec adds work to
    each of their steps), then in the priority order of `--rows`."""
    variants = parse_variants(args.rows.split(","), args.replicas, [int(s) for s in args.seeds.split(",")])
    return sorted(variants, key=lambda v: -(v.compressed + 2 * v.project_residual_weights))


def gpu_ids(device: str) -> list[str]:
    """Visible GPUs as CUDA_VISIBLE_DEVICES entries; one pseudo-GPU on the CPU."""
    if device != "cuda":
        return [""]
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible:
        return [g for g in visible.split(",") if g]
    return [str(i) for i in range(torch.cuda.device_count())]


def load(args):
    blob = torch.load(args.data)
    # bench/make_code_corpus.py stores int16 (carry limit); the feed indexes with int32 like data.load_corpus.
    corpus = Corpus(train=blob["train"].to(torch.int32), val=blob["val"].to(torch.int32),
                    description=blob["description"], cache_path=args.data)
    seq_len = corpus.train.shape[1]
    run = parse_config(run_config(args.steps, args.micro, args.lr, seq_len, bf16=args.device == "cuda",
                                  inner_steps=args.inner_steps))
    return corpus, run, model_config_for(args.model, blob["vocab_size"])


def claim(claims: str, name: str) -> bool:
    """True for exactly one worker per name (an exclusive create)."""
    try:
        os.close(os.open(os.path.join(claims, name.replace(":", "_")), os.O_CREAT | os.O_EXCL))
        return True
    except FileExistsError:
        return False


def worker(args) -> int:
    """Run unclaimed rows until none is left or the next would end after `--deadline`; rewrite `--out` after each."""
    torch.set_num_threads(args.threads)
    corpus, run, llama = load(args)
    device = torch.device(args.device)
    seq_len = corpus.train.shape[1]
    meta = {
        "card": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "torch": torch.__version__,
        "command": args.command, "worker": args.worker, "gpus": args.gpus,
        "procs_per_gpu": args.procs_per_gpu, "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "model": args.model, "model_config": llama.to_dict(), "replicas": args.replicas, "stages": args.stages,
        "steps": args.steps, "inner_steps": args.inner_steps, "micro_batch": args.micro, "seq_len": seq_len,
        "lr": args.lr, "tokens_per_row": args.steps * args.micro * seq_len * args.replicas, "data": corpus.description,
    }
    results, last = [], 0.0
    for v in ordered_variants(args):
        if time.time() + last > args.deadline:  # would not end in time, judging by this worker's last row
            break
        if not claim(args.claims, v.name):
            continue
        t0 = time.time()
        r = simulate_variant(run, v, llama, corpus, args.replicas, args.stages, args.steps, device, progress=False)
        last = time.time() - t0
        r.pop("replica_losses")
        results.append(r)
        print(f"[{args.worker}] {v.name:<24} val {r['val_loss']:.4f} train {r['final_train_loss']:.4f} "
              f"({r['seconds']:.0f}s, {r['seconds'] / args.steps:.3f} s/step)", flush=True)
        tmp = args.out + ".tmp"
        with open(tmp, "w") as f:
            json.dump({**meta, "rows": degradation_table(results)}, f, indent=1, default=str)
        os.replace(tmp, args.out)
    return 0


def calibrate_worker(args) -> int:
    """One row for a few steps after a warm-up, timed once every worker of the level is warm."""
    torch.set_num_threads(args.threads)
    corpus, run, llama = load(args)
    device = torch.device(args.device)
    v = ordered_variants(args)[0]
    simulate_variant(run, v, llama, corpus, args.replicas, args.stages, 2, device, progress=False)
    open(os.path.join(args.claims, f"ready{args.worker}"), "w").close()
    start = time.time()
    while len([n for n in os.listdir(args.claims) if n.startswith("ready")]) < args.level and time.time() < start + 300:
        time.sleep(0.05)
    r = simulate_variant(run, v, llama, corpus, args.replicas, args.stages, args.steps, device, progress=False)
    with open(args.out, "w") as f:
        json.dump({"row": v.name, "s_per_step": r["seconds"] / args.steps,
                   "card": torch.cuda.get_device_name() if device.type == "cuda" else "cpu"}, f)
    return 0


FORWARD = ("data", "model", "replicas", "stages", "steps", "inner_steps", "micro", "lr", "rows", "seeds", "device",
           "procs_per_gpu", "command")


def spawn(args, n: int, gpus: list[str], role: list[str], outs: list[str], claims: str) -> int:
    """n workers, round-robin over `gpus`, each told the run's options, its role and output file."""
    threads = args.threads or max(1, (os.cpu_count() or 1) // n)
    forward = [x for k in FORWARD for x in (f"--{k.replace('_', '-')}", str(getattr(args, k)))]
    procs = []
    for w in range(n):
        env = dict(os.environ, OMP_NUM_THREADS=str(threads))
        if gpus[w % len(gpus)]:
            env["CUDA_VISIBLE_DEVICES"] = gpus[w % len(gpus)]
        cmd = [sys.executable, os.path.abspath(__file__), *forward, *role, "--worker", str(w), "--gpus", str(len(gpus)),
               "--claims", claims, "--out", outs[w], "--threads", str(threads)]
        procs.append(subprocess.Popen(cmd, env=env))
    return max(p.wait() for p in procs)


def calibrate(args, gpus: list[str]) -> int:
    """s/step per process and aggregate steps/s on one GPU at each concurrency in `--procs`."""
    levels, tmp = [int(p) for p in args.procs.split(",")], tempfile.mkdtemp()
    report = {"card": None, "torch": torch.__version__,
              "command": args.command, "model": args.model, "replicas": args.replicas, "stages": args.stages,
              "micro_batch": args.micro, "steps": args.steps, "cpus": os.cpu_count(), "levels": []}
    for n in levels:
        claims = tempfile.mkdtemp(dir=tmp)
        outs = [os.path.join(claims, f"w{w}.json") for w in range(n)]
        rc = spawn(args, n, gpus[:1], ["--calibrate-worker", "--level", str(n)], outs, claims)
        done = [json.load(open(o)) for o in outs if os.path.exists(o)]
        per = [d["s_per_step"] for d in done]
        report["card"] = report["card"] or (done[0]["card"] if done else None)
        if rc or len(per) < n:
            print(f"procs {n}: {len(per)} of {n} workers finished (rc {rc})", flush=True)
            break
        agg = sum(1 / s for s in per)
        report["levels"].append({"procs": n, "s_per_step": per, "aggregate_steps_per_s": agg})
        print(f"procs/GPU {n:>3}: s/step per process {min(per):.3f}-{max(per):.3f}, "
              f"aggregate {agg:.2f} steps/s per GPU", flush=True)
    shutil.rmtree(tmp, ignore_errors=True)
    tasks, usable = len(ordered_variants(args)), args.budget_s - 60  # start-up, validation, tail
    report["suggestion"] = {}
    for g in (1, 2, 4, 8):
        # Rows run in waves of procs x g workers, each row at its level's measured s/step.
        fits = {lv["procs"]: int(usable / (-(-tasks // (lv["procs"] * g)) * max(lv["s_per_step"])))
                for lv in report["levels"]}
        if fits:
            procs = max(fits, key=fits.get)
            report["suggestion"][g] = {"procs_per_gpu": procs, "steps_per_row": fits[procs]}
            print(f"{tasks} rows in ~{usable:.0f}s of training on {g} GPU(s): --procs-per-gpu {procs} "
                  f"--steps {fits[procs]} at most", flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"paper_tables_calibration_{args.tag}.json"), "w") as f:
        json.dump(report, f, indent=1)
    return 0


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True, help="torch file with int16 or int32 'train'/'val' blocks [N, seq] (bench/make_code_corpus.py)")
    p.add_argument("--model", default="20M")
    p.add_argument("--replicas", type=int, default=8)
    p.add_argument("--stages", type=int, default=4)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--inner-steps", type=int, default=50)
    p.add_argument("--micro", type=int, default=8)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--rows", default=DEFAULT_ROWS)
    p.add_argument("--seeds", default="0,1")
    p.add_argument("--device", default="cuda")
    p.add_argument("--procs-per-gpu", type=int, default=int(os.environ.get("PROCS_PER_GPU", 6)))
    p.add_argument("--threads", type=int, default=0, help="torch threads per worker (default: CPUs / workers)")
    p.add_argument("--budget-s", type=float, default=540,
                   help="start no row that would end after this many seconds (by the worker's previous row)")
    p.add_argument("--tag", default="run", help="names the partial JSONs: paper_tables_<tag>_g<gpu>p<proc>.json")
    p.add_argument("--out", required=True, help="directory for the JSONs (a worker: its JSON file)")
    p.add_argument("--calibrate", action="store_true", help="time s/step at each concurrency of --procs")
    p.add_argument("--procs", default="1,4,8", help="with --calibrate: processes per GPU to try")
    # Internal: what the launcher tells each worker.
    p.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    p.add_argument("--calibrate-worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--level", type=int, help=argparse.SUPPRESS)
    p.add_argument("--claims", help=argparse.SUPPRESS)
    p.add_argument("--deadline", type=float, default=float("inf"), help=argparse.SUPPRESS)
    p.add_argument("--command", help=argparse.SUPPRESS)
    p.add_argument("--gpus", type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker is not None:
        return calibrate_worker(args) if args.calibrate_worker else worker(args)

    args.command = " ".join(sys.argv)
    gpus = gpu_ids(args.device)
    if args.calibrate:
        return calibrate(args, gpus)
    os.makedirs(args.out, exist_ok=True)
    n = len(gpus) * args.procs_per_gpu
    names = [f"paper_tables_{args.tag}_g{w % len(gpus)}p{w // len(gpus)}.json" for w in range(n)]
    print(f"{len(ordered_variants(args))} rows x {args.steps} steps on {len(gpus)} GPU(s) x {args.procs_per_gpu} "
          f"processes; partial JSONs {args.out}/paper_tables_{args.tag}_g*p*.json", flush=True)
    claims, deadline = tempfile.mkdtemp(), ["--deadline", str(time.time() + args.budget_s)]
    try:
        return spawn(args, n, gpus, deadline, [os.path.join(args.out, name) for name in names], claims)
    finally:
        shutil.rmtree(claims, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
