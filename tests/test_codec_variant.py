"""A research variant written in this file alone: a stage-boundary codec and an outer-step
aggregation registered here, selected by the config, run through the engine (2 stages x 2 replicas,
gloo) and both simulators.

This is the walk-through of docs/extending.md: nothing under hetloco_ds/ names the two rules below.
"""
from __future__ import annotations

import pytest
import torch

from distributed import run_ranks
from hetloco_ds.boundary import BoundaryCodec, register_codec
from hetloco_ds.model import residual_dtype
from hetloco_ds.sparseloco import aggregate

SEQ, VOCAB, H, STEPS, MICRO = 16, 96, 2, 4, 2


@register_codec("toy_sign_topk")
class SignTopK(BoundaryCodec):
    """Lossy and stateless: each coordinate's sign flipped by a fixed random sign (from the subspace
    seed), then per token the d / ratio coordinates of largest magnitude travel as (values, indices);
    the receiver scatters them into zeros and flips the signs back. No T_perp, no token ids.

    Autograd gives the backward message: the gradient of the values, which is grad(X^) at the kept
    coordinates, sign-flipped."""

    def __init__(self, hidden_size, vocab_size, wire_dtype, keep: int, signs: torch.Tensor):
        super().__init__(hidden_size, vocab_size, wire_dtype)
        self.keep, self.signs = keep, signs

    @classmethod
    def from_config(cls, sub, *, replica, num_replicas, hidden_size, vocab_size, wire_dtype, device):
        g = torch.Generator().manual_seed(sub.seed)
        signs = (torch.randint(0, 2, (hidden_size,), generator=g) * 2 - 1).float().to(device)
        return cls(hidden_size, vocab_size, wire_dtype, hidden_size // sub.ratio_for(replica, num_replicas), signs)

    @property
    def width(self) -> int:
        return self.keep

    def message_spec(self, micro_batch, seq_len):
        # values, then int16 indices viewed as bytes (NCCL has no int16)
        return [((micro_batch, seq_len, self.keep), self.wire_dtype), ((micro_batch, seq_len, 2 * self.keep), torch.uint8)]

    def tensors(self):
        # `keep` travels as a shape: the pure functions see tensors only (vmap stacks them)
        return {"signs": self.signs, "keep": torch.zeros(self.keep)}

    @staticmethod
    def encode_hidden(tensors, hidden, ids, perp, wire_dtype):
        flipped = hidden.float() * tensors["signs"]
        idx = flipped.abs().topk(tensors["keep"].shape[-1], dim=-1).indices
        return flipped.gather(-1, idx).to(wire_dtype), idx.to(torch.int16).view(torch.uint8)

    @staticmethod
    def decode_hidden(tensors, message, ids, perp):
        values, idx = message
        idx = idx.view(torch.int16).long()
        flipped = values.new_zeros(*values.shape[:-1], tensors["signs"].shape[-1]).scatter(-1, idx, values)
        hidden = flipped.float() * tensors["signs"]
        return hidden.to(residual_dtype(hidden))


CALLS: list[int] = []
"""Contributors each time this process ran the toy aggregation (every driver must run it)."""


@aggregate.aggregation("toy_half_mean")
def half_mean(pos, values, numel):
    """The contributors' mean, halved: an outer step that moves theta half as far as eq. 2."""
    CALLS.append(values.shape[0])
    return aggregate.scatter_sum(pos, values, numel), 0.5 / values.shape[0]


def _config():
    return {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": 1,
        "pipeline": {"stages": 2},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "betas": [0.9, 0.95], "weight_decay": 0.1}},
        "hetloco": {"sparseloco": {"inner_steps": H, "aggregation": "toy_half_mean"},
                    "subspace": {"codec": "toy_sign_topk", "ratio": 2, "compressed_replicas": [1]},
                    "train": {"seq_len": SEQ, "seed": 7}},
    }


def _batch(replica: int, step: int):
    g = torch.Generator().manual_seed(1000 * replica + step)
    ids = torch.randint(0, VOCAB, (MICRO, SEQ), generator=g)
    return ids, ids


def _engine_body(rank, cfg):
    from conftest import tiny_llama_config
    from hetloco_ds.build import build_engine, build_module
    from hetloco_ds.config import parse_config

    run = parse_config(cfg)
    module = build_module(run, tiny_llama_config())
    engine = build_engine(run, module, seq_len=SEQ)
    losses = [engine.train_step(iter([_batch(engine.replica, step)])) for step in range(1, STEPS + 1)]
    last = losses[-1].bytes
    return {"replica": engine.replica, "codec": module.codec.name, "losses": [r.loss for r in losses],
            "aggregated": CALLS[:],
            "outer": [r.outer is not None for r in losses], "nbytes": module.codec.nbytes(MICRO, SEQ),
            "activation": last["activation"]["sent"], "activation_grad": last["activation_grad"]["sent"]}


