"""`sizes.outer_step_transient_bytes` (what plan adds for the outer step's phase of a stage's peak)
against the bytes the real `SparseLoCoState.prepare` and `finish` allocate beside the state, counted
by a dispatch mode that follows every storage an op creates until it is freed. On a CPU the host
state's device copies are clones, so the walk allocates the same transients it does on a GPU.
Breaks if the outer step starts holding more than the rule says (plan would then under-predict the
peak and propose a run that runs out of memory) or the rule drifts far above what it holds."""
from __future__ import annotations

import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from hetloco_ds import sizes
from hetloco_ds.config import SparseLoCoConfig
from hetloco_ds.sparseloco.outer import SparseLoCoState


class LiveBytes(TorchDispatchMode):
    """Peak bytes of storages created by ops inside the mode and alive at once (an op's output that
    shares an input's storage, an in-place or out= op, allocates nothing)."""

    def __init__(self):
        super().__init__()
        self.live = self.peak = 0
        self._seen: set[int] = set()

    def _free(self, key: int, n: int) -> None:
        self.live -= n
        self._seen.discard(key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {a.untyped_storage().data_ptr() for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)}
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            key, n = storage.data_ptr(), storage.nbytes()
            if n == 0 or key in inputs or key in self._seen:
                continue
            self._seen.add(key)
            self.live += n
            self.peak = max(self.peak, self.live)
            weakref.finalize(storage, self._free, key, n)
        return out


def llama_stage(d: int, ffn: int, layers: int, vocab: int) -> list[tuple[int, ...]]:
    """A whole replica's trainable shapes in the engine's order (embedding, layers, norm, head)."""
    shapes = [(vocab, d)]
    for _ in range(layers):
        shapes += [(d,), (d, d), (d, d), (d, d), (d, d), (d,), (ffn, d), (ffn, d), (d, ffn)]
    return shapes + [(d,), (vocab, d)]


def measure(shapes, cfg: SparseLoCoConfig, on_host: bool, unit_numel: int) -> tuple[int, int]:
    torch.manual_seed(0)
    params = [torch.randn(s) for s in shapes]
    state = SparseLoCoState(params, cfg, on_host=on_host, unit_numel=unit_numel)
    for p in params:
        p.add_(torch.randn_like(p), alpha=0.01)
    with LiveBytes() as prep:
        payload = state.prepare(params)
    other = payload.clone()
    with LiveBytes() as fin:
        state.finish(params, [payload, other])
    return prep.peak, fin.peak


CASES = [
    # (label, shapes, unit_numel, sparseloco fields)
    ("d256 one unit a group", llama_stage(256, 704, 4, 512), sizes.OUTER_UNIT_NUMEL, {}),
    ("d256 groups cut into units", llama_stage(256, 704, 4, 512), 200_000, {}),
    ("d256 no error feedback", llama_stage(256, 704, 4, 512), 200_000, {"error_decay": 0.0}),
    ("d192 4-bit values", llama_stage(192, 512, 3, 300), 100_000, {"quant_bits": 4}),
    ("d256 outer momentum", llama_stage(256, 704, 2, 512), 200_000, {"outer_momentum": 0.9}),
]


@pytest.mark.parametrize("on_host", [True, False], ids=["state-on-host", "state-on-device"])
@pytest.mark.parametrize("label,shapes,unit_numel,fields", CASES, ids=[c[0] for c in CASES])
def test_outer_step_transients_are_what_the_size_rule_says(label, shapes, unit_numel, fields, on_host):
    cfg = SparseLoCoConfig(**fields)
    prepare, finish = measure(shapes, cfg, on_host, unit_numel)
    rule = sizes.outer_step_transient_bytes(shapes, on_host, cfg.chunk_size, cfg.topk, cfg.chunking, cfg.topk_rule,
                                            error_feedback=cfg.error_decay != 0, unit_numel=unit_numel)
    # Never below what prepare holds (plan would under-predict), at most 10% above it; finish holds less.
    assert prepare <= rule <= 1.10 * prepare, (label, prepare, rule, rule / prepare)
    assert finish <= rule, (label, finish, rule)


def test_units_are_the_states_own():
    """plan walks `sizes.outer_units`; the state computes on exactly those slices, in that order."""
    shapes = llama_stage(256, 704, 4, 512)
    params = [torch.zeros(s) for s in shapes]
    state = SparseLoCoState(params, SparseLoCoConfig(), unit_numel=200_000)
    got = [(tuple(u.group.shape), u.lo, u.hi) for u in state._units]
    assert got == sizes.outer_units(shapes, 200_000)
    assert [hi - lo for s, lo, hi in got if s == (704, 256)] == [1] * 8  # 180,224 elements a member: one a unit
    assert [hi - lo for s, lo, hi in got if s == (256, 256)] == [3, 3, 3, 3, 3, 1]  # 16 members, 3 a unit
