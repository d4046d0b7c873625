"""The paper's Tables 1, 2, 4 and 5a in the paper's regime, at small scale, with the batched simulator.

The regime (METHOD.md "The paper's training regime"), not the absolute sizes: a 20M
LLaMA, M = 8 replicas x S = 4 virtual stages, H = 50, 32 x 2 x 256 = 16,384 tokens per replica
step (524K global in the paper, 131K here), 5000 steps = 100 outer syncs, about 32 tokens per
parameter, every replica validated through its own pipeline and the mean reported, AdamW at its
own tuned lr (`--lr-sweep`), 2 seeds, on real code (bench/make_corpus.py, int16 blocks).

Rows in priority order (`--rows`; ROW[:RATIO][:FLAG...] as `hetloco-ds simulate --variants`):
SparseLoCo, AdamW, PP-Compress and Het at 1/8 and 1/96, AdamW with compression and its het mix,
Het 1/8 without embedding adaptation, the dense DiLoCo control (`diloco`, SparseLoCo's loop with
`aggregation: dense`; in the default list once this checkout's config accepts it). `--aggregation
A` / `--outer-lr X` set those on every SparseLoCo row, and a row can carry any sparseloco field
(`het:8:aggregation=selected_count`), so an aggregation study is a row list, not new code.

Rows x seeds are spread over every visible GPU, `--procs-per-gpu` worker processes on each (one
batched row fills a GPU: 1). Workers take the next unclaimed row in priority order and rewrite
their own `paper_tables_<tag>_g<gpu>p<proc>.json` under `--out` after every row, so a killed
run keeps what finished; `bench/summarize_tables.py` merges them. `--gpus-per-row G` makes a worker
G processes on G GPUs that run each row together, each holding M/G of its replicas (sim/sharded.py;
the same losses as one process up to the kernels' summation order): a row too long for one GPU's
session then fits. Its rank 0 takes, records and writes rows as a lone worker does.

Budget: a running row stops at its last outer-step boundary before the `--budget-s` deadline:
with `--state-dir` saved there and resumed by the next run on the same machine, so rows longer
than one run's time limit still finish (every row is then started while time is left;
`--resume-only` starts none, continuing only the saved ones, and ends at once where none is); without
it abandoned, and a worker starts no row it cannot finish in time (judged by `--s-per-step` or its
previous row's pace).

    python bench/paper_tables.py --data .benchdata/code_bpe8192_seq256.pt --lr-sweep 3e-4,1e-3,2e-3 \\
        --steps 1000 --tag sweep --out $OUT                                  # short lr sweep, seed 0
    python bench/paper_tables.py --data ... --lr-from bench/results/paper_tables_sweep/paper_tables_summary.json \\
        --state-dir runs/paper_tables_state --tag h100x8 --out $OUT          # the tables
    python bench/paper_tables.py --data ... --estimate                      # FLOPs and GPU-minutes per row
    python bench/paper_tables.py --data ... --cpu-smoke --out /tmp/tables   # tiny, M = 2 x S = 2, 2 steps, CPU
    python bench/paper_tables.py --data ... --cpu-smoke --gpus-per-row 2 --out /tmp/tables  # the same, 2 processes
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
import typing

import torch
import torch.distributed as tdist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from hetloco_ds import checkpoint  # noqa: E402
from hetloco_ds.config import ConfigError, SparseLoCoConfig, parse_config  # noqa: E402
from hetloco_ds.data import Corpus  # noqa: E402
from hetloco_ds.launch import free_port  # noqa: E402
from hetloco_ds.presets import model_config_for  # noqa: E402
from hetloco_ds.sim.rows import degradation_table, parse_variants, simulate_variant  # noqa: E402
from hetloco_ds.sim.sharded import Shards, init_group  # noqa: E402

PEAK_FLOPS = 989e12  # H100/H200 SXM dense bf16, as bench/gpu_throughput.py


def dense_aggregation_supported() -> bool:
    """Whether this checkout's config has the dense DiLoCo control (`aggregation: dense`)."""
    return "dense" in typing.get_args(SparseLoCoConfig.model_fields["aggregation"].annotation)


# The tables' order: SparseLoCo, AdamW, PP-Compress and Het at 1/8 and 1/96, AdamW with and without
# compression and its het mix, the embedding-adaptation ablation, then the dense control.
PRIORITY_ROWS = ("sparseloco", "adamw", "pp:8", "het:8", "pp:96", "het:96", "adamw-pp:8", "adamw-het:8",
                 "het:8:noadapt", "diloco")
DEFAULT_ROWS = ",".join(r for r in PRIORITY_ROWS if r != "diloco" or dense_aggregation_supported())


