"""SparseLoCo's outer step for the parameters of one pipeline stage of one replica (eq. 2).

    delta = theta_prev - theta_m             e = beta * e + delta
    c     = Q(TOPK(e))                       e = e - dequant(c)
    avg   = (1 / contributors) * sum_m dequant(c_m)
    theta = theta_prev - outer_lr * avg      (written into the parameters; theta_prev = theta)

Rules (`config.SparseLoCoConfig`, the one schema and the one set of defaults; each key names a rule
of a registry in aggregate.py, where a new one is registered; the "paper" preset is eq. (2) as written)
    screen      "agreement"       before everything below, a finite payload that disagrees with the
                                  others is left out as a non-finite one is (aggregate.py).
    aggregation "mean"            eq. (2): sum / contributing replicas (M when all are finite).
                "selected_count"  per coordinate: sum / replicas that selected it (0 where none did).
                "dense"           the uncompressed control: every replica sends its whole delta
                                  (no top-k, no quantisation, no error feedback), / contributors.
    norm_clip   "median"          before the sum, replica r's decoded tensor d_r of each parameter
                                  is scaled by min(1, med / (||d_r|| + 1e-8)), med = the lower
                                  median over the contributors of ||d_r|| (L2, per tensor).
    outer_momentum mu > 0         Nesterov outer SGD: b = mu*b + avg; theta -= outer_lr*(avg + mu*b).
    The sender's error feedback never sees any of this: it subtracts what it sent, and the
    division, the clip and the momentum act on the receivers' aggregate only.
    Presets (`presets.PRESETS`): "templar" (below), "diloco" (dense, outer_lr 0.7, Nesterov 0.9).

What the SparseLoCo authors' code does (github.com/tplr-ai/templar, v2.1.3, Sept 2025:
src/tplr/compress.py, src/tplr/neurons.py, src/tplr/distributed.py, hparams/hparams.json)
    pseudo-gradient  DistributedHelper.restore_offloaded_params: p.grad = theta_prev - theta, theta
                     restored to theta_prev.
    error feedback   neurons.prepare_gradient_dict: e = momentum_decay * e + outer_learning_rate * delta
                     (0.95 and 1.0 in hparams.json), then e -= decode(what was sent, after
                     quantisation). The outer lr multiplies delta here *and* the aggregate below,
                     so it acts twice; at the configured 1.0 this is moot. We apply it once.
    chunking         ChunkingTransformer(target_chunk=64): every dimension of a parameter is cut
                     to its largest divisor <= 64 (_get_smaller_split). 2-D: 64 x 64 tiles,
                     flattened row-major, tiles row-major (the same as our "tiles"); 1-D: chunks
                     of <= 64 elements (our "per_dim"; ours put <= 4096 in a 1-D chunk). No DCT
                     (use_dct false).
    top-k            TopKCompressor.compress: torch.topk(|x|, k, sorted=False) per chunk, signed
                     values sent, k = _clamp_topk(topk_compression): min(topk, chunk), >= 2, even,
                     the same k for every chunk (our "fixed"): a 64-element 1-D chunk sends 32.
                     topk_compression is 32 in hparams.py's defaults (and in hparams.json until
                     2025-09-01, 64 since). Indices packed 12 bits, two in three bytes (as ours).
    quantisation     always on (quantization_bins 4 = 2 bits, range 6 std): per tensor, centred on
                     the mean, scale = 6 * std / bins with std = ||v - mean|| / sqrt(n - 1) (our
                     "sample"), code = clamp(round(centred / scale + bins/2), 0, bins - 1) (our
                     "nearest"), decoded to the mean of the bin's values (_quantize_values /
                     _dequantize_values).
    aggregation      neurons.outer_step -> TopKCompressor.batch_decompress(clip_norm=True): per
                     parameter, the norms of the peers' (dequantised) value vectors, their
                     torch.median, each peer's values scaled by clamp(median / (norm + 1e-8),
                     max=1) *before* the division; then scatter_reduce_(reduce="mean",
                     include_self=False): each coordinate divided by the peers that selected it.
                     So the clip is per tensor, per sender, on what it sent, not on the aggregate.
    outer step       p.grad = that aggregate; torch.optim.SGD(lr=outer_learning_rate), no
                     momentum, no weight decay (neurons/trainer.py).
    Our "templar" preset is this rule set without the doubled outer lr (it is 1.0 in both);
    quantisation stays off unless quant_bits is set (2 for templar's), as in the paper's runs.
    Checked against templar's compress.py itself (one outer step, M = 4, one replica 1000x,
    LLaMA-like 1-D and 2-D shapes): the synced theta agrees to float32 rounding (<= 2e-6 on
    steps of ~6), with and without 2-bit quantisation.

Pure logic, no process group: the collective is injected by the caller, in two phases,

    payload = state.prepare(params)          # this replica's compact uint8 buffer
    gathered = all_gather(payload)           # caller's collective, rank order = replica order
    report = state.finish(params, gathered)

so a test drives M fake replicas in one process by passing the list of their payloads.

One payload per stage and outer step, laid out and checked by payload.py (`PayloadLayout`: a
self-checking header, then the parameters grouped by shape), the same length on every replica of a
stage group. A replica whose pseudo-gradient holds a NaN/Inf sends the same length with the finite
flag cleared and a zero body; its error buffer is left as it was, and `finish` averages over the
others only and restores every replica, the faulty one included, to the same synced theta. A
payload flagged finite whose values are not (a faulty or hostile sender) is left out the same way.

Determinism: every replica decodes the same bytes and sums them in fp32 in replica order, one
scatter-add per replica; positions inside one payload are distinct, so each address receives
exactly one add per call and the result does not depend on atomics or thread order. All replicas
then apply the same fused update, so they end bitwise identical (on the same kind of device).
theta is computed as theta_prev + (-outer_lr / n) * sum, i.e. eq. (2) with the 1/n and the
outer lr folded into one scale (equal to theta_prev - outer_lr * avg up to the last bit).

Cost: prepare makes two dense passes to form the new e (theta_prev - param, then + beta * e;
the new buffer replaces the old one, no copy), one |.|/tiling pass, and torch.topk, which
dominates; everything after top-k is O(selected). finish makes three dense passes (zero the
sum, update theta_prev, copy theta into the parameters) plus one O(selected) scatter-add per
replica. Both walk the state in units: a same-shape group's members in slices of at most
`UNIT_NUMEL` elements (one member when a member is larger), so the transients beside the state
(|e| tiles for top-k, the decoded sum, a host-resident unit's device copies) are a few units,
not the size of the largest group. Memory: prepare holds the old and new error buffers until it
knows the replica is finite (+4 B/parameter of the stage, transient, on the device); finish
allocates a transient fp32 sum the size of one unit at a time.
Under "dense" the payload is the whole stage (numel x value_dtype) and finish adds M whole
tensors; norm_clip adds one O(selected) pass; outer_momentum one fp32 buffer per parameter
(in state_dict as "momentum") and two dense passes. Every finish checks the values of the payloads
flagged finite (one O(selected) pass, one host sync); a screen decodes every payload once more
before aggregating ("agreement": M scatters and M^2 gathers of O(selected), a unit-sized fp32
transient, one host sync).

Where the state lives between outer steps (`on_host`, config `sparseloco.outer_state_device`):
on the parameters' device, or in host memory (pinned when the device is a GPU), 8 B/parameter
(12 with outer momentum) off the device. On the host, each unit is copied to the device on a
side stream while the previous unit computes, and the results are copied back on that stream
without a host wait (torchft's DiLoCo keeps its backup of the synced parameters on the host the
same way); a host read of the state (`theta_prev`, `error`, `state_dict`, `rebase`) first waits
for those copies. The computation is the same code on the same units either way, so the two
placements train the same bits.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Sequence

import torch
from torch import Tensor

from .. import sizes
from .aggregate import AGGREGATIONS, CLIPS, SCREENS
from .payload import PayloadLayout, Section, is_dense, outer_config

UNIT_NUMEL = sizes.OUTER_UNIT_NUMEL
"""Elements of the largest slice of a same-shape group the outer step works on at once (module docstring)."""


@dataclass(frozen=True)
class OuterReport:
    """What one outer step did on this replica."""

    bytes_per_replica: int
    """Payload length every replica sent (header included)."""
    contributors: tuple[int, ...]
    """Replica indices (positions in the gathered list) whose pseudo-gradients were averaged."""
    excluded: tuple[int, ...]
    """Replica indices left out: a non-finite pseudo-gradient, or dropped by the screen (`screened`)."""
    averages: dict[int, Tensor] = field(default_factory=dict)
    """Parameter index -> dense fp32 update direction `avg` with theta = theta_prev - outer_lr * avg (the
    aggregate; with outer momentum the Nesterov step), only for the indices asked via `keep_average`."""
    selected: int | None = None
    """With `count_selected`: entries the contributors sent, summed over them (n * k per chunk)."""
    distinct: int | None = None
    """With `count_selected`: coordinates at least one contributor sent; selected / distinct is the
    mean number of replicas behind each coordinate of the aggregate (n when dense)."""
    screened: tuple[int, ...] = ()
    """Replica indices the screen (`sparseloco.screen`) dropped from a finite payload; also in `excluded`."""
    scores: dict = field(default_factory=dict)
    """The screen's scores by name, each a list over the payloads (None for a non-finite one; empty without a screen)."""


