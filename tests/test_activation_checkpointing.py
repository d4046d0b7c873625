"""pipeline.activation_checkpoint_interval: runs of decoder layers keep only their input and are
recomputed in the backward, with the same bits, and `plan` counts what that saves."""
from __future__ import annotations

import pytest

from distributed import build_from_hf, run_ranks
from hetloco_ds import sizes
from hetloco_ds.config import ConfigError, parse_config
from test_schedule import SEQ, _batches, _config, _digest


def _train_body(rank, cases, steps):
    """Per (name, hf_dir, interval, schedule, tied_embeddings, bf16): every step's (loss, parameter
    hash, outer step?) and how often the stage's decoder layers ran forward; plus the runs the module
    recomputes against `sizes.recomputed_runs`."""
    from hetloco_ds.model import DecoderLayer

    out = {}
    for name, hf_dir, interval, schedule, tied_embeddings, bf16 in cases:
        cfg = _config(schedule, tied_embeddings)
        cfg["pipeline"]["activation_checkpoint_interval"] = interval
        if bf16:
            cfg["bf16"] = {"enabled": True}
        engine, module, llama = build_from_hf(hf_dir, cfg, SEQ)
        calls = [0]
        for m in module.modules():
            if isinstance(m, DecoderLayer):
                m.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
        rows = []
        for step in range(1, steps + 1):
            rec = engine.train_step(iter(_batches(engine.replica, step)))
            rows.append((rec.loss, _digest(module), rec.outer is not None))
        start, stop = module.parts[module.stage_id], module.parts[module.stage_id + 1]
        expected = sizes.recomputed_runs(llama.num_hidden_layers, start, stop, interval)
        got = [b - a for a, b, on in _runs(start, stop, interval, module.is_checkpointable_results) if on]
        out[name, interval, schedule, bf16] = {"rows": rows, "calls": calls[0], "runs": (got, expected),
                                              "decoders": sum(isinstance(m, DecoderLayer) for m in module.modules())}
    return out


def _runs(start, stop, interval, flags):
    if interval <= 0:
        return []
    bounds = [(a, min(a + interval, stop)) for a in range(start, stop, interval)]
    assert len(bounds) == len(flags), (bounds, flags)
    return [(a, b, on) for (a, b), on in zip(bounds, flags)]


def test_recomputed_decoder_layers_train_bitwise_as_kept_ones(hf_untied, hf_tied):
    """2 replicas x 2 stages, replica 1 compressed (ratio 4), 3 micro-batches a step, through an
    outer step: with runs of 1 and of 2 decoder layers recomputed, every step's loss and every
    stage's parameters (hash of the bits) are those of the run that keeps its activations, under
    both schedules, untied and tied (both ways), in fp32 and under bf16 autocast; the decoder layers
    ran forward again in the backward (more calls than without), and the runs the module recomputes
    are the ones `sizes.recomputed_runs` gives `plan`. Breaks if a recomputed run's forward differs
    (autocast, the codec's ids), if a gradient is lost (DeepSpeed's reentrant checkpoint drops the
    embedding's when a run holds it), or if the plan's rule drifts from the module's."""
    cases = []
    for interval in (0, 1, 2):
        cases += [("untied", hf_untied, interval, "blocking", None, False),
                  ("untied", hf_untied, interval, "overlapped", None, False),
                  ("tied apart", hf_tied, interval, "overlapped", "outer_step", False),
                  ("tied exactly", hf_tied, interval, "blocking", "every_step", False)]
    cases += [("untied", hf_untied, interval, "blocking", None, True) for interval in (0, 1)]
    steps = 3
    for r in run_ranks(_train_body, 4, cases, steps):
        for name, _, interval, schedule, _, bf16 in cases:
            got, off = r[name, interval, schedule, bf16], r[name, 0, schedule, bf16]
            assert any(row[2] for row in got["rows"]), name  # an outer step happened
            assert got["rows"] == off["rows"], (name, interval, schedule, bf16)
            assert got["runs"][0] == got["runs"][1], (name, interval, got["runs"])
            if interval:
                assert got["runs"][0], (name, interval)  # every stage recomputes something here
                assert got["calls"] == off["calls"] + steps * 3 * sum(got["runs"][0]), (name, interval, got, off)
            else:
                assert got["calls"] == steps * 3 * got["decoders"]


def test_recomputed_runs_are_deepspeeds_runs_of_decoder_layers_only():
    """`sizes.recomputed_runs` over a 4-layer model's pipeline layers (0 embedding, 1-4 decoders, 5
    norm, 6 head): a run is recomputed only when every layer in it is a decoder layer."""
    assert sizes.recomputed_runs(4, 0, 7, 0) == []
    assert sizes.recomputed_runs(4, 0, 7, 1) == [1, 1, 1, 1]
    assert sizes.recomputed_runs(4, 0, 7, 2) == [2]  # [0,1] holds the embedding, [2,3] yes, [4,5] the norm, [6]
    assert sizes.recomputed_runs(4, 0, 3, 2) == [1]  # S = 2, stage 0 (layers 0-2): [0,1] no, [2] yes
    assert sizes.recomputed_runs(4, 3, 7, 2) == [2]  # stage 1 (layers 3-6): [3,4] yes, [5,6] no
    assert sizes.recomputed_runs(4, 0, 7, 3) == []  # [0-2] the embedding, [3-5] the norm, [6] the head
    assert sizes.recomputed_runs(8, 1, 9, 4) == [4, 4]


def test_checkpointing_lowers_plans_activation_peak_by_the_kept_inputs():
    """`sizes.stage_activation_bytes` with every decoder layer recomputed on its own: per micro-batch
    in flight only the residual stream at each layer's input (act_bytes x d a token) instead of the
    layer's activations, plus one layer recomputed during the backward."""
    d, ffn, kv, tokens, layers, in_flight = 4096, 14336, 1024, 8192, 32, 1
    per_layer = sizes.layer_activation_bytes(d, ffn, kv)
    off = sizes.stage_activation_bytes(tokens, layers, in_flight, d, ffn, kv)
    on = sizes.stage_activation_bytes(tokens, layers, in_flight, d, ffn, kv, recomputed=[1] * layers)
    assert off == layers * tokens * per_layer + tokens * per_layer
    assert on == tokens * (layers * 2 * d + per_layer) + tokens * per_layer
    assert off / on > 9  # an 8B replica at seq 8192: 54 GB of activations kept, 5.4 GB checkpointed


@pytest.mark.parametrize("value", [-1, 1.5, "2", True])
def test_a_bad_interval_is_refused_in_one_line_naming_it(value):
    with pytest.raises(ConfigError, match=r"pipeline\.activation_checkpoint_interval .*" + repr(value).replace(".", r"\.")):
        parse_config({"pipeline": {"activation_checkpoint_interval": value}})


def test_reentrant_checkpointing_is_refused_and_deepspeeds_engine_is_left_out():
    """use_reentrant true is refused (the layers are recomputed with torch's non-reentrant checkpoint);
    DeepSpeed's engine gets interval 0 and no use_reentrant, so it neither sets the interval again
    nor swaps in its own checkpoint function."""
    with pytest.raises(ConfigError, match="use_reentrant = True"):
        parse_config({"pipeline": {"activation_checkpoint_interval": 1, "use_reentrant": True}})
    run = parse_config({"pipeline": {"activation_checkpoint_interval": 2, "use_reentrant": False}})
    assert run.activation_checkpoint_interval == 2
    engine_pipeline = run.engine_ds_config()["pipeline"]
    assert engine_pipeline["activation_checkpoint_interval"] == 0 and "use_reentrant" not in engine_pipeline
