"""The outer step's rules by name: what the config's `sparseloco` keys choose, and where a new rule goes.

    AGGREGATIONS  `sparseloco.aggregation`: how the contributors' decoded payloads become one update
                  ("mean", "selected_count", "dense")
    CLIPS         `sparseloco.norm_clip`: what each contributor's decoded tensor is scaled to first
                  ("none", "median")
    SCREENS       `sparseloco.screen`: which contributors are left out before both ("none", "agreement")
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
    screen.measure(pos, values, numel) -> a tensor of statistics, summed over every unit of the
                payload; screen.decide(sums) -> (rows to drop, their scores by name, a list over
                the rows each)
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


# --------------------------------------------------------------------------- screen
@dataclass(frozen=True)
class AgreementScreen:
    """Leave out a contributor whose payload is far longer than the others' or points away from them.

    Over the whole payload (every tensor of the stage or block), with d_r contributor r's decoded
    pseudo-gradient, n contributors and f = (n - 1) // 2 (the most that can be left out while the
    kept ones stay a majority):

        norm_ratio_r = ||d_r|| / median_j ||d_j||                       (the lower median)
        z_rj         = <d_r, d_j> / sqrt(sum_i (d_ri d_ji)^2)
        agreement_r  = the (n - 1 - f)-th largest of z_rj, j != r

    z_rj is the inner product in units of its own spread under random signs: were d_j's entries
    given independent random signs (a payload of noise, or one that shares nothing with d_r), <d_r,
    d_j> would have mean 0 and exactly that standard deviation. So it says how surely two payloads
    point the same way, whatever their sparsity, density or overlap. agreement_r is r's with the least
    similar of its n - 1 - f closest peers (Krum's count of neighbours): an honest replica has at least
    that many honest peers, which point its way; a flipped, random or constant payload has none. Not
    the agreement with the sum of the others: with three replicas and one flipped, an honest one's
    "others" are the other honest one minus the attacker, zero in expectation.

    r is dropped when norm_ratio_r > `max_norm_ratio`; or, while median_j agreement_j is at least
    `min_median_agreement` (the honest replicas agree beyond doubt), when agreement_r is below both
    `min_agreement_ratio` x that median and `min_agreement` (a fraction of the honest level, so honest
    replicas that agree less than others are kept, and never within noise's reach of zero, where a
    random or constant payload sits); or, while the median is positive at all (below the floor, e.g.
    at a warmup's first steps or in a tiny model, failing to agree could be noise), when agreement_r <
    -`max_opposition` (it points against its closest peers beyond what noise does). At most f are
    dropped, the furthest past a threshold first; with fewer than `min_contributors` nobody is, since
    two payloads cannot say which of them is wrong.

    `measure` sums <d_r, d_j> and sum_i (d_ri d_ji)^2 over the units (so a stage is screened as one
    payload whatever its slicing): n scatters and n^2 gathers of the selected entries, one fp32
    transient of a unit's size; `decide` is one host sync."""

    max_norm_ratio: float = 3.0
    min_agreement_ratio: float = 0.25
    min_agreement: float = 3.0
    min_median_agreement: float = 8.0
    max_opposition: float = 3.0
    min_contributors: int = 3

    def measure(self, pos, values, numel: int):
        """[2, n, n] float64: <d_r, d_j> and sum_i (d_ri d_ji)^2 over this unit."""
        import torch

        v = values.double()
        if pos is None:
            return torch.stack([v @ v.T, v.square() @ v.square().T])
        n = values.shape[0]
        sums = v.new_zeros((2, n, n))
        dense = values.new_zeros(numel)
        for r in range(n):
            dense[pos[r]] = values[r]  # positions inside one row are distinct: a plain write
            prod = dense[pos].double() * v  # [n, per]: d_r at each row's positions, times that row
            sums[0, r], sums[1, r] = prod.sum(1), prod.square().sum(1)
            dense[pos[r]] = 0.0
        return sums

    def scores(self, sums) -> dict:
        """norm_ratio and agreement (class docstring) of each contributor, from `measure`'s sums."""
        import torch

        gram, spread = sums[0], sums[1].sqrt()
        n = gram.shape[0]
        norm = gram.diagonal().clamp(min=0).sqrt()
        z = torch.where(spread > 0, gram / spread.clamp(min=1e-300), torch.zeros_like(gram))
        z = z.masked_fill(torch.eye(n, dtype=torch.bool, device=gram.device), -float("inf"))
        if n > 1:
            agreement = z.sort(dim=1, descending=True).values[:, n - 2 - (n - 1) // 2]
        else:  # nobody to agree with
            agreement = torch.zeros(1, dtype=gram.dtype, device=gram.device)
        median = norm.sort().values[(n - 1) // 2]
        return {"norm_ratio": (norm / median.clamp(min=1e-300)).tolist(), "agreement": agreement.tolist()}

    def decide(self, sums) -> tuple[list[int], dict]:
        scores = self.scores(sums)
        ratio, agreement = scores["norm_ratio"], scores["agreement"]
        n = len(ratio)
        if n < self.min_contributors:
            return [], scores
        median = sorted(agreement)[(n - 1) // 2]
        if median >= self.min_median_agreement:
            floor = max(self.min_agreement, self.min_agreement_ratio * median)
        else:
            floor = -self.max_opposition if median > 0 else -float("inf")
        # How far past a threshold each one is (> 0: past it), norm and direction on one scale.
        past = [max(ratio[r] / self.max_norm_ratio - 1.0, (floor - agreement[r]) / max(abs(floor), 1.0))
                for r in range(n)]
        order = sorted((r for r in range(n) if past[r] > 0), key=lambda r: (-past[r], r))
        return sorted(order[: (n - 1) // 2]), scores


SCREENS = Registry("screen", {"none": None, "agreement": AgreementScreen()})


def screen(name: str, rule: Any):
    """Register `rule` (with `measure` and `decide`, module docstring) as screen `name`; returns it."""
    return SCREENS.register(name, rule)


REGISTRIES = (AGGREGATIONS, CLIPS, SCREENS, TOPK_RULES)
"""Every registry, by its `sparseloco` key; the payload fingerprint covers the rule each names."""
