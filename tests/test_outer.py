"""SparseLoCo's outer step on fake replicas in one process: the all-gather is the list itself."""
from __future__ import annotations

import io
import math

import pytest
import torch

from hetloco_ds.config import SparseLoCoConfig
from hetloco_ds.sparseloco.compress import TensorCodec
from hetloco_ds.sparseloco.outer import SparseLoCoState
from hetloco_ds.sparseloco.payload import HEADER, payload_nbytes
from hetloco_ds.sparseloco.presets import PRESETS

SHAPES = [(65, 130), (10000,), (65, 130), (7,), (3, 5), (128, 96)]  # a repeated shape exercises grouping
DENSE = dict(topk=4096, error_decay=0.0, quant_bits=None, outer_lr=1.0)  # k = whole chunk: no compression


def paper(**fields) -> SparseLoCoConfig:
    """Eq. (2) as the paper writes it (the "paper" preset: divide by M, no clip), `fields` over it."""
    return SparseLoCoConfig(preset="paper", **fields)


def make_replicas(m: int, cfg: SparseLoCoConfig, shapes=SHAPES, seed: int = 0):
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
    paper(),
    paper(chunk_size=64, topk=8, quant_bits=2),
    paper(chunk_size=64, topk=8, value_dtype="bfloat16", outer_lr=0.7),
    paper(chunk_size=64, topk=8, aggregation="selected_count"),
    paper(**PRESETS["templar"]),
    paper(**{**PRESETS["templar"], "chunk_size": 64, "topk": 8, "quant_bits": 2}),
    paper(**PRESETS["diloco"]),
    paper(aggregation="dense", norm_clip="median", value_dtype="bfloat16"),
], ids=["paper", "quant2", "bf16", "selected_count", "templar", "templar_quant2", "diloco", "dense_clip_bf16"])
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
    _, params, states = make_replicas(3, paper(**DENSE))
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
    _, params, states = make_replicas(3, paper(**DENSE))
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
    _, params, states = make_replicas(3, paper(chunk_size=64, topk=8))
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
    theta0, params, states = make_replicas(2, paper())
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
        cfg = paper(chunk_size=4, topk=1, error_decay=0.0, aggregation=aggregation)
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
    cfg = paper(chunk_size=64, topk=8, quant_bits=2, error_decay=0.95)
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
    cfg = paper(chunk_size=2, topk=1, error_decay=0.5, outer_lr=0.5)
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
    cfg = paper(chunk_size=64, topk=8, quant_bits=4)
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
    _, params, states = make_replicas(1, paper())
    other = SparseLoCoState([p.clone() for p in params[0]], paper(error_decay=0.9))
    mine, theirs = states[0].prepare(params[0]), other.prepare(params[0])
    with pytest.raises(ValueError, match="fingerprint"):
        states[0].finish(params[0], [mine, theirs])
    with pytest.raises(ValueError, match="expected uint8"):
        states[0].finish(params[0], [mine, mine[:-4]])
    with pytest.raises(RuntimeError, match="twice"):
        other.prepare(params[0])


# ------------------------------------------------------------------ templar's rules, the dense control
def sent_by(states, deltas):
    """float64 tensors each replica sent, recovered as delta - e (valid for error_decay = 0)."""
    return [[(d - e).double() for d, e in zip(ds, st.error)] for ds, st in zip(deltas, states)]


