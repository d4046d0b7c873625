"""Merge the paper-table runs (partial JSONs of bench/paper_tables.py) into one summary and a plot.

Relative degradation of each row is against the uncompressed row of the same mode (SparseLoCo
or AdamW), seed, inner lr and outer-step settings; rows are then averaged over seeds with their
spread. Per row: outer steps, tokens per replica step and per parameter, epochs of the corpus,
the validation loss (each seed's mean over replicas, each replica through its own pipeline), the
last sync's diagnostics (replicas per sent coordinate, cosine of the applied update with the
dense average, error-buffer norm), and the paper's numbers (512M, DCLM, 10B tokens;
../shared/METHOD.md) beside ours. An lr sweep's summary also names the best lr of each mode
(`best_lr`, read by `paper_tables.py --lr-from`). Every input must share one setting (model,
steps, M, S, micro-batch, accumulation, lr); a (row, seed) seen twice is an error.

    python bench/summarize_tables.py [JSON or folder ...] [--out-dir DIR]
    # default: bench/results/paper_tables_*.json; writes paper_tables_summary.json and .png to DIR
"""
from __future__ import annotations

import argparse
import glob
import json
import math
import os
import statistics

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results")

# Paper: Table 2 (SparseLoCo, M = 8, S = 4, H = 50), Table 4 (AdamW H = 1), Table 5a (het, k/d = 1/8).
PAPER = {
    "pp:8": 4.0, "het:8": 3.3, "pp:24": 5.9, "het:24": 5.5, "pp:96": 8.4, "het:96": 7.7,
    "adamw-pp:8": 2.2, "adamw-het:8": 2.9, "het:8:noadapt": 5.9,
}
# Paper, 512M, DCLM, 10B tokens: the uncompressed rows' validation loss (METHOD.md).
PAPER_LOSS = {"sparseloco": 2.73, "adamw": 2.75}
# Paper, Table 1 (losses at the end of each size's compute-optimal run, the baseline's hyperparameters
# for every row) and Table 4's AdamW (512M; the paper has no AdamW row at 178M).
PAPER_TABLE1_LOSS = {"178M": {"sparseloco": 3.07, "pp:8": 3.14, "het:8": 3.12},
                     "512M": {"sparseloco": 2.73, "pp:8": 2.84, "het:8": 2.82, "adamw": 2.75}}
# Paper, Table 2 (512M): degradation over SparseLoCo in % at each d/k.
PAPER_TABLE2_PCT = {"pp": {8: 4.0, 24: 5.9, 96: 8.4, 192: 11.0, 384: 11.4, 768: 12.5},
                    "het": {8: 3.3, 24: 5.5, 96: 7.7, 192: 8.8, 384: 9.5, 768: 9.9}}
# Table 9: the widths behind the paper's k = d / ratio.
PAPER_WIDTH = {"178M": 1024, "512M": 1536}


# Table order: SparseLoCo rows (Tables 1/2, 5a), then AdamW (Table 4), the dense control; others after them.
ORDER = ("sparseloco", "pp:8", "het:8", "pp:24", "het:24", "pp:96", "het:96", "pp:8:noadapt", "het:8:noadapt",
         "adamw", "adamw-pp:8", "adamw-het:8", "diloco")
SETTING = ("model", "steps", "replicas", "stages", "micro_batch", "grad_accum", "lr", "inner_steps", "seq_len")


def table_row(name: str) -> str:
    """A row's name without its KEY=VALUE flags (lr=, aggregation=, ...): the paper's row it stands for."""
    return ":".join(p for p in name.split(":") if "=" not in p)


def base_key(v: dict) -> tuple:
    """What a row shares with the uncompressed row it is measured against (sim.rows.Variant.base_key)."""
    return (v["mode"], v["seed"], v.get("lr"), tuple(sorted((v.get("sparseloco") or {}).items())),
            v.get("optimizer_state"))


def input_files(paths: list[str]) -> list[str]:
    """The run JSONs among `paths` (folders are searched), never a summary or a calibration."""
    found = []
    for path in paths or [RESULTS]:
        found += sorted(glob.glob(os.path.join(path, "paper_tables_*.json"))) if os.path.isdir(path) else [path]
    skip = ("paper_tables_summary", "paper_tables_calibration")
    return [f for f in found if not os.path.basename(f).startswith(skip)]


