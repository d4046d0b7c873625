"""LLaMA as a sequence of stage layers.

These modules know nothing of pipelines, replicas or compression. Each one maps 1:1 onto a
block of `transformers`' LlamaForCausalLM so that weights keep their HF names under a
per-layer prefix (see `convert.KEY_MAP`). Between layers the activation is a pair
`(hidden, ids)`: the token ids ride along because a compressed stage boundary needs them to
rebuild the high-rank embedding component T_perp[x]; an uncompressed boundary drops them.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import (
    LlamaDecoderLayer,
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
)

from .init_schemes import init_scheme
from .sizes import LayerLayout


def _trunc_normal_(t: torch.Tensor, std: float, cut: float | None = None) -> None:
    # TorchTitan's cut: +-2 absolute (never reached at these stds) unless a cut in stds is given.
    bound = 2.0 if cut is None else cut * std
    nn.init.trunc_normal_(t, mean=0.0, std=std, a=-bound, b=bound)


def stage_config(config: LlamaConfig) -> LlamaConfig:
    """A copy of `config` fixed to SDPA attention, which is causal without a mask tensor.

    No mask travels between stages, so attention must be causal by construction; eager
    attention with `attention_mask=None` would silently attend to the future.
    """
    config = copy.deepcopy(config)
    config._attn_implementation = "sdpa"
    config.use_cache = False
    return config


def parameter_count(config: LlamaConfig) -> int:
    """Every parameter of the whole model `config` describes, a tied table once (built on meta)."""
    from transformers import LlamaForCausalLM

    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    return sum(p.numel() for p in model.parameters())  # parameters() yields a tied table once


def head_dim(config: LlamaConfig) -> int:
    """A head's width: the config's own `head_dim` where it names one (transformers honours it),
    else hidden / heads."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def residual_dtype(t: torch.Tensor) -> torch.dtype:
    """dtype of the residual stream: the autocast dtype under autocast (as DeepSpeed's bf16
    mode runs it, halving every elementwise pass), the tensor's own dtype otherwise (fp32
    training, or DeepSpeed's own bf16 mode where the weights themselves are bf16)."""
    if torch.is_autocast_enabled(t.device.type):
        return torch.get_autocast_dtype(t.device.type)
    return t.dtype


class TokenEmbedding(nn.Module):
    """Token embedding TE = weight + perp.

    `weight` is the trainable part (T_S once a subspace split is made; all of TE otherwise).
    `perp` is T_perp, a fixed high-rank buffer that `subspace.split_embedding` fills; it is
    None for models that never compress.
    """

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(config.vocab_size, config.hidden_size))
        nn.init.normal_(self.weight, std=1.0 if init_scheme(config) == "torchtitan" else config.initializer_range)
        # A None buffer stays out of state_dict until a split assigns a tensor to it.
        self.register_buffer("perp", None)

    def table(self) -> torch.Tensor:
        """The full embedding table TE."""
        return self.weight if self.perp is None else self.weight + self.perp

    def forward(self, ids: torch.Tensor):
        hidden = F.embedding(ids, self.weight)
        if self.perp is not None:
            hidden = hidden + F.embedding(ids, self.perp)
        return hidden.to(residual_dtype(hidden)), ids

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """Tied LM head: logits = hidden @ TE^T."""
        return F.linear(hidden, self.table())


def tied_head_forward(module: TokenEmbedding, hidden: torch.Tensor):
    """`forward_fn` for the tied LM head (a function, so DeepSpeed can pickle-free call it)."""
    if getattr(module, "fuse_loss", False):
        return HeadInput(hidden, module.table())
    return module.head(hidden)


class RMSNorm(LlamaRMSNorm):
    """LlamaRMSNorm whose output keeps the input's dtype.

    HF multiplies its weight into the normalised input; with fp32 weights under bf16
    autocast that promotes the output (and every pass over it, forward and backward) to
    fp32, then each following projection casts it back. Casting the weight to the input's
    dtype is what a bf16 model computes; in fp32 it is HF's computation exactly.
    """

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        input_dtype = hidden_states.dtype
        x = hidden_states.to(torch.float32)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight.to(input_dtype) * x.to(input_dtype)


class DecoderLayer(nn.Module):
    """One `transformers` LlamaDecoderLayer with the rotary table it needs.

    Rotary positions are recomputed on every layer from the sequence length, so nothing
    positional has to cross a stage boundary.
    """

    def __init__(self, config: LlamaConfig, layer_idx: int):
        super().__init__()
        config = stage_config(config)
        self.layer = LlamaDecoderLayer(config, layer_idx)
        # Same parameter names (and an all-ones init, so no RNG draw changes).
        self.layer.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.layer.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary = LlamaRotaryEmbedding(config)
        if init_scheme(config) == "torchtitan":
            with torch.no_grad():
                attn, mlp = self.layer.self_attn, self.layer.mlp
                for lin in (attn.q_proj, attn.k_proj, attn.v_proj, mlp.gate_proj):
                    _trunc_normal_(lin.weight, 0.02)
                for lin in (attn.o_proj, mlp.up_proj, mlp.down_proj):
                    _trunc_normal_(lin.weight, 0.02 / (2 * (layer_idx + 1)) ** 0.5)

    @torch.no_grad()
    def reset_nonpersistent_buffers(self) -> None:
        """Recompute the rotary tables (`inv_freq`), which no state dict carries.

        A layer built on the meta device and then `to_empty`'d holds uninitialised memory here;
        loading weights never touches these buffers, so they must be rebuilt from the config.
        """
        with torch.device("cpu"):
            fresh = LlamaRotaryEmbedding(self.rotary.config)
        for name, buffer in fresh.named_buffers():
            self.rotary.get_buffer(name).copy_(buffer)
        self.rotary.attention_scaling = fresh.attention_scaling

    def forward(self, inputs):
        hidden, ids = inputs
        positions = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
        cos_sin = self.rotary(hidden, positions)
        hidden = self.layer(hidden, position_embeddings=cos_sin, position_ids=positions)
        return hidden, ids


