"""The per-replica simulator, the reference: one module set, optimizer and schedule per replica.

Each `SimReplica` holds, per virtual stage, the same StageAlgorithm a pipeline rank of that stage
holds, and encodes and decodes with its codec (`StageAlgorithm.codec`); `Simulation` runs M of them
and meets them at outer steps through `core.outer_step_all`, exactly as HetlocoEngine ranks do.
"""
from __future__ import annotations

import copy

import torch
from torch import nn

from .. import optim, sizes
from ..config import HetlocoConfig, RunConfig
from ..model import causal_lm_loss, layer_list
from .core import build_layers, link_bytes, outer_step_all, stage_algorithms, tied_apart


class SimReplica:
    """One replica: its own copy of every layer, optimizer and schedule, and per virtual stage
    the same StageAlgorithm and BoundaryCodec a pipeline rank of that stage holds."""

    def __init__(self, layers, run: RunConfig, hetloco: HetlocoConfig, replica: int, num_replicas: int,
                 stages: int, device, apart: bool = False):
        self.replica = replica
        self.layers = copy.deepcopy(layers)
        config = self.layers[1].layer.self_attn.config
        self.parts = sizes.stage_parts(config.num_hidden_layers, stages)
        self.forward_fns = [e.forward_fn for e in layer_list(config)]
        self.stage_params, self.algorithms, self.links, self.block_ids = stage_algorithms(
            self.layers, self.parts, hetloco, replica, num_replicas, device, apart, run.bf16)
        self.params = [p for ps in self.stage_params for p in ps]
        self.codecs = [alg.codec for alg in self.algorithms]
        self.bf16 = run.bf16
        self.optimizer = optim.build_optimizer(self.params, run.optimizer, hetloco.train.optimizer_state)
        self.scheduler = optim.build_scheduler(run.scheduler, self.optimizer)

    def stage_layers(self, s: int) -> list[nn.Module]:
        return self.layers[self.parts[s]:self.parts[s + 1]]

    def loss(self, ids, labels):
        x = ids
        stages = len(self.parts) - 1
        # As in the pipeline: the layers under autocast, the loss outside it; stage s encodes
        # with its own codec and stage s + 1 decodes with its own, as two ranks would.
        with torch.autocast(device_type=ids.device.type, dtype=torch.bfloat16, enabled=self.bf16):
            for s in range(stages):
                if s > 0:
                    x = self.codecs[s].decode(x)
                for layer, fn in zip(self.stage_layers(s), self.forward_fns[self.parts[s]:self.parts[s + 1]]):
                    x = layer(x) if fn is None else fn(layer, x)  # a tied head: its forward_fn, as the pipeline calls it
                if s < stages - 1:
                    x = self.codecs[s].encode(x)
        return causal_lm_loss(x, labels)

    def backward(self, micro_batches) -> torch.Tensor:
        """Forward and backward of every micro-batch; their losses as a float32 [gas] tensor on
        the device (no host sync, so the host can queue the next work while the device runs)."""
        losses = []
        for ids, labels in micro_batches:
            loss = self.loss(ids, labels)
            (loss / len(micro_batches)).backward()
            losses.append(loss.detach())
        return torch.stack(losses)

    def clip_and_step(self, max_norm: float) -> None:
        grads = [p.grad for p in self.params if p.grad is not None]
        optim.clip_(grads, optim.grad_sq_norm(grads), max_norm)
        decay = optim.decoupled_decay(self.optimizer)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.scheduler is not None:
            self.scheduler.step()
        for alg, link in zip(self.algorithms, self.links):
            alg.after_inner_step(link, decay)


class Simulation:
    """M SimReplicas meeting at outer steps, exactly as HetlocoEngine ranks do; with
    `hetloco.replica_stages`, replica m has its own depth (`stages` is then ignored) and the
    replicas meet block by block (`sizes.block_parts`), as the engine's ranks do."""

    def __init__(self, run: RunConfig, hetloco: HetlocoConfig, llama_config, replicas: int, stages: int, device):
        depths = hetloco.replica_stages or [stages] * replicas
        if len(depths) != replicas:
            raise ValueError(f"hetloco.replica_stages = {depths} names {len(depths)} replicas, the simulation has {replicas}")
        self.run, self.hetloco, self.M, self.S, self.device = run, hetloco, replicas, max(depths), device
        self.micro, self.gas = run.micro_batch, run.grad_accum
        apart = tied_apart(llama_config, hetloco, depths)
        layers = [m.to(device) for m in build_layers(llama_config, hetloco.train.seed, apart)]
        self.replicas = [SimReplica(layers, run, hetloco, m, replicas, depths[m], device, apart) for m in range(replicas)]
        self.members = tuple(str(m) for m in range(replicas))
        self.step = 0
        self.outer_steps = 0
        self.attack = None
        """A `sparseloco.attacks.Attack` injected at every outer step (`simulate_variant` sets the row's)."""

    def train_step(self, batches_per_replica) -> torch.Tensor:
        """One optimizer step of every replica; `batches_per_replica[m]` is its micro-batches.
        Returns the micro-batch losses, [M, gas] on the device; `replica_losses` reads them."""
        losses = torch.stack([r.backward(b) for r, b in zip(self.replicas, batches_per_replica)])
        if not self.hetloco.sparseloco.enabled:
            # Plain data parallelism: average the gradients, then every replica steps.
            with torch.no_grad():
                means = [torch.stack([p.grad for p in ps]).mean(0) for ps in zip(*(r.params for r in self.replicas))]
                for r in self.replicas:
                    torch._foreach_copy_([p.grad for p in r.params], means)
        for r in self.replicas:
            r.clip_and_step(self.run.clip)
        self.step += 1
        return losses

    def outer_step(self) -> dict:
        self.outer_steps += 1
        return {"outer_step": self.outer_steps, **outer_step_all(self.replicas, self.members, attack=self.attack)}

    @torch.no_grad()
    def validation_losses(self, batches) -> list[float]:
        """Every replica's mean loss over the same held-out batches, each through its own
        pipeline (a compressed replica through its compressed boundaries), as the paper averages."""
        return [float(torch.stack([r.loss(ids, labels) for ids, labels in batches]).mean()) for r in self.replicas]

    def link_bytes_per_step(self, seq_len: int) -> dict:
        return link_bytes(self, [r.codecs[0].nbytes(self.micro, seq_len) for r in self.replicas])