@dataclass
class _Group(Section):
    """A payload section's parameters with their state stacked, [G, *shape]."""

    theta_prev: Tensor
    error: Tensor
    momentum: Tensor | None = None

    @property
    def numel(self) -> int:
        """Elements of one member."""
        return self.theta_prev[0].numel()


@dataclass(frozen=True)
class _Unit:
    """Members [lo, hi) of one group: what the outer step computes on at once."""

    group: _Group
    lo: int
    hi: int

    @property
    def members(self) -> list[int]:
        return self.group.members[self.lo:self.hi]

    def of(self, stacked: Tensor) -> Tensor:
        """This unit's slice of a group's stacked [G, ...] tensor (a view)."""
        return stacked[self.lo:self.hi]


class _HostCopies:
    """Copies of host-resident outer state to and from the stage's device, on a side CUDA stream.

    A fetch is issued on the side stream and waited for by the compute stream only when used, so
    the next unit's copy runs while this one computes; a store waits for the compute that made the
    value, then copies on the side stream, and nothing waits for it until the host reads the state
    (`settle`). Every tensor crossing streams is recorded on the stream that last uses it, so the
    caching allocator never hands its memory out early. On a CPU device the copies are plain
    copies: the same path, the same values, nothing to overlap.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._unsettled = False

    def fetch(self, hosts: Sequence[Tensor]):
        """Start copying `hosts` to the device; `ready` gives the device tensors."""
        if self.stream is None:
            return [h.clone() for h in hosts], None
        with torch.cuda.stream(self.stream):
            out = [torch.empty(h.shape, dtype=h.dtype, device=self.device) for h in hosts]
            for o, h in zip(out, hosts):
                o.copy_(h, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.stream)
        return out, done

    def ready(self, fetched) -> list[Tensor]:
        out, done = fetched
        if done is not None:
            compute = torch.cuda.current_stream(self.device)
            compute.wait_event(done)
            for o in out:
                o.record_stream(compute)
        return out

    def store(self, value: Tensor, host: Tensor) -> None:
        """host <- value, once the compute stream's work so far (which made `value`) is done."""
        if self.stream is None:
            host.copy_(value)
            return
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            host.copy_(value, non_blocking=True)
        value.record_stream(self.stream)
        self._unsettled = True

    def settle(self) -> None:
        """Wait for every store: the host copy is then current."""
        if self._unsettled:
            self.stream.synchronize()
            self._unsettled = False


