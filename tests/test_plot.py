"""`hetloco-ds plot`'s bytes chart, read back from matplotlib's artists: what is drawn, not that a
PNG exists (test_run_outputs.py runs the command on a real run's metrics)."""
from __future__ import annotations

import json

import pytest

from hetloco_ds import plot

pytest.importorskip("matplotlib")


def _step(step: int, replica: int, act: int, emb: int, sync: int) -> dict:
    counts = {"activation": act, "activation_grad": act, "embedding_sync": emb, "outer_sync": sync, "control": 8}
    return {"kind": "step", "step": step, "replica": replica, "loss": 5.0 - step / 10,
            "bytes": {k: {"sent": n, "recv": n} for k, n in counts.items()}}


@pytest.fixture
def rows():
    """Two replicas, H = 2: an uncompressed replica 0 (activation and activation_grad equal, no
    embedding sync) and a compressed replica 1 (a quarter of the activations, an embedding sync
    at each outer step); outer syncs at steps 2 and 4."""
    out = []
    for step in range(1, 5):
        outer = step % 2 == 0
        out.append(_step(step, 0, 4096, 0, 1000 if outer else 0))
        out.append(_step(step, 1, 1024, 300 if outer else 0, 1000 if outer else 0))
    return out


def test_bytes_chart_draws_each_link_class_and_every_kind_of_every_replica(rows):
    """The chart once had one line per kind, all replicas summed: activation hid exactly under
    activation_grad, embedding_sync (zero on a replica, or everywhere) never appeared, and neither
    links nor replicas could be told apart."""
    import matplotlib.pyplot as plt

    fig = plot.bytes_figure(plot.series(rows), "run")
    try:
        links, bars = fig.axes
        drawn = {line.get_label().split(" (")[0]: (list(line.get_xdata()), list(line.get_ydata()))
                 for line in links.get_lines()}
        assert drawn == {
            "stage links": ([1, 2, 3, 4], [10240, 20780, 31020, 41560]),  # 2 x (4096 + 1024) a step, + 300 at 2 and 4
            "replica links": ([1, 2, 3, 4], [0, 2000, 2000, 4000]),
            "control": ([1, 2, 3, 4], [16, 32, 48, 64]),
        }
        assert [line.get_label() for line in links.get_lines()] == [
            "stage links (41.6KB)", "replica links (4.0KB)", "control (64B)"]

        assert [c.get_label() for c in bars.containers] == list(plot.BYTE_KINDS)
        widths = {c.get_label(): [round(p.get_width()) for p in c.patches] for c in bars.containers}
        assert widths == {"activation": [16384, 4096], "activation_grad": [16384, 4096], "outer_sync": [2000, 2000],
                          "embedding_sync": [0, 600], "control": [32, 32]}
        # Equal kinds side by side, not on top of each other: every bar has its own row.
        rows_y = [p.get_y() for c in bars.containers for p in c.patches]
        assert len(set(rows_y)) == len(rows_y) == 2 * len(plot.BYTE_KINDS)
        labels = [t.get_text() for t in bars.texts]
        assert labels == ["16.4KB", "4.1KB", "16.4KB", "4.1KB", "2.0KB", "2.0KB", "0B", "600B", "32B", "32B"]
        assert [t.get_text() for t in bars.get_yticklabels()] == ["replica 0", "replica 1"]
    finally:
        plt.close(fig)


def test_plot_command_writes_the_chart_of_the_runs_metrics(rows, tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    written = plot.plot_run(run)
    assert [p.name for p in written] == [plot.LOSS_PNG, plot.BYTES_PNG]
    assert all(p.read_bytes()[:4] == b"\x89PNG" for p in written)
