"""The outer step's rules by name: what the config's `sparseloco` keys choose, and where a new rule goes.

    AGGREGATIONS  `sparseloco.aggregation`: how the contributors' decoded payloads become one update
                  ("mean", "selected_count", "dense")
    CLIPS         `sparseloco.norm_clip`: what each contributor's decoded tensor is scaled to first
                  ("none", "median")
    TOPK_RULES    `sparseloco.topk_rule`: k per chunk ("scaled", "fixed"); this registry is `sizes.TOPK_RULES`
                  itself, since k decides the payload's bytes and sizes.py is where every size rule lives

A rule registered here (at import of the module that defines it, before the config is read) is a
name the config accepts, and every replica of a stage group must register the same one: the payload
header's fingerprint covers each chosen rule's identity (`Registry.identity`: the function's module
and qualified name, a dataclass rule's fields too), so replicas that chose or defined another rule
refuse each other's payloads instead of summing them.

    from hetloco_ds.sparseloco import aggregate

    @aggregate.aggregation("half_mean")
    def half_mean(pos, values, numel):
        return aggregate.scatter_sum(pos, values, numel), 0.5 / values.shape[0]

    cfg = SparseLoCoConfig(aggregation="half_mean")

The shapes a rule sees (n contributors in gathered order, a unit of G same-shape members of `per`
decoded entries each; positions are flat in the unit's [G * numel] state, distinct within one row):

    aggregation(pos [n, G*per] int64 | None when dense, values [n, G*per] fp32, numel = G * numel)
                -> (acc [numel] fp32, scale): the update direction is scale * acc
    clip(values [n, G, per] fp32) -> values of the same shape
    topk rule(chunk_len, topk, chunk_size) -> k in [1, chunk_len]

Every replica calls a rule on the same bytes in the same order, so a rule made of deterministic
tensor operations keeps the replicas bitwise identical; a rule must not depend on anything a replica
holds alone (its own payload, its rank, a random generator).

Importing this module imports no torch (the config reads the keys); the rules import it when called.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping

from .. import sizes

CLIP_EPS = 1e-8  # templar's: factor = min(1, median / (norm + 1e-8))


def _identity(rule: Any) -> str:
    if rule is None:
        return "None"
    if dataclasses.is_dataclass(rule) and not isinstance(rule, type):
        inner = ", ".join(f"{f.name}={_identity(getattr(rule, f.name))}" for f in dataclasses.fields(rule))
        return f"{type(rule).__module__}.{type(rule).__qualname__}({inner})"
    if callable(rule) and hasattr(rule, "__qualname__"):
        return f"{rule.__module__}.{rule.__qualname__}"
    return repr(rule)


class Registry(Mapping):
    """Rules of one config key by name, in registration order (`key`: the `sparseloco` field)."""

    def __init__(self, key: str, rules: dict):
        self.key = key
        self._rules = rules

    def __getitem__(self, name: str):
        if name not in self._rules:
            raise KeyError(self.unknown(name))
        return self._rules[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._rules)

    def __len__(self) -> int:
        return len(self._rules)

    def unknown(self, name: Any) -> str:
        return f"{self.key} must be one of {tuple(self._rules)}, got {name!r}"

    def check(self, name: Any) -> str:
        """`name` if registered, else one ValueError naming it and the registered names."""
        if not isinstance(name, str) or name not in self._rules:
            raise ValueError(self.unknown(name))
        return name

    def identity(self, name: str) -> str:
        """What the payload fingerprint records of rule `name`: stable across processes (no addresses)."""
        return f"{name}={_identity(self[name])}"

    def register(self, name: str, rule: Any):
        """Add `rule` as `name`; registering the same rule again is a no-op (a module imported twice),
        another rule under a taken name is refused."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"a {self.key} rule needs a non-empty name, got {name!r}")
        if name in self._rules and _identity(self._rules[name]) != _identity(rule):
            raise ValueError(f"{self.key} {name!r} is already registered as {_identity(self._rules[name])}; "
                             "register the new rule under another name")
        self._rules[name] = rule
        return rule


