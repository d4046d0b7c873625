"""LLaMA as a DeepSpeed PipelineModule whose stage boundaries may be subspace-compressed.

The layers (hetloco_ds.model) know nothing of this: the module adds a boundary codec
around each stage's slice of layers. On an uncompressed replica a boundary carries the
hidden state alone; on a compressed one it carries (X - T_perp[x]) U and the token ids, and
the next stage rebuilds X^ = X~ U^T + T_perp[x]. Autograd then sends grad(X^) U backward.
"""
from __future__ import annotations

import functools

import torch
from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec
from deepspeed.runtime.pipe.topology import PipeDataParallelTopology
from torch import nn
from transformers import LlamaConfig

from .. import subspace
from ..model import DecoderLayer, residual_dtype, FinalNorm, LMHead, TokenEmbedding, causal_lm_loss, tied_head_forward


def layer_specs(config: LlamaConfig) -> list:
    """Embedding, one spec per decoder layer, final norm, LM head (tied or not)."""
    n = config.num_hidden_layers
    specs: list = []
    if config.tie_word_embeddings:
        specs.append(TiedLayerSpec("embed", TokenEmbedding, config, tied_weight_attr=["weight"]))
    else:
        specs.append(LayerSpec(TokenEmbedding, config))
    specs += [LayerSpec(DecoderLayer, config, i) for i in range(n)]
    specs.append(LayerSpec(FinalNorm, config))
    if config.tie_word_embeddings:
        specs.append(TiedLayerSpec("embed", TokenEmbedding, config, forward_fn=tied_head_forward, tied_weight_attr=["weight"]))
    else:
        specs.append(LayerSpec(LMHead, config))
    return specs


def stage_parts(num_layers: int, num_stages: int) -> list[int]:
    """Layer-index boundaries: decoder layers split as evenly as possible (earlier stages
    take the remainder), the embedding on the first stage, norm and head on the last."""
    if not 1 <= num_stages <= num_layers:
        raise ValueError(f"stage count {num_stages} must be between 1 and the {num_layers} decoder layers")
    base, extra = divmod(num_layers, num_stages)
    parts = [0]
    for s in range(num_stages):
        parts.append(parts[-1] + base + (1 if s < extra else 0))
    # spec index = decoder index + 1 (embedding first); the first stage also owns spec 0
    parts = [0] + [p + 1 for p in parts[1:]]
    parts[-1] = num_layers + 3
    return parts


class BoundaryCodec(nn.Module):
    """Encodes a stage's output for the wire and decodes the previous stage's message.

    `basis` is None on uncompressed replicas. `perp` is T_perp (shared with the embedding
    on the first stage). `wire_dtype` is what crosses the link (bf16 under bf16 training).
    """

    def __init__(self, basis: torch.Tensor | None, wire_dtype: torch.dtype, id_dtype: torch.dtype):
        super().__init__()
        self.register_buffer("basis", basis, persistent=False)
        self.register_buffer("perp", None, persistent=False)
        self.wire_dtype = wire_dtype
        self.id_dtype = id_dtype

    @property
    def compressed(self) -> bool:
        return self.basis is not None

    def encode(self, outputs):
        hidden, ids = outputs
        if not self.compressed:
            return hidden.to(self.wire_dtype)
        reduced = subspace.encode(hidden.float(), ids, self.perp, self.basis)
        # Ids travel as the bytes of the narrowest integer type: NCCL has no int16, so they
        # are viewed as uint8 on the wire (same bytes) and viewed back on receipt.
        return reduced.to(self.wire_dtype), ids.to(self.id_dtype).view(torch.uint8)

    def decode(self, message):
        if not self.compressed:
            return message.to(residual_dtype(message)), None
        reduced, ids = message
        ids = ids.view(self.id_dtype).long()
        hidden = subspace.decode(reduced.float(), ids, self.perp, self.basis)
        return hidden.to(residual_dtype(hidden)), ids


def id_dtype_for(vocab_size: int) -> torch.dtype:
    """Narrowest signed integer type holding every token id (gloo and NCCL have no uint16)."""
    if vocab_size <= 2**7:
        return torch.int8
    if vocab_size <= 2**15:
        return torch.int16
    return torch.int32


