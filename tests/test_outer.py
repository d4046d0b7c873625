"""SparseLoCo's outer step on fake replicas in one process: the all-gather is the list itself."""
from __future__ import annotations

import io

import pytest
import torch

from hetloco_ds.sparseloco.compress import TensorCodec
from hetloco_ds.sparseloco.outer import HEADER, OuterConfig, SparseLoCoState, payload_nbytes

SHAPES = [(65, 130), (10000,), (65, 130), (7,), (3, 5), (128, 96)]  # a repeated shape exercises grouping
DENSE = dict(topk=4096, error_decay=0.0, quant_bits=None, outer_lr=1.0)  # k = whole chunk: no compression


def make_replicas(m: int, cfg: OuterConfig, shapes=SHAPES, seed: int = 0):
    """M replicas that start from the same theta, each with a state; returns (theta0, params, states)."""
    g = torch.Generator().manual_seed(seed)
    theta0 = [torch.randn(s, generator=g) for s in shapes]
    params = [[t.clone() for t in theta0] for _ in range(m)]
    states = [SparseLoCoState(p, cfg) for p in params]
    return theta0, params, states


def inner_steps(params, seed: int, scale: float = 0.1):
    """Stand-in for H AdamW steps: every replica moves its parameters differently."""
    g = torch.Generator().manual_seed(seed)
    for replica in params:
        for p in replica:
            p.add_(torch.randn(p.shape, generator=g) * scale)


def outer_step(params, states, **kw):
    payloads = [s.prepare(p) for s, p in zip(states, params)]  # each replica, then the all-gather
    reports = [s.finish(p, payloads, **kw) for s, p in zip(states, params)]
    return payloads, reports


@pytest.mark.parametrize("cfg", [
    OuterConfig(),
    OuterConfig(chunk_size=64, topk=8, quant_bits=2),
    OuterConfig(chunk_size=64, topk=8, value_dtype=torch.bfloat16, outer_lr=0.7),
    OuterConfig(chunk_size=64, topk=8, aggregation="selected_count"),
], ids=["paper", "quant2", "bf16", "selected_count"])
def test_replicas_end_each_outer_step_bitwise_identical(cfg):
    """Guards the synchronisation invariant: differing sums or orders would let replicas drift apart."""
    _, params, states = make_replicas(3, cfg)
    for step in range(3):
        inner_steps(params, seed=step)
        payloads, reports = outer_step(params, states)
        assert {p.numel() for p in payloads} == {payload_nbytes(SHAPES, cfg)} == {r.bytes_per_replica for r in reports}
        for replica, state in zip(params[1:], states[1:]):
            assert all(torch.equal(a, b) for a, b in zip(replica, params[0]))
            assert all(torch.equal(a, b) for a, b in zip(state.theta_prev, states[0].theta_prev))
        assert all(torch.equal(a, b) for a, b in zip(params[0], states[0].theta_prev))
        assert reports[0].contributors == (0, 1, 2) and reports[0].excluded == ()


def test_uncompressed_outer_step_equals_mean_of_replicas():
    """Guards eq. (2) end to end: with k = whole chunk, beta = 0, no quantisation and lr = 1 the outer
    step is plain parameter averaging; a wrong sign, scale or 1/M breaks it."""
    _, params, states = make_replicas(3, OuterConfig(**DENSE))
    inner_steps(params, seed=1)
    mean = [torch.stack(ps).mean(0) for ps in zip(*params)]
    outer_step(params, states)
    for replica, state in zip(params, states):
        for p, want, e in zip(replica, mean, state.error):
            torch.testing.assert_close(p, want, rtol=1e-6, atol=1e-6)
            assert torch.equal(e, torch.zeros_like(e))


def test_nonfinite_replica_is_excluded_and_restored_to_the_synced_theta():
    """Guards the NaN guard: the others average among themselves (divide by 2, not 3), and the faulty
    replica leaves the step with the same theta as everyone else instead of its NaN."""
    _, params, states = make_replicas(3, OuterConfig(**DENSE))
    inner_steps(params, seed=2)
    params[1][3][2] = float("nan")
    params[1][0][10, 7] = float("inf")
    mean = [(a + b) / 2 for a, b in zip(params[0], params[2])]
    payloads, reports = outer_step(params, states)
    assert len({p.numel() for p in payloads}) == 1
    assert payloads[1][5] == 0 and payloads[0][5] == 1  # header flag byte
    assert not payloads[1][HEADER.size:].any()  # a zero body
    for r in reports:
        assert r.contributors == (0, 2) and r.excluded == (1,)
    for replica in params:
        for p, want in zip(replica, mean):
            torch.testing.assert_close(p, want, rtol=1e-6, atol=1e-6)
    assert all(torch.equal(a, b) for a, b in zip(params[1], params[0]))


