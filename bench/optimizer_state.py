"""The loss cost of holding the inner AdamW's moments in less memory (issue 59, item 2):
`hetloco.train.optimizer_state` "bf16", "8bit" and "cpu_offload" against "fp32", at 20M and 105M,
the same seed, the same tokens, the same schedule.

    python bench/optimizer_state.py --data .benchdata/corpus.pt --out $OUT/optimizer_state.json   # GPU
    python bench/optimizer_state.py --data ... --out ... --resume       # keep rows already in --out
    python bench/optimizer_state.py --cpu-smoke --out /tmp/optimizer_state.json   # tiny, CPU, seconds

Rows, each trained by the batched simulator (`sim.rows.simulate_variant`, so the engine's
StageAlgorithm and `optim.build_optimizer`), one per (model, option): `<model>:<option>`, plain
SparseLoCo (no boundary compression), every row of a model on the same corpus, seed, data order
and LR schedule; only the optimizer's state differs. The schedule is shorter than the size sweep's
one pass (bench/size_sweep.py --one-pass --micro 8, 950 x 4 steps at M = 8 x S = 4), to fit about
ten GPU-minutes a row at 105M: M = 8 replicas x S = 4 virtual stages, H = 50, 8 sequences of 256
tokens a replica step, --steps 500 (10 outer syncs, 8.2M tokens over the replicas), inner lr 2e-3
(warmup 5%, cosine to 10%), bf16 autocast. That time is an estimate: nothing has run on a GPU yet.

Written to --out after every row ("status" "partial" until the last): "card" (the GPU's name, or
"cpu" with the CPU's), "command", "settings", "rows". Per row:
    model, optimizer_state, seed
    val_loss                 held-out loss after the last sync, mean over the replicas (--eval-batches
                             micro-batches of the held-out split)
    final_train_loss         the last step's training loss, mean over the replicas
    delta_pct_vs_fp32        100 (val_loss - the same model's fp32 row's) / that row's; null for fp32
                             itself and while the fp32 row is missing
    device_bytes_per_param, host_bytes_per_param   `sizes.optimizer_state_bytes_per_param`: what the
                             option holds per parameter for the moments (host: cpu_offload's moments
                             and host copies)
    outer_steps, diverged_at_step (null unless a loss went non-finite), seconds (the row's wall time)
With --resume, rows already in --out whose settings are this run's are kept, not trained again.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
for path in (HERE, REPO):
    if path not in sys.path:
        sys.path.insert(0, path)

import robust_outer  # noqa: E402  (its row loading, card and run options)
from hetloco_ds.sizes import OPTIMIZER_STATES as OPTIONS  # noqa: E402  (the one list: config and plan read it too)

SETTINGS = ("replicas", "stages", "steps", "inner_steps", "micro", "seq", "vocab", "data",
            "lr", "eval_batches", "seed", "device", "compile")
"""What a row's training depends on besides its model and option: --resume keeps the rows of --out only
where these are the same (a call with more --models or --options adds rows to a file)."""


def _row(r: dict, model: str, state: str, seed: int, seconds: float) -> dict:
    from hetloco_ds import sizes

    return {"model": model, "optimizer_state": state, "seed": seed, "val_loss": r["val_loss"],
            "final_train_loss": r["final_train_loss"], "delta_pct_vs_fp32": None,
            "device_bytes_per_param": sizes.optimizer_state_bytes_per_param(state, "device"),
            "host_bytes_per_param": sizes.optimizer_state_bytes_per_param(state, "host"),
            "outer_steps": r["outer_steps"], "diverged_at_step": r.get("diverged_at_step"), "seconds": round(seconds, 1)}


def deltas(rows: dict) -> dict:
    """Each row's delta_pct_vs_fp32 from the rows' own val losses."""
    for row in rows.values():
        base = rows.get(f"{row['model']}:fp32")
        ok = base is not None and row["optimizer_state"] != "fp32"
        row["delta_pct_vs_fp32"] = 100.0 * (row["val_loss"] - base["val_loss"]) / base["val_loss"] if ok else None
    return rows


def _write(path: str, report: dict) -> None:
    with open(path + ".tmp", "w") as f:
        json.dump(report, f, indent=1)
    os.replace(path + ".tmp", path)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="20M,105M", help="model presets, comma-separated")
    p.add_argument("--options", default=",".join(OPTIONS), help="optimizer_state values; fp32 is the reference")
    p.add_argument("--replicas", type=int, default=8)
    p.add_argument("--stages", type=int, default=4)
    p.add_argument("--steps", type=int, default=500)
    p.add_argument("--inner-steps", type=int, default=50, help="H")
    p.add_argument("--micro", type=int, default=8, help="sequences a replica step")
    robust_outer.add_corpus_args(p)
    robust_outer.add_run_args(p)
    p.add_argument("--cpu-smoke", action="store_true",
                   help="preset tiny, vocab 512, M 2 x S 2, H 2, 4 steps, micro 2 x seq 32, options fp32, bf16, "
                        "8bit, cpu_offload, CPU, 1 thread")
    if "--cpu-smoke" in (sys.argv[1:] if argv is None else argv):  # defaults only: explicit flags win
        p.set_defaults(models="tiny", replicas=2, stages=2, steps=4, inner_steps=2, micro=2, seq=32, vocab=512,
                       eval_batches=1, device="cpu", threads=1)
    args = p.parse_args(argv)
    args.models = [m for m in args.models.split(",") if m]
    args.options = [o for o in args.options.split(",") if o]
    bad = [o for o in args.options if o not in OPTIONS]
    if bad or "fp32" not in args.options:
        raise SystemExit(f"optimizer_state: --options {','.join(args.options)}: each one of {OPTIONS}, fp32 among them")
    args.sparseloco = {}

    import torch

    from hetloco_ds.sim.rows import Variant, simulate_variant

    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    settings = {k: getattr(args, k) for k in SETTINGS}
    report = {"status": "partial", "card": robust_outer.card(args.device), "versions": {"torch": torch.__version__},
              "command": " ".join(shlex.quote(a) for a in [sys.executable] + (sys.argv if argv is None else
                                                                              ["optimizer_state.py", *argv])),
              "settings": settings, "rows": {}}
    kept = {}
    if args.resume and os.path.exists(args.out):
        old = json.load(open(args.out))
        same = {k: v for k, v in old.get("settings", {}).items() if k in SETTINGS} == settings
        kept = old["rows"] if same else {}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    for model in args.models:
        args.shape = model
        run, llama, corpus = robust_outer.load(args)
        report["settings"].setdefault("corpus", corpus.description)
        for state in ["fp32"] + [o for o in args.options if o != "fp32"]:
            name = f"{model}:{state}"
            if name in kept:
                report["rows"][name] = kept[name]
                print(f"[optimizer_state] {name}: kept from {args.out}", flush=True)
                continue
            t0 = time.perf_counter()
            v = Variant(name, seed=args.seed, optimizer_state=state)
            r = simulate_variant(run, v, llama, corpus, args.replicas, args.stages, args.steps, device,
                                 progress=False, compile=args.compile)
            report["rows"][name] = _row(r, model, state, args.seed, time.perf_counter() - t0)
            deltas(report["rows"])
            row = report["rows"][name]
            print(f"[optimizer_state] {name}: val {row['val_loss']:.4f}, delta vs fp32 "
                  f"{row['delta_pct_vs_fp32'] if row['delta_pct_vs_fp32'] is not None else 0:+.3f}%, "
                  f"{row['seconds']} s", flush=True)
            _write(args.out, report)
    report["status"] = "done"
    deltas(report["rows"])
    _write(args.out, report)
    print(f"[optimizer_state] wrote {args.out}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