class HetlocoPipelineModule(PipelineModule):
    """PipelineModule over `layer_specs(config)` with a BoundaryCodec at each end of the stage.

    The replica's compression is known only once the topology exists, so the codec is
    configured after construction with `configure_boundary`.
    """

    def __init__(self, config: LlamaConfig, num_stages: int, world_size: int, seed: int = 0, hf_dir: str | None = None):
        self.llama_config = config
        self._n_layers = config.num_hidden_layers
        self._hf_dir = hf_dir
        topology = PipeDataParallelTopology(num_pp=num_stages, num_dp=world_size // num_stages)
        super().__init__(
            layers=layer_specs(config),
            topology=topology,
            loss_fn=causal_lm_loss,
            # Seed each layer by its index, so a fresh model is the same whatever S is.
            seed_layers=True,
            base_seed=seed,
            partition_method="uniform",
            activation_checkpoint_interval=0,
        )
        # Seeding was for construction only; forward() would otherwise reseed every layer call.
        self.seed_layers = False
        self.codec = BoundaryCodec(None, torch.float32, id_dtype_for(config.vocab_size))
        self.autocast_dtype: torch.dtype | None = None
        """Compute dtype of the forward under autocast (bf16 training); None runs in fp32."""

    def _build(self):
        if self._hf_dir is None:
            return super()._build()
        # Only this stage's layers are built, on the meta device, then filled with this
        # stage's tensors from the checkpoint: no rank ever materialises the whole model.
        from .. import convert

        with torch.device("meta"):
            super()._build()
        layers = self.local_layers()
        convert.materialize(layers, torch.device("cpu"))
        convert.load_hf_into_layers(self._hf_dir, self.llama_config, layers)

    def _partition_layers(self, method="uniform"):
        stage_id = self._topo.get_coord(self.global_rank).pipe
        self.parts = stage_parts(self._n_layers, self.num_stages)
        self._set_bounds(start=self.parts[stage_id], stop=self.parts[stage_id + 1])

    @property
    def replica_id(self) -> int:
        return self._topo.get_coord(self.global_rank).data

    @property
    def is_first_stage(self) -> bool:
        return self.stage_id == 0

    @property
    def is_last_stage(self) -> bool:
        return self.stage_id == self.num_stages - 1

    def local_layers(self) -> dict[int, nn.Module]:
        """DeepSpeed layer index -> module, for the layers this stage holds."""
        layers = {}
        for i, f in enumerate(self.forward_funcs):
            module = f.args[0] if isinstance(f, functools.partial) else f  # tied head: partial(fn, module)
            if isinstance(module, nn.Module):
                layers[self._local_start + i] = module
        return layers

    def embeddings(self) -> list[TokenEmbedding]:
        """The TokenEmbedding modules on this stage (first stage; the tied head on the last)."""
        found: list[TokenEmbedding] = []
        for m in self.local_layers().values():
            if isinstance(m, TokenEmbedding) and all(m is not e for e in found):
                found.append(m)
        return found

    def configure_boundary(self, basis: torch.Tensor | None, wire_dtype: torch.dtype) -> None:
        device = next(self.parameters()).device
        self.codec.basis = None if basis is None else basis.to(device)
        self.codec.wire_dtype = wire_dtype

    def set_perp(self, perp: torch.Tensor | None) -> None:
        """Install T_perp on the codec and on every embedding of this stage (one shared tensor)."""
        self.codec.perp = perp
        for emb in self.embeddings():
            emb.perp = perp

    def forward(self, forward_input):
        # Autocast here, inside the engine's forward: DeepSpeed's engine disables an autocast
        # entered around it unless its own `torch_autocast` section is on.
        device = forward_input[0].device if isinstance(forward_input, tuple) else forward_input.device
        with torch.autocast(device_type=device.type, dtype=self.autocast_dtype or torch.bfloat16,
                            enabled=self.autocast_dtype is not None):
            if not self.is_first_stage:
                forward_input = self.codec.decode(forward_input)
            outputs = super().forward(forward_input)
            if not self.is_last_stage:
                outputs = self.codec.encode(outputs)
        return outputs
