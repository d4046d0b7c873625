"""A tied model's loss: the embedding and head copies tied apart between outer steps vs tied exactly.

    python bench/tied_embeddings.py [--steps 300] [--seeds 0,1] [--model tiny] [--out bench/results]
    python bench/tied_embeddings.py --cpu-smoke --out /tmp/tied   # every_step and outer_step, H = 2, 4 steps

`hetloco-ds simulate` (the simulator computes what the engine computes: tests/test_simulate.py)
on the packaged CPU config (configs/cpu_tiny.json: M = 2 replicas, S = 2 stages, replica 1
compressed at ratio 8, H = 20, micro-batch 8, seq 128, AdamW lr 2e-3 with warm-up and cosine
decay to `--steps`) and the `--model` preset with tie_word_embeddings, for each seed:

  every_step   hetloco.sparseloco.tied_embeddings = "every_step": the two copies' gradients are
               summed every inner step (exact tying; on the engine a dense V x d all-reduce
               between the first and last stage every step)
  outer_step   "outer_step" (the default): each copy trains on its own gradient with its own
               AdamW state; at every outer step both become theta_prev - (avg_embedding + avg_head)
  outer_mean   not in the engine, a patch of this script only: the same with the mean of the two
               aggregates instead of their sum; recorded because it is the other natural choice

Reported per row and seed: validation loss (the same held-out batches, every replica through its
own pipeline, averaged), the final train loss (mean over the last H steps), and the relative
difference to every_step of the same seed. Writes tied_embeddings.json.
"""
from __future__ import annotations

import argparse
import inspect
import json
import os
import platform
import statistics
import sys
import textwrap
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)


def _patch_mean() -> None:
    """StageAlgorithm.sync_embeddings with (avg + head) / 2 instead of avg + head."""
    import torch

    from hetloco_ds import algorithm

    src = textwrap.dedent(inspect.getsource(algorithm.StageAlgorithm.sync_embeddings))
    assert "avg = avg + head" in src
    src = src.replace("avg = avg + head", "avg = (avg + head) * 0.5").replace("@torch.no_grad()\n", "")
    ns: dict = {}
    exec(src, algorithm.__dict__, ns)
    algorithm.StageAlgorithm.sync_embeddings = torch.no_grad()(ns["sync_embeddings"])