def test_nonfinite_replica_keeps_its_error_buffer_unpoisoned():
    """Guards error feedback across a bad step: a NaN must not enter e, and e must not absorb delta."""
    _, params, states = make_replicas(3, OuterConfig(chunk_size=64, topk=8))
    inner_steps(params, seed=3)
    outer_step(params, states)  # a normal step first, so e is non-zero
    before = [e.clone() for e in states[2].error]
    assert any(e.abs().sum() > 0 for e in before)
    inner_steps(params, seed=4)
    params[2][1][0] = float("nan")
    _, reports = outer_step(params, states)
    assert reports[2].excluded == (2,)
    assert all(torch.equal(a, b) for a, b in zip(states[2].error, before))
    assert all(torch.isfinite(p).all() for p in params[2])


def test_all_replicas_nonfinite_leaves_theta_unchanged():
    """Guards the degenerate case: nobody contributes, so no division by zero and theta stays put."""
    theta0, params, states = make_replicas(2, OuterConfig())
    for replica in params:
        replica[0][0, 0] = float("nan")
    _, reports = outer_step(params, states, keep_average=[0])
    assert reports[0].contributors == () and reports[0].excluded == (0, 1)
    assert all(torch.equal(p, t) for replica in params for p, t in zip(replica, theta0))
    assert torch.equal(reports[0].averages[0], torch.zeros(SHAPES[0]))


def test_selected_count_divides_each_coordinate_by_its_selectors():
    """Guards the named alternative aggregation and that 'mean' stays the paper's 1/M: coordinate 0 is
    selected by two replicas, coordinate 2 by one; mean divides both by 3."""
    deltas = [[3.0, 0.0, 0.0, 0.0], [1.0, 0.5, 0.0, 0.0], [0.0, 0.0, 6.0, 0.0]]  # k = 1 of a 4-chunk
    results = {}
    for aggregation in ("mean", "selected_count"):
        cfg = OuterConfig(chunk_size=4, topk=1, error_decay=0.0, aggregation=aggregation)
        _, params, states = make_replicas(3, cfg, shapes=[(4,)])
        for replica, d in zip(params, deltas):
            replica[0].sub_(torch.tensor(d))
        theta0 = states[0].theta_prev[0].clone()
        outer_step(params, states)
        results[aggregation] = theta0 - params[0][0]
    torch.testing.assert_close(results["mean"], torch.tensor([4 / 3, 0.0, 2.0, 0.0]))
    torch.testing.assert_close(results["selected_count"], torch.tensor([2.0, 0.0, 6.0, 0.0]))


def test_error_buffer_is_beta_e_plus_delta_minus_what_was_sent():
    """Guards e = beta*e + delta - dequant(c) with quantisation: subtracting the pre-quantisation values
    (or nothing) would make the quantisation error vanish from feedback."""
    cfg = OuterConfig(chunk_size=64, topk=8, quant_bits=2, error_decay=0.95)
    _, params, states = make_replicas(1, cfg, shapes=[(65, 130)])
    codec = TensorCodec((65, 130), 64, 8, 2)
    for step in range(2):
        e_before, theta_prev = states[0].error[0].clone(), states[0].theta_prev[0].clone()
        inner_steps(params, seed=10 + step)
        e_new = (theta_prev - params[0][0]) + 0.95 * e_before
        payload = states[0].prepare(params[0])
        assert payload.numel() == payload_nbytes([(65, 130)], cfg) == HEADER.size + codec.nbytes
        sent = torch.zeros(65, 130)
        codec.decode_add_(payload[HEADER.size:], sent)
        assert (sent != 0).sum() == codec.n_selected
        torch.testing.assert_close(states[0].error[0], e_new - sent, rtol=1e-6, atol=1e-6)
        report = states[0].finish(params[0], [payload], keep_average=True)
        torch.testing.assert_close(report.averages[0], sent, rtol=0, atol=0)
        torch.testing.assert_close(params[0][0], theta_prev - sent, rtol=0, atol=0)


