"""Named LLaMA shapes: `--model-config NAME` or a JSON file of LlamaConfig fields.

The one table of named shapes: training (`model_config_for`) and the cost model
(`plan.ModelShape.preset`) both read PRESETS. Pure Python at import (the cost model runs
without torch); transformers is imported only to build a LlamaConfig.
"""
from __future__ import annotations

import json
import os

from .config import ConfigError
from .init_schemes import init_scheme

DEFAULT_VOCAB = 32000
"""Vocabulary of a preset where no tokenizer fixes it (the paper's 32K; the cost model's default)."""

# The paper's Table 6 / Table 9 shapes (head dim 128, SwiGLU), and a CPU-sized one.
PRESETS: dict[str, dict] = {
    "tiny": dict(hidden_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=352, max_position_embeddings=2048),
    "20M": dict(hidden_size=384, num_hidden_layers=8, num_attention_heads=6, num_key_value_heads=6,
                intermediate_size=1024, max_position_embeddings=2048),
    # The size sweep's steps between 20M and 178M (issue 32): head dim 64, SwiGLU at 3d; d = 768 is
    # the smallest width whose 1/96 subspace keeps k = 8.
    "60M": dict(hidden_size=576, num_hidden_layers=12, num_attention_heads=9, num_key_value_heads=9,
                intermediate_size=1728, max_position_embeddings=2048),
    "105M": dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, num_key_value_heads=12,
                 intermediate_size=2304, max_position_embeddings=2048),
    "178M": dict(hidden_size=1024, num_hidden_layers=9, num_attention_heads=8, num_key_value_heads=8,
                 intermediate_size=2688, max_position_embeddings=2048),
    "512M": dict(hidden_size=1536, num_hidden_layers=12, num_attention_heads=12, num_key_value_heads=12,
                 intermediate_size=3904, max_position_embeddings=2048),
    "1B": dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=8, num_key_value_heads=8,
               intermediate_size=8192, max_position_embeddings=1024),
    # Llama-3.2-3B's shape (its vocabulary is 128256; its context 128K, here 8192 as Llama-3-8B's).
    "3B": dict(hidden_size=3072, num_hidden_layers=28, num_attention_heads=24, num_key_value_heads=8,
               intermediate_size=8192, max_position_embeddings=8192),
    # Llama-3-8B's shape (its vocabulary is 128256: pass it as the vocab), the largest that issue 28 trains.
    "8B": dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
               intermediate_size=14336, max_position_embeddings=8192),
    # LLaMA-2-70B-like, for the paper's Figure 2.
    "70B": dict(hidden_size=8192, num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8,
                intermediate_size=28672, max_position_embeddings=4096),
}


def model_config_for(name_or_json: str, vocab_size: int):
    """A LlamaConfig from a preset name or a JSON file; `vocab_size` fills in where not given."""
    from transformers import LlamaConfig

    if name_or_json in PRESETS:
        fields = dict(PRESETS[name_or_json])
    elif name_or_json.endswith(".json"):
        if not os.path.exists(name_or_json):
            raise ConfigError(f"--model-config {name_or_json}: file not found")
        with open(name_or_json) as f:
            fields = json.load(f)
    else:
        raise ConfigError(f"--model-config {name_or_json!r}: not a preset ({', '.join(PRESETS)}) nor a .json file")
    fields.setdefault("vocab_size", vocab_size)
    fields.setdefault("tie_word_embeddings", False)
    fields.setdefault("rms_norm_eps", 1e-5)
    fields.setdefault("rope_theta", 10000.0)
    try:
        config = LlamaConfig(**fields)
        init_scheme(config)
        return config
    except (TypeError, ValueError) as err:
        raise ConfigError(f"--model-config {name_or_json}: {err}") from None
