"""hetloco.train.loss_chunk_tokens: the last stage's loss a chunk of tokens at a time, without a
micro-batch's [tokens, vocab] logits, the same loss and gradients as the whole logits give."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from distributed import build_from_hf, run_ranks
from hetloco_ds import sizes
from hetloco_ds.config import ConfigError, parse_config
from hetloco_ds.model import HeadInput, causal_lm_loss, chunked_lm_loss
from test_outer_memory import LiveBytes
from test_schedule import SEQ, _batches, _config


def _reference(hidden, weight, labels):
    """Next-token cross-entropy as HF's LlamaForCausalLM takes it: the logits shifted against the labels."""
    logits = F.linear(hidden, weight)
    return F.cross_entropy(logits[:, :-1].reshape(-1, weight.shape[0]), labels[:, 1:].reshape(-1))


@pytest.mark.parametrize("chunk", [1, 5, 37, 73, 74, 1000])
def test_chunked_loss_and_its_gradients_are_the_whole_logits_in_float64(chunk):
    """Float64, 2 x 37 tokens, vocab 50 (a chunk that divides the 74 tokens, ones that do not, one
    larger than all): the loss and the gradients of the hidden state and the weight equal the shifted
    cross-entropy of the whole logits to 1e-12. Breaks if a chunk's tokens are dropped or counted
    twice, the last position is not ignored, or the mean is over the wrong count."""
    g = torch.Generator().manual_seed(chunk)
    hidden = torch.randn(2, 37, 16, dtype=torch.float64, generator=g, requires_grad=True)
    weight = torch.randn(50, 16, dtype=torch.float64, generator=g, requires_grad=True)
    labels = torch.randint(0, 50, (2, 37), generator=g)
    ref = _reference(hidden, weight, labels)
    ref_grads = torch.autograd.grad(ref, (hidden, weight))
    got = chunked_lm_loss(HeadInput(hidden, weight), labels, chunk)
    grads = torch.autograd.grad(got, (hidden, weight))
    assert got.dtype == torch.float64 and abs(got.item() - ref.item()) < 1e-12
    for a, b in zip(grads, ref_grads):
        assert torch.allclose(a, b, rtol=0, atol=1e-12), (a - b).abs().max().item()


def test_chunked_loss_under_bf16_autocast_is_the_whole_logits_loss():
    """Under bf16 autocast on the CPU the chunked loss casts the hidden state and the weight as
    `F.linear` would and takes the cross-entropy in fp32: the loss and gradients are
    `causal_lm_loss`'s (bf16 logits, fp32 loss) to bf16's rounding of a logit."""
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, 24, 32, generator=g, requires_grad=True)
    weight = (0.1 * torch.randn(64, 32, generator=g)).requires_grad_()
    labels = torch.randint(0, 64, (2, 24), generator=g)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = causal_lm_loss(F.linear(hidden, weight), labels)
        got = chunked_lm_loss(HeadInput(hidden, weight), labels, 7)
    assert got.dtype == ref.dtype == torch.float32
    assert abs(got.item() - ref.item()) < 1e-3 * ref.item()
    for a, b in zip(torch.autograd.grad(got, (hidden, weight)), torch.autograd.grad(ref, (hidden, weight))):
        assert torch.allclose(a, b, rtol=2e-2, atol=1e-4), (a - b).abs().max().item()


