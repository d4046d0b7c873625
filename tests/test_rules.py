"""The outer step's rules as registries (sparseloco/aggregate.py): a rule registered in this file is a
config choice, runs the outer step, sizes the payload and enters the fingerprint; and the "agreement"
screen, which leaves out a replica whose payload disagrees with the others'."""
from __future__ import annotations

import pytest
import torch

from hetloco_ds import sizes
from hetloco_ds.config import ConfigError, SparseLoCoConfig, parse_config
from hetloco_ds.sparseloco import aggregate
from hetloco_ds.sparseloco.outer import SparseLoCoState
from hetloco_ds.sparseloco.payload import HEADER, payload_nbytes


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


# ------------------------------------------------------------------ the agreement screen
from hetloco_ds.sparseloco.attacks import ATTACKS, corrupt_  # noqa: E402

SCREEN_SHAPES = [(64, 64), (256,), (8, 32)]
SCREENED = dict(chunk_size=64, topk=8, error_decay=0.0, screen="agreement")


def _honest_payloads(cfg, m: int, seed: int = 0):
    """m replicas from one theta, each moved by a shared direction plus its own noise (replicas that
    agree, as SparseLoCo's do); (params, states, payloads)."""
    g = torch.Generator().manual_seed(seed)
    theta = [torch.randn(s, generator=g) for s in SCREEN_SHAPES]
    common = [torch.randn(s, generator=g) for s in SCREEN_SHAPES]
    params = [[t.clone() for t in theta] for _ in range(m)]
    states = [SparseLoCoState(p, cfg) for p in params]
    for replica in params:
        for p, c in zip(replica, common):
            p.sub_(0.1 * (c + 0.7 * torch.randn(p.shape, generator=g)))
    return params, states, [s.prepare(p) for s, p in zip(states, params)]


def _finish_all(params, states, payloads):
    return [s.finish(p, payloads) for s, p in zip(states, params)]


@pytest.mark.parametrize("aggregation", ["selected_count", "mean", "dense"])
@pytest.mark.parametrize("attack", [a for a in ATTACKS if a != "absent"])
def test_agreement_screen_drops_each_attack_and_the_honest_synced_theta_is_theirs_alone(attack, aggregation):
    """Four replicas, the last one's payload corrupted (sign flip, x100, uniform noise of its norm, a
    constant of its norm): the screen drops it on every replica, reports it excluded and screened, and
    every replica (the attacker too) leaves with bitwise the theta an outer step over the three honest
    payloads alone gives. Its scores say why: x100 has norm ratio ~100, the others agreement below a
    quarter of the median (which is far above the noise floor). Breaks if an attack is averaged in, if replicas decide differently, or if the drop
    changed anything but the set of contributors."""
    cfg = paper(**SCREENED, aggregation=aggregation)
    params, states, payloads = _honest_payloads(cfg, 4)
    corrupt_(states[3], payloads[3], attack, torch.Generator().manual_seed(1))
    ref_params, ref_states, _ = _honest_payloads(cfg, 3)
    _finish_all(ref_params, ref_states, payloads[:3])
    reports = _finish_all(params, states, payloads)
    for r in reports:
        assert (r.screened, r.excluded, r.contributors) == ((3,), (3,), (0, 1, 2))
        assert r.scores == reports[0].scores
    for replica in params:
        assert all(torch.equal(a, b) for a, b in zip(replica, ref_params[0]))
    ratio, agreement = reports[0].scores["norm_ratio"], reports[0].scores["agreement"]
    if attack == "scale":
        assert ratio[3] > 90 and max(ratio[:3]) < 1.2
    else:
        assert max(abs(x - 1) for x in ratio) < 0.2  # norm-preserving attacks: only the direction gives them away
        assert agreement[3] < max(3, sorted(agreement)[1] / 4) and min(agreement[:3]) > 8


def test_agreement_screen_keeps_every_honest_replica_and_changes_no_bit_of_the_step():
    """Honest replicas only (4, and 3): nothing is screened, and theta is bitwise the step without a
    screen. Breaks if the screen dropped an honest replica (a false positive) or touched the values."""
    for m in (4, 3):
        screened = _honest_payloads(paper(**SCREENED), m)
        plain = _honest_payloads(paper(**{**SCREENED, "screen": "none"}), m)
        reports = _finish_all(*screened)
        _finish_all(*plain)
        assert reports[0].screened == () and reports[0].contributors == tuple(range(m))
        assert all(torch.equal(a, b) for a, b in zip(screened[0][0], plain[0][0]))


