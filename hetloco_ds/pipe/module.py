"""LLaMA as a DeepSpeed PipelineModule whose stage boundaries may be compressed.

The layers (hetloco_ds.model) know nothing of this: the module calls a boundary codec
(`boundary.BoundaryCodec`) around each stage's slice of layers, the one its engine's StageAlgorithm
built from the config. On an uncompressed replica a boundary carries the hidden state alone; on a
subspace-compressed one it carries (X - T_perp[x]) U and the token ids, and the next stage
rebuilds X^ = X~ U^T + T_perp[x]. Autograd then sends grad(X^) U backward.
"""
from __future__ import annotations

import torch
from deepspeed import comm as dist
from deepspeed.pipe import LayerSpec, TiedLayerSpec
from deepspeed.runtime.pipe.topology import PipeDataParallelTopology
from torch.utils.checkpoint import checkpoint
from transformers import LlamaConfig

from .. import sizes
from ..boundary import BoundaryCodec, IdentityCodec
from ..model import ChunkedLoss, TokenEmbedding, causal_lm_loss, fuse_head_loss, layer_list
from ..patches import PipelineModuleAdapter


def layer_specs(config: LlamaConfig, head_apart: bool = False) -> list:
    """`model.layer_list` as DeepSpeed LayerSpecs (tied layers as TiedLayerSpecs of one module).

    `head_apart`: a tied head is a module of its own beside the embedding on the same stage (a
    one-stage replica in a world whose other replicas hold the copies on two stages:
    `HetlocoPipelineModule`); still a function over that module, so it has no layer file."""
    specs = []
    for e in layer_list(config):
        key = e.tied and (f"{e.tied}_head" if head_apart and e.forward_fn is not None else e.tied)
        specs.append(TiedLayerSpec(key, e.cls, *e.args, forward_fn=e.forward_fn, tied_weight_attr=["weight"]) if key
                     else LayerSpec(e.cls, *e.args))
    return specs


def head_apart(config: LlamaConfig, replica_stages: list[int] | None, stages: int) -> bool:
    """Whether a replica of `stages` stages holds a tied model's embedding and head as two copies
    on one stage: it has one stage and another replica has several, where the copies train apart
    (`sparseloco.tied_embeddings: outer_step`); so every replica's outer step sees the same
    parameters, and its replicas end each outer step bitwise alike."""
    return bool(config.tie_word_embeddings) and replica_stages is not None and stages == 1 and max(replica_stages) > 1


def recompute(function, *inputs):
    """DeepSpeed's `activation_checkpoint_func` for a run of decoder layers: torch's non-reentrant
    checkpoint, which keeps the run's input (hidden state, ids) and runs it again, under the
    forward's autocast, in the backward. Non-reentrant because it works under torch.compile and
    with inputs that need no gradient (the ids). The RNG is not stashed: no layer draws from it
    (no dropout), and DeepSpeed seeds each layer's forward anyway."""
    return checkpoint(function, *inputs, use_reentrant=False, preserve_rng_state=False)


RECOMPUTED_LAYERS = ["DecoderLayer"]
"""`checkpointable_layers`: a run is recomputed only if every layer in it is a decoder layer
(`sizes.recomputed_runs` states the same rule for `plan`)."""