def test_chunked_loss_holds_one_chunks_logits_as_the_size_rule_says():
    """Every storage the forward and backward create, followed until freed (test_outer_memory's
    LiveBytes), fp32, 512 tokens, vocab 4096, d 64: the whole logits' loss peaks above 512 x 4096 x 16 B
    (`sizes.logit_bytes` of a micro-batch, less what it frees early); chunks of 64 tokens peak within
    `sizes.logit_bytes` of `sizes.loss_tokens` (64) plus the gradients of the weight and the hidden
    state, which the stage's state and working set already count, and at under a fifth of the whole.
    Breaks if the chunked loss keeps a chunk's logits past its own (the rule would under-count)."""
    g = torch.Generator().manual_seed(0)
    tokens, vocab, d, chunk = 512, 4096, 64, 64
    hidden = torch.randn(1, tokens, d, generator=g, requires_grad=True)
    weight = (0.05 * torch.randn(vocab, d, generator=g)).requires_grad_()
    labels = torch.randint(0, vocab, (1, tokens), generator=g)
    peaks = {}
    for name, loss in (("whole", lambda: causal_lm_loss(F.linear(hidden, weight), labels)),
                       ("chunked", lambda: chunked_lm_loss(HeadInput(hidden, weight), labels, chunk))):
        with LiveBytes() as live:
            torch.autograd.grad(loss(), (hidden, weight))
        peaks[name] = live.peak
    grads = 4 * (vocab * d + tokens * d)
    assert peaks["whole"] > tokens * sizes.logit_bytes(vocab, 4) * 0.75, peaks
    assert peaks["chunked"] <= sizes.loss_tokens(tokens, chunk) * sizes.logit_bytes(vocab, 4) + grads, peaks
    assert peaks["chunked"] < peaks["whole"] / 5, peaks


def _train_body(rank, cases, steps):
    """Per (name, hf_dir, schedule, tied_embeddings, bf16, chunk): every step's loss, and on the
    stage holding the head whether its loss is the chunked one."""
    from hetloco_ds.model import ChunkedLoss

    out = {}
    for name, hf_dir, schedule, tied_embeddings, bf16, chunk in cases:
        cfg = _config(schedule, tied_embeddings)
        cfg["hetloco"]["train"]["loss_chunk_tokens"] = chunk
        if bf16:
            cfg["bf16"] = {"enabled": True}
        engine, module, _ = build_from_hf(hf_dir, cfg, SEQ)
        losses = [engine.train_step(iter(_batches(engine.replica, step))).loss for step in range(1, steps + 1)]
        losses.append(engine.eval_batch(iter(_batches(engine.replica, 99))).item())  # the inference schedule too
        out[name, bf16, chunk] = {"losses": losses, "chunked": isinstance(module.loss_fn, ChunkedLoss),
                                  "last": engine.is_last_stage()}
    return out


def test_engine_trains_with_the_chunked_loss_as_with_the_whole_logits(hf_untied, hf_tied):
    """2 replicas x 2 stages, replica 1 compressed, 3 micro-batches of 2 x 16 tokens a step, through
    an outer step, chunks of 5 tokens: every step's loss, and then eval_batch's, is the whole-logits
    run's to fp32's summation order (1e-5), untied, tied with the head on another stage (both ways of training the copies),
    and under bf16 autocast; the last stage runs the chunked loss and no other stage does. Breaks if
    the head's weight (the tied table T_S + T_perp included) loses its gradient through the fused
    loss, or the loss reaches a stage without the head."""
    cases = []
    for chunk in (0, 5):
        cases += [("untied", hf_untied, "blocking", None, False, chunk),
                  ("tied apart", hf_tied, "overlapped", "outer_step", False, chunk),
                  ("tied exactly", hf_tied, "blocking", "every_step", False, chunk),
                  ("untied", hf_untied, "blocking", None, True, chunk)]
    for r in run_ranks(_train_body, 4, cases, 3):
        for name, _, _, _, bf16, chunk in cases:
            got, whole = r[name, bf16, chunk], r[name, bf16, 0]
            assert got["chunked"] == (chunk > 0 and got["last"]), (name, got)
            assert got["losses"] == pytest.approx(whole["losses"], rel=1e-2 if bf16 else 1e-5), (name, bf16, got, whole)


@pytest.mark.parametrize("value", [-1, 1.5, "8", True])
def test_a_bad_chunk_is_refused_in_one_line_naming_it(value):
    with pytest.raises(ConfigError) as err:
        parse_config({"hetloco": {"train": {"loss_chunk_tokens": value}}})
    assert "hetloco.train.loss_chunk_tokens" in str(err.value) and repr(value) in str(err.value), str(err.value)
    assert "\n" not in str(err.value).strip()
