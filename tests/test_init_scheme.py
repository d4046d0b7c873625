"""A fresh model's init scheme (`init_schemes.INIT_SCHEMES`, the model config's `hetloco_init`): TorchTitan's
LLaMA init, the one the authors' code trains from, next to ours; the same weights whichever driver
builds them (DeepSpeed's LayerSpecs seeded as PipelineModule does, the simulator's `build_layers`)."""
from __future__ import annotations

import json
import math

import pytest
import torch
from deepspeed.runtime import utils as ds_utils

from hetloco_ds.config import ConfigError
from hetloco_ds.pipe.module import layer_specs
from hetloco_ds.presets import model_config_for
from hetloco_ds.sim.core import build_layers

FIELDS = {"hidden_size": 256, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 4,
          "intermediate_size": 512, "max_position_embeddings": 128}


def config(tmp_path, **extra):
    path = tmp_path / "model.json"
    path.write_text(json.dumps({**FIELDS, **extra}))
    return model_config_for(str(path), 4096)


def test_torchtitan_init_draws_each_weight_at_titans_std(tmp_path):
    layers = build_layers(config(tmp_path, hetloco_init="torchtitan"), seed=0)
    std = lambda t: t.detach().std().item()  # noqa: E731
    assert std(layers[0].weight) == pytest.approx(1.0, rel=0.02)
    for i, layer in enumerate(layers[1:5]):
        attn, mlp = layer.layer.self_attn, layer.layer.mlp
        for w in (attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight, mlp.gate_proj.weight):
            assert std(w) == pytest.approx(0.02, rel=0.03)
        for w in (attn.o_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight):
            assert std(w) == pytest.approx(0.02 / math.sqrt(2 * (i + 1)), rel=0.03)
    head = layers[-1].lm_head.weight
    assert std(head) == pytest.approx(256 ** -0.5 * 0.986, rel=0.03)  # N(0, s) cut at 3 s: std 0.986 s
    assert head.abs().max().item() <= 3 * 256 ** -0.5
    ours = build_layers(config(tmp_path), seed=0)
    assert std(ours[0].weight) == pytest.approx(0.02, rel=0.02)  # initializer_range
    assert std(ours[1].layer.self_attn.o_proj.weight) == pytest.approx(1 / math.sqrt(3 * 256), rel=0.03)  # torch's


def test_the_pipeline_builds_the_simulators_weights_under_each_scheme(tmp_path):
    for scheme in ("torch", "torchtitan"):
        cfg = config(tmp_path, hetloco_init=scheme)
        sim = build_layers(cfg, seed=7)
        for idx, spec in enumerate(layer_specs(cfg)):
            ds_utils.set_random_seed(7 + idx)  # PipelineModule._build with seed_layers=True
            built = spec.build()
            for (name, a), (_, b) in zip(built.state_dict().items(), sim[idx].state_dict().items()):
                assert torch.equal(a, b), (scheme, idx, name)


@pytest.mark.parametrize("extra,says", [({"hetloco_init": "titan"}, "hetloco_init = 'titan' must be one of"),
                                        ({"hetloco_init": "torchtitan", "tie_word_embeddings": True}, "untied")])
def test_a_bad_scheme_is_one_line_naming_it(tmp_path, extra, says):
    with pytest.raises(ConfigError, match=says) as err:
        config(tmp_path, **extra)
    assert "\n" not in str(err.value)
