"""The outer step's rules as registries (sparseloco/aggregate.py): a rule registered in this file is a
config choice, runs the outer step, sizes the payload and enters the fingerprint."""
from __future__ import annotations

import pytest
import torch

from hetloco_ds import sizes
from hetloco_ds.config import ConfigError, SparseLoCoConfig, parse_config
from hetloco_ds.sparseloco import aggregate
from hetloco_ds.sparseloco.outer import SparseLoCoState, payload_nbytes


def paper(**fields) -> SparseLoCoConfig:
    return SparseLoCoConfig(preset="paper", **fields)


def sparseloco(section: dict) -> SparseLoCoConfig:
    return parse_config({"hetloco": {"sparseloco": section}}).hetloco.sparseloco


# Registered at import, as a researcher's module would: every process that imports this file has them.
@aggregate.aggregation("test_sum")
def _sum_without_dividing(pos, values, numel):
    return aggregate.scatter_sum(pos, values, numel), 1.0


@aggregate.clip("test_halve")
def _halve(values):
    return values * 0.5


@aggregate.topk_rule("test_one")
def _one_per_chunk(chunk_len, topk, chunk_size):
    return 1


def _outer_steps(cfg, deltas, shapes):
    """One outer step of len(deltas) replicas from zero parameters; each replica's params afterwards."""
    params = [[torch.zeros(s) for s in shapes] for _ in deltas]
    states = [SparseLoCoState(p, cfg) for p in params]
    for replica, ds in zip(params, deltas):
        for p, d in zip(replica, ds):
            p.sub_(torch.tensor(d))
    payloads = [s.prepare(p) for s, p in zip(states, params)]
    reports = [s.finish(p, payloads) for s, p in zip(states, params)]
    return params, reports


def test_rules_registered_in_a_test_file_are_config_choices_and_run_the_outer_step():
    """An aggregation and a clip registered above are accepted by name in the config (an unknown name
    is refused, naming the registered ones), and the outer step applies them: coordinate 0 is sent by
    two replicas, 2 by one (k = 1 of a 4-chunk, beta = 0); test_sum adds without dividing, test_halve
    halves every sent value first, so theta moves by (3 + 1) / 2 and 6 / 2. Breaks if config kept a
    copy of the choices, or the outer step a string switch of its own."""
    cfg = sparseloco({"preset": "paper", "aggregation": "test_sum", "norm_clip": "test_halve", "chunk_size": 4,
                      "topk": 1, "error_decay": 0.0})
    assert (cfg.aggregation, cfg.norm_clip) == ("test_sum", "test_halve")
    with pytest.raises(ConfigError, match=r"aggregation must be one of \(.*'test_sum'.*\), got 'test_summ'"):
        sparseloco({"aggregation": "test_summ"})
    params, reports = _outer_steps(cfg, [[[3.0, 0.0, 0.0, 0.0]], [[1.0, 0.5, 0.0, 0.0]], [[0.0, 0.0, 6.0, 0.0]]], [(4,)])
    for replica in params:
        assert torch.equal(replica[0], -torch.tensor([2.0, 0.0, 3.0, 0.0]))
    assert reports[0].contributors == (0, 1, 2)


def test_a_rule_defined_otherwise_under_a_taken_name_is_refused_and_parts_the_fingerprint(monkeypatch):
    """Registering another function as "mean" is refused with one line naming it; and two replicas whose
    registries hold different rules under one name (two processes that imported different code) build
    payloads of one length whose fingerprints differ, so each refuses the other's. Breaks if the
    fingerprint recorded the rule's name only: the replicas would sum payloads under different math."""
    with pytest.raises(ValueError, match="'mean' is already registered"):
        aggregate.AGGREGATIONS.register("mean", aggregate.Aggregation(_sum_without_dividing))
    aggregate.aggregation("test_sum")(_sum_without_dividing)  # the same rule again: a module imported twice
    shapes = [(64, 64)]
    ours = SparseLoCoState([torch.zeros(s) for s in shapes], paper(aggregation="test_sum"))
    monkeypatch.setitem(aggregate.AGGREGATIONS._rules, "test_sum", aggregate.Aggregation(aggregate.scatter_sum))
    theirs = SparseLoCoState([torch.zeros(s) for s in shapes], paper(aggregation="test_sum"))
    params = [torch.randn(s) for s in shapes]
    mine, other = ours.prepare(params), theirs.prepare(params)
    assert mine.numel() == other.numel()
    with pytest.raises(ValueError, match="fingerprint"):
        ours.finish(params, [mine, other])


def test_a_topk_rule_registered_here_sizes_the_payload_the_codec_fills():
    """topk_rule "test_one" (k = 1 in every chunk), registered above, is a config choice, and the cost
    model's size rule (sizes.stage_payload_nbytes, what `plan` reports) equals the payload the outer
    step builds under it: 4 chunks of a 128 x 128 tensor -> 4 values + 4 packed 12-bit indices (6 bytes,
    padded to 8) + the 16-byte header. A rule giving k outside [1, chunk_len] is refused, naming it.
    Breaks if the size rules lived in two places."""
    cfg = sparseloco({"topk_rule": "test_one"})
    shapes = [(128, 128)]
    want = sizes.PAYLOAD_HEADER_BYTES + 4 * 4 + 8
    assert sizes.stage_payload_nbytes(shapes, cfg.chunk_size, cfg.topk, topk_rule="test_one") == want
    assert payload_nbytes(shapes, cfg) == want
    state = SparseLoCoState([torch.zeros(s) for s in shapes], cfg)
    assert state.prepare([torch.randn(s) for s in shapes]).numel() == want
    aggregate.topk_rule("test_zero")(lambda chunk_len, topk, chunk_size: 0)
    with pytest.raises(ValueError, match="topk_rule 'test_zero' gave k = 0"):
        sizes.topk_per_chunk(64, rule="test_zero")
