"""The pipeline is LlamaForCausalLM: same loss and same gradient for every parameter."""
from __future__ import annotations

import pytest
import torch
from transformers import LlamaForCausalLM

from distributed import build_from_hf, run_ranks


def _ds_config(stages: int) -> dict:
    return {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 2,
        "gradient_clipping": 0.0,
        "pipeline": {"stages": stages},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "hetloco": {"sparseloco": {"enabled": False}, "train": {"seq_len": 16}},
    }


def _grads_body(rank, hf_dir, ds_cfg, batch):
    from hetloco_ds import convert

    engine, module, cfg = build_from_hf(hf_dir, ds_cfg, batch.shape[1])
    grads = {}

    def capture(lr_kwargs=None):
        for idx, layer in module.local_layers().items():
            mapping = convert.hf_keys_for_layer(cfg, idx)
            for name, p in layer.named_parameters():
                if p.grad is not None and name in mapping:
                    grads[mapping[name]] = p.grad.detach().clone()

    engine._exec_optimizer_step = capture
    micro = batch.chunk(2)
    rec = engine.train_step(iter([(m, m) for m in micro]))
    return rec.loss, grads


def _reference(hf_dir, batch):
    model = LlamaForCausalLM.from_pretrained(hf_dir, attn_implementation="sdpa").float()
    out = model(input_ids=batch, labels=batch)
    out.loss.backward()
    return float(out.loss), {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("stages,fixture", [(1, "hf_untied"), (2, "hf_untied"), (4, "hf_untied"), (2, "hf_tied")])
def test_pipeline_loss_and_grads_match_transformers(stages, fixture, request):
    """Pipeline forward loss and every parameter gradient equal LlamaForCausalLM's (fp32), for
    S = 1, 2, 4 with GQA, and with tied embeddings. Breaks if a layer is dropped, misordered,
    mis-mapped, if rotary positions or causality differ per stage, or if the tied head's
    gradient is not summed across its two stages."""
    hf_dir = request.getfixturevalue(fixture)
    torch.manual_seed(1)
    batch = torch.randint(0, 96, (4, 16))
    ref_loss, ref_grads = _reference(hf_dir, batch)
    results = run_ranks(_grads_body, stages, hf_dir, _ds_config(stages), batch)
    merged = {}
    for loss, grads in results:
        assert loss == pytest.approx(ref_loss, rel=1e-5, abs=1e-6)
        merged.update(grads)
    assert set(merged) == set(ref_grads), set(merged) ^ set(ref_grads)
    for name, g in ref_grads.items():
        torch.testing.assert_close(merged[name], g, rtol=1e-4, atol=1e-6, msg=lambda m: f"{name}: {m}")


def test_rmsnorm_is_hf_in_fp32_and_keeps_bf16_under_autocast():
    """model.RMSNorm computes exactly LlamaRMSNorm in fp32, and under bf16 autocast (fp32
    weight, bf16 residual stream) returns bf16 equal to a bf16 LlamaRMSNorm's output. Breaks if
    the fp32 weight promotes the output to fp32 again (the elementwise cost it exists to remove)
    or if the normalisation itself changes."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from hetloco_ds.model import RMSNorm

    torch.manual_seed(0)
    ours, ref = RMSNorm(32, eps=1e-5), LlamaRMSNorm(32, eps=1e-5)
    with torch.no_grad():
        ours.weight.uniform_(0.5, 1.5)
        ref.weight.copy_(ours.weight)
    x = torch.randn(3, 5, 32)
    assert torch.equal(ours(x), ref(x))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = ours(x.bfloat16())
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, ref.bfloat16()(x.bfloat16()))