def test_agreement_scores_are_the_sign_normalised_inner_products_and_norms_of_the_decoded_payloads():
    """The scores against a float64 reference computed from the dense pseudo-gradients (aggregation
    "dense", beta = 0: the payload is the pseudo-gradient): norm / lower median norm, and each replica's
    (n - 1 - f)-th largest z_rj = <d_r, d_j> / sqrt(sum_i (d_ri d_ji)^2) over its peers, f = (n - 1) // 2
    (the 2nd of 3 at n = 4, the 2nd of 4 at n = 5). Breaks if the sums over units, the normalisation or
    the order statistic moved."""
    for m in (4, 5):
        params, states, payloads = _honest_payloads(paper(**{**SCREENED, "aggregation": "dense"}), m, seed=3)
        deltas = [torch.cat([(t - p).double().flatten() for t, p in zip(states[0].theta_prev, replica)])
                  for replica in params]
        report = _finish_all(params, states, payloads)[0]
        norms = torch.stack([d.norm() for d in deltas])
        z = [[(a @ b / (a * b).square().sum().sqrt()).item() for b in deltas] for a in deltas]
        q = m - 1 - (m - 1) // 2
        want = [sorted((z[r][j] for j in range(m) if j != r), reverse=True)[q - 1] for r in range(m)]
        assert report.scores["agreement"] == pytest.approx(want, rel=1e-9)
        assert report.scores["norm_ratio"] == pytest.approx((norms / norms.sort().values[(m - 1) // 2]).tolist(), rel=1e-9)


def test_agreement_screen_keeps_a_majority_and_needs_three_replicas():
    """At most (n - 1) // 2 are dropped, so the kept ones are a majority: two x100 replicas of four are
    both far past the norm threshold, one is dropped; two flipped of five, both. Two flipped of four
    agree with each other as the honest two do: a tie, nobody is dropped. Two replicas, one flipped:
    nobody (two payloads cannot say which is wrong). Breaks if a minority could decide the step."""
    cases = [(4, [2, 3], "scale", 1), (5, [3, 4], "flip", 2), (4, [2, 3], "flip", 0), (2, [1], "flip", 0)]
    for m, bad, attack, dropped in cases:
        params, states, payloads = _honest_payloads(paper(**SCREENED), m, seed=5)
        for r in bad:
            corrupt_(states[r], payloads[r], attack, torch.Generator())
        report = _finish_all(params, states, payloads)[0]
        assert len(report.screened) == dropped and set(report.screened) <= set(bad), (m, attack, report.screened)


def test_a_nonfinite_replica_is_excluded_before_the_screen_looks():
    """A non-finite replica (flag cleared, zero body) among four honest ones and a flipped one: the
    screen decides among the five finite payloads, drops the flipped one, reports both excluded and
    only the flipped one screened; the scores name no score for the non-finite one."""
    params, states, payloads = _honest_payloads(paper(**SCREENED), 6, seed=7)
    corrupt_(states[4], payloads[4], "flip", torch.Generator())
    params[5][0][0, 0] = float("nan")
    states[5]._pending = False
    payloads[5] = states[5].prepare(params[5])
    reports = _finish_all(params, states, payloads)
    assert (reports[0].screened, reports[0].excluded) == ((4,), (4, 5))
    assert reports[0].scores["agreement"][5] is None


def test_engine_run_drops_the_replica_whose_payloads_are_scaled_and_its_rows_name_it(tiny_jobs, tmp_path):
    """A real 3-rank `hetloco-ds train` (1 stage x 3 replicas, gloo) under sparseloco.screen "agreement",
    rank 2's payloads scaled x100 by tests/fault_inject (what a peer sending bad bytes does). The first
    outer step's pseudo-gradients are all zero (the warmup's lr is 0 for both inner steps): nobody is
    screened, nothing can be judged. From the second on, every outer row of every replica names replica
    2 screened and excluded, with 0 and 1 contributing, its norm ratio ~100; rank 0 prints a warning
    naming it at each; and the three replicas' validation losses after the last sync are bitwise equal
    (one synced model, the attacker's included). Breaks if the engine's ranks decided differently, a
    zero payload were judged, or the drop were not reported where a user looks."""
    import runs
    from distributed import fork_job, job_stderr
    from test_cli import write_config

    inputs = tiny_jobs.inputs("replicas")
    config = write_config(tmp_path / "screen.json", {**runs.LAYOUTS["replicas"], "hetloco.sparseloco.screen": "agreement",
                                                     "hetloco.train.checkpoint_interval": 0})
    out, log = tmp_path / "out", tmp_path / "job"
    procs = fork_job(log, 3, runs.train_args({**inputs, "config": str(config)}, out), runs.env(inputs["cache"]),
                     fault="2:poison:1:scale")
    for p in procs:
        p.join(300)
    codes = [p.exitcode for p in procs]
    assert codes == [0, 0, 0], f"exit codes {codes}\n{job_stderr(log, 3)[-4000:]}"
    outer = [r for r in runs.rows(out) if r["kind"] == "outer"]
    assert sorted((r["outer_step"], r["replica"]) for r in outer) == [(k, m) for k in range(1, 5) for m in range(3)]
    for r in outer:
        ratio = r["screen_scores"]["norm_ratio"]
        if r["outer_step"] == 1:
            assert (r["screened"], r["contributors"]) == ([], [0, 1, 2]) and set(ratio.values()) == {0.0}, r
            continue
        assert (r["screened"], r["excluded"], r["contributors"]) == ([2], [2], [0, 1]), r
        assert ratio["2"] > 90 and max(ratio["0"], ratio["1"]) < 1.5, r
    warnings = [line for line in (tmp_path / "job.rank0.out").read_text().splitlines() if "sparseloco.screen" in line]
    assert len(warnings) == 3 and all("replicas [2]" in line for line in warnings), warnings
    last = [r["replica_losses"] for r in runs.rows(out) if r["kind"] == "validation" and r["step"] == runs.STEPS]
    assert len(last) == 1 and len(last[0]) == 3 and len(set(last[0])) == 1, last


def _sums(z: list[list[float]], norms: list[float]):
    """measure()'s sums for pairwise agreements `z` (off the diagonal) and payload `norms`: each pair's
    spread is 1, so <d_r, d_j> is z_rj itself."""
    gram = torch.tensor(z, dtype=torch.float64)
    gram.diagonal().copy_(torch.tensor(norms, dtype=torch.float64).square())
    return torch.stack([gram, torch.ones_like(gram)])


@pytest.mark.parametrize("median, attacker_z, dropped", [(10, 2.9, [3]), (10, 3.1, []), (10, -20, [3]),
                                                        (40, 9.9, [3]), (40, 10.1, [])])
def test_agreement_screen_fails_a_payload_below_a_quarter_of_the_median_and_three(median, attacker_z, dropped):
    """Four payloads of equal norm, the honest three agreeing at z = `median` (above min_median_agreement
    8): the fourth is dropped below max(3, median / 4): at 10 below 3, at 40 below 10."""
    a, m = attacker_z, median
    z = [[0, m, m, a], [m, 0, m, a], [m, m, 0, a], [a, a, a, 0]]
    drop, scores = aggregate.AgreementScreen().decide(_sums(z, [1.0] * 4))
    assert drop == dropped and scores["agreement"] == [m, m, m, a]


@pytest.mark.parametrize("attacker_z, dropped", [(0.0, []), (-2.9, []), (-3.1, [3])])
def test_below_the_agreement_floor_only_a_payload_opposing_its_peers_is_dropped(attacker_z, dropped):
    """The honest three agree at z = 5 only (below min_median_agreement 8: their agreement is not beyond
    doubt), so a payload that merely fails to agree (0, -2.9) is kept, as noise could look like that;
    one pointing against its peers beyond max_opposition (-3.1 < -3) is dropped. Breaks if the screen
    judged agreement where it cannot tell it from noise, or let a clear opposition through."""
    a = attacker_z
    z = [[0, 5, 5, a], [5, 0, 5, a], [5, 5, 0, a], [a, a, a, 0]]
    drop, _ = aggregate.AgreementScreen().decide(_sums(z, [1.0] * 4))
    assert drop == dropped


def test_two_against_two_drops_nobody_and_a_long_payload_is_dropped_whatever_the_agreement():
    """Two pairs, each agreeing within and opposing the other: the median agreement is negative, nobody
    is dropped (no majority to side with). A payload 3.5x the median norm is dropped even though its
    direction agrees. Breaks if a tie were broken arbitrarily, or the norm test depended on direction."""
    z = [[0, 9, -9, -9], [9, 0, -9, -9], [-9, -9, 0, 9], [-9, -9, 9, 0]]
    assert aggregate.AgreementScreen().decide(_sums(z, [1.0] * 4))[0] == []
    z = [[0, 10, 10, 10], [10, 0, 10, 10], [10, 10, 0, 10], [10, 10, 10, 0]]
    drop, scores = aggregate.AgreementScreen().decide(_sums(z, [1.0, 1.0, 1.0, 3.5]))
    assert drop == [3] and scores["norm_ratio"] == [1.0, 1.0, 1.0, 3.5]


def test_both_simulators_inject_the_rows_attack_and_screen_it_alike(tmp_path):
    """Row "sparseloco:screen=agreement:attack=scale" (M = 4 x S = 2, H = 2, random tokens) in the
    per-replica and the batched simulator: the last replica's payloads of every block are scaled x100
    after the gather (sim/core.py, the one place): in both, every outer row names it screened, each
    stage's decision does (its norm ratio ~100), and the replicas validate one synced model. Breaks if
    the hook were missing from one simulator, hit another replica, or the rows lost the decisions.
    (The two simulators' losses part in the last bits after the first sync at this size, where a
    rounding difference moves a top-k pick, with or without an attack: not compared here.)"""
    from hetloco_ds.config import parse_config
    from hetloco_ds.data import Corpus
    from hetloco_ds.presets import model_config_for
    from hetloco_ds.sim.rows import parse_variants, simulate_variant

    cfg = parse_config({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
                        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
                        "hetloco": {"sparseloco": {"inner_steps": 2}, "train": {"seq_len": 16, "eval_batches": 2}}})
    g = torch.Generator().manual_seed(0)
    corpus = Corpus(torch.randint(0, 96, (64, 16), generator=g, dtype=torch.int32),
                    torch.randint(0, 96, (8, 16), generator=g, dtype=torch.int32), "random", tmp_path)
    variant = parse_variants(["sparseloco:screen=agreement:attack=scale"], 4, [0])[0]
    assert (variant.attack, variant.attacker, variant.sparseloco) == ("scale", -1, {"screen": "agreement"})
    results = {batched: simulate_variant(cfg, variant, model_config_for("tiny", 96), corpus, 4, 2, 6,
                                         torch.device("cpu"), progress=False, batched=batched)
               for batched in (False, True)}
    for r in results.values():
        assert [o["screened"] for o in r["outer"]] == [[3]] * 3
        assert all(d["screened"] == [3] and d["norm_ratio"]["3"] > 50 for o in r["outer"] for d in o["screen"].values())
        assert sorted(r["outer"][0]["screen"]) == ["stage0", "stage1"]
        assert len(set(r["val_losses"])) == 1


@pytest.mark.parametrize("quant_bits", [None, 2])
def test_a_payload_flagged_finite_with_a_nan_value_is_excluded_without_any_screen(quant_bits):
    """A sender that sets the finite flag over a NaN value (or a NaN in its lookup table) is left out as
    a non-finite replica is, with the screen off: the others' step is bitwise theirs alone and every
    replica stays finite. Breaks if the header's word were trusted: one NaN summed in reaches every
    replica's parameters."""
    cfg = paper(chunk_size=64, topk=8, error_decay=0.0, quant_bits=quant_bits)
    params, states, payloads = _honest_payloads(cfg, 4, seed=9)
    states[3].value_sections(payloads[3])[1][0, 0] = float("nan")
    ref_params, ref_states, _ = _honest_payloads(cfg, 3, seed=9)
    _finish_all(ref_params, ref_states, payloads[:3])
    reports = _finish_all(params, states, payloads)
    assert (reports[0].excluded, reports[0].contributors, reports[0].screened) == ((3,), (0, 1, 2), ())
    for replica in params:
        assert all(torch.equal(a, b) for a, b in zip(replica, ref_params[0]))


def test_an_absent_replica_is_excluded_as_non_finite_and_the_others_step_alone():
    """attacks' "absent" (the simulator's reference of the honest replicas alone): the payload is marked
    non-finite with a zero body, so it is excluded, not screened, and the others' step is bitwise theirs
    alone. Breaks if the reference row let the absent replica's bytes in."""
    cfg = paper(**SCREENED)
    params, states, payloads = _honest_payloads(cfg, 4)
    corrupt_(states[3], payloads[3], "absent", torch.Generator())
    assert not payloads[3][HEADER.size:].any()
    ref_params, ref_states, _ = _honest_payloads(cfg, 3)
    _finish_all(ref_params, ref_states, payloads[:3])
    reports = _finish_all(params, states, payloads)
    assert (reports[0].excluded, reports[0].screened, reports[0].contributors) == ((3,), (), (0, 1, 2))
    for replica in params:
        assert all(torch.equal(a, b) for a, b in zip(replica, ref_params[0]))