@pytest.mark.parametrize("aggregation, want", [
    ("selected_count", [3.0, 3.5, 3.5, 4.0]),
    ("mean", [1.5, 1.75, 1.75, 2.0]),
])
def test_median_clip_scales_each_replica_to_the_lower_median_norm_before_dividing(aggregation, want):
    """Guards templar's clip, worked by hand. One chunk of 4, k = 2, beta = 0, four replicas send
    A = [3, 4, 0, 0] (norm 5), B = [0, 0, 6, 8] (10), C = [0, 3, 4, 0] (5), D = 1000 * [.6, 0, 0, .8].
    Lower median of (5, 5, 10, 1000) = 5: B is halved to [0, 0, 3, 4], D becomes [3, 0, 0, 4].
    selected_count: coordinate 0 = (3 + 3) / 2, 1 = (4 + 3) / 2, 2 = (3 + 4) / 2, 3 = (4 + 4) / 2;
    mean: the column sums (6, 7, 7, 8) / 4. Without the clip coordinate 3 would be 404; with the
    upper median (10) or the mean of the middle two (7.5) B would not be halved; clipping the
    aggregate instead of each sender gives other numbers."""
    deltas = [[3.0, 4.0, 0.0, 0.0], [0.0, 0.0, 6.0, 8.0], [0.0, 3.0, 4.0, 0.0], [600.0, 0.0, 0.0, 800.0]]
    cfg = paper(chunk_size=4, topk=2, error_decay=0.0, aggregation=aggregation, norm_clip="median")
    _, params, states = make_replicas(4, cfg, shapes=[(4,)])
    for replica, d in zip(params, deltas):
        replica[0].sub_(torch.tensor(d))
    theta0 = states[0].theta_prev[0].clone()
    _, reports = outer_step(params, states, keep_average=True)
    torch.testing.assert_close(theta0 - params[0][0], torch.tensor(want), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(reports[0].averages[0], torch.tensor(want), rtol=1e-6, atol=1e-6)
    for state in states:  # every sender still drops all it sent from its error buffer
        assert torch.equal(state.error[0], torch.zeros(4))


@pytest.mark.parametrize("aggregation", ["selected_count", "mean"])
def test_median_clip_bounds_the_step_when_one_replica_is_scaled_by_1000(aggregation):
    """Guards the clip end to end against a float64 reference: replica 2's pseudo-gradient is 1000x the
    others'. Each sender's decoded tensor is clipped to the median norm, so the synced model moves
    no further than lr * sqrt(sum_r min(|s_r|, med)^2) (and lr * med under 1/M); without the clip the
    outlier drags every tensor ~100x further (checked below, so the bound is not vacuous)."""
    m, lr = 4, 1.0
    moved = {}
    for clip in ("median", "none"):
        cfg = paper(**{**PRESETS["templar"], "chunk_size": 64, "topk": 8, "error_decay": 0.0,
                             "aggregation": aggregation, "norm_clip": clip, "outer_lr": lr})
        _, params, states = make_replicas(m, cfg)
        inner_steps(params, seed=3)
        theta0 = [t.clone() for t in states[0].theta_prev]
        for p, t in zip(params[2], theta0):
            p.copy_(t - 1000 * (t - p))
        deltas = [[t - p for t, p in zip(theta0, replica)] for replica in params]
        payloads = [s.prepare(p) for s, p in zip(states, params)]
        sent = sent_by(states, deltas)
        for s, p in zip(states, params):
            s.finish(p, payloads)
        moved[clip] = [torch.linalg.vector_norm((t - p).double()) for t, p in zip(theta0, params[0])]
        if clip == "none":
            continue
        for i, (t, p) in enumerate(zip(theta0, params[0])):
            s_i = [sent[r][i] for r in range(m)]
            norms = torch.stack([torch.linalg.vector_norm(x) for x in s_i])
            med = norms.sort().values[(m - 1) // 2]
            clipped = [x * min(1.0, float(med / (n + 1e-8))) for x, n in zip(s_i, norms)]
            total = torch.stack(clipped).sum(0)
            if aggregation == "selected_count":
                agg = total / torch.stack([x != 0 for x in s_i]).sum(0).clamp(min=1)
                bound = lr * torch.sqrt(sum(torch.minimum(n, med) ** 2 for n in norms))
            else:
                agg = total / m
                bound = lr * med
            torch.testing.assert_close(p.double(), t.double() - lr * agg, rtol=1e-5, atol=1e-6)
            assert moved["median"][i] <= bound * (1 + 1e-5), (i, moved["median"][i], bound)
    assert all(b > 50 * a for a, b in zip(moved["median"], moved["none"])), (moved["median"], moved["none"])


@pytest.mark.parametrize("value_dtype", [torch.float32, torch.bfloat16])
def test_dense_outer_step_averages_whole_pseudo_gradients_without_error_feedback(value_dtype):
    """Guards the DiLoCo control: at lr 1 the synced model is the replicas' average (the value_dtype-
    rounded deltas), the error buffers stay zero whatever beta is, and the payload carries every
    parameter (numel x value_dtype, padded to 4 bytes) behind the header."""
    cfg = paper(aggregation="dense", error_decay=0.95, value_dtype=str(value_dtype).removeprefix("torch."))
    theta0, params, states = make_replicas(3, cfg)
    size = 4 if value_dtype == torch.float32 else 2
    assert payload_nbytes(SHAPES, cfg) == HEADER.size + sum(-(-math.prod(s) * size // 4) * 4 for s in SHAPES)
    for step in range(2):
        theta = [t.clone() for t in states[0].theta_prev]
        inner_steps(params, seed=20 + step)
        deltas = [[(t - p).to(value_dtype).double() for t, p in zip(theta, replica)] for replica in params]
        want = [t.double() - sum(ds) / 3 for t, ds in zip(theta, zip(*deltas))]
        payloads, _ = outer_step(params, states)
        assert {p.numel() for p in payloads} == {payload_nbytes(SHAPES, cfg)}
        for replica, state in zip(params, states):
            for p, w, e in zip(replica, want, state.error):
                torch.testing.assert_close(p.double(), w, rtol=1e-6, atol=1e-6)
                assert torch.equal(e, torch.zeros_like(e))


def test_outer_momentum_is_torch_nesterov_sgd_on_the_average():
    """Guards outer_momentum against torch.optim.SGD(nesterov=True) applied to the averaged pseudo-
    gradient (DiLoCo's outer optimizer), over three syncs; and that the report's average is the
    applied step, so the embedding resync (theta_prev - outer_lr * avg) stays right."""
    cfg = paper(**PRESETS["diloco"])
    theta0, params, states = make_replicas(2, cfg)
    ref = [torch.nn.Parameter(t.double().clone()) for t in theta0]
    opt = torch.optim.SGD(ref, lr=cfg.outer_lr, momentum=cfg.outer_momentum, nesterov=True)
    for step in range(3):
        theta = [t.clone() for t in states[0].theta_prev]
        inner_steps(params, seed=30 + step)
        for r, t, ps in zip(ref, theta, zip(*params)):  # grad = the replicas' mean pseudo-gradient
            r.grad = torch.stack([(t - p).double() for p in ps]).mean(0)
        opt.step()
        _, reports = outer_step(params, states, keep_average=True)
        for i, (p, r) in enumerate(zip(params[0], ref)):
            torch.testing.assert_close(p.double(), r.detach(), rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(theta[i] - cfg.outer_lr * reports[0].averages[i], p, rtol=1e-5, atol=1e-5)
    state = states[0].state_dict()
    assert len(state["momentum"]) == len(SHAPES)
    fresh = SparseLoCoState([p.clone() for p in params[0]], cfg)
    with pytest.raises(ValueError, match="momentum"):
        fresh.load_state_dict({k: v for k, v in state.items() if k != "momentum"})
    fresh.load_state_dict(state)
    assert all(torch.equal(a, b) for a, b in zip(fresh.momentum, states[0].momentum))


@pytest.mark.parametrize("field, value", [
    ("chunking", "per_dim"), ("topk_rule", "fixed"), ("quant_rounding", "nearest"), ("quant_std", "sample"),
    ("norm_clip", "median"),
    ("aggregation", "selected_count"), ("outer_momentum", 0.5),
])
def test_replicas_with_different_rule_options_refuse_each_others_payloads(field, value):
    """Guards the header fingerprint over every rule option: on one 64 x 64 tile these options leave
    the payload length unchanged, so only the fingerprint stops a replica from averaging payloads
    built under another rule (e.g. one clipping, one not). A dense replica differs in length."""
    shapes = [(64, 64)]  # one full tile: k = 32 under either top-k rule, the same tiles under either chunking
    base = paper(quant_bits=2)
    other = paper(**{"quant_bits": 2, field: value})
    _, params, states = make_replicas(1, base, shapes=shapes)
    theirs = SparseLoCoState([p.clone() for p in params[0]], other)
    mine, their_payload = states[0].prepare(params[0]), theirs.prepare(params[0])
    assert mine.numel() == their_payload.numel()
    with pytest.raises(ValueError, match="fingerprint"):
        states[0].finish(params[0], [mine, their_payload])
    dense = SparseLoCoState([p.clone() for p in params[0]], paper(aggregation="dense"))
    with pytest.raises(ValueError, match="disagree"):
        states[0].finish(params[0], [mine, dense.prepare(params[0])])


def test_presets_set_every_rule_and_explicit_fields_win():
    """Guards the config edge: 'templar' selects all of templar's rules at once, a field written next
    to it overrides it, the defaults are one set (the config's, no second copy to drift), and a dense
    run asking for quantisation fails with one line naming quant_bits."""
    from hetloco_ds.config import ConfigError, parse_config
    from hetloco_ds.sparseloco.payload import LOCAL_FIELDS

    def outer(section):
        cfg = parse_config({"hetloco": {"sparseloco": section}}).hetloco.sparseloco
        return {k: v for k, v in cfg.model_dump().items() if k not in LOCAL_FIELDS}

    def want(**fields):
        return outer({"preset": "paper", **fields})

    assert outer({"preset": "templar"}) == want(**PRESETS["templar"])
    assert outer({"preset": "templar"}) == want(chunking="per_dim", topk_rule="fixed", quant_rounding="nearest",
                                                quant_std="sample", aggregation="selected_count", norm_clip="median")
    assert outer({"preset": "templar", "aggregation": "mean"})["aggregation"] == "mean"
    assert outer({"preset": "diloco"}) == want(aggregation="dense", outer_lr=0.7, outer_momentum=0.9)
    # The run's default is the measured one (README, "Aggregation"); "paper" is eq. (2) as written.
    assert outer({}) == want(aggregation="selected_count", norm_clip="median")
    assert outer({}) == {k: v for k, v in SparseLoCoConfig().model_dump().items() if k not in LOCAL_FIELDS}
    assert want() == {k: v for k, v in paper().model_dump().items() if k not in LOCAL_FIELDS}
    with pytest.raises(ConfigError, match="quant_bits"):
        outer({"aggregation": "dense", "quant_bits": 2})


@pytest.mark.parametrize("preset", [None, "templar", "diloco"])
@pytest.mark.parametrize("quant_bits", [None, 2])
@pytest.mark.parametrize("value_dtype", [torch.float32, torch.bfloat16])
def test_size_rule_payload_equals_the_codecs_under_every_rule(preset, quant_bits, value_dtype):
    """Guards the one size rule: the cost model's `sizes.stage_payload_nbytes`, given the rule options,
    must equal what the outer step actually sends, or plan and simulator report other bytes."""
    from hetloco_ds import sizes

    if preset == "diloco" and quant_bits is not None:
        pytest.skip("the dense control sends unquantised values")
    cfg = paper(**{**PRESETS.get(preset, {}), "quant_bits": quant_bits, "chunk_size": 64, "topk": 8,
                         "value_dtype": str(value_dtype).removeprefix("torch.")})
    _, params, states = make_replicas(1, cfg)
    value_bytes = 4 if value_dtype == torch.float32 else 2
    want = sizes.stage_payload_nbytes(SHAPES, cfg.chunk_size, cfg.topk, cfg.quant_bits, value_bytes,
                                      cfg.chunking, cfg.topk_rule, dense=cfg.aggregation == "dense")
    assert states[0].prepare(params[0]).numel() == payload_nbytes(SHAPES, cfg) == want


@pytest.mark.parametrize("cfg", [
    paper(chunk_size=64, topk=8, quant_bits=2),
    paper(**PRESETS["templar"]),
    paper(**PRESETS["diloco"]),
], ids=["quant2", "templar", "diloco_momentum"])
def test_host_resident_state_and_sliced_groups_train_the_same_bits(cfg):
    """outer_state_device "cpu" (the state in host memory, copied in and out unit by unit) and groups
    cut into one-member units, against the state on the device in whole groups: 3 replicas, 3 outer
    steps, the second with a non-finite replica; every payload, parameter, theta_prev, error and
    momentum bitwise equal, and a state_dict from one placement resumes in the other. Breaks if the
    host path skips a write-back (the new error, theta_prev, momentum), reads a stale copy, or if
    slicing a group changes what is selected, clipped or summed."""
    variants = {"device": {}, "host": dict(on_host=True), "host_sliced": dict(on_host=True, unit_numel=1),
                "device_sliced": dict(unit_numel=1)}
    g = torch.Generator().manual_seed(7)
    theta0 = [torch.randn(s, generator=g) for s in SHAPES]
    runs = {}
    for name, kw in variants.items():
        params = [[t.clone() for t in theta0] for _ in range(3)]
        runs[name] = (params, [SparseLoCoState(p, cfg, **kw) for p in params], [])
    assert all(s.on_host for s in runs["host"][1]) and len(runs["host_sliced"][1][0]._units) == len(SHAPES)
    for step in range(3):
        for params, states, payloads in runs.values():
            inner_steps(params, seed=40 + step)
            if step == 1:
                params[2][1][5] = float("nan")
            payloads.append(outer_step(params, states)[0])
    ref_params, ref_states, ref_payloads = runs["device"]
    for name, (params, states, payloads) in runs.items():
        assert all(torch.equal(a, b) for a, b in zip(sum(payloads, []), sum(ref_payloads, []))), name
        for p, s, rp, rs in zip(params, states, ref_params, ref_states):
            assert all(torch.equal(a, b) for a, b in zip(p, rp)), name
            for field in ("theta_prev", "error") + (("momentum",) if cfg.outer_momentum else ()):
                assert all(torch.equal(a, b) for a, b in zip(getattr(s, field), getattr(rs, field))), (name, field)
    # A checkpoint of the device placement resumes on the host and sends the same bytes.
    inner_steps(ref_params, seed=50)
    resumed = SparseLoCoState([p.clone() for p in ref_params[0]], cfg, on_host=True, unit_numel=1)
    resumed.load_state_dict(ref_states[0].state_dict())
    assert torch.equal(resumed.prepare([p.clone() for p in ref_params[0]]), ref_states[0].prepare(ref_params[0]))


@pytest.mark.parametrize("placement", [dict(), dict(on_host=True), dict(on_host=True, unit_numel=1)],
                         ids=["device", "host", "host_sliced"])
def test_matches_is_true_exactly_when_the_parameters_are_theta_at_the_last_sync(placement):
    """`matches` (what a checkpoint asks to know whether theta_prev needs storing, and save_pretrained
    whether the replicas are synced) wherever the state lives: true from the start and after an
    outer step, false once one element of one parameter moved by one ulp, whatever its unit. Breaks if
    the comparison skips a unit or a member, or compares a host copy that is not the state's."""
    theta0, params, states = make_replicas(2, paper(), seed=3)
    states = [SparseLoCoState(p, paper(), **placement) for p in params]
    assert all(s.matches(p) for s, p in zip(states, params))
    for i in range(len(SHAPES)):
        flat = params[0][i].view(-1)
        flat[-1] = torch.nextafter(flat[-1], torch.tensor(float("inf")))
        assert not states[0].matches(params[0]), i
        flat[-1] = theta0[i].view(-1)[-1]
        assert states[0].matches(params[0]), i
    inner_steps(params, seed=5)
    assert not any(s.matches(p) for s, p in zip(states, params))
    outer_step(params, states)
    assert all(s.matches(p) for s, p in zip(states, params))
