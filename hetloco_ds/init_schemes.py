"""How a fresh model's weights are drawn, by name (a model config's `hetloco_init`); `model.py` draws
them. Plain Python, so the edge (`presets.model_config_for`) checks a config before anything is built.

"torch" (default): the token embedding N(0, initializer_range), every linear layer torch's default
(kaiming-uniform). "torchtitan": TorchTitan's LLaMA, the model the authors' code trains: the
embedding N(0, 1); q/k/v and gate N(0, 0.02); the residual writers o_proj and down_proj, and up_proj,
N(0, 0.02 / sqrt(2 (layer + 1))); the head N(0, d^-1/2) cut at 3 std. A checkpoint loaded over the
model replaces either.
"""
from __future__ import annotations

INIT_SCHEMES = ("torch", "torchtitan")


def init_scheme(config) -> str:
    """The model config's `hetloco_init` ("torch" where it names none), checked: one line naming a bad one."""
    scheme = getattr(config, "hetloco_init", None) or "torch"
    if scheme not in INIT_SCHEMES:
        raise ValueError(f"hetloco_init = {scheme!r} must be one of {', '.join(map(repr, INIT_SCHEMES))}")
    if scheme == "torchtitan" and getattr(config, "tie_word_embeddings", False):
        raise ValueError("hetloco_init = 'torchtitan' draws the embedding N(0, 1) and the head N(0, d^-1/2): "
                         "a tied table cannot be both (TorchTitan's LLaMA is untied); set tie_word_embeddings false")
    return scheme