def _simulate(cls):
    from conftest import tiny_llama_config
    from hetloco_ds.config import parse_config

    run = parse_config(_config())
    sim = cls(run, run.hetloco, tiny_llama_config(), 2, 2, torch.device("cpu"))
    assert [r.algorithms[0].codec.name for r in sim.replicas] == ["identity", "toy_sign_topk"]
    losses = []
    for step in range(1, STEPS + 1):
        losses.append(sim.train_step([[_batch(m, step)] for m in range(2)]).reshape(-1).tolist())
        if step % H == 0:
            CALLS.clear()
            sim.outer_step()
            assert CALLS and set(CALLS) == {2}, CALLS  # the toy aggregation, over both replicas' payloads
    return [[row[m] for row in losses] for m in range(2)]


def test_a_codec_and_an_aggregation_registered_in_a_test_file_run_alike_in_the_engine_and_both_simulators():
    """The toy codec above on replica 1 of 2 and the toy aggregation on every stage (2 stages, H = 2,
    two outer steps): the engine's replica-1 ranks encode with the codec and meter exactly its message
    (values and int16 indices forward, the values' gradient backward, per micro-batch), every rank and
    both simulators aggregate with the toy rule over both replicas' payloads, and every replica's loss
    at every step is the same in the engine, the per-replica simulator and the batched one (float
    rounding). Breaks if a driver builds its codec or its outer rule other than from the config
    through StageAlgorithm (the toy would not be there, not on the wire, or not called), if the
    batched simulator's vmap of a codec's pure functions differs from the per-replica call, or if the
    backward message is not autograd's gradient of the floating part."""
    from hetloco_ds.sim.batched import BatchedSimulation
    from hetloco_ds.sim.replica import Simulation

    ranks = run_ranks(_engine_body, 4, _config())
    engine = {}
    for r in ranks:
        assert r["codec"] == ("toy_sign_topk" if r["replica"] == 1 else "identity")
        engine.setdefault(r["replica"], r["losses"])
        assert engine[r["replica"]] == r["losses"]  # every stage reports its replica's loss
        assert r["outer"] == [False, True, False, True]
        assert r["aggregated"] and set(r["aggregated"]) == {2}, r["aggregated"]
    k = 32 // 2  # d / ratio
    toy = (MICRO * SEQ * (k * 4 + k * 2), MICRO * SEQ * k * 4)
    assert {r["nbytes"] for r in ranks if r["replica"] == 1} == {toy}
    # One micro-batch a step; each rank's record holds its replica's bytes (both stages summed).
    assert {(r["activation"], r["activation_grad"]) for r in ranks if r["replica"] == 1} == {toy}
    per_replica, batched = _simulate(Simulation), _simulate(BatchedSimulation)
    for m in (0, 1):
        assert per_replica[m] == pytest.approx(engine[m], rel=1e-5), m
        assert batched[m] == pytest.approx(per_replica[m], rel=1e-5), m


def test_a_codec_name_nobody_registered_is_refused_naming_the_key_and_the_registered_ones():
    """`hetloco.subspace.codec` naming no registered codec fails when the stage's algorithm is built,
    before any step, in one line naming the key, the value and what is registered. Breaks if an unknown
    name silently falls back to another codec."""
    from conftest import tiny_llama_config
    from hetloco_ds.config import ConfigError, parse_config
    from hetloco_ds.sim.replica import Simulation

    cfg = _config()
    cfg["hetloco"]["subspace"]["codec"] = "no_such_codec"
    run = parse_config(cfg)
    with pytest.raises(ConfigError, match=r"hetloco.subspace.codec = 'no_such_codec' .*identity.*toy_sign_topk"):
        Simulation(run, run.hetloco, tiny_llama_config(), 2, 2, torch.device("cpu"))


@pytest.mark.parametrize("ratio,bf16", [(None, False), (None, True), (4, False), (8, True)])
def test_a_built_in_codecs_message_is_what_the_cost_model_prices(ratio, bf16):
    """The identity codec (ratio None) and the subspace codec at k = d / ratio < d put on the wire,
    per micro-batch and by their own message and gradient specs, exactly `sizes.boundary_nbytes`,
    the rule `plan` prices a boundary by. Breaks if a built-in codec's message and the size rule
    part (a tensor, a dtype or the ids' width changes in one of them only)."""
    from hetloco_ds import sizes
    from hetloco_ds.boundary import build_codec, wire_dtype_of
    from hetloco_ds.config import SubspaceConfig

    d, vocab, b, L = 64, 40000, 3, 5  # a vocabulary past 32K: 4-byte ids
    sub = SubspaceConfig(compressed_replicas=[] if ratio is None else "all", ratio=ratio or 1)
    codec = build_codec(sub, replica=0, num_replicas=1, hidden_size=d, vocab_size=vocab,
                        wire_dtype=wire_dtype_of(bf16), device="cpu")
    assert codec.name == ("identity" if ratio is None else "subspace")
    assert codec.nbytes(b, L) == sizes.boundary_nbytes(b, L, d, codec.width, 2 if bf16 else 4, vocab)
