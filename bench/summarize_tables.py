"""Merge the paper-table runs (partial JSONs of bench/paper_tables.py) into one summary and a plot.

Relative degradation of each row is against the uncompressed row of the same mode
(SparseLoCo or AdamW) and seed; rows are then averaged over seeds with their spread. The
paper's numbers (512M, DCLM, 10B tokens; ../shared/METHOD.md) stand beside ours. Every input
must share one setting (model, steps, M, S, micro-batch, lr); a (row, seed) seen twice is an error.

    python bench/summarize_tables.py [JSON or folder ...] [--out-dir DIR]
    # default: bench/results/paper_tables_*.json; writes paper_tables_summary.json and .png to DIR
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import statistics

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results")

# Paper: Table 2 (SparseLoCo, M = 8, S = 4, H = 50), Table 4 (AdamW H = 1), Table 5a (het, k/d = 1/8).
PAPER = {
    "pp:8": 4.0, "het:8": 3.3, "pp:24": 5.9, "het:24": 5.5, "pp:96": 8.4, "het:96": 7.7,
    "adamw-pp:8": 2.2, "adamw-het:8": 2.9, "het:8:noadapt": 5.9,
}


# Table order: SparseLoCo rows (Tables 1/2, 5a), then AdamW (Table 4); others after them.
ORDER = ("sparseloco", "pp:8", "het:8", "pp:24", "het:24", "pp:96", "het:96", "pp:8:noadapt", "het:8:noadapt",
         "adamw", "adamw-pp:8", "adamw-het:8")
SETTING = ("model", "steps", "replicas", "stages", "micro_batch", "lr", "inner_steps", "seq_len")


def input_files(paths: list[str]) -> list[str]:
    """The run JSONs among `paths` (folders are searched), never a summary or a calibration."""
    found = []
    for path in paths or [RESULTS]:
        found += sorted(glob.glob(os.path.join(path, "paper_tables_*.json"))) if os.path.isdir(path) else [path]
    skip = ("paper_tables_summary", "paper_tables_calibration")
    return [f for f in found if not os.path.basename(f).startswith(skip)]


def load_rows(paths: list[str]) -> tuple[list[dict], dict]:
    rows, meta, seen = [], None, {}
    for path in input_files(paths):
        with open(path) as f:
            doc = json.load(f)
        setting = {k: doc.get(k) for k in SETTING}
        if meta is None:
            meta = {k: v for k, v in doc.items() if k not in ("rows", "worker", "cuda_visible_devices")}
        elif setting != {k: meta.get(k) for k in SETTING}:
            raise SystemExit(f"{path}: setting {setting} differs from the first file's; pass one run's files")
        for r in doc["rows"]:
            key = r["variant"]["name"]
            if key in seen:
                raise SystemExit(f"{key} is in both {seen[key]} and {path}")
            seen[key] = path
            rows.append({**r, "file": os.path.basename(path)})
    if meta is None:
        raise SystemExit(f"no paper_tables_*.json in {paths or [RESULTS]}")
    return rows, meta


def summarize(rows: list[dict]) -> list[dict]:
    base = {(r["variant"]["mode"], r["variant"]["seed"]): r["val_loss"] for r in rows if r["variant"]["compressed"] == 0}
    by_row: dict[str, list[dict]] = {}
    for r in sorted(rows, key=lambda r: r["variant"]["seed"]):
        by_row.setdefault(r["variant"]["name"].split("@")[0], []).append(r)
    by_row = dict(sorted(by_row.items(), key=lambda kv: ORDER.index(kv[0]) if kv[0] in ORDER else len(ORDER)))
    out = []
    for name, group in by_row.items():
        deltas = []
        for r in group:
            b = base.get((r["variant"]["mode"], r["variant"]["seed"]))
            if b is not None:
                deltas.append(100.0 * (r["val_loss"] - b) / b)
        losses = [r["val_loss"] for r in group]
        out.append({
            "row": name,
            "mode": group[0]["variant"]["mode"],
            "ratio": group[0]["variant"]["ratio"],
            "compressed_replicas": group[0]["variant"]["compressed"],
            "seeds": [r["variant"]["seed"] for r in group],
            "val_loss_mean": statistics.fmean(losses),
            "val_loss_per_seed": losses,
            "delta_pct_mean": statistics.fmean(deltas) if deltas else None,
            "delta_pct_per_seed": deltas,
            "paper_delta_pct": PAPER.get(name),
            "stage_link_bytes_per_token": group[0]["stage_link_bytes_per_token"],
        })
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
    for ax, source, title in ((axes[0], "ours", f"this repo: {meta['model']}, {corpus_label(meta['data'])}, {meta['steps']} steps"),
                              (axes[1], "paper", "paper: 512M, DCLM, 10B tokens (Table 2)")):
        for kind, marker in (("pp", "o-"), ("het", "s--")):
            pts = sorted((r["ratio"], r) for r in summary
                         if r["mode"] == "sparseloco" and r["row"].startswith(kind + ":") and r["row"].count(":") == 1)
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
    rows, meta = load_rows(args.inputs)
    summary = summarize(rows)
    doc = {**meta, "rows": summary, "sources": sorted({r["file"] for r in rows})}
    os.makedirs(args.out_dir, exist_ok=True)
    with open(os.path.join(args.out_dir, "paper_tables_summary.json"), "w") as f:
        json.dump(doc, f, indent=1)
    plot(summary, meta, os.path.join(args.out_dir, "paper_tables.png"))
    print(f"| row | val loss (mean of seeds {summary[0]['seeds']}) | Δ% ours (per seed) | Δ% paper |")
    print("| --- | --- | --- | --- |")
    for r in summary:
        per = ", ".join(f"{d:.2f}" for d in r["delta_pct_per_seed"])
        mean = "—" if r["delta_pct_mean"] is None else f"{r['delta_pct_mean']:.2f}"
        paper = "—" if r["paper_delta_pct"] is None else f"{r['paper_delta_pct']:.1f}"
        print(f"| {r['row']} | {r['val_loss_mean']:.4f} | {mean} ({per}) | {paper} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