# --------------------------------------------------------------------------- aggregation
@dataclass(frozen=True)
class Aggregation:
    """An aggregation rule: `combine` (module docstring) and whether its payload is the dense control's."""

    combine: Callable
    dense: bool = False
    """The payload carries each replica's whole pseudo-gradient: no top-k, no quantisation, no error feedback."""

    def __call__(self, pos, values, numel: int):
        return self.combine(pos, values, numel)


def scatter_sum(pos, values, numel: int):
    """The contributors' decoded rows summed into a dense [numel] fp32 tensor, in row order.

    Positions inside one row are distinct, so each scatter_add_ adds exactly one value per address:
    the same bits on every replica and every run, atomics or not."""
    if pos is None:
        acc = values[0].clone()
        for r in range(1, values.shape[0]):
            acc.add_(values[r])
        return acc
    acc = values.new_zeros(numel)
    for r in range(values.shape[0]):
        acc.scatter_add_(0, pos[r], values[r])
    return acc


def _mean(pos, values, numel: int):
    """Paper eq. (2): the sum over the contributors, divided by their number (M when all contribute)."""
    return scatter_sum(pos, values, numel), 1.0 / values.shape[0]


def _selected_count(pos, values, numel: int):
    """templar's: each coordinate's sum divided by the contributors that selected it (0 where none did)."""
    acc = scatter_sum(pos, values, numel)
    if pos is None:
        return acc, 1.0 / values.shape[0]
    cnt = values.new_zeros(numel)
    for r in range(values.shape[0]):
        cnt.scatter_add_(0, pos[r], values.new_ones(values.shape[1]))
    return acc.div_(cnt.clamp_(min=1)), 1.0


AGGREGATIONS = Registry("aggregation", {
    "mean": Aggregation(_mean),
    "selected_count": Aggregation(_selected_count),
    "dense": Aggregation(_mean, dense=True),
})


def aggregation(name: str, *, dense: bool = False):
    """Decorator: register `combine(pos, values, numel) -> (acc, scale)` as aggregation `name`."""
    def register(combine: Callable) -> Callable:
        AGGREGATIONS.register(name, Aggregation(combine, dense))
        return combine
    return register


# --------------------------------------------------------------------------- clip
def _no_clip(values):
    return values


def _median_clip(values):
    """templar's: each contributor's decoded tensor scaled by min(1, med / (||d_r|| + 1e-8)), med the lower
    median over the contributors of ||d_r|| (L2, per tensor; positions inside one payload are distinct,
    so the norm of the values is the norm of the decoded sparse tensor)."""
    import torch

    norms = torch.linalg.vector_norm(values, dim=-1)  # [n, G]
    # The lower middle value for even n, as torch.median; by sort, which has a deterministic form on
    # a GPU (median's indices have none: train.deterministic would refuse it).
    median = norms.sort(dim=0).values[(norms.shape[0] - 1) // 2]
    return values * (median / (norms + CLIP_EPS)).clamp(max=1.0).unsqueeze(-1)


CLIPS = Registry("norm_clip", {"none": _no_clip, "median": _median_clip})


def clip(name: str):
    """Decorator: register `clip(values [n, G, per]) -> values` as norm_clip `name`."""
    def register(fn: Callable) -> Callable:
        CLIPS.register(name, fn)
        return fn
    return register


# --------------------------------------------------------------------------- top-k
TOPK_RULES = Registry("topk_rule", sizes.TOPK_RULES)


def topk_rule(name: str):
    """Decorator: register `k(chunk_len, topk, chunk_size) -> int` as topk_rule `name` (in sizes.TOPK_RULES)."""
    def register(fn: Callable) -> Callable:
        TOPK_RULES.register(name, fn)
        return fn
    return register


REGISTRIES = (AGGREGATIONS, CLIPS, TOPK_RULES)
"""Every registry, by its `sparseloco` key; the payload fingerprint covers the rule each names."""