def load_rows(paths: list[str]) -> tuple[list[dict], dict, list[dict]]:
    rows, meta, seen, unfinished = [], None, {}, []
    for path in input_files(paths):
        with open(path) as f:
            doc = json.load(f)
        setting = {k: doc.get(k) for k in SETTING}
        if meta is None:
            meta = {k: v for k, v in doc.items() if k not in ("rows", "worker", "cuda_visible_devices", "unfinished")}
        elif setting != {k: meta.get(k) for k in SETTING}:
            raise SystemExit(f"{path}: setting {setting} differs from the first file's; pass one run's files")
        for r in doc["rows"]:
            key = r["variant"]["name"]
            if key in seen:
                raise SystemExit(f"{key} is in both {seen[key]} and {path}")
            seen[key] = path
            rows.append({**r, "file": os.path.basename(path), "card": r.get("card") or doc.get("card"),
                         "gpus": doc.get("gpus_per_row", 1)})
        unfinished += doc.get("unfinished", [])
    if meta is None:
        raise SystemExit(f"no paper_tables_*.json in {paths or [RESULTS]}")
    return rows, meta, [u for u in unfinished if u["row"] not in seen]


def _mean(values):
    values = [v for v in values if v is not None]
    return statistics.fmean(values) if values else None


def steps_per_pass(meta: dict, r: dict) -> float | None:
    """Inner steps of row `r` (its "replicas" and "tokens_per_replica_step") in one pass over the
    corpus `meta` records; None where either is unrecorded."""
    if not (meta.get("corpus_train_tokens") and r.get("tokens_per_replica_step")):
        return None
    return meta["corpus_train_tokens"] / (r["replicas"] * r["tokens_per_replica_step"])


def recorded_losses(r: dict) -> dict[int, float]:
    """{step: train loss} of what a row kept: every `train_losses_every`-th step from step 1
    (paper_tables writes the stride; rows from before it, all of whole tens of steps, kept every
    steps / len)."""
    losses = r.get("train_losses") or []
    return {1 + i * loss_stride(r): x for i, x in enumerate(losses)}