class FinalNorm(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, inputs):
        hidden, _ = inputs
        return self.norm(hidden)


class LMHead(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if init_scheme(config) == "torchtitan":
            with torch.no_grad():
                _trunc_normal_(self.lm_head.weight, config.hidden_size ** -0.5, cut=3.0)

    fuse_loss = False
    """Set on the instance by `fuse_head_loss`: hand the loss the hidden state and the head's weight."""

    def forward(self, hidden: torch.Tensor):
        if self.fuse_loss:
            return HeadInput(hidden, self.lm_head.weight)
        return self.lm_head(hidden)


class HeadInput(NamedTuple):
    """What a fused head hands the loss in place of logits (`chunked_lm_loss`)."""

    hidden: torch.Tensor
    weight: torch.Tensor


def fuse_head_loss(head: nn.Module) -> None:
    """Make the LM head (an `LMHead`, or the tied `TokenEmbedding` called as the head) return
    `HeadInput` instead of logits, for `chunked_lm_loss`."""
    head.fuse_loss = True


def _chunk_loss_sum(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, dtype) -> torch.Tensor:
    # The weight's cast inside the chunk: each chunk's gradient reaches the fp32 weight in fp32, so
    # the chunks add in fp32 (a cast shared by the chunks would add their bf16 gradients in bf16).
    logits = F.linear(hidden.to(dtype), weight.to(dtype))
    logits = logits if logits.dtype == torch.float64 else logits.float()  # fp32 at least, as causal_lm_loss
    return F.cross_entropy(logits, target, ignore_index=-100, reduction="sum")


def chunked_lm_loss(head: HeadInput, labels: torch.Tensor, chunk_tokens: int) -> torch.Tensor:
    """`causal_lm_loss` of `F.linear(hidden, weight)` without its [tokens, vocab] logits: the tokens
    in chunks of `chunk_tokens`, each chunk's logits made, reduced to a summed loss and dropped,
    then made again in the backward (torch.utils.checkpoint), so one chunk's logits and their
    gradient are the most the loss holds (`sizes.logit_bytes`). The price is the head's forward
    matmul, and under autocast the weight's cast, once more a chunk. Under autocast the matmul runs in
    its dtype, as `F.linear` would; the loss is fp32, as `causal_lm_loss`'s. The same value as
    `causal_lm_loss` up to the order of the sum over tokens."""
    hidden, weight = head
    dtype = head_dtype(hidden, weight)
    target = next_token_targets(labels)
    hidden = hidden.reshape(-1, hidden.shape[-1])
    with torch.autocast(hidden.device.type, enabled=False):
        total = sum(checkpoint(_chunk_loss_sum, hidden[i:i + chunk_tokens], weight, target[i:i + chunk_tokens], dtype,
                               use_reentrant=False, preserve_rng_state=False)
                    for i in range(0, hidden.shape[0], chunk_tokens))
    return total / (target != -100).sum()


class ChunkedLoss:
    """The pipeline's loss_fn behind a fused head: `chunked_lm_loss` at `chunk_tokens`."""

    def __init__(self, chunk_tokens: int):
        self.chunk_tokens = chunk_tokens

    def __call__(self, head: HeadInput, labels: torch.Tensor) -> torch.Tensor:
        return chunked_lm_loss(head, labels, self.chunk_tokens)


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy, mean over predicted positions, as LlamaForCausalLM computes it.

    The labels are shifted (the last position gets the ignore index), not the logits: slicing
    the [b, seq, vocab] logits would copy them forward and scatter their gradient back.
    """
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), next_token_targets(labels), ignore_index=-100)


def next_token_targets(labels: torch.Tensor) -> torch.Tensor:
    """[b, seq] labels as the flat [b * seq] targets of the positions' logits: each position's next
    token, the ignore index (-100) at the last."""
    return F.pad(labels[:, 1:].long(), (0, 1), value=-100).reshape(-1)


def head_dtype(hidden: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """The dtype the LM head's matmul runs in: autocast's where it is on, else the inputs' own."""
    device = hidden.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else torch.promote_types(
        hidden.dtype, weight.dtype)


@dataclass(frozen=True)
class LayerEntry:
    """One layer of the model's layer list: `cls(*args)` builds it."""

    cls: type
    args: tuple
    tied: str | None = None
    """Key shared by layers that are one module (the tied embedding and head), else None."""
    forward_fn: Callable | None = None
    """How a tied replica is called instead of its forward (the tied head: `tied_head_forward`)."""

    def build(self) -> nn.Module:
        return self.cls(*self.args)


def layer_list(config: LlamaConfig) -> list[LayerEntry]:
    """LlamaForCausalLM as a list of stage layers, in `sizes.LayerLayout` order: embedding,
    decoder layers, final norm, LM head (tied: a replica of the embedding). The pipeline wraps
    these in DeepSpeed LayerSpecs; the HF key map and the simulator build them directly."""
    tied = "embed" if config.tie_word_embeddings else None
    layers = [LayerEntry(TokenEmbedding, (config,), tied)]
    layers += [LayerEntry(DecoderLayer, (config, i)) for i in range(config.num_hidden_layers)]
    layers.append(LayerEntry(FinalNorm, (config,)))
    layers.append(LayerEntry(TokenEmbedding, (config,), tied, tied_head_forward) if tied else LayerEntry(LMHead, (config,)))
    assert len(layers) == LayerLayout(config.num_hidden_layers).count
    return layers