TRAIN_LOSSES_EVERY = 10  # a finished row keeps every 10th step's train loss (from step 1): enough for a curve


def run_config(args, seq_len: int) -> dict:
    return {
        "train_micro_batch_size_per_gpu": args.micro,
        "gradient_accumulation_steps": args.gas,
        "gradient_clipping": 1.0,
        "bf16": {"enabled": args.device == "cuda"},
        "optimizer": {"type": "AdamW", "params": {"lr": args.lr, "betas": [0.9, 0.95], "weight_decay": 0.1}},
        "scheduler": {"type": "WarmupCosineLR",
                      "params": {"total_num_steps": args.steps,
                                 "warmup_num_steps": getattr(args, "warmup_steps", 0) or max(1, args.steps // 10),
                                 "warmup_min_ratio": 0.0, "cos_min_ratio": 0.1}},
        "hetloco": {"sparseloco": {"inner_steps": args.inner_steps, "outer_lr": 1.0, "error_decay": 0.95, "topk": 32},
                    "train": {"seq_len": seq_len, "eval_batches": args.eval_batches, "seed": 0}},
    }


def best_lrs(path: str) -> dict[str, float]:
    """{"adamw": lr, "sparseloco": lr}: each mode's best lr in a sweep summary (summarize_tables.best_lr;
    summaries written before it recorded the seeds compared give the lr alone)."""
    with open(path) as f:
        doc = json.load(f)
    best = doc.get("best_lr") or {}
    if not best:
        raise SystemExit(f"--lr-from {path}: no best_lr in it (summarise an --lr-sweep run)")
    return {mode: b["lr"] if isinstance(b, dict) else b for mode, b in best.items()}


def row_list(args) -> list[str]:
    """`--rows`, or in sweep mode each `--sweep-rows` row at each lr; `--lr-from`, `--aggregation` and
    `--outer-lr` appended as flags to the rows they concern (a row's own flag wins)."""
    if args.lr_sweep:
        return [f"{r}:lr={lr}" for r in args.sweep_rows.split(",") for lr in args.lr_sweep.split(",")]
    rows = [r for r in args.rows.split(",") if r]
    lrs = best_lrs(args.lr_from) if args.lr_from else {}
    out = []
    for r in rows:
        mode = "adamw" if r.startswith("adamw") else "sparseloco"
        flags = r.split(":")[1:]
        keys = {f.split("=")[0] for f in flags if "=" in f}
        extra = []
        if mode in lrs and "lr" not in keys:
            extra.append(f"lr={lrs[mode]:g}")
        if mode == "sparseloco" and args.aggregation and "aggregation" not in keys and not r.startswith("diloco"):
            extra.append(f"aggregation={args.aggregation}")
        if mode == "sparseloco" and args.outer_lr and "outer_lr" not in keys:
            extra.append(f"outer_lr={args.outer_lr:g}")
        out.append(":".join([r, *extra]))
    return out


def ordered_variants(args) -> list:
    """Every (row, seed) in priority order, seeds inner: the first rows finish on every seed first."""
    seeds = [int(s) for s in args.seeds.split(",")]
    if args.lr_sweep:
        seeds = seeds[:1]
    return parse_variants(row_list(args), args.replicas, seeds)


def who(args) -> str:
    """A worker's prefix on its lines: the model too, since runs of several sizes print to one log."""
    return f"[{args.model} {args.worker}]"


def gpu_ids(device: str, chosen: str | None = None) -> list[str]:
    """Visible GPUs as CUDA_VISIBLE_DEVICES entries, or `chosen` of them (--gpu-ids: a share of a
    machine another run shares); one pseudo-GPU on the CPU."""
    if device != "cuda":
        return [""]
    if chosen:
        return [g for g in chosen.split(",") if g]
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible:
        return [g for g in visible.split(",") if g]
    return [str(i) for i in range(torch.cuda.device_count())]


def load(args):
    blob = torch.load(args.data, weights_only=True)  # a corpus file: tensors and plain data, nothing run
    # bench/make_corpus.py stores int16 (half the file); the feed indexes with int32 like data.load_corpus.
    corpus = Corpus(train=blob["train"].to(torch.int32), val=blob["val"].to(torch.int32),
                    description=blob["description"], cache_path=args.data)
    seq_len = corpus.train.shape[1]
    run = parse_config(run_config(args, seq_len))
    llama = model_config_for(args.model, blob["vocab_size"])
    llama.max_position_embeddings = max(llama.max_position_embeddings, seq_len)
    return corpus, run, llama


def n_params(llama) -> int:
    """Trainable parameters of one replica (embedding, layers, norm, head)."""
    d, f, L, V = llama.hidden_size, llama.intermediate_size, llama.num_hidden_layers, llama.vocab_size
    kv = llama.num_key_value_heads * (d // llama.num_attention_heads)
    layer = d * d * 2 + 2 * d * kv + 3 * d * f + 2 * d
    return V * d * (1 if llama.tie_word_embeddings else 2) + L * layer + d


def tokens_per_step(args, seq_len: int) -> int:
    """Every replica's tokens in one inner step."""
    return args.replicas * args.micro * args.gas * seq_len


def row_flops(llama, args, seq_len: int) -> float:
    """Training FLOPs of one row: (6 N + 12 L d seq) a token (bench/gpu_throughput.py's convention)
    x every replica's tokens; the boundary codec and the outer steps are left out (< 1%)."""
    per_token = 6 * n_params(llama) + 12 * llama.num_hidden_layers * llama.hidden_size * seq_len
    return per_token * args.steps * tokens_per_step(args, seq_len)


def steps_for_tokens(llama, args, seq_len: int) -> int:
    """Inner steps that give every row `--tokens-per-param` tokens (all replicas') per parameter,
    rounded up to whole outer steps, so sizes compare at the same tokens per parameter."""
    per_step = tokens_per_step(args, seq_len)
    outer = -(-int(args.tokens_per_param * n_params(llama)) // (per_step * args.inner_steps))
    return max(1, outer) * args.inner_steps


def steps_for_passes(passes: float, corpus_tokens: int, args, seq_len: int) -> int:
    """Inner steps in whole outer steps that stay within `passes` passes over a corpus of
    `corpus_tokens` training tokens (all replicas' tokens counted), so no row sees a token more
    often than that."""
    per_step = tokens_per_step(args, seq_len)
    outer = int(passes * corpus_tokens) // (per_step * args.inner_steps)
    if outer < 1:
        raise SystemExit(f"paper_tables: --passes {passes:g} of {corpus_tokens} tokens is less than one outer step "
                         f"({per_step * args.inner_steps} tokens)")
    return outer * args.inner_steps


def safe_name(name: str) -> str:
    return name.replace(":", "_").replace("=", "-")


def finished_rows(paths: str) -> set[str]:
    """Row names (with seed) already in the run JSONs among `paths` (files or folders, comma-separated)."""
    done = set()
    for path in [p for p in paths.split(",") if p]:
        files = [os.path.join(path, f) for f in sorted(os.listdir(path))] if os.path.isdir(path) else [path]
        for f in files:
            if os.path.basename(f).startswith("paper_tables_") and f.endswith(".json"):
                with open(f) as fh:
                    done.update(r["variant"]["name"] for r in json.load(fh).get("rows", []))
    return done


def claim(claims: str, name: str) -> bool:
    """True for exactly one worker per name (an exclusive create)."""
    try:
        os.close(os.open(os.path.join(claims, safe_name(name)), os.O_CREAT | os.O_EXCL))
        return True
    except FileExistsError:
        return False


def row_margin_s(state: str | None) -> float:
    """Seconds before the deadline by which a row must stop: a saved row's state takes time to
    write; an abandoned row writes nothing, and a finished one only its validation and JSON."""
    return 60 if state else 15


def run_row(args, v, run, llama, corpus, device, state, meta: dict) -> tuple[dict, float]:
    """One row (`simulate_variant`), compiled if asked, and the time its last attempt started; a
    compiler failure reruns it eager (noted in `meta`). In a group of --gpus-per-row processes
    every one calls it for the same row."""
    t0 = time.time()
    if getattr(args, "probe", None):
        args.probe.take()  # a curve left by a row that stopped or failed is not this row's
    if args.compile:
        # Each row compiles from scratch: a second row's simulator otherwise recompiles under the
        # guards and vmap state the first row's left on the same code objects (on 2 H100s,
        # adamw-pp:8 after het:96 in one process failed with a BatchedTensor inside fake tensors,
        # where every row run first in its process compiled).
        torch._dynamo.reset()
    kw = {"shards": args.gpus_per_row} if args.gpus_per_row > 1 else {}
    try:
        return simulate_variant(run, v, llama, corpus, args.replicas, args.stages, args.steps, device, progress=False,
                                compile=args.compile, deadline=args.deadline - row_margin_s(state), state_path=state,
                                val_every=args.val_every, **kw), t0
    except Exception as err:  # noqa: BLE001 - a compiler failure costs the row's speed, not the row
        if not args.compile or isinstance(err, torch.cuda.OutOfMemoryError):
            raise
        # A group's processes compile the same graph, so they fail (and fall back) alike.
        print(f"{who(args)} {v.name}: compiled run failed ({type(err).__name__}: {str(err)[:200]}); "
              "this row runs eager", flush=True)
        meta["eager_rows"] = meta.get("eager_rows", []) + [v.name]
        t0 = time.time()
        return simulate_variant(run, v, llama, corpus, args.replicas, args.stages, args.steps, device, progress=False,
                                compile=False, deadline=args.deadline - row_margin_s(state), state_path=state,
                                val_every=args.val_every, **kw), t0


def saved_state(path: str | None) -> bool:
    """Whether a row's state was saved at `path` (by one process, or by a group's first block)."""
    return bool(path) and (os.path.exists(path) or os.path.exists(path + ".g0"))


def saved_curve(path: str) -> list[dict]:
    """The validation curve (`--val-every`) of a row saved at `path` (by one process, or a group's
    first block): a row whose state cannot leave the machine still brings back how far it got.
    Memory-mapped, so the state's tensors (gigabytes at 178M) are not read."""
    path = path if os.path.exists(path) else path + ".g0"
    return torch.load(path, map_location="cpu", mmap=True, weights_only=True).get("val_curve", [])


def resumable(state_dir: str) -> set[str]:
    """The rows (`safe_name`s, with their seed) saved in `state_dir` and not finished since: what
    --resume-only runs. A machine given back and lent again holds none."""
    names = set(os.listdir(state_dir)) if state_dir and os.path.isdir(state_dir) else set()
    rows = {n.split(".pt")[0] for n in names if ".pt" in n}  # a row's state files: <row>.pt[.g<block>]
    return {r for r in rows if saved_state(os.path.join(state_dir, r + ".pt")) and r + ".done" not in names}


def worker_meta(args, llama, corpus, device) -> dict:
    seq_len = corpus.train.shape[1]
    tokens_per_replica_step = args.micro * args.gas * seq_len
    meta = {
        "card": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "torch": torch.__version__,
        "command": args.command, "worker": args.worker, "gpus": args.gpus,
        "procs_per_gpu": args.procs_per_gpu, "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "model": args.model, "model_config": llama.to_dict(), "n_params": n_params(llama),
        "replicas": args.replicas, "stages": args.stages, "steps": args.steps, "inner_steps": args.inner_steps,
        "micro_batch": args.micro, "grad_accum": args.gas, "seq_len": seq_len, "lr": args.lr,
        "tokens_per_replica_step": tokens_per_replica_step,
        "tokens_per_row": args.steps * args.replicas * tokens_per_replica_step,
        "corpus_train_tokens": corpus.train.numel(), "data": corpus.description, "simulator": "batched",
        "compile": args.compile, "lr_sweep": args.lr_sweep, "eval_batches": args.eval_batches,
        "val_every": args.val_every, "warmup_steps": args.warmup_steps or max(1, args.steps // 10),
    }
    if args.gpus_per_row > 1:
        meta["gpus_per_row"] = args.gpus_per_row
    return meta


def worker(args) -> int:
    """Run unclaimed rows in priority order until none is left or the budget ends; rewrite `--out` after each.

    With --gpus-per-row G this is one of a group of G processes that run each row together
    (sim/sharded.py): the group's rank 0 chooses, claims and records the rows as a lone worker
    does and tells the others each row it starts (`Shards.first`); they run it beside it."""
    torch.set_num_threads(args.threads)
    if torch.cuda.is_available():
        torch.backends.cuda.matmul.allow_tf32 = True
    device = init_group(args.gpus_per_row, args.device) if args.gpus_per_row > 1 else torch.device(args.device)
    group = Shards.of_world(args.replicas, args.gpus_per_row)
    corpus, run, llama = load(args)
    if args.probe_boundaries:
        if args.gpus_per_row > 1:
            raise SystemExit("--probe-boundaries measures a row run by one process (--gpus-per-row 1)")
        import boundary_probe  # bench/, beside this script
        args.probe = boundary_probe.install()
    if not group.rank0:
        by_name = {v.name: v for v in ordered_variants(args)}
        while (name := group.first(None)) is not None:
            run_row(args, by_name[name], run, llama, corpus, device, state_file(args, name, ".pt"), {})
        return 0
    meta = worker_meta(args, llama, corpus, device)
    results, unfinished, pace = [], [], args.s_per_step
    done = finished_rows(args.skip_done)
    # A row finished by an earlier run on the same machine is marked in the state folder: the next run
    # skips it even when its JSON was not named in --skip-done (it was that run's output, not committed).
    variants = [v for v in ordered_variants(args) if v.name not in done]
    marks = {v.name: state_file(args, v.name, ".done") for v in variants}
    variants = [v for v in variants if not (marks[v.name] and os.path.exists(marks[v.name]))]
    states = {v.name: state_file(args, v.name, ".pt") for v in variants}
    # Rows saved by an earlier run first: they are the closest to done.
    variants.sort(key=lambda v: not saved_state(states[v.name]))
    for v in variants:
        state = states[v.name]
        if args.resume_only and not saved_state(state):
            continue  # main said which rows it resumes
        if pace and not state and time.time() + pace * args.steps + 60 > args.deadline:
            # another worker or a later run takes it; said, since a call that starts nothing is
            # otherwise silent
            print(f"{who(args)} {v.name:<28} not started: {pace * args.steps + 60:.0f} s at {pace:.3f} s a "
                  f"step and the last minute's margin, {args.deadline - time.time():.0f} s of the budget left",
                  flush=True)
            continue
        if not claim(args.claims, v.name):
            continue
        group.first(v.name)  # the group's other processes start this row
        # A row that the call's limit kills before its first save leaves only this line to say it ran.
        print(f"{who(args)} {v.name:<28} {'resumed' if saved_state(state) else 'started'} with "
              f"{args.deadline - time.time():.0f} s of the budget left", flush=True)
        r, t0 = run_row(args, v, run, llama, corpus, device, state, meta)
        if r["status"] != "done":
            unfinished.append({k: r[k] for k in ("status", "step", "steps", "seconds", "seconds_by_phase")}
                              | {"row": v.name, "val_curve": saved_curve(state) if r["status"] == "saved" else []})
            print(f"{who(args)} {v.name:<28} {r['status']} at step {r['step']} of {args.steps}", flush=True)
        else:
            pace = (time.time() - t0) / args.steps
            record_row(args, r, marks[v.name], results)
        checkpoint.replace_text(args.out, json.dumps({**meta, "rows": degradation_table(results),
                                                      "unfinished": unfinished}, indent=1, default=str))
        if r["status"] != "done" or time.time() + 60 > args.deadline:
            break  # the budget is spent
    group.first(None)  # no more rows
    return 0


def grouped_worker(args) -> int:
    """`worker`, and with --gpus-per-row G > 1 the group's process group closed at the end."""
    try:
        return worker(args)
    finally:
        if args.gpus_per_row > 1 and tdist.is_initialized():
            tdist.destroy_process_group()


def state_file(args, name: str, suffix: str) -> str | None:
    return os.path.join(args.state_dir, safe_name(name) + suffix) if args.state_dir else None


def record_row(args, r: dict, mark: str | None, results: list) -> None:
    """A finished row: marked done in the state folder, trimmed, kept, printed."""
    if mark:
        checkpoint.replace_text(mark, f"{r['val_loss']}\n")
    r.pop("replica_losses")
    if getattr(args, "probe", None):
        r["boundary_probe"] = args.probe.take()
    r["train_losses"] = r["train_losses"][::TRAIN_LOSSES_EVERY]
    r["train_losses_every"] = TRAIN_LOSSES_EVERY
    results.append(r)
    last = r["outer"][-1] if r["outer"] else {}
    print(f"{who(args)} {r['variant']['name']:<28} val {r['val_loss']:.4f} train {r['final_train_loss']:.4f} "
          f"overlap {last.get('replicas_per_selected') or 0:.2f} cos {last.get('update_cosine') or 0:.2f} "
          f"({r['seconds']:.0f}s, {r['seconds'] / args.steps:.3f} s/step; "
          + ", ".join(f"{k} {v:.0f}s" for k, v in r["seconds_by_phase"].items()) + ")", flush=True)


def calibrate_worker(args) -> int:
    """One row for a few steps after a warm-up, timed once every worker of the level is warm."""
    torch.set_num_threads(args.threads)
    corpus, run, llama = load(args)
    device = torch.device(args.device)
    v = ordered_variants(args)[0]
    simulate_variant(run, v, llama, corpus, args.replicas, args.stages, 2, device, progress=False, compile=args.compile)
    open(os.path.join(args.claims, f"ready{args.worker}"), "w").close()
    start = time.time()
    while len([n for n in os.listdir(args.claims) if n.startswith("ready")]) < args.level and time.time() < start + 300:
        time.sleep(0.05)
    r = simulate_variant(run, v, llama, corpus, args.replicas, args.stages, args.steps, device, progress=False,
                         compile=args.compile)
    with open(args.out, "w") as f:
        json.dump({"row": v.name, "s_per_step": r["seconds"] / args.steps,
                   "card": torch.cuda.get_device_name() if device.type == "cuda" else "cpu"}, f)
    return 0


FORWARD = ("data", "model", "replicas", "stages", "steps", "inner_steps", "micro", "gas", "lr", "rows", "seeds",
           "device", "procs_per_gpu", "command", "eval_batches", "lr_sweep", "sweep_rows", "lr_from", "aggregation",
           "outer_lr", "state_dir", "s_per_step", "skip_done", "val_every", "warmup_steps")


def gpu_blocks(args, gpus: list[str]) -> list[list[str]]:
    """The GPUs in blocks of --gpus-per-row, one block per row at a time (on the CPU, one block of
    that many processes)."""
    g = args.gpus_per_row
    if gpus == [""]:
        return [[""] * g]
    return [gpus[i:i + g] for i in range(0, len(gpus) - g + 1, g)]


def spawn(args, n: int, gpus: list[str], role: list[str], outs: list[str], claims: str) -> int:
    """n workers, round-robin over the blocks of `gpus` (`gpu_blocks`), each told the run's options,
    its role and output file; with --gpus-per-row G a worker is G processes, one per GPU of its
    block, with the environment a launcher gives a torch.distributed world of G (a free port each)."""
    g = args.gpus_per_row
    blocks = gpu_blocks(args, gpus)
    threads = args.threads or max(1, (os.cpu_count() or 1) // (n * g))
    forward = [x for k in FORWARD if getattr(args, k) not in (None, "")
               for x in (f"--{k.replace('_', '-')}", str(getattr(args, k)))]
    forward += ["--compile"] if args.compile else []
    forward += ["--probe-boundaries"] if args.probe_boundaries else []
    forward += ["--resume-only"] if args.resume_only else []
    forward += ["--gpus-per-row", str(g)] if g > 1 else []
    procs = []
    for w in range(n):
        block = blocks[w % len(blocks)]
        port = str(free_port()) if g > 1 else None
        for rank in range(g):
            env = dict(os.environ, OMP_NUM_THREADS=str(threads))
            if block[0]:
                env["CUDA_VISIBLE_DEVICES"] = ",".join(block)
            if g > 1:
                env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(g), LOCAL_WORLD_SIZE=str(g),
                           MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
            cmd = [sys.executable, os.path.abspath(__file__), *forward, *role, "--worker", str(w), "--gpus",
                   str(len(gpus)), "--claims", claims, "--out", outs[w], "--threads", str(threads)]
            procs.append(subprocess.Popen(cmd, env=env))
    return max(p.wait() for p in procs)


def check_gpus_per_row(args, gpus: list[str]) -> None:
    """--gpus-per-row G: G divides the replicas and the visible GPUs (SystemExit naming the numbers)."""
    g = args.gpus_per_row
    if g == 1:
        return
    if g < 1 or args.replicas % g:
        raise SystemExit(f"paper_tables: --gpus-per-row {g} must divide --replicas {args.replicas} "
                         "(each process holds replicas/G of a row's replicas)")
    if gpus != [""] and len(gpus) % g:
        raise SystemExit(f"paper_tables: --gpus-per-row {g} must divide the {len(gpus)} visible GPUs")
    if args.calibrate:
        raise SystemExit("paper_tables: --calibrate times one process a GPU; run it without --gpus-per-row")


def calibrate(args, gpus: list[str]) -> int:
    """s/step per process and aggregate steps/s on one GPU at each concurrency in `--procs`."""
    levels, tmp = [int(p) for p in args.procs.split(",")], tempfile.mkdtemp()
    report = {"card": None, "torch": torch.__version__, "command": args.command, "model": args.model,
              "replicas": args.replicas, "stages": args.stages, "micro_batch": args.micro, "grad_accum": args.gas,
              "steps": args.steps, "compile": args.compile, "cpus": os.cpu_count(), "levels": []}
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
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"paper_tables_calibration_{args.tag}.json"), "w") as f:
        json.dump(report, f, indent=1)
    return 0


def estimate(args) -> int:
    """FLOPs of each row and its GPU-minutes on one H100 at a few MFUs (no training)."""
    corpus, _, llama = load(args)
    seq_len = corpus.train.shape[1]
    flops = row_flops(llama, args, seq_len)
    tokens = args.steps * args.replicas * args.micro * args.gas * seq_len
    rows = ordered_variants(args)
    print(f"{args.model}: {n_params(llama) / 1e6:.1f}M parameters; {tokens / 1e6:.0f}M tokens a row "
          f"({tokens / n_params(llama):.1f} per parameter, {tokens / corpus.train.numel():.1f} epochs of the corpus); "
          f"{flops:.3g} FLOPs a row")
    for mfu in (0.15, 0.25, 0.35):
        minutes = flops / (PEAK_FLOPS * mfu) / 60
        print(f"  MFU {mfu:.2f}: {minutes:5.1f} GPU-minutes a row, {minutes * len(rows) / 60:5.2f} GPU-hours for "
              f"{len(rows)} rows x seeds")
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", required=True, help="torch file with int16 or int32 'train'/'val' blocks [N, seq] (bench/make_corpus.py)")
    p.add_argument("--model", default="20M")
    p.add_argument("--replicas", type=int, default=8)
    p.add_argument("--stages", type=int, default=4)
    p.add_argument("--steps", type=int, default=5000, help="inner steps a row (5000 at H = 50: 100 outer syncs)")
    p.add_argument("--tokens-per-param", type=float, default=0.0,
                   help="set --steps from the model's size: this many tokens (every replica's) per parameter, "
                        "in whole outer steps (0: --steps as given)")
    p.add_argument("--passes", type=float, default=0.0,
                   help="set --steps to the whole outer steps within this many passes over the corpus (0: --steps)")
    p.add_argument("--inner-steps", type=int, default=50)
    p.add_argument("--micro", type=int, default=32)
    p.add_argument("--gas", type=int, default=2, help="micro-batches a step: micro x gas x seq tokens per replica step")
    p.add_argument("--lr", type=float, default=1e-3, help="inner lr of rows without their own (lr=X or --lr-from)")
    p.add_argument("--eval-batches", type=int, default=16, help="held-out micro-batches each replica validates on")
    p.add_argument("--warmup-steps", type=int, default=0,
                   help="linear lr warm-up steps before the cosine decay (0: a tenth of --steps)")
    p.add_argument("--val-every", type=int, default=0,
                   help="also validate every this many steps, a multiple of --inner-steps (each row's val_curve; "
                        "0: at the end only)")
    p.add_argument("--rows", default=DEFAULT_ROWS, help="comma-separated rows in priority order")
    p.add_argument("--seeds", default="0,1")
    p.add_argument("--lr-sweep", default="", help="comma-separated lrs: run --sweep-rows at each (first seed only)")
    p.add_argument("--sweep-rows", default="adamw,sparseloco")
    p.add_argument("--lr-from", default="", help="a sweep's paper_tables_summary.json: its best lr per mode")
    p.add_argument("--aggregation", default="", help="sparseloco.aggregation of every SparseLoCo row")
    p.add_argument("--outer-lr", type=float, default=0.0, help="sparseloco.outer_lr of every SparseLoCo row (0: 1.0)")
    p.add_argument("--compile", action="store_true", help="torch.compile the batched simulator's forward")
    p.add_argument("--probe-boundaries", action="store_true",
                   help="at each validation, record each boundary's dropped and exactly rebuilt share of the "
                        "activation (bench/boundary_probe.py): the row's 'boundary_probe'")
    p.add_argument("--device", default="cuda")
    p.add_argument("--gpu-ids", help="comma-separated CUDA_VISIBLE_DEVICES entries to run on (default: every "
                                     "visible GPU), for runs that share one machine's GPUs side by side")
    p.add_argument("--procs-per-gpu", type=int, default=int(os.environ.get("PROCS_PER_GPU", 1)))
    p.add_argument("--gpus-per-row", type=int, default=1,
                   help="GPUs (processes) that run one row together, each holding replicas/G of its replicas "
                        "(sim/sharded.py); a row saved by the budget resumes only with the same value")
    p.add_argument("--threads", type=int, default=0, help="torch threads per worker (default: CPUs / workers)")
    p.add_argument("--budget-s", type=float, default=540,
                   help="seconds from launch after which no row is started or continued (a running one stops at "
                        "its last outer-step boundary before it)")
    p.add_argument("--s-per-step", type=float, default=0.0,
                   help="expected seconds a step (bench/sim_throughput.py) for the budget's first-row judgement")
    p.add_argument("--state-dir", default="", help="save rows stopped by the budget here and resume them in the next run")
    p.add_argument("--resume-only", action="store_true",
                   help="start no row: only continue the rows saved in --state-dir (a chain's later calls: on a "
                        "machine that was given back in between, the call ends at once instead of starting anew)")
    p.add_argument("--skip-done", default="", help="run JSONs (files or folders, comma-separated) whose rows are done")
    p.add_argument("--tag", default="run", help="names the partial JSONs: paper_tables_<tag>_g<gpu>p<proc>.json")
    p.add_argument("--out", required=True, help="directory for the JSONs (a worker: its JSON file)")
    p.add_argument("--calibrate", action="store_true", help="time s/step at each concurrency of --procs")
    p.add_argument("--procs", default="1,2", help="with --calibrate: processes per GPU to try")
    p.add_argument("--estimate", action="store_true", help="print each row's FLOPs and GPU-minutes, train nothing")
    p.add_argument("--cpu-smoke", action="store_true",
                   help="preset tiny, M 2 x S 2, H 1, 2 steps of 2 x 1 micro-batches, rows sparseloco and het:8, "
                        "seed 0, one worker on the CPU")
    # Internal: what the launcher tells each worker.
    p.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    p.add_argument("--calibrate-worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--level", type=int, help=argparse.SUPPRESS)
    p.add_argument("--claims", help=argparse.SUPPRESS)
    p.add_argument("--deadline", type=float, default=float("inf"), help=argparse.SUPPRESS)
    p.add_argument("--command", help=argparse.SUPPRESS)
    p.add_argument("--gpus", type=int, help=argparse.SUPPRESS)
    if "--cpu-smoke" in (sys.argv[1:] if argv is None else argv):  # defaults only: explicit flags win
        p.set_defaults(model="tiny", replicas=2, stages=2, steps=2, inner_steps=1, micro=2, gas=1, eval_batches=1,
                       rows="sparseloco,het:8", seeds="0", device="cpu", tag="smoke", threads=1)
    args = p.parse_args(argv)
    if args.worker is not None:
        return calibrate_worker(args) if args.calibrate_worker else grouped_worker(args)

    args.command = " ".join([sys.argv[0]] + (sys.argv[1:] if argv is None else argv))
    if args.val_every < 0 or (args.val_every and args.val_every % args.inner_steps):
        raise SystemExit(f"paper_tables: --val-every {args.val_every} must be a multiple of --inner-steps "
                         f"{args.inner_steps} (0: validate at the end only)")
    try:  # every row's config checked here, before any worker (or GPU) starts
        variants = ordered_variants(args)
        base = parse_config(run_config(args, 256)).hetloco
        for v in variants:
            v.hetloco(base, args.replicas)
    except ConfigError as err:
        raise SystemExit(f"paper_tables: {err}") from None
    if not os.path.isfile(args.data):
        raise SystemExit(f"paper_tables: --data {args.data}: no such file (bench/make_corpus.py makes one)")
    if args.tokens_per_param and args.passes:
        raise SystemExit("paper_tables: give --tokens-per-param or --passes, not both")
    if args.resume_only:
        if not args.state_dir:
            raise SystemExit("paper_tables: --resume-only needs --state-dir, where the saved rows are")
        done, saved = finished_rows(args.skip_done), resumable(args.state_dir)
        left = [v.name for v in variants if safe_name(v.name) in saved and v.name not in done]
        if not left:
            print(f"paper_tables: --resume-only: no row of --rows is saved under {args.state_dir}, nothing to "
                  "resume (a machine lent afresh holds none)", flush=True)
            return 0
        print(f"paper_tables: --resume-only: resuming {', '.join(left)}", flush=True)
    if args.tokens_per_param or args.passes:
        blob = torch.load(args.data, mmap=True, weights_only=True)
        llama = model_config_for(args.model, blob["vocab_size"])
        seq_len = blob["train"].shape[1]
        args.steps = (steps_for_tokens(llama, args, seq_len) if args.tokens_per_param
                      else steps_for_passes(args.passes, blob["train"].numel(), args, seq_len))
        del blob
    if args.estimate:
        return estimate(args)
    gpus = gpu_ids(args.device, args.gpu_ids)
    if not gpus:
        raise SystemExit(f"paper_tables: --device {args.device}: no CUDA device visible (CUDA_VISIBLE_DEVICES="
                         f"{os.environ.get('CUDA_VISIBLE_DEVICES')!r}); --device cpu runs on this CPU")
    check_gpus_per_row(args, gpus)
    if args.calibrate:
        return calibrate(args, gpus)
    os.makedirs(args.out, exist_ok=True)
    if args.state_dir:
        os.makedirs(args.state_dir, exist_ok=True)
    blocks = len(gpu_blocks(args, gpus))
    n = blocks * args.procs_per_gpu
    names = [f"paper_tables_{args.tag}_g{w % blocks}p{w // blocks}.json" for w in range(n)]
    per_row = f", {args.gpus_per_row} GPUs a row" if args.gpus_per_row > 1 else ""
    print(f"{len(variants)} rows x seeds of {args.steps} steps on {len(gpus)} GPU(s) x {args.procs_per_gpu} "
          f"processes{per_row}; partial JSONs {args.out}/paper_tables_{args.tag}_g*p*.json", flush=True)
    if not dense_aggregation_supported() and "diloco" not in args.rows:
        print("note: the dense DiLoCo control row (diloco) needs sparseloco.aggregation 'dense' (branch templar); "
              "this checkout has none, so the default rows leave it out", flush=True)
    claims, deadline = tempfile.mkdtemp(), ["--deadline", str(time.time() + args.budget_s)]
    try:
        return spawn(args, n, gpus, deadline, [os.path.join(args.out, name) for name in names], claims)
    finally:
        shutil.rmtree(claims, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