def loss_stride(r: dict) -> int:
    """Steps between a row's recorded train losses (`recorded_losses`)."""
    losses = r.get("train_losses") or []
    return r.get("train_losses_every") or (r["steps"] // len(losses) if losses else 1)


def pass_drops(r: dict, steps_per_pass: float | None) -> dict | None:
    """How far a row's train loss falls across the start of each new pass over the corpus against
    across the middle of a pass (the mean of its recorded train losses in the 90 steps before a
    point minus in the 90 after, averaged over the points that fit): a model that memorises its
    corpus falls at the boundaries and little between them. None without a whole boundary."""
    losses, steps = recorded_losses(r), r["steps"]
    if not losses or not steps_per_pass:
        return None

    def drop(point: float) -> float | None:
        before = [x for s, x in losses.items() if point - 100 <= s < point - 10]
        after = [x for s, x in losses.items() if point + 10 < s <= point + 100]
        return statistics.fmean(before) - statistics.fmean(after) if before and after else None

    passes = int(steps // steps_per_pass)
    new = [d for k in range(1, passes + 1) if (d := drop(k * steps_per_pass)) is not None]
    mid = [d for k in range(1, passes) if (d := drop((k + 0.5) * steps_per_pass)) is not None]
    if not new:
        return None
    return {"new_pass": statistics.fmean(new), "mid_pass": statistics.fmean(mid) if mid else None,
            "boundaries": len(new)}


def first_pass_fresh(r: dict, steps_per_pass: float | None, H: int) -> dict | None:
    """The row's recorded train loss at the first step after the last outer sync (every `H`, the
    run's) within the first pass over the corpus ({"step", "loss"}): the synced model's loss on
    batches no replica has seen, the mean over every replica's micro-batches of that step. A row
    without outer syncs (AdamW) is read at the same step, as unseen. None where it was not recorded."""
    losses = recorded_losses(r)
    if not losses or not steps_per_pass:
        return None
    # The point is the schedule's, not the last one recorded: a row that diverged before it ran
    # there and failed (NaN, the worst), not a row whose point is an earlier step.
    every = loss_stride(r)
    after_sync = [s for s in range(H + 1, min(r["steps"], int(steps_per_pass)) + 1, H) if (s - 1) % every == 0]
    if not after_sync:
        return None
    step = after_sync[-1]
    if step not in losses:
        return {"step": step, "loss": math.nan} if r.get("diverged_at_step") is not None else None
    return {"step": step, "loss": losses[step]}


def summarize(rows: list[dict], meta: dict) -> list[dict]:
    base = {base_key(r["variant"]): r["val_loss"] for r in rows if r["variant"]["compressed"] == 0}
    by_row: dict[str, list[dict]] = {}
    for r in sorted(rows, key=lambda r: r["variant"]["seed"]):
        by_row.setdefault(r["variant"]["name"].split("@")[0], []).append(r)

    def order(name):
        t = table_row(name)
        return (ORDER.index(t) if t in ORDER else len(ORDER), name)

    out = []
    for name in sorted(by_row, key=order):
        group = by_row[name]
        deltas = []
        for r in group:
            b = base.get(base_key(r["variant"]))
            if b is not None:
                deltas.append(100.0 * (r["val_loss"] - b) / b)
        losses = [r["val_loss"] for r in group]
        first = group[0]
        tokens = first["steps"] * first["replicas"] * first.get("tokens_per_replica_step", 0)
        per_pass = steps_per_pass(meta, first)
        last = [r["outer"][-1] if r.get("outer") else {} for r in group]
        out.append({
            "row": name,
            "table_row": table_row(name),
            "mode": first["variant"]["mode"],
            "ratio": first["variant"]["ratio"],
            "compressed_replicas": first["variant"]["compressed"],
            "lr": first["variant"].get("lr") or meta.get("lr"),
            "sparseloco": first["variant"].get("sparseloco") or {},
            "seeds": [r["variant"]["seed"] for r in group],
            "outer_steps": first.get("outer_steps"),
            "tokens_per_replica_step": first.get("tokens_per_replica_step"),
            "tokens_per_param": tokens / first["n_params"] if first.get("n_params") else None,
            "epochs": tokens / meta["corpus_train_tokens"] if meta.get("corpus_train_tokens") else None,
            "val_loss_mean": statistics.fmean(losses),
            "val_loss_per_seed": losses,
            "val_loss_per_replica_per_seed": [r.get("val_losses") for r in group],
            "final_train_loss_per_seed": [r.get("final_train_loss") for r in group],
            "val_curve_per_seed": [r.get("val_curve") or None for r in group],
            "diverged_at_step_per_seed": [r.get("diverged_at_step") for r in group],
            "train_drop_per_seed": [pass_drops(r, per_pass) for r in group],
            "first_pass_fresh_per_seed": [first_pass_fresh(r, per_pass, meta.get("inner_steps") or 1) for r in group],
            "delta_pct_mean": statistics.fmean(deltas) if deltas else None,
            "delta_pct_per_seed": deltas,
            "paper_delta_pct": PAPER.get(table_row(name)),
            "paper_val_loss_512m": PAPER_LOSS.get(table_row(name)),
            "last_sync_replicas_per_selected": _mean(x.get("replicas_per_selected") for x in last),
            "last_sync_update_cosine": _mean(x.get("update_cosine") for x in last),
            "last_sync_error_norm": _mean(x.get("error_norm") for x in last),
            "stage_link_bytes_per_token": first["stage_link_bytes_per_token"],
            "seconds_per_seed": [r.get("seconds") for r in group],
            "card_per_seed": [r.get("card") for r in group],  # a size's seeds may have run on different cards
            "gpus_per_seed": [r.get("gpus", 1) for r in group],  # GPUs that ran the seed's row together
        })
    return out


def best_lr(summary: list[dict]) -> dict[str, dict]:
    """An lr sweep's best lr per mode among its uncompressed rows: {mode: {"lr", "seeds"}}.

    The rows of a mode are compared on the seeds all of them ran (a second seed added to one lr later must
    not move that lr against lrs run once: the seed spread is as large as the lr differences near the
    best); only where they share none does each row's own mean decide.
    """
    by_mode: dict[str, list[dict]] = {}
    for r in summary:
        if r["compressed_replicas"] == 0 and r["lr"] is not None and not r["sparseloco"]:
            by_mode.setdefault(r["mode"], []).append(r)
    out = {}
    for mode, rows in by_mode.items():
        shared = sorted(set.intersection(*(set(r["seeds"]) for r in rows)))

        def score(r: dict) -> float:
            x = r["val_loss_mean"] if not shared else \
                statistics.fmean(v for s, v in zip(r["seeds"], r["val_loss_per_seed"]) if s in shared)
            return x if math.isfinite(x) else math.inf  # a diverged lr is the worst, not min()'s first NaN

        best = min(rows, key=score)
        out[mode] = {"lr": best["lr"], "seeds": shared or None}
    return out


def corpus_label(description: str) -> str:
    """A few words for the plot title from the corpus description the run recorded."""
    if "site-packages" in description:
        return "Python sources corpus"
    return "stdlib corpus" if "standard library" in description else description.split("(")[0].strip()[:40]


def plot(summary: list[dict], meta: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    regime = (f"{meta['model']}, {corpus_label(meta['data'])}, {meta['steps']} steps, "
              f"{meta.get('tokens_per_replica_step', '?')} tok/replica step")
    for ax, source, title in ((axes[0], "ours", f"this repo: {regime}"),
                              (axes[1], "paper", "paper: 512M, DCLM, 10B tokens (Table 2)")):
        for kind, marker in (("pp", "o-"), ("het", "s--")):
            pts = sorted(((r["ratio"], r) for r in summary if r["mode"] == "sparseloco" and not r["sparseloco"]
                          and r["table_row"].startswith(kind + ":") and r["table_row"].count(":") == 1),
                         key=lambda x: x[0])
            xs = [1 / ratio for ratio, _ in pts]
            if source == "ours":
                pts = [(ratio, r) for ratio, r in pts if r["delta_pct_per_seed"]]  # a run cut short may lack a base
                xs = [1 / ratio for ratio, _ in pts]
                ys = [r["delta_pct_mean"] for _, r in pts]
                lo = [min(r["delta_pct_per_seed"]) for _, r in pts]
                hi = [max(r["delta_pct_per_seed"]) for _, r in pts]
                ax.errorbar(xs, ys, yerr=[[y - a for y, a in zip(ys, lo)], [b - y for y, b in zip(ys, hi)]],
                            fmt=marker, capsize=3, label="uniform (all compress)" if kind == "pp" else "het (half)")
            else:
                ax.plot(xs, [r["paper_delta_pct"] for _, r in pts], marker,
                        label="uniform (all compress)" if kind == "pp" else "het (half)")
        ax.set_xscale("log")
        ax.set_xlabel("k/d")
        ax.set_ylabel("validation loss degradation vs SparseLoCo (%)")
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("inputs", nargs="*", help="JSON files or folders (default: bench/results)")
    p.add_argument("--out-dir", default=RESULTS)
    args = p.parse_args()
    rows, meta, unfinished = load_rows(args.inputs)
    summary = summarize(rows, meta)
    doc = {**meta, "rows": summary, "unfinished": unfinished, "sources": sorted({r["file"] for r in rows})}
    if meta.get("lr_sweep"):
        doc["best_lr"] = best_lr(summary)
    os.makedirs(args.out_dir, exist_ok=True)
    tmp = os.path.join(args.out_dir, "paper_tables_summary.json.tmp")
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=1)
    os.replace(tmp, os.path.join(args.out_dir, "paper_tables_summary.json"))
    plot(summary, meta, os.path.join(args.out_dir, "paper_tables.png"))
    print("| row | outer steps | tok/param | val loss (mean of seeds) | per seed | Δ% ours (per seed) | Δ% paper "
          "| replicas/coord | cos(update, dense) |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in summary:
        per = ", ".join(f"{d:.2f}" for d in r["delta_pct_per_seed"])
        mean = "—" if r["delta_pct_mean"] is None else f"{r['delta_pct_mean']:.2f}"
        paper = "—" if r["paper_delta_pct"] is None else f"{r['paper_delta_pct']:.1f}"
        tpp = "—" if r["tokens_per_param"] is None else f"{r['tokens_per_param']:.1f}"
        ov = "—" if r["last_sync_replicas_per_selected"] is None else f"{r['last_sync_replicas_per_selected']:.2f}"
        cos = "—" if r["last_sync_update_cosine"] is None else f"{r['last_sync_update_cosine']:.2f}"
        seeds = ", ".join(f"{v:.4f}" for v in r["val_loss_per_seed"])
        print(f"| {r['row']} | {r['outer_steps']} | {tpp} | {r['val_loss_mean']:.4f} | {seeds} | {mean} ({per}) "
              f"| {paper} | {ov} | {cos} |")
    if doc.get("best_lr"):
        for mode, b in doc["best_lr"].items():
            on = f"seeds {b['seeds']}, the ones every lr ran" if b["seeds"] else "each row's own seeds"
            print(f"best lr for {mode}: {b['lr']:g} (compared on {on})")
    for u in unfinished:
        print(f"unfinished: {u['row']} {u['status']} at step {u['step']} of {u['steps']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
