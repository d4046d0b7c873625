"""Issue 57 item 4: how much of a boundary's activation a compressed link drops, over training.

docs/templar_pp_diff.md measured at init only: with our embedding at N(0, 0.02) the subspace link
drops 92-94% of ||X|| at every 20M boundary, with the embedding at N(0, 1) 15-27%, because what
crosses exactly (T_perp[ids]) is then most of X. Whether that survives training decides whether the
init can be the lever it looked like. `install()` makes every validation of a batched-simulator row
(paper_tables' workers, `--probe-boundaries`) first push `PROBE_BATCHES` of its held-out batches
through the pipeline stage by stage and record, per boundary and replica:

- `dropped`: ||X - X^|| / ||X||, X the stage's output, X^ what the next stage receives;
- `exact`: ||T_perp[ids]|| / ||X||, the part the link rebuilds exactly from the ids (None for an
  uncompressed replica, whose link drops nothing).

Each a ratio of norms over the batches' tokens. `take()` hands over the curve since the last take
(one row's, in a worker that runs rows one after another); a row resumed from a saved state has
only the steps of its last call.
"""
from __future__ import annotations

import torch

from hetloco_ds.sim.batched import BatchedSimulation

PROBE_BATCHES = 2


class _Recorder:
    def __init__(self):
        self.curve: list[dict] = []

    def take(self) -> list[dict]:
        out, self.curve = self.curve, []
        return out


@torch.no_grad()
def measure(sim: BatchedSimulation, batches) -> list[dict]:
    """Per boundary: each replica's dropped and exact shares over `batches` (ids [b, L] each), read
    off the simulator's own eager forward, its `_boundary` watched for the call."""
    M = sim.shards.local
    sums = [{"x": torch.zeros(M, dtype=torch.float64), "lost": torch.zeros(M, dtype=torch.float64),
             "exact": torch.zeros(M, dtype=torch.float64)} for _ in range(sim.S - 1)]
    link = sim._boundary

    def watched(s: int, x):
        got = link(s, x)
        tok, flat = x[1], x[0].float().reshape(M, -1)
        sums[s]["x"] += flat.pow(2).sum(1).double().cpu()
        sums[s]["lost"] += (flat - got[0].float().reshape(M, -1)).pow(2).sum(1).double().cpu()
        perp = sim.perp[s + 1]  # what the receiving stage rebuilds from the ids
        if perp is not None:
            rebuilt = torch.stack([perp[m][tok[m]] for m in range(M)])
            sums[s]["exact"] += rebuilt.float().reshape(M, -1).pow(2).sum(1).double().cpu()
        return got

    sim._boundary = watched
    try:
        for ids, labels in batches:
            sim._forward_eager(ids.expand(M, *ids.shape), labels.expand(M, *labels.shape))
    finally:
        del sim._boundary  # the class's method again
    compressed = [r.algorithms[0].codec.compressed for r in sim.replicas]
    return [{"boundary": b, "dropped": (t["lost"] / t["x"]).sqrt().tolist(),
             "exact": [e if c else None for e, c in zip((t["exact"] / t["x"]).sqrt().tolist(), compressed)]}
            for b, t in enumerate(sums)]


def install() -> _Recorder:
    """Wraps BatchedSimulation.validation_losses in this process; returns the recorder."""
    rec = _Recorder()
    plain = BatchedSimulation.validation_losses

    def validation_losses(self, batches):
        rec.curve.append({"step": self.step, "boundaries": measure(self, batches[:PROBE_BATCHES])})
        return plain(self, batches)

    BatchedSimulation.validation_losses = validation_losses
    return rec