def test_two_parameter_model_two_outer_steps_exact():
    """torchft-style exact case (numbers worked by hand, all dyadic so float32 is exact).

    Two replicas, w in R^2 (one chunk, k = 1) and b in R^1, beta = 0.5, outer_lr = 0.5.
    Step 1: delta_A = ([.25, .5], .125), delta_B = ([.5, -.25], -.375)
      A sends w[1] = .5, keeps e_A = [.25, 0]; B sends w[0] = .5, keeps e_B = [0, -.25]
      avg = ([.25, .25], -.125); theta = ([1, 2] - .5 * avg, .5 + .0625) = ([.875, 1.875], .5625)
    Step 2: delta_A = ([.25, .25], .25), delta_B = ([0, .5], .25)
      e_A = .5 * [.25, 0] + [.25, .25] = [.375, .25] -> sends w[0] = .375, keeps [0, .25]
      e_B = .5 * [0, -.25] + [0, .5] = [0, .375]    -> sends w[1] = .375, keeps [0, 0]
      avg = ([.1875, .1875], .25); theta = ([.78125, 1.78125], .4375)
    Applying outer_lr to the error buffer too, or dropping the error feedback, changes step 2.
    """
    cfg = OuterConfig(chunk_size=2, topk=1, error_decay=0.5, outer_lr=0.5)
    theta = [torch.tensor([1.0, 2.0]), torch.tensor([0.5])]
    params = [[t.clone() for t in theta] for _ in range(2)]
    states = [SparseLoCoState(p, cfg) for p in params]
    steps = [
        ([([0.25, 0.5], [0.125]), ([0.5, -0.25], [-0.375])],
         ([0.875, 1.875], [0.5625]), [[0.25, 0.0], [0.0, -0.25]]),
        ([([0.25, 0.25], [0.25]), ([0.0, 0.5], [0.25])],
         ([0.78125, 1.78125], [0.4375]), [[0.0, 0.25], [0.0, 0.0]]),
    ]
    for deltas, (want_w, want_b), want_e in steps:
        for replica, (dw, db) in zip(params, deltas):
            replica[0].sub_(torch.tensor(dw))
            replica[1].sub_(torch.tensor(db))
        outer_step(params, states)
        for replica, state, e_w in zip(params, states, want_e):
            assert torch.equal(replica[0], torch.tensor(want_w)) and torch.equal(replica[1], torch.tensor(want_b))
            assert torch.equal(state.error[0], torch.tensor(e_w)) and torch.equal(state.error[1], torch.zeros(1))


def test_state_dict_round_trip_resumes_bit_for_bit():
    """Guards checkpointing: theta_prev and e must both be saved, or a resumed run sends different bytes."""
    cfg = OuterConfig(chunk_size=64, topk=8, quant_bits=4)
    _, params, states = make_replicas(2, cfg)
    inner_steps(params, seed=5)
    outer_step(params, states)
    buf = io.BytesIO()
    torch.save(states[0].state_dict(), buf)
    buf.seek(0)
    restored = SparseLoCoState([p.clone() for p in params[0]], cfg)
    restored.load_state_dict(torch.load(buf))
    inner_steps(params, seed=6)
    twin = [p.clone() for p in params[0]]
    a, b = states[0].prepare(params[0]), restored.prepare(twin)
    assert torch.equal(a, b)
    assert all(torch.equal(x, y) for x, y in zip(states[0].error, restored.error))
    states[0].finish(params[0], [a, b])
    restored.finish(twin, [a, b])
    assert all(torch.equal(x, y) for x, y in zip(params[0], twin))


def test_mismatched_replicas_are_rejected_with_a_readable_error():
    """Guards against silently averaging payloads built with another config or parameter list."""
    _, params, states = make_replicas(1, OuterConfig())
    other = SparseLoCoState([p.clone() for p in params[0]], OuterConfig(error_decay=0.9))
    mine, theirs = states[0].prepare(params[0]), other.prepare(params[0])
    with pytest.raises(ValueError, match="fingerprint"):
        states[0].finish(params[0], [mine, theirs])
    with pytest.raises(ValueError, match="expected uint8"):
        states[0].finish(params[0], [mine, mine[:-4]])
    with pytest.raises(RuntimeError, match="twice"):
        other.prepare(params[0])
