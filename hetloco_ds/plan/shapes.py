"""The model shapes the cost model prices: a LLaMA-style decoder's dimensions, the named presets
(`hetloco_ds.presets`), and the parameter tensors each pipeline stage and each outer-sync block
holds, cut where the pipeline cuts the layer list (`sizes`). Pure Python (no torch).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from .. import sizes
from ..presets import DEFAULT_VOCAB, PRESETS as SHAPE_PRESETS


@dataclass(frozen=True)
class ModelShape:
    """A LLaMA-style decoder (SwiGLU MLP, RMSNorm, rotary, untied embedding and LM head)."""

    d: int
    """Hidden size d_model."""
    n_layers: int
    """Number of decoder layers."""
    n_heads: int
    """Attention (query) heads."""
    ffn: int
    """SwiGLU intermediate size."""
    vocab: int
    """Vocabulary size."""
    seq_len: int
    """Sequence length L."""
    n_kv_heads: int | None = None
    """Key/value heads (grouped-query attention); None = n_heads."""
    name: str = "custom"
    """Label used in reports."""
    tied: bool = False
    """tie_word_embeddings: the LM head is the embedding (its copy on the last stage has the same shape)."""

    @classmethod
    def preset(cls, name: str, vocab: int = DEFAULT_VOCAB) -> "ModelShape":
        """A named shape of `hetloco_ds.presets` (sequence length = its max_position_embeddings)."""
        f = SHAPE_PRESETS[name]
        return cls(d=f["hidden_size"], n_layers=f["num_hidden_layers"], n_heads=f["num_attention_heads"],
                   n_kv_heads=f.get("num_key_value_heads"), ffn=f["intermediate_size"], vocab=vocab,
                   seq_len=f["max_position_embeddings"], name=name)

    @property
    def kv_heads(self) -> int:
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

    @property
    def kv_dim(self) -> int:
        return self.d // self.n_heads * self.kv_heads

    def layer_tensors(self, i: int) -> list[tuple[str, tuple[int, ...]]]:
        """Parameter tensors of decoder layer i, as (HF-style name, shape)."""
        d, f, kv = self.d, self.ffn, self.kv_dim
        p = f"layers.{i}."
        return [
            (p + "self_attn.q_proj.weight", (d, d)),
            (p + "self_attn.k_proj.weight", (kv, d)),
            (p + "self_attn.v_proj.weight", (kv, d)),
            (p + "self_attn.o_proj.weight", (d, d)),
            (p + "mlp.gate_proj.weight", (f, d)),
            (p + "mlp.up_proj.weight", (f, d)),
            (p + "mlp.down_proj.weight", (d, f)),
            (p + "input_layernorm.weight", (d,)),
            (p + "post_attention_layernorm.weight", (d,)),
        ]

    def n_params(self) -> int:
        return sum(math.prod(s) for stage in stage_tensors(self, 1) for _, s in stage)


PRESETS: dict[str, ModelShape] = {name: ModelShape.preset(name) for name in SHAPE_PRESETS}


def resolve_model(model: str | ModelShape) -> ModelShape:
    """A preset name or a ModelShape, validated."""
    if isinstance(model, str):
        if model not in PRESETS:
            raise ValueError(f"unknown model preset {model!r}; known: {', '.join(PRESETS)}")
        return PRESETS[model]
    if not isinstance(model, ModelShape):
        raise ValueError(f"model must be a preset name or a ModelShape, got {model!r}")
    for f in ("d", "n_layers", "n_heads", "ffn", "vocab", "seq_len"):
        v = getattr(model, f)
        if not isinstance(v, int) or v <= 0:
            raise ValueError(f"model.{f} must be a positive integer, got {v!r}")
    if model.d % model.n_heads:
        raise ValueError(f"n_heads={model.n_heads} does not divide d={model.d}")
    if model.n_heads % model.kv_heads:
        raise ValueError(f"n_kv_heads={model.kv_heads} does not divide n_heads={model.n_heads}")
    return model


def stage_tensors(model: ModelShape, stages: int) -> list[list[tuple[str, tuple[int, ...]]]]:
    """Trainable parameter tensors on each stage, as the pipeline splits the layers
    (`sizes.stage_parts`): stage 0 holds the token embedding (T_S on a compressed replica: same
    shape; T_perp is a buffer, never synced), the last stage the final norm and head."""
    try:
        parts = sizes.stage_parts(model.n_layers, stages)
    except ValueError:
        raise ValueError(f"stages={stages} exceeds n_layers={model.n_layers}: a stage needs a layer") from None
    return [_layer_list_tensors(model, a, b) for a, b in zip(parts, parts[1:])]


def block_tensors(model: ModelShape, replica_stages: Sequence[int]) -> list[list[tuple[str, tuple[int, ...]]]]:
    """Parameter tensors of each block of the outer sync (`sizes.block_parts`: the finest common
    partition of the replicas' stage cuts); with one S for every replica, `stage_tensors`."""
    for stages in set(replica_stages):
        stage_tensors(model, stages)  # one readable error for an S the model cannot take
    parts = sizes.block_parts(model.n_layers, replica_stages)
    return [_layer_list_tensors(model, a, b) for a, b in zip(parts, parts[1:])]


def _layer_list_tensors(model: ModelShape, first: int, end: int) -> list[tuple[str, tuple[int, ...]]]:
    """Tensors of the layer list's entries [first, end) (`sizes.LayerLayout`)."""
    layout = sizes.LayerLayout(model.n_layers)
    ts: list[tuple[str, tuple[int, ...]]] = []
    for i in range(first, end):
        if i == layout.embedding:
            ts.append(("embed_tokens.weight", (model.vocab, model.d)))
        elif i in layout.decoders:
            ts.extend(model.layer_tensors(i - layout.decoder(0)))
        elif i == layout.norm:
            ts.append(("norm.weight", (model.d,)))
        else:
            ts.append(("lm_head.weight", (model.vocab, model.d)))
    return ts
