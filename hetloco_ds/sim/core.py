"""What both simulators share: the layers built as the pipeline builds them, each virtual stage's
StageAlgorithm and LocalStageLink, the bytes the real links would carry, and the outer step of
every (replica, stage) with its per-sync diagnostics.

A simulator here is `replica.Simulation` or `batched.BatchedSimulation`: both hold `replicas`,
each with `layers`, `algorithms[s]`, `links[s]` and `stage_params`.
"""
from __future__ import annotations

import copy

import torch
from torch import nn

from .. import sizes
from ..algorithm import StageAlgorithm
from ..config import HetlocoConfig
from ..model import TokenEmbedding, layer_list
from ..patches import seed_layer
from ..sparseloco.outer import payload_nbytes
from ..transport import Gathered, LocalStageLink


def tied_apart(config, hetloco: HetlocoConfig, stages: int) -> bool:
    """Whether a tied model's embedding and head copies train apart between outer steps (as the
    pipeline's first and last stages hold them: StageAlgorithm.tied_apart)."""
    return (bool(config.tie_word_embeddings) and stages > 1 and hetloco.sparseloco.enabled
            and hetloco.sparseloco.tied_embeddings == "outer_step")


def build_layers(config, seed: int, apart: bool = False) -> list[nn.Module]:
    """All layers, each seeded by its index exactly as the pipeline seeds it (so the same model).

    A tied head is the embedding module itself (gradients add up: exact tying), or with `apart`
    a copy of it with parameters of its own, as the pipeline's last stage holds."""
    layers: list[nn.Module] = []
    tied: dict[str, nn.Module] = {}
    for idx, entry in enumerate(layer_list(config)):
        if entry.tied in tied:
            layers.append(copy.deepcopy(tied[entry.tied]) if apart else tied[entry.tied])
            continue
        seed_layer(seed, idx)
        module = entry.build()
        if entry.tied:
            tied[entry.tied] = module
        layers.append(module)
    return layers


def stage_params(layers, parts) -> list[list[nn.Parameter]]:
    """Each stage's trainable parameters in layer order, a tied module's once (on its first stage)."""
    out, seen = [], set()
    for s in range(len(parts) - 1):
        params = []
        for layer in layers[parts[s]:parts[s + 1]]:
            for p in layer.parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    params.append(p)
        out.append(params)
    return out


def stage_algorithms(layers, parts, hetloco: HetlocoConfig, replica: int, num_replicas: int, device):
    """Per virtual stage of one replica: the StageAlgorithm a pipeline rank of that stage holds
    (set up: T_S / T_perp split, theta snapshot) and its LocalStageLink."""
    config = layers[1].layer.self_attn.config
    params = stage_params(layers, parts)
    tied = bool(config.tie_word_embeddings) and len(parts) > 2
    algorithms = [
        StageAlgorithm(params[s], hetloco, replica=replica, num_replicas=num_replicas,
                       hidden_size=config.hidden_size, vocab_size=config.vocab_size, device=device,
                       embeddings=[m for m in layers[parts[s]:parts[s + 1]] if isinstance(m, TokenEmbedding)],
                       layers=layers[parts[s]:parts[s + 1]], tied=tied)
        for s in range(len(parts) - 1)]
    links = LocalStageLink.for_replica(len(parts) - 1)
    for alg, link in zip(algorithms, links):
        alg.setup(link)
    return params, algorithms, links


def link_bytes(sim, widths: list[int], seq_len: int) -> dict:
    """Bytes per optimizer step and replica on stage links (forward + backward; replica m's
    boundary is `widths[m]` wide) and per outer step on replica links, from the shapes the real
    pipeline sends; `sim` is either simulator."""
    config = sim.replicas[0].layers[1].layer.self_attn.config
    rows = []
    for width in widths:
        fwd, bwd = sizes.boundary_nbytes(sim.micro, seq_len, config.hidden_size, width,
                                         2 if sim.run.bf16 else 4, config.vocab_size)
        rows.append((fwd + bwd) * sim.gas * (sim.S - 1))
    outer = sum(payload_nbytes([tuple(p.shape) for p in ps], sim.hetloco.sparseloco)
                for ps in sim.replicas[0].stage_params)
    return {"stage_links_per_step": rows, "outer_payload_per_replica": outer}


