"""Our entry point: builds a HetlocoEngine from the same DeepSpeed JSON.

`deepspeed.initialize` always builds the stock PipelineEngine for a PipelineModule, so this
mirrors what it does for that case (DeepSpeedConfig + engine constructor) with our engine,
after taking out of DeepSpeed's hands the settings we implement per replica: bf16 (autocast
over fp32 master weights), gradient clipping (over the replica's stages) and the optimizer
(a plain torch AdamW, so no fused op has to be JIT-built).
"""
from __future__ import annotations

import os

import torch

from . import patches
from .config import RunConfig, check_topology
from .optim import build_optimizer


def init_distributed(distributed_port: int | None = None, dist_init_required: bool | None = None) -> None:
    """Process group from the launcher's environment (deepspeed, torchrun, or our --nproc).
    `distributed_port` and `dist_init_required` mean what they mean to `deepspeed.initialize`."""
    patches.apply_all()
    import deepspeed
    from deepspeed import comm as dist
    from deepspeed.constants import TORCH_DISTRIBUTED_DEFAULT_PORT

    if dist.is_initialized():
        return
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    deepspeed.init_distributed(dist_backend=backend, dist_init_required=dist_init_required,
                               distributed_port=TORCH_DISTRIBUTED_DEFAULT_PORT if distributed_port is None
                               else distributed_port)


def build_engine(run: RunConfig, module, seq_len: int, replica: tuple[int, int] | None = None, transport=None,
                 args=None, lr_scheduler=None):
    """A HetlocoEngine over an already built HetlocoPipelineModule (`replica`, `transport`: elastic
    mode, see HetlocoEngine; `args`, `lr_scheduler`: as `deepspeed.initialize` passes them to its
    engine)."""
    from deepspeed.runtime.config import DeepSpeedConfig

    from .engine import HetlocoEngine

    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    module.to(device)
    if run.hetloco.train.compile:
        compile_stage(module)
    params = [p for p in module.parameters() if p.requires_grad]
    optimizer = build_optimizer(params, run.optimizer, run.hetloco.train.optimizer_state)
    mpu = module.mpu()
    ds = run.engine_ds_config()
    engine = HetlocoEngine(
        args=args,
        model=module,
        optimizer=optimizer,
        model_parameters=params,
        lr_scheduler=lr_scheduler,
        mpu=mpu,
        dist_init_required=False,
        config=ds,
        config_class=DeepSpeedConfig(ds, mpu),
        run=run,
        seq_len=seq_len,
        replica=replica,
        transport=transport,
    )
    return engine


def compile_stage(module) -> None:
    """torch.compile this stage's decoder layers and, on the last stage, the loss.

    Layers are compiled in place (`nn.Module.compile`), so parameter names, checkpoints and
    the HF export are unchanged; all layers share one graph (parameters are graph inputs).
    The loss is compiled so the fp32 upcast of the logits fuses into the softmax instead of
    materialising a [tokens, vocab] fp32 copy; a chunked loss (`train.loss_chunk_tokens`) is not:
    its chunks already bound that copy, and each is made again in the backward by torch's checkpoint.
    """
    from .model import ChunkedLoss, DecoderLayer

    for layer in module.local_layers().values():
        if isinstance(layer, DecoderLayer):
            layer.compile()
    if module.loss_fn is not None and not isinstance(module.loss_fn, ChunkedLoss):
        module.loss_fn = torch.compile(module.loss_fn)


def use_deterministic_kernels(run: RunConfig) -> None:
    """`train.deterministic`: every kernel deterministic from here on, or torch's error naming the one
    that has no deterministic form. Before the first matmul: cuBLAS reads its workspace setting
    when its handle is made."""
    if not run.hetloco.train.deterministic:
        return
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)


def build_module(run: RunConfig, llama_config, hf_dir: str | None = None, hf_state=None):
    """This rank's stage of the PipelineModule: from an HF directory (only this stage's
    tensors), from an in-memory LlamaForCausalLM state dict, or freshly initialised with
    per-layer seeds (the same model whatever S is)."""
    from deepspeed import comm as dist

    from .pipe.module import HetlocoPipelineModule

    use_deterministic_kernels(run)
    world = dist.get_world_size()
    check_topology(world, run.stages, run.source, llama_config.num_hidden_layers, run.hetloco.replica_stages)
    module = HetlocoPipelineModule(llama_config, run.stages, world, seed=run.hetloco.train.seed, hf_dir=hf_dir,
                                   hf_state=hf_state, replica_stages=run.hetloco.replica_stages,
                                   fleet_stages=run.fleet_stages,
                                   activation_checkpoint_interval=run.activation_checkpoint_interval)
    module.fuse_head_loss(run.hetloco.train.loss_chunk_tokens)
    return module
