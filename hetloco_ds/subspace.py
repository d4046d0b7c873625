"""Subspace projection of stage boundaries (paper sections 2.2 and 2.4).

Pure tensor functions: the basis U, the projection Pi(T) = T U U^T, the boundary codec
X~ = (X - T_perp[x]) U  /  X^ = X~ U^T + T_perp[x], the token-embedding split, its
re-projection after every outer sync, the whole table's weight decay, and the ablations' per-step
projections. Nothing here knows of DeepSpeed or processes.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .model import DecoderLayer
from .sizes import subspace_dim


def make_basis(d: int, k: int, seed: int) -> torch.Tensor:
    """U in R^{d x k} with orthonormal columns: QR of a seeded Gaussian matrix.

    Built on the CPU in float64 and rounded to float32, so every rank on every device gets
    the same bits without U ever being sent. The Gaussian is d x d and U takes its first k
    columns, so bases of one seed are nested: Col(U_k) is inside Col(U_k') for k <= k'.
    Replicas with different ratios therefore share the smallest subspace, which is where
    the trainable embedding T_S lives.
    """
    if not 1 <= k <= d:
        raise ValueError(f"subspace dimension k = {k} must be in [1, d = {d}]")
    gen = torch.Generator().manual_seed(seed)
    gauss = torch.randn(d, d, generator=gen, dtype=torch.float64)[:, :k]
    q, r = torch.linalg.qr(gauss)
    # Fix the sign ambiguity of QR so the basis does not depend on the LAPACK build.
    q = q * torch.sign(torch.diagonal(r)).unsqueeze(0)
    return q.to(torch.float32).contiguous()


def project(t: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Pi(T) = T U U^T, row-wise onto Col(U)."""
    return (t @ u) @ u.T


def split_embedding(table: torch.Tensor, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """TE -> (T_S, T_perp) with T_S = TE U U^T and T_perp = TE - T_S."""
    t_s = project(table, u)
    return t_s, table - t_s


def encode(hidden: torch.Tensor, ids: torch.Tensor, perp: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """X~ = (X - T_perp[x]) U: b x L x k. Autograd then sends grad(X^) U backward by itself."""
    return (hidden - F.embedding(ids.long(), perp).to(hidden.dtype)) @ u.to(hidden.dtype)


def decode(reduced: torch.Tensor, ids: torch.Tensor, perp: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """X^ = X~ U^T + T_perp[x]."""
    return reduced @ u.to(reduced.dtype).T + F.embedding(ids.long(), perp).to(reduced.dtype)


def off_subspace_norm(t: torch.Tensor, u: torch.Tensor) -> float:
    """||T - Pi(T)|| / ||T||: 0 when T lies in Col(U)."""
    denom = t.norm()
    if denom == 0:
        return 0.0
    return float((t - project(t, u)).norm() / denom)


@torch.no_grad()
def resync_embedding_(t_s: torch.Tensor | None, perp: torch.Tensor, avg: torch.Tensor, outer_lr: float, u: torch.Tensor) -> None:
    """Paper eqs. 3-4 after an outer sync, in place, given T_S = theta_prev - lr * avg.

    theta_prev is in Col(U) (projected at the previous sync), so
      T_perp += T_S - Pi(T_S) = -lr * (avg - Pi(avg))      and      T_S = Pi(T_S).
    T_perp's change depends only on the averaged T_S pseudo-gradient, so stages that hold
    T_perp but not T_S (`t_s is None`) apply the identical update from the small sparse
    aggregate, with the same operations in the same order: every holder ends bitwise equal.
    """
    avg = avg.to(perp.dtype)
    perp.add_(avg - project(avg, u), alpha=-outer_lr)
    if t_s is not None:
        t_s.copy_(project(t_s, u))


@torch.no_grad()
def project_rows_(weight: torch.Tensor, u: torch.Tensor) -> None:
    """In place, W <- U U^T W for a residual-writing weight [d, in] (its outputs land in Col(U))."""
    weight.copy_(u @ (u.T @ weight))


@torch.no_grad()
def project_embeddings_(embeddings, basis: torch.Tensor) -> None:
    """T_S <- Pi(T_S) onto Col(`basis`) on every TokenEmbedding given, in place."""
    for emb in embeddings:
        emb.weight.copy_(project(emb.weight, basis))


@torch.no_grad()
def project_residual_weights_(layers, basis: torch.Tensor) -> None:
    """The Table 5b ablation: o_proj's and down_proj's outputs into Col(U) on every DecoderLayer
    among `layers`, in place."""
    for layer in layers:
        if isinstance(layer, DecoderLayer):
            project_rows_(layer.layer.self_attn.o_proj.weight, basis)
            project_rows_(layer.layer.mlp.down_proj.weight, basis)


@torch.no_grad()
def decay_perp_share_(embeddings, perp: torch.Tensor, decay: float) -> None:
    """T_S -= decay * T_perp on every TokenEmbedding given, in place: after an AdamW step that
    shrank T_S by (1 - decay), TE = T_S + T_perp has shrunk as a whole. T_perp stays as it is,
    so every stage's copy stays bitwise equal; its share reaches it at the next sync."""
    if decay == 0:
        return
    for emb in embeddings:
        emb.weight.add_(perp.to(emb.weight.dtype), alpha=-decay)


def split_basis(cfg, num_replicas: int, d: int, seed: int) -> torch.Tensor | None:
    """The basis T_S lives in: the smallest k among compressed replicas (bases of one seed
    nest, so it lies inside every compressed replica's Col(U)); None when nobody compresses."""
    ratios = [cfg.ratio_for(m, num_replicas) for m in range(num_replicas) if cfg.compressed(m, num_replicas)]
    if not ratios:
        return None
    return make_basis(d, subspace_dim(d, max(ratios)), seed)