def one(row: str, seed: int, steps: int, model: str, inner_steps: int | None = None) -> dict:
    """One simulation in this process (rows run in separate processes: the mean row patches).
    `inner_steps`: H instead of the config's."""
    import torch

    from hetloco_ds import data
    from hetloco_ds.config import load_config
    from hetloco_ds.presets import model_config_for
    from hetloco_ds.sim.rows import Variant, simulate_variant

    torch.set_num_threads(1)
    if row == "outer_mean":
        _patch_mean()
    run = load_config(None)
    run.scheduler["params"]["total_num_steps"] = steps
    # The config's 20 warm-up steps, or a tenth of a shorter run (else its lr would never leave ~0).
    run.scheduler["params"]["warmup_num_steps"] = min(run.scheduler["params"]["warmup_num_steps"], max(1, steps // 10))
    if inner_steps:
        run.hetloco.sparseloco.inner_steps = inner_steps
    tok = data.default_tokenizer(vocab_size=run.hetloco.train.vocab_size, progress=False)
    cfg = model_config_for(model, len(tok))
    cfg.tie_word_embeddings = True
    corpus = data.load_corpus(None, tok, run.hetloco.train.seq_len, progress=False)
    v = Variant(name=row, ratio=run.hetloco.subspace.ratio, compressed=1, seed=seed,
                sparseloco={"tied_embeddings": "every_step" if row == "every_step" else "outer_step"})
    t0 = time.perf_counter()
    r = simulate_variant(run, v, cfg, corpus, 2, run.stages, steps, torch.device("cpu"), progress=False)
    return {"row": row, "seed": seed, "val_loss": r["val_loss"], "val_losses": r["val_losses"],
            "final_train_loss": r["final_train_loss"], "train_losses": [round(x, 5) for x in r["train_losses"]],
            "seconds": time.perf_counter() - t0, "sparseloco": v.hetloco(run.hetloco, 2).sparseloco.model_dump(),
            "model": {k: getattr(cfg, k) for k in ("hidden_size", "num_hidden_layers", "vocab_size", "tie_word_embeddings")}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--seeds", default="0,1")
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--rows", default="every_step,outer_step,outer_mean")
    ap.add_argument("--parallel", type=int, default=2, help="simulations at once")
    ap.add_argument("--out", default=os.path.join(REPO, "bench", "results"))
    ap.add_argument("--inner-steps", type=int, default=None, help="H (default: the config's, 20)")
    ap.add_argument("--cpu-smoke", action="store_true",
                    help="rows every_step and outer_step, seed 0, H = 2, 4 steps, in this process")
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)  # internal: ROW:SEED
    if "--cpu-smoke" in (sys.argv[1:] if argv is None else argv):  # defaults only: explicit flags win
        ap.set_defaults(steps=4, seeds="0", rows="every_step,outer_step", inner_steps=2)
    args = ap.parse_args(argv)
    if args.one:
        row, seed = args.one.split(":")
        print(json.dumps(one(row, int(seed), args.steps, args.model, args.inner_steps)), flush=True)
        return 0
    jobs = [(r, int(s)) for s in args.seeds.split(",") for r in args.rows.split(",")]
    t0, load0 = time.time(), os.getloadavg()
    if args.cpu_smoke:
        if "outer_mean" in args.rows:
            ap.error("--cpu-smoke runs the rows in this process; outer_mean patches the engine's class")
        results = [one(row, seed, args.steps, args.model, args.inner_steps) for row, seed in jobs]
    else:
        results = run_apart(jobs, args)
    report_rows(results, args, argv, t0, load0)
    return 0


def run_apart(jobs: list[tuple[str, int]], args) -> list[dict]:
    """Each (row, seed) in its own process, `args.parallel` at a time."""
    import subprocess

    env = dict(os.environ, TQDM_DISABLE="1", HETLOCO_QUIET="1", TOKENIZERS_PARALLELISM="false", PYTHONPATH=REPO)
    # Tokenizer and corpus cache once, before the simulations read them side by side.
    subprocess.run([sys.executable, "-c", "from hetloco_ds import data; from hetloco_ds.config import load_config; "
                    "t = data.default_tokenizer(vocab_size=load_config(None).hetloco.train.vocab_size, progress=False); "
                    "data.load_corpus(None, t, load_config(None).hetloco.train.seq_len, progress=False)"],
                   env=env, check=True, capture_output=True)
    results, running = [], []
    while jobs or running:
        while jobs and len(running) < args.parallel:
            row, seed = jobs.pop(0)
            cmd = [sys.executable, __file__, "--one", f"{row}:{seed}", "--steps", str(args.steps), "--model", args.model]
            cmd += ["--inner-steps", str(args.inner_steps)] if args.inner_steps else []
            running.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
        p = running.pop(0)
        out, err = p.communicate(timeout=7200)
        if p.returncode != 0:
            raise RuntimeError(f"{p.args}: {err[-2000:]}")
        res = json.loads(out.strip().splitlines()[-1])
        results.append(res)
        print(f"{res['row']:>11} seed {res['seed']}: val {res['val_loss']:.4f} train {res['final_train_loss']:.4f} "
              f"({res['seconds']:.0f} s)", flush=True)
    return results


def report_rows(results: list[dict], args, argv, t0: float, load0) -> None:
    """Each row against every_step of the same seed; writes tied_embeddings.json under --out."""
    base = {r["seed"]: r["val_loss"] for r in results if r["row"] == "every_step"}
    for r in results:
        r["val_vs_every_step_pct"] = 100 * (r["val_loss"] - base[r["seed"]]) / base[r["seed"]] if r["seed"] in base else None
    rows = sorted({r["row"] for r in results}, key=args.rows.split(",").index)
    table = {row: {"val_loss_mean": statistics.fmean(r["val_loss"] for r in results if r["row"] == row),
                   "val_vs_every_step_pct": [round(r["val_vs_every_step_pct"], 3) for r in results
                                             if r["row"] == row and r["val_vs_every_step_pct"] is not None]}
             for row in rows}
    report = {
        "what": "simulated validation loss of a tied model: copies tied apart between outer steps vs exactly; "
                "bench/tied_embeddings.py's docstring defines every number",
        "command": "python bench/tied_embeddings.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "machine": {"cpu": platform.processor(), "cores": os.cpu_count(), "loadavg_at_start": load0,
                    "loadavg_at_end": os.getloadavg()},
        "settings": {"config": "hetloco_ds/configs/cpu_tiny.json", "model": args.model, "steps": args.steps,
                     "inner_steps": args.inner_steps or "the config's",
                     "replicas": 2, "stages": 2, "compressed_replicas": [1]},
        "summary": table,
        "results": results,
        "total_seconds": round(time.time() - t0, 1),
    }
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "tied_embeddings.json")
    from hetloco_ds import checkpoint

    checkpoint.replace_text(path, json.dumps(report, indent=1) + "\n")
    for row, t in table.items():
        print(f"{row:>11}: mean val {t['val_loss_mean']:.4f}; vs every_step {t['val_vs_every_step_pct']} %")
    print(f"wrote {path}")


if __name__ == "__main__":
    sys.exit(main())
