"""bench/outer_state.py, the GPU memory bench of sparseloco.outer_state_device, in its CPU smoke form."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"


def test_outer_state_bench_smoke_runs_both_placements_to_the_same_bits():
    """measure_outer_state (what bench/scale.py calls) on the tiny preset, 2 replicas on gloo: a row per
    placement with every rank, the state where the placement says, the predicted device state 8 B per
    parameter lower on the host, an outer step timed on every rank, and both placements training the
    same losses and parameters. Breaks if the bench stops passing the placement to the engine, loses a
    rank's row, or if the two placements stop training the same bits."""
    spec = importlib.util.spec_from_file_location("outer_state_bench", BENCH / "outer_state.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    report = bench.measure_outer_state(cpu_smoke=True, steps=3)
    assert report["ok"], report
    rows = {row["placement"]: row for row in report["results"]}
    assert sorted(rows) == ["cpu", "gpu"]
    for name, row in rows.items():
        assert [r["rank"] for r in row["ranks"]] == [0, 1]
        assert all(r["on_host"] == (name == "cpu") for r in row["ranks"])
        assert all(r["outer_s"] > 0 for r in row["ranks"])
    for g, c in zip(rows["gpu"]["ranks"], rows["cpu"]["ranks"]):
        assert g["n_params_local"] == c["n_params_local"] > 0
        assert (g["state_gib"] - c["state_gib"]) * 2**30 == pytest.approx(8 * g["n_params_local"])
    assert report["comparison"]["same_bits"] and report["comparison"]["same_losses"]
