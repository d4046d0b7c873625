"""What both simulators share: the layers built as the pipeline builds them, each virtual stage's
StageAlgorithm and LocalStageLink, the bytes the real links would carry, and the outer step of
every (replica, stage) with its per-sync diagnostics.

A simulator here is `replica.Simulation` or `batched.BatchedSimulation`: both hold `replicas`,
each with `layers`, `algorithms[s]`, `links[s]`, `stage_params` and `block_ids[s]` (the outer-sync
blocks stage s holds: `[s]` when every replica has the same depth, else `sizes.block_parts`'s).
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
from ..sparseloco.payload import payload_nbytes
from ..transport import Gathered, LocalStageLink


def tied_apart(config, hetloco: HetlocoConfig, stages: int | list[int]) -> bool:
    """Whether a tied model's embedding and head copies train apart between outer steps (as the
    pipeline's first and last stages hold them: StageAlgorithm.tied_apart); `stages`: the depth, or
    each replica's (a one-stage replica beside deeper ones holds two copies too: pipe.module.head_apart)."""
    deepest = max(stages) if isinstance(stages, (list, tuple)) else stages
    return (bool(config.tie_word_embeddings) and deepest > 1 and hetloco.sparseloco.enabled
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


def param_blocks(layers, params: list[nn.Parameter], held: list[int], blocks: list[int]) -> list[list[int]]:
    """Indices into `params` of each block in `held` (`blocks`: sizes.block_parts boundaries)."""
    layer_of: dict[int, int] = {}
    for idx, layer in enumerate(layers):
        for p in layer.parameters():
            layer_of.setdefault(id(p), idx)
    return sizes.params_by_block([layer_of[id(p)] for p in params], held, blocks)


def stage_algorithms(layers, parts, hetloco: HetlocoConfig, replica: int, num_replicas: int, device,
                     apart: bool = False, bf16: bool = False):
    """Per virtual stage of one replica: the StageAlgorithm a pipeline rank of that stage holds
    (set up: T_S / T_perp split, theta snapshot; its `codec` the stage's boundary codec), its
    LocalStageLink and the outer-sync blocks it holds (`hetloco.replica_stages` mixed:
    `sizes.block_parts`'s; else the stage itself). `apart`: the layers hold a tied head as a copy
    of its own (`build_layers`); `bf16`: bf16 training (the codecs' wire dtype)."""
    config = layers[1].layer.self_attn.config
    params = stage_params(layers, parts)
    S = len(parts) - 1
    tied = bool(config.tie_word_embeddings) and (S > 1 or apart)
    mixed = hetloco.replica_stages is not None and len(set(hetloco.replica_stages)) > 1
    blocks = sizes.block_parts(config.num_hidden_layers, hetloco.replica_stages) if mixed else None
    block_ids = [sizes.stage_blocks(config.num_hidden_layers, S, s, blocks) if mixed else [s] for s in range(S)]
    algorithms = [
        StageAlgorithm(params[s], hetloco, replica=replica, num_replicas=num_replicas,
                       hidden_size=config.hidden_size, vocab_size=config.vocab_size, device=device,
                       embeddings=[m for m in layers[parts[s]:parts[s + 1]] if isinstance(m, TokenEmbedding)],
                       layers=layers[parts[s]:parts[s + 1]], tied=tied,
                       blocks=param_blocks(layers, params[s], block_ids[s], blocks) if mixed else None, bf16=bf16)
        for s in range(S)]
    links = LocalStageLink.for_replica(S)
    for alg, link in zip(algorithms, links):
        alg.setup(link)
    return params, algorithms, links, block_ids


def link_bytes(sim, boundary: list[tuple[int, int]]) -> dict:
    """Bytes per optimizer step and replica on stage links (forward + backward; `boundary[m]`:
    replica m's codec's (forward, backward) bytes a micro-batch, `BoundaryCodec.nbytes`) and per
    outer step on replica links, from the shapes the real pipeline sends; `sim` is either simulator."""
    rows = []
    # every replica's depth (`boundary` covers every replica of the row, also where a sharded row's
    # process holds only some of them)
    depths = sim.hetloco.replica_stages or [sim.S] * len(boundary)
    for (fwd, bwd), depth in zip(boundary, depths):
        rows.append((fwd + bwd) * sim.gas * (depth - 1))
    outer = sum(payload_nbytes([tuple(ps[i].shape) for i in block], sim.hetloco.sparseloco)
                for ps, a in zip(sim.replicas[0].stage_params, sim.replicas[0].algorithms) for block in a.blocks)
    return {"stage_links_per_step": rows, "outer_payload_per_replica": outer}


def _block_view(r, b: int):
    """(algorithm, its block index k, the block's parameter indices) of block b in replica r."""
    for a, ids in zip(r.algorithms, r.block_ids):
        if b in ids:
            k = ids.index(b)
            return a, k, a.blocks[k]
    raise KeyError(f"no stage of replica {r} holds block {b}")


@torch.no_grad()
def outer_step_all(replicas, members: tuple[str, ...], shards=None, attack=None) -> dict:
    """One outer step of every block of every replica (`replicas[m].algorithms[s]`, `.links[s]`,
    `.block_ids[s]`), exactly as the engine's ranks take it: every stage prepares a payload per
    block it holds, each block's payloads are 'all-gathered' (a list, replica order), every stage
    finishes; then every stage of every replica syncs its embeddings
    (StageAlgorithm.sync_embeddings), after every owner of a shared aggregate (the first stage's
    T_S, a tied head's on the last stage) has offered it in its finish.

    With `attack` (a `sparseloco.attacks.Attack`) its replica's payload of every block is corrupted
    after the gather, where a peer's bad bytes would arrive, before any stage finishes.

    With `shards` (a `sharded.Shards`) `replicas` are this process's block of the row's `members`:
    the payloads, the replicas' parameters for the dense mean and their error norms are gathered
    from every block, in replica order, and the rest runs as on one process (the replicas leave
    an outer step with the same theta, so the applied update is any replica's).

    Returns the replicas excluded (and, under `sparseloco.screen`, those screened and each stage's
    decision: "screen": {"stage<s>": {"screened", and the screen's scores by replica id}}) and the
    per-sync diagnostics, computed from what the outer step has anyway (theta at the last sync, the
    replicas' parameters, the payloads, the error buffers), never inside inner steps:
      replicas_per_selected  entries sent / coordinates sent by anyone: 1 = no overlap, M = all agree
      update_cosine          cosine of the applied update theta_prev - theta_new (T_perp's part of
                             the embedding included) with the dense mean of the pseudo-gradients
      update_norm, dense_norm  their norms (1/M aggregation shrinks the first)
      error_norm             the error buffer's norm after this step, mean over replicas
    """
    gather = shards.gather if shards is not None else (lambda t: t)
    gather_list = shards.gather_list if shards is not None else list
    excluded: set[str] = set()
    screened: set[str] = set()
    scores: dict = {}
    selected = distinct = 0
    dev = replicas[0].algorithms[0].device
    dot, applied_sq, dense_sq = (torch.zeros((), dtype=torch.float64, device=dev) for _ in range(3))
    error_sq = torch.zeros(len(replicas), dtype=torch.float64, device=dev)
    blocks = range(1 + max(b for ids in replicas[0].block_ids for b in ids))
    snapshots = []
    for b in blocks:
        views = [_block_view(r, b) for r in replicas]
        ref, _, idx = views[0]
        theta = ref.outer.theta_prev
        before = [theta[i].to(dev, copy=True) for i in idx]  # the synced theta, alike on every replica
        dense = [tp - gather(torch.stack([a.params[j].detach().float() for a, _, js in views for j in js[n:n + 1]])).mean(0)
                 for n, tp in enumerate(before)]
        emb = [n for n, i in enumerate(idx) if any(ref.params[i] is e.weight for e in ref.embeddings)]
        perp = ref.perp.clone() if emb and ref.perp is not None else None
        snapshots.append((ref, idx, before, dense, emb, perp))
    payloads = [[a.prepare() for a in r.algorithms] for r in replicas]
    gathered = []
    for b in blocks:
        found = [(r.block_ids[s].index(b), s) for r in replicas for s in range(len(r.block_ids)) if b in r.block_ids[s]]
        # Every process of a sharded row reaches this gather once per block, in block order.
        gathered.append(Gathered(gather_list([payloads[m][s][k] for m, (k, s) in enumerate(found)]), members))
        if attack is not None:
            a, k, _ = _block_view(replicas[0], b)
            attack.apply(a.outer.states[k], gathered[-1].payloads, a.outer_steps, b)
    for m, r in enumerate(replicas):
        for s, (a, link, ids) in enumerate(zip(r.algorithms, r.links, r.block_ids)):
            result = a.finish([gathered[b] for b in ids], link, count_selected=m == 0)
            excluded.update(result.excluded)
            screened.update(result.screened)
            if m == 0 and result.scores:  # every replica decides alike: replica 0's view is every one's
                scores[f"stage{s}"] = {"screened": sorted(int(i) for i in result.screened), **result.scores}
            if m == 0:
                selected, distinct = selected + result.selected, distinct + result.distinct
            error_sq[m] += torch.stack(torch._foreach_norm(a.outer.error)).double().pow(2).sum()
    for r in replicas:
        for a, link in zip(r.algorithms, r.links):
            a.sync_embeddings(link)
    for ref, idx, before, dense, emb, perp in snapshots:
        applied = [bf - ref.params[i].detach().float() for bf, i in zip(before, idx)]
        if perp is not None:
            for n in emb:
                applied[n] += perp - ref.perp
        for a, d in zip(applied, dense):
            dot += (a.double() * d.double()).sum()
            applied_sq += a.double().pow(2).sum()
            dense_sq += d.double().pow(2).sum()
    dot, applied_sq, dense_sq, error = dot.item(), applied_sq.item(), dense_sq.item(), gather(error_sq).sqrt().mean().item()
    return {
        "excluded": sorted(int(m) for m in excluded),
        **({"screened": sorted(int(m) for m in screened), "screen": scores} if scores else {}),
        "replicas_per_selected": selected / distinct if distinct else None,
        "update_cosine": dot / (applied_sq * dense_sq) ** 0.5 if applied_sq and dense_sq else None,
        "update_norm": applied_sq ** 0.5,
        "dense_norm": dense_sq ** 0.5,
        "error_norm": error,
    }
