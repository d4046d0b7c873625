"""`hetloco-ds plot RUN_DIR`: loss and bytes-by-link PNGs from a run's metrics.jsonl.

`loss.png`: each replica's training loss per step and the validation loss. `bytes.png`, the
quantity the method exists to shrink, in two panels: the bytes sent so far on each link class
(stage links: activation and activation_grad every step, embedding_sync at outer steps; replica
links: outer_sync; control: scalars on either), all replicas summed, log scale; and each
replica's total per kind, one bar per kind with its value written beside it, so kinds of equal
size (activation and activation_grad on an uncompressed link) and kinds that sent nothing stay
visible.
matplotlib is imported only here (the `plot` extra: `pip install 'hetloco_ds[plot]'`).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from .sizes import BYTE_KINDS

LOSS_PNG = "loss.png"
BYTES_PNG = "bytes.png"
LINK_CLASSES = {"stage links": ("activation", "activation_grad", "embedding_sync"), "replica links": ("outer_sync",),
                "control": ("control",)}
"""Which link each byte kind crosses (meter.py); every kind in exactly one class."""
assert sorted(k for ks in LINK_CLASSES.values() for k in ks) == sorted(BYTE_KINDS)


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


def _cumulative(by_step: dict[int, int]) -> tuple[list, list]:
    total, xs, ys = 0, [], []
    for step in sorted(by_step):
        total += by_step[step]
        xs.append(step)
        ys.append(total)
    return xs, ys


def series(rows: list[dict]) -> dict:
    """{"train": {replica: ([steps], [losses])}, "validation": ([steps], [losses]),
    "sent": {kind: ([steps], [cumulative bytes sent, all replicas])} (kinds that sent anything),
    "links": {link class: ([steps], [cumulative bytes sent, all replicas])},
    "per_replica": {replica: {kind: bytes sent}} (every kind of the rows, zeros included)}.

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
    per_replica: dict[int, dict[str, int]] = {}
    for (step, replica), r in sorted(steps.items()):
        xs, ys = train.setdefault(replica, ([], []))
        xs.append(step)
        ys.append(r["loss"])
        totals = per_replica.setdefault(replica, {})
        for kind, counts in r["bytes"].items():
            by_step = per_step.setdefault(kind, {})
            by_step[step] = by_step.get(step, 0) + counts["sent"]
            totals[kind] = totals.get(kind, 0) + counts["sent"]
    sent = {kind: _cumulative(by_step) for kind, by_step in per_step.items() if any(by_step.values())}
    links = {}
    for link, kinds in LINK_CLASSES.items():
        by_step: dict[int, int] = {}
        for kind in kinds:
            for step, n in per_step.get(kind, {}).items():
                by_step[step] = by_step.get(step, 0) + n
        if by_step:
            links[link] = _cumulative(by_step)
    ordered = sorted(validation)
    return {"train": train, "validation": (ordered, [validation[s] for s in ordered]), "sent": sent, "links": links,
            "per_replica": per_replica}


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

    fig = bytes_figure(data, Path(run_dir).name)
    _save(fig, out / BYTES_PNG)
    plt.close(fig)
    written.append(out / BYTES_PNG)
    return written


def bytes_figure(data: dict, name: str):
    """The bytes chart of `series(...)`: link classes over steps, and each replica's kinds."""
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    from .metrics import human_bytes as human

    replicas = sorted(data["per_replica"])
    kinds = [k for k in BYTE_KINDS if any(k in data["per_replica"][m] for m in replicas)]
    fig, (links, bars) = plt.subplots(1, 2, figsize=(13, 4.5), gridspec_kw={"width_ratios": [1, 1.2]})
    for link, (xs, ys) in data["links"].items():
        links.plot(xs, ys, linewidth=1.5, label=f"{link} ({human(ys[-1])})")
    if any(ys[-1] for _, ys in data["links"].values()):
        links.set_yscale("log")
    if data["links"]:
        links.legend()
    links.set(xlabel="step", ylabel="bytes sent so far (all replicas)", title=f"bytes by link class: {name}")
    links.xaxis.set_major_locator(MaxNLocator(integer=True))
    links.grid(alpha=0.3, which="both")

    # One bar per (replica, kind), side by side: equal kinds do not hide each other, and a kind that
    # sent nothing still has its row and its "0 B".
    height = 0.8 / max(1, len(kinds))
    largest = max((n for m in replicas for n in data["per_replica"][m].values()), default=0)
    for j, kind in enumerate(kinds):
        ys = [m - 0.4 + height * (j + 0.5) for m in replicas]
        sent = [data["per_replica"][m].get(kind, 0) for m in replicas]
        found = bars.barh(ys, sent, height=height * 0.9, label=kind)
        bars.bar_label(found, labels=[human(n) for n in sent], padding=2, fontsize=7)
    if largest:
        bars.set_xscale("symlog", linthresh=1)
        bars.set_xlim(0, largest * 30)
    bars.set_yticks(replicas, [f"replica {m}" for m in replicas])
    bars.invert_yaxis()
    bars.set(xlabel="bytes sent (whole run)", title="bytes by replica and kind")
    if kinds:
        bars.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    return fig


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