class SparseLoCoState:
    """theta_prev and error-feedback buffers of one stage of one replica, and its outer step.

    `params` fixes the parameter order and shapes for the life of the state; every replica
    of the stage group must pass the same shapes in the same order, starting from identical
    values (the state snapshots them as theta_prev). `on_host`: keep the state in host memory
    between outer steps (module docstring). `unit_numel`: elements of the largest slice of a
    same-shape group computed on at once (`UNIT_NUMEL`).
    """

    def __init__(self, params: Sequence[Tensor], cfg=None, *, on_host: bool = False, unit_numel: int = UNIT_NUMEL):
        params = list(params)
        if not params:
            raise ValueError("SparseLoCoState needs at least one parameter")
        devices = {p.device for p in params}
        if len(devices) != 1:
            raise ValueError(f"all parameters of a stage must be on one device, got {sorted(map(str, devices))}")
        self.cfg = outer_config(cfg)
        # The rules are looked up once: the state keeps the ones its fingerprint names.
        self.dense = is_dense(self.cfg)
        self._aggregation, self._clip = AGGREGATIONS[self.cfg.aggregation], CLIPS[self.cfg.norm_clip]
        self._screen = SCREENS[self.cfg.screen]
        self.device = params[0].device
        self.on_host = on_host
        self._copies = _HostCopies(self.device) if on_host else None
        self.shapes = [tuple(p.shape) for p in params]
        self.layout = PayloadLayout(self.shapes, self.cfg, self.device)
        self.nbytes = self.layout.nbytes
        self._groups: list[_Group] = []
        self._units: list[_Unit] = []
        self._where: list[tuple[int, int]] = [(0, 0)] * len(params)
        # The units as sizes cuts them (plan's memory rule walks the same list).
        spans: dict[tuple[int, ...], list[tuple[int, int]]] = {}
        for shape, lo, hi in sizes.outer_units(self.shapes, unit_numel):
            spans.setdefault(shape, []).append((lo, hi))
        with torch.no_grad():
            for sec in self.layout.sections:
                tp = self._snapshot([params[i] for i in sec.members])
                momentum = self._zeros(tp) if self.cfg.outer_momentum > 0 else None
                group = _Group(sec.shape, sec.members, sec.codec, sec.offset, tp, self._zeros(tp), momentum)
                for j, i in enumerate(sec.members):
                    self._where[i] = (len(self._groups), j)
                self._groups.append(group)
                self._units += [_Unit(group, lo, hi) for lo, hi in spans[tuple(sec.shape)]]
        self._pending = False

    # ------------------------------------------------------------------ where the state lives
    def _snapshot(self, params: list[Tensor]) -> Tensor:
        """fp32 [G, *shape] copy of same-shape parameters, where the state lives."""
        if not self.on_host:
            return torch.stack([p.detach().to(torch.float32) for p in params])
        # Filled member by member: no device transient the size of the group.
        out = torch.empty((len(params), *params[0].shape), dtype=torch.float32, pin_memory=self._pinned)
        for o, p in zip(out, params):
            o.copy_(p.detach())
        return out

    def _zeros(self, like: Tensor) -> Tensor:
        if not self.on_host:
            return torch.zeros_like(like)
        return torch.zeros(like.shape, dtype=like.dtype, pin_memory=self._pinned)

    @property
    def _pinned(self) -> bool:
        # Pinned memory needs CUDA; asynchronous copies need it pinned.
        return self.on_host and self.device.type == "cuda"

    def _walk(self, names: Sequence[str]):
        """(unit, {name: the unit's state on the device}) for every unit, in order. Resident state
        comes as views (in-place updates land in it); host state as device copies, the next unit's
        already in flight while the caller computes on this one (`_keep` writes them back)."""
        if not self.on_host:
            for u in self._units:
                yield u, {n: u.of(getattr(u.group, n)) for n in names}
            return

        def fetch(u: _Unit):
            return self._copies.fetch([u.of(getattr(u.group, n)) for n in names])

        ahead = fetch(self._units[0])
        for k, u in enumerate(self._units):
            current, ahead = ahead, (fetch(self._units[k + 1]) if k + 1 < len(self._units) else None)
            yield u, dict(zip(names, self._copies.ready(current)))

    def _keep(self, unit: _Unit, name: str, value: Tensor) -> None:
        """The unit's new `name` (a device tensor from `_walk`) back where the state lives."""
        if self.on_host:
            self._copies.store(value, unit.of(getattr(unit.group, name)))

    # ------------------------------------------------------------------ views
    def _view(self, which: str, i: int) -> Tensor:
        if self.on_host:
            self._copies.settle()
        g, j = self._where[i]
        return getattr(self._groups[g], which)[j]

    @property
    def theta_prev(self) -> list[Tensor]:
        """fp32 parameters at the last sync, per parameter (views into the state, on the host when
        `on_host`)."""
        return [self._view("theta_prev", i) for i in range(len(self.shapes))]

    @property
    def error(self) -> list[Tensor]:
        """fp32 error-feedback buffers, per parameter (views into the state; zero under 'dense')."""
        return [self._view("error", i) for i in range(len(self.shapes))]

    @property
    def momentum(self) -> list[Tensor] | None:
        """fp32 outer-momentum buffers, per parameter (views), or None without outer momentum."""
        if self.cfg.outer_momentum == 0:
            return None
        return [self._view("momentum", i) for i in range(len(self.shapes))]

    def synced(self, i: int) -> Tensor:
        """theta_prev of parameter i as a new tensor on the parameters' device."""
        return self._view("theta_prev", i).to(self.device, copy=True)

    @torch.no_grad()
    def rebase(self, i: int, value: Tensor) -> None:
        """Set theta_prev of parameter i to `value` (after an in-place change of the synced
        parameter outside the outer step, e.g. the T_S projection of eqs. 3-4)."""
        self._view("theta_prev", i).copy_(value)

    @torch.no_grad()
    def matches(self, params: Sequence[Tensor]) -> bool:
        """Whether `params` equal theta_prev bit for bit. Compared on the parameters' device unit by
        unit, host-resident state brought over as the outer step brings it: never a whole copy of
        the state on the device, and a host-resident state never meets a device tensor in one op."""
        params = self._check(params)
        same = True
        for u, state in self._walk(("theta_prev",)):
            theta = state["theta_prev"]
            same = same and all(torch.equal(theta[j], params[i].detach()) for j, i in enumerate(u.members))
        return same

    def _check(self, params: Sequence[Tensor]) -> list[Tensor]:
        params = list(params)
        shapes = [tuple(p.shape) for p in params]
        if shapes != self.shapes:
            raise ValueError(f"parameters changed since the state was built: {len(shapes)} tensors {shapes[:4]}..., "
                             f"expected {len(self.shapes)} tensors {self.shapes[:4]}...")
        return params

    # ------------------------------------------------------------------ phase 1
    @torch.no_grad()
    def prepare(self, params: Sequence[Tensor]) -> Tensor:
        """Error feedback and compression; returns this replica's uint8 payload of `self.nbytes`."""
        params = self._check(params)
        if self._pending:
            raise RuntimeError("prepare() called twice without finish(): the error buffer would absorb delta twice")
        beta, dense = self.cfg.error_decay, self.dense
        # The new error buffers, on the device until the replica is known to be finite.
        fresh = {id(g): torch.empty((len(g.members), *g.shape), device=self.device) for g in self._groups}
        staged = []
        finite = []
        for u, state in self._walk(("theta_prev",) if dense or beta == 0 else ("theta_prev", "error")):
            e_new = u.of(fresh[id(u.group)])
            for j, i in enumerate(u.members):
                torch.sub(state["theta_prev"][j], params[i], out=e_new[j])  # delta
            if dense:  # no error feedback: delta itself is sent
                finite.append(torch.isfinite(e_new).all())
                staged.append((u, e_new, None))
                continue
            if beta != 0:
                e_new.add_(state["error"], alpha=beta)
            sel = u.group.codec.select(e_new)
            # A NaN/Inf anywhere in a chunk ranks first in its top-k, so checking the selected
            # values is checking the whole pseudo-gradient (test_topk_selects_nonfinite_first).
            finite.append(torch.isfinite(sel.values).all())
            staged.append((u, e_new, sel))
        ok = bool(torch.stack(finite).all())  # the one host sync of prepare
        payload = self.layout.blank(ok)
        if ok:
            for u, e_new, sel in staged:
                rows = u.of(u.group.rows(payload))
                if sel is None:  # dense: the error buffer stays zero, a bf16 cast's residual is dropped
                    u.group.codec.pack_(rows, e_new)
                    continue
                sent = u.group.codec.pack_(rows, sel)
                # e = e - dequant(c): only the selected coordinates change.
                e_new.view(len(u.members), -1).scatter_(1, sel.pos, sel.values - sent)
            if not dense:
                for g in self._groups:
                    if self.on_host:
                        self._copies.store(fresh[id(g)], g.error)
                    else:  # into the same storage: a checkpoint's host copy of it is then reused
                        g.error.copy_(fresh[id(g)])
        # else: error buffers stay as they were, the body stays zero, the flag says excluded.
        self._pending = True
        return payload

    def value_sections(self, payload: Tensor) -> list[Tensor]:
        """Writable views of a payload's float sections, one [members, n] per same-shape group
        (`PayloadLayout.value_sections`): where a fault injection corrupts what a replica sends."""
        return self.layout.value_sections(payload)

    # ------------------------------------------------------------------ phase 2
    @torch.no_grad()
    def finish(self, params: Sequence[Tensor], payloads: Sequence[Tensor],
               keep_average: bool | Iterable[int] = False, count_selected: bool = False) -> OuterReport:
        """Aggregate the gathered payloads (in list order), apply the outer step, write the
        synced theta into `params` in place.

        `keep_average`: True, or the parameter indices, for which the report carries the dense
        fp32 `avg` with theta = theta_prev - outer_lr * avg (the embedding resync needs it for T_S).
        `count_selected`: the report carries `selected` and `distinct` (one boolean pass over
        each group's state and one host sync; a diagnostic, off in training).
        """
        params = self._check(params)
        if not self._pending:
            raise RuntimeError("finish() called without prepare()")
        flags = self.layout.flags(payloads)
        payloads = [p.to(self.device) for p in payloads]
        finite = self.layout.finite_values(payloads, tuple(m for m, f in enumerate(flags) if f))
        screened, scores = self._screened(payloads, finite)
        contributors = tuple(m for m in finite if m not in screened)
        excluded = tuple(m for m in range(len(flags)) if m not in contributors)
        keep = set(range(len(params))) if keep_average is True else set(keep_average or ())
        lr, n, mu = self.cfg.outer_lr, len(contributors), self.cfg.outer_momentum
        averages: dict[int, Tensor] = {}
        counts = [0, torch.zeros((), dtype=torch.int64, device=self.device)] if count_selected else None
        for u, state in self._walk(("theta_prev", "momentum") if n and mu > 0 else ("theta_prev",)):
            g, theta = u.group, state["theta_prev"]
            if n == 0:
                averages.update({i: torch.zeros(g.shape, device=self.device) for i in u.members if i in keep})
            else:
                acc, scale = self._aggregate(g, [u.of(g.rows(payloads[m])) for m in contributors], counts)
                if mu > 0:
                    # Nesterov (torch.optim.SGD's form, dampening 0): b = mu*b + avg; step = avg + mu*b
                    avg = acc.mul_(scale)
                    buf = state["momentum"]
                    buf.view(-1).mul_(mu).add_(avg)
                    acc, scale = avg.add_(buf.view(-1), alpha=mu), 1.0
                    self._keep(u, "momentum", buf)
                # theta = theta_prev - lr * (scale * sum), fused into one pass over the unit
                theta.view(-1).add_(acc, alpha=-lr * scale)
                for j, i in enumerate(u.members):
                    if i in keep:
                        averages[i] = (acc[j * g.numel:(j + 1) * g.numel] * scale).view(g.shape)
                self._keep(u, "theta_prev", theta)
            # every replica, the excluded ones too, leaves with the synced theta
            torch._foreach_copy_([params[i] for i in u.members], list(theta.unbind(0)))
        self._pending = False
        selected, distinct = (counts[0], int(counts[1])) if counts is not None else (None, None)
        return OuterReport(self.nbytes, contributors, excluded, averages, selected, distinct, screened, scores)

    def _screened(self, payloads: list[Tensor], finite: tuple[int, ...]) -> tuple[tuple[int, ...], dict]:
        """(replica indices the screen drops, its scores by name, each a list over the payloads, None for
        a non-finite one): one pass
        over every unit's decoded rows to sum the screen's statistics, then its decision, made from
        the same bytes in the same order on every replica."""
        if self._screen is None or not finite:
            return (), {}
        totals = None
        for u in self._units:
            g = u.group
            pos, values = self._decode(g, [u.of(g.rows(payloads[m])) for m in finite])
            stats = self._screen.measure(pos, values.reshape(len(finite), -1), len(u.members) * g.numel)
            totals = stats if totals is None else totals + stats
        drop, scores = self._screen.decide(totals)
        full = {name: [None] * len(payloads) for name in scores}
        for name, values in scores.items():
            for r, v in zip(finite, values):
                full[name][r] = v
        return tuple(sorted(finite[r] for r in drop)), full

    def _decode(self, g: _Group, rows: list[Tensor]) -> tuple[Tensor | None, Tensor]:
        """The contributors' rows (each [size, nbytes], size members of group g) decoded at once:
        values [n, size, per] (per = numel when dense, else n_selected) and, for sparse payloads,
        positions [n, size * per] in the members' flattened [size * numel] state."""
        n, size, numel = len(rows), rows[0].shape[0], g.numel
        flat = torch.stack(rows).view(n * size, g.codec.nbytes)
        if self.dense:
            return None, g.codec.unpack(flat).view(n, size, -1)
        pos, values = g.codec.unpack(flat)
        starts = torch.arange(0, size * numel, numel, device=self.device)  # each member's first element
        return (pos.view(n, size, -1) + starts.view(1, size, 1)).view(n, -1), values.view(n, size, -1)

    def _aggregate(self, g: _Group, rows: list[Tensor], counts: list | None = None) -> tuple[Tensor, float]:
        """(acc, scale) over the contributors' payload rows (each [size, nbytes], size members of
        group g), in list order: the aggregate of those members' flattened [size * numel] state is
        scale * acc. `counts`, when given, [selected, distinct] to add their entries sent and
        coordinates sent by anyone to."""
        n, size, numel = len(rows), rows[0].shape[0], g.numel
        pos, values = self._decode(g, rows)
        # Per tensor, over the contributors' decoded tensors; every replica computes it from the same
        # bytes in the same order: identical factors.
        values = self._clip(values).reshape(n, -1)
        if counts is not None:
            if pos is None:  # dense: every coordinate from every contributor
                counts[0] += n * size * numel
                counts[1] += size * numel
            else:
                hit = torch.zeros(size * numel, dtype=torch.bool, device=self.device)
                hit[pos.reshape(-1)] = True
                counts[0] += pos.numel()
                counts[1] += hit.sum()
        return self._aggregation(pos, values, size * numel)

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict:
        """theta_prev and error buffers per parameter (views, on the host when `on_host`: serialise
        before the next prepare)."""
        if self._pending:
            raise RuntimeError("state_dict() between prepare() and finish(): checkpoint at an outer-step boundary")
        state = {"shapes": list(self.shapes), "theta_prev": self.theta_prev, "error": self.error}
        if self.momentum is not None:
            state["momentum"] = self.momentum
        return state

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        shapes = [tuple(s) for s in state["shapes"]]
        if shapes != self.shapes:
            raise ValueError(f"checkpointed SparseLoCo state has {len(shapes)} parameters {shapes[:4]}..., "
                             f"this stage has {len(self.shapes)} {self.shapes[:4]}...")
        if self.momentum is not None and "momentum" not in state:
            raise ValueError(f"checkpointed SparseLoCo state has no outer-momentum buffers; this config has "
                             f"outer_momentum = {self.cfg.outer_momentum}")
        for i in range(len(self.shapes)):
            self._view("theta_prev", i).copy_(state["theta_prev"][i])
            self._view("error", i).copy_(state["error"][i])
            if self.momentum is not None:
                self._view("momentum", i).copy_(state["momentum"][i])
        self._pending = False