class HetlocoPipelineModule(PipelineModuleAdapter):
    """PipelineModule over `layer_specs(config)` with a BoundaryCodec at each end of the stage.

    The replica's codec is known only once the topology exists: the engine hands the module its
    StageAlgorithm's (`codec`); until then the module's stages meet uncompressed in fp32.
    """

    def __init__(self, config: LlamaConfig, num_stages: int, world_size: int, seed: int = 0, hf_dir: str | None = None,
                 hf_state=None, replica_stages: list[int] | None = None, fleet_stages=None,
                 activation_checkpoint_interval: int = 0):
        """`replica_stages`: each replica's depth (`hetloco.replica_stages`); the world is laid out by
        `sizes.replica_ranks` and this rank's replica has its own grid (`num_stages` is then its depth).
        `fleet_stages`: an elastic replica's fleet of mixed depths (`RunConfig.fleet_stages`); the world
        is this replica alone, the depths only decide `head_apart`.
        `activation_checkpoint_interval`: the DeepSpeed JSON's pipeline.activation_checkpoint_interval
        (`RunConfig`), as DeepSpeed's PipelineModule applies it, runs of decoder layers only."""
        self.llama_config = config
        self._hf_dir = hf_dir
        self._hf_state = hf_state
        """An in-memory LlamaForCausalLM state dict to load instead of `hf_dir` (the public API's model=)."""
        ranks = None
        if replica_stages is not None:
            ranks = sizes.replica_ranks(replica_stages)
            num_stages = next(len(r) for r in ranks if dist.get_rank() in r)
        self.head_apart = head_apart(config, replica_stages or fleet_stages, num_stages)
        super().__init__(
            layers=layer_specs(config, self.head_apart),
            topology=None if ranks else PipeDataParallelTopology(num_pp=num_stages, num_dp=world_size // num_stages),
            replica_ranks=ranks,
            loss_fn=causal_lm_loss,
            # Seed each layer by its index, so a fresh model is the same whatever S is.
            seed_layers=True,
            base_seed=seed,
            partition_method="uniform",
            activation_checkpoint_func=recompute,
            checkpointable_layers=RECOMPUTED_LAYERS,
        )
        # Set here, not through DeepSpeed's engine config (`RunConfig.engine_ds_config` leaves it 0),
        # so the module is whole without an engine and nothing swaps in DeepSpeed's own checkpoint function.
        self.set_checkpoint_interval(activation_checkpoint_interval)
        self.codec: BoundaryCodec = IdentityCodec(config.hidden_size, config.vocab_size)
        self.autocast_dtype: torch.dtype | None = None
        """Compute dtype of the forward under autocast (bf16 training); None runs in fp32."""

    def fuse_head_loss(self, chunk_tokens: int) -> None:
        """`hetloco.train.loss_chunk_tokens`: on the stage holding the LM head, the head hands the
        loss its input and weight and the loss makes the logits a chunk of tokens at a time
        (`model.chunked_lm_loss`); 0, and every other stage, as built."""
        head = self.local_layers().get(sizes.LayerLayout(self.llama_config.num_hidden_layers).count - 1)
        if chunk_tokens <= 0 or head is None:
            return
        fuse_head_loss(head)
        self.loss_fn = ChunkedLoss(chunk_tokens)

    def stage_parts(self) -> list[int]:
        return sizes.stage_parts(self.llama_config.num_hidden_layers, self.num_stages)

    def build_layers(self):
        if self._hf_dir is None and self._hf_state is None:
            return super().build_layers()
        # Only this stage's layers are built, on the meta device, then filled with this
        # stage's tensors from the checkpoint: no rank ever materialises the whole model.
        from .. import convert

        with torch.device("meta"):
            super().build_layers()
        layers = self.local_layers()
        convert.materialize(layers, torch.device("cpu"))
        if self._hf_state is not None:
            convert.load_state_into_layers(self._hf_state, self.llama_config, layers)
            self._hf_state = None  # the caller's model keeps its tensors; this module keeps its copies
        else:
            convert.load_hf_into_layers(self._hf_dir, self.llama_config, layers)

    @property
    def replica_id(self) -> int:
        return self.replica[0]

    @torch.no_grad()
    def sync_local_copies(self) -> None:
        if self.head_apart:  # the head copy starts as (and after a load is) the embedding
            layers = self.local_layers()
            layers[sizes.LayerLayout(self.llama_config.num_hidden_layers).head].weight.copy_(layers[0].weight)

    @property
    def is_first_stage(self) -> bool:
        return self.stage_id == 0

    @property
    def is_last_stage(self) -> bool:
        return self.stage_id == self.num_stages - 1

    def embeddings(self) -> list[TokenEmbedding]:
        """The TokenEmbedding modules on this stage (first stage; the tied head on the last)."""
        found: list[TokenEmbedding] = []
        for m in self.local_layers().values():
            if isinstance(m, TokenEmbedding) and all(m is not e for e in found):
                found.append(m)
        return found

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
