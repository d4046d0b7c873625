"""`hetloco-ds plot RUN_DIR`: loss and bytes-by-link PNGs from a run's metrics.jsonl.

`loss.png`: each replica's training loss per step and the validation loss. `bytes.png`:
the bytes sent so far on each link class (all replicas summed, log scale), the quantity the
method exists to shrink: activation and activation_grad cross stage links every step,
outer_sync crosses replica links at outer steps, embedding_sync and control are small.
matplotlib is imported only here (the `plot` extra: `pip install 'hetloco_ds[plot]'`).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

LOSS_PNG = "loss.png"
BYTES_PNG = "bytes.png"


class PlotError(ValueError):
    """A run directory without usable metrics; the message names it."""


def read_rows(run_dir: str | os.PathLike) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise PlotError(f"{path} not found: RUN_DIR is the --out of `hetloco-ds train`")
    rows = []
    with open(path) as f:
        for number, line in enumerate(f, start=1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except ValueError as err:
                    raise PlotError(f"{path}:{number}: not JSON ({err})") from None
    return rows


def series(rows: list[dict]) -> dict:
    """{"train": {replica: ([steps], [losses])}, "validation": ([steps], [losses]),
    "sent": {kind: ([steps], [cumulative bytes sent, all replicas])}}.

    A resumed run appends the steps it repeats after its checkpoint again; the last row of a
    (step, replica) wins, as it is the one the run continued from.
    """
    steps: dict[tuple[int, int], dict] = {}
    validation: dict[int, float] = {}
    for r in rows:
        if r.get("kind") == "step":
            steps[r["step"], r["replica"]] = r
        elif r.get("kind") == "validation":
            validation[r["step"]] = r["loss"]
    train: dict[int, tuple[list, list]] = {}
    per_step: dict[str, dict[int, int]] = {}
    for (step, replica), r in sorted(steps.items()):
        xs, ys = train.setdefault(replica, ([], []))
        xs.append(step)
        ys.append(r["loss"])
        for kind, counts in r["bytes"].items():
            by_step = per_step.setdefault(kind, {})
            by_step[step] = by_step.get(step, 0) + counts["sent"]
    sent = {}
    for kind, by_step in per_step.items():
        total, xs, ys = 0, [], []
        for step in sorted(by_step):
            total += by_step[step]
            xs.append(step)
            ys.append(total)
        if total:
            sent[kind] = (xs, ys)
    ordered = sorted(validation)
    return {"train": train, "validation": (ordered, [validation[s] for s in ordered]), "sent": sent}


def _save(fig, path: Path) -> None:
    """Write the PNG under a temporary name, then rename: a reader never sees half a file."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        fig.savefig(tmp, format="png", dpi=120, bbox_inches="tight")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def plot_run(run_dir: str | os.PathLike, out_dir: str | os.PathLike | None = None) -> list[Path]:
    """Write loss.png and bytes.png for `run_dir` into `out_dir` (default RUN_DIR/plots)."""
    data = series(read_rows(run_dir))
    if not data["train"] and not data["validation"][0]:
        raise PlotError(f"{Path(run_dir) / 'metrics.jsonl'} has no step or validation rows yet")
    try:
        import matplotlib
    except ImportError:
        raise PlotError("hetloco-ds plot needs matplotlib: pip install 'hetloco_ds[plot]'") from None
    matplotlib.use("Agg")  # files only; never a display
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    out = Path(out_dir) if out_dir is not None else Path(run_dir) / "plots"
    out.mkdir(parents=True, exist_ok=True)
    written = []

    fig, ax = plt.subplots(figsize=(7, 4))
    for replica, (xs, ys) in sorted(data["train"].items()):
        ax.plot(xs, ys, linewidth=1, label=f"train, replica {replica}")
    vx, vy = data["validation"]
    if vx:
        ax.plot(vx, vy, "ko-", markersize=4, label="validation")
    ax.set(xlabel="step", ylabel="loss", title=f"loss: {Path(run_dir).name}")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(alpha=0.3)
    ax.legend()
    _save(fig, out / LOSS_PNG)
    plt.close(fig)
    written.append(out / LOSS_PNG)

    fig, ax = plt.subplots(figsize=(7, 4))
    for kind, (xs, ys) in data["sent"].items():
        ax.plot(xs, ys, linewidth=1.5, label=kind)
    if data["sent"]:
        ax.set_yscale("log")
        ax.legend()
    ax.set(xlabel="step", ylabel="bytes sent so far (all replicas)", title=f"bytes by link class: {Path(run_dir).name}")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(alpha=0.3, which="both")
    _save(fig, out / BYTES_PNG)
    plt.close(fig)
    written.append(out / BYTES_PNG)
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="hetloco-ds plot", description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", help="a training run's --out directory (holds metrics.jsonl)")
    parser.add_argument("--out", help="where to write the PNGs (default: RUN_DIR/plots)")
    args = parser.parse_args(argv)
    try:
        written = plot_run(args.run_dir, args.out)
    except (PlotError, OSError) as err:
        print(f"hetloco-ds plot: error: {err}", file=sys.stderr)
        return 2
    for path in written:
        print(path)
    return 0
