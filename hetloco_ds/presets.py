"""Named LLaMA shapes: `--model-config NAME` or a JSON file of LlamaConfig fields."""
from __future__ import annotations

import json
import os

from transformers import LlamaConfig

from .config import ConfigError

# The paper's Table 6 / Table 9 shapes (head dim 128, SwiGLU), and a CPU-sized one.
PRESETS: dict[str, dict] = {
    "tiny": dict(hidden_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=352, max_position_embeddings=2048),
    "20M": dict(hidden_size=384, num_hidden_layers=8, num_attention_heads=6, num_key_value_heads=6,
                intermediate_size=1024, max_position_embeddings=2048),
    "178M": dict(hidden_size=1024, num_hidden_layers=9, num_attention_heads=8, num_key_value_heads=8,
                 intermediate_size=2688, max_position_embeddings=2048),
    "512M": dict(hidden_size=1536, num_hidden_layers=12, num_attention_heads=12, num_key_value_heads=12,
                 intermediate_size=3904, max_position_embeddings=2048),
    "1B": dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=8, num_key_value_heads=8,
               intermediate_size=8192, max_position_embeddings=1024),
}


def model_config_for(name_or_json: str, vocab_size: int) -> LlamaConfig:
    """A LlamaConfig from a preset name or a JSON file; `vocab_size` fills in where not given."""
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
        return LlamaConfig(**fields)
    except (TypeError, ValueError) as err:
        raise ConfigError(f"--model-config {name_or_json}: {err}") from None