@torch.no_grad()
def outer_step_all(replicas, members: tuple[str, ...], shards=None) -> dict:
    """One outer step of every stage of every replica (`replicas[m].algorithms[s]`, `.links[s]`),
    exactly as the engine's ranks take it: per stage every replica prepares, the payloads are
    'all-gathered' (a list), all finish; then every stage of every replica syncs its embeddings
    (StageAlgorithm.sync_embeddings), after every owner of a shared aggregate (the first stage's
    T_S, a tied head's on the last stage) has offered it in its finish.

    With `shards` (a `sharded.Shards`) `replicas` are this process's block of the row's `members`:
    the payloads, the replicas' parameters for the dense mean and their error norms are gathered
    from every block, in replica order, and the rest runs as on one process (the replicas leave
    an outer step with the same theta, so the applied update is any replica's).

    Returns the replicas excluded and the per-sync diagnostics, computed from what the outer step
    has anyway (theta at the last sync, the replicas' parameters, the payloads, the error buffers),
    never inside inner steps:
      replicas_per_selected  entries sent / coordinates sent by anyone: 1 = no overlap, M = all agree
      update_cosine          cosine of the applied update theta_prev - theta_new (T_perp's part of
                             the embedding included) with the dense mean of the pseudo-gradients
      update_norm, dense_norm  their norms (1/M aggregation shrinks the first)
      error_norm             the error buffer's norm after this step, mean over replicas
    """
    gather = shards.gather if shards is not None else (lambda t: t)
    gather_list = shards.gather_list if shards is not None else list
    excluded: set[str] = set()
    selected = distinct = 0
    dev = replicas[0].algorithms[0].device
    dot, applied_sq, dense_sq = (torch.zeros((), dtype=torch.float64, device=dev) for _ in range(3))
    error_sq = torch.zeros(len(replicas), dtype=torch.float64, device=dev)
    stages = range(len(replicas[0].algorithms))
    snapshots = []
    for s in stages:
        algs = [r.algorithms[s] for r in replicas]
        ref = algs[0]
        before = [t.to(dev, copy=True) for t in ref.outer.theta_prev]  # the synced theta, alike on every replica
        dense = [tp - gather(torch.stack([a.params[i].detach().float() for a in algs])).mean(0)
                 for i, tp in enumerate(before)]
        emb = [i for i, p in enumerate(ref.params) if any(p is e.weight for e in ref.embeddings)]
        perp = ref.perp.clone() if emb and ref.perp is not None else None
        snapshots.append((before, dense, emb, perp))
        # Every block reaches these gathers once per stage, in stage order.
        gathered = Gathered(gather_list([a.prepare() for a in algs]), members)
        for m, (r, a) in enumerate(zip(replicas, algs)):
            result = a.finish(gathered, r.links[s], count_selected=m == 0)
            excluded.update(result.excluded)
            if m == 0:
                selected, distinct = selected + result.selected, distinct + result.distinct
            error_sq[m] += torch.stack(torch._foreach_norm(a.outer.error)).double().pow(2).sum()
    for r in replicas:
        for a, link in zip(r.algorithms, r.links):
            a.sync_embeddings(link)
    for s, (before, dense, emb, perp) in zip(stages, snapshots):
        ref = replicas[0].algorithms[s]
        applied = [b - p.detach().float() for b, p in zip(before, ref.params)]
        if perp is not None:
            for i in emb:
                applied[i] += perp - ref.perp
        for a, d in zip(applied, dense):
            dot += (a.double() * d.double()).sum()
            applied_sq += a.double().pow(2).sum()
            dense_sq += d.double().pow(2).sum()
    error = gather(error_sq).sqrt().mean().item()
    dot, applied_sq, dense_sq = dot.item(), applied_sq.item(), dense_sq.item()
    return {
        "excluded": sorted(int(m) for m in excluded),
        "replicas_per_selected": selected / distinct if distinct else None,
        "update_cosine": dot / (applied_sq * dense_sq) ** 0.5 if applied_sq and dense_sq else None,
        "update_norm": applied_sq ** 0.5,
        "dense_norm": dense_sq ** 0.5,
        "error_norm": error,
    }
