"""Shaped links on one Linux host: one network namespace per rank, tc-limited per link class.

Layout (all of it inside namespaces this module creates; the host's interfaces, addresses and
routes are never touched):

    hl-<pid>-<tag>-hub :  bridge br0 with ports p0 .. p{W-1}   (no address)
    hl-<pid>-<tag>-<i> :  lo up, veth hl0 = 10.77.x.y/16 (peer p<i> on the hub's bridge)

Every rank reaches every other rank through the bridge. Shaping is on each rank's egress (hl0):
an htb root whose unclassified traffic passes unshaped, plus one htb class per peer whose link
has a rate (with two children, below), selected by a u32 match on the peer's address. A link is

* "stage": same replica, adjacent stages (activations one way, gradients the other);
* "replica": same stage, different replicas (the SparseLoCo outer sync);
* "other": anything else (rendezvous, DeepSpeed's global collectives), unshaped by default.

Egress shaping on both ends makes each link full duplex at its rate, as plan.py assumes. Two
details keep a transfer from moving faster or slower than bytes / rate:

* no GSO burst: each hl0 gets `gso_max_segs 1` (the `gso_max_segs` argument), so TCP hands htb
  one MTU-sized frame at a time. With GSO on (veth's default, gso_max_size 65536), htb passes a
  whole 64 KB segment whenever its tokens are non-negative, so after an idle gap up to 64 KB
  leave ahead of the rate (a 160 KB transfer at 5 Mbit/s took 0.81x bytes / rate; 0.98-1.0x
  without GSO). htb's own burst / cburst is already one frame (tc's default at these rates:
  1600 bytes). The price is CPU: a frame per skb caps a link at what the host can push frame by
  frame (on the 2-core benchmark machine, under load, a 4 MB send took 84 ms on a 10 Gbit/s
  class and 97 ms at 1 Gbit/s, i.e. ~0.4 Gbit/s): rates of ~1 Gbit/s and more are CPU-bound.
  A larger gso_max_segs trades burst (gso_max_segs x 1448 bytes ahead of the rate after an
  idle gap) for CPU; it applies to connections opened after the network is up.
* ACKs first (`ack_priority`, on by default): each shaped link is an htb class at the link's
  rate with two children that share it: TCP segments without payload (ACKs, SYNs) at priority
  0, everything else at priority 1. With one FIFO per link, the ACKs of the data a rank
  receives wait behind the data it sends on the same link (htb's leaf queue holds up to 1000
  frames, 2.4 s at 5 Mbit/s); when both directions of a pair are busy at once (an all-gather),
  one direction then stalls for want of ACKs: a 160 KB exchange at 5 Mbit/s took 1.0x-1.6x a
  one-way send. ACKs still count against the link's rate. Only payload-free segments jump
  the queue: a segment with stream bytes overtaking earlier ones would arrive out of order.

Latency is *not* applied: this kernel has no netem (nor prio/ifb to build a delay from), so the
harness only limits rate; link latency lives in the cost model (`plan.predict(stage_latency=...)`).

Usage: `run_shaped(cmd_for_rank, world, rank_coords, stage_rate_bps, replica_rate_bps)` runs one
command per rank inside its namespace with MASTER_ADDR / MASTER_PORT / RANK / WORLD_SIZE /
LOCAL_RANK and GLOO_SOCKET_IFNAME set, and tears the network down afterwards, also on errors,
Ctrl-C or SIGTERM. `ShapedNetwork` is the context manager underneath, for callers that want to
start processes themselves or read tc's byte counters (`link_bytes`).
"""
from __future__ import annotations

import dataclasses
import functools
import os
import random
import re
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from typing import Callable, Mapping, Sequence

from . import sizes
from .launch import die_with_parent
from .launch import signal_group as _signal_group

PREFIX = "hl-"
"""Every namespace this module creates is named PREFIX + '<creator pid>-<tag>-...'."""
IFACE = "hl0"
"""The veth interface name inside every rank namespace (use it for *_SOCKET_IFNAME)."""
SUBNET = "10.77"
"""Rank i gets SUBNET.{(i+1)//256}.{(i+1)%256}/16 — inside its own namespace only."""

CHILD_STRIDE = 0x5000
MAX_WORLD = CHILD_STRIDE - 16
"""htb minor ids are 16 bits: a link to peer j is 1:(j+16), its children add CHILD_STRIDE, 2 x it."""
ACK_SHARE = 0.02
"""Share of a link's rate guaranteed to its ACK child (the ACKs of a full-rate transfer the other
way take ~2%); each child may borrow up to the whole rate."""

Coords = tuple[int, int]  # (replica, stage)


# ----------------------------------------------------------------------------- topology helpers


def replica_coords(replica_stages: Sequence[int]) -> list[Coords]:
    """(replica, stage) of each rank of a static world whose replica m has `replica_stages[m]`
    stages, in the engine's rank layout (`sizes.replica_ranks`: DeepSpeed's PipeDataParallelTopology,
    rank = stage * M + replica, where the depths are equal)."""
    ranks = sizes.replica_ranks(replica_stages)
    where = {r: (m, s) for m, own in enumerate(ranks) for s, r in enumerate(own)}
    return [where[r] for r in range(len(where))]


def replica_major_coords(stages: int) -> Callable[[int], Coords]:
    """rank -> (replica, stage) for rank = replica * S + stage."""
    return lambda rank: (rank // stages, rank % stages)


def link_class(a: Coords, b: Coords) -> str:
    """'stage', 'replica' or 'other' for the link between ranks at coordinates a and b."""
    (ra, sa), (rb, sb) = a, b
    if ra == rb and abs(sa - sb) == 1:
        return "stage"
    if sa == sb and ra != rb:
        return "replica"
    return "other"


def address(rank: int) -> str:
    """The harness address of `rank` (inside its namespace)."""
    n = rank + 1
    if not 0 < n < 65535:
        raise ValueError(f"rank {rank} out of range for a /16")
    return f"{SUBNET}.{n // 256}.{n % 256}"


# ----------------------------------------------------------------------------- shell helpers


def _sh(*args: str, input: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
    p = subprocess.run(list(args), input=input, capture_output=True, text=True)
    if check and p.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} failed ({p.returncode}): {p.stderr.strip()}")
    return p


def list_namespaces() -> list[str]:
    """Names of all network namespaces (`ip netns list`)."""
    out = _sh("ip", "netns", "list").stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def harness_namespaces(prefix: str = PREFIX) -> list[str]:
    """Namespaces whose name starts with `prefix`."""
    return [n for n in list_namespaces() if n.startswith(prefix)]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale(prefix: str = PREFIX) -> list[str]:
    """Delete harness namespaces whose creating process is dead (left by a SIGKILLed run).

    Only names of the form PREFIX<pid>-... with a dead <pid> are touched; running harnesses keep
    theirs. Returns the names removed.
    """
    gone = []
    for n in harness_namespaces(prefix):
        m = re.match(re.escape(prefix) + r"(\d+)-", n)
        if m and not _pid_alive(int(m.group(1))):
            _kill_namespace_pids(n)
            if _sh("ip", "netns", "del", n, check=False).returncode == 0:
                gone.append(n)
    return gone


def _kill_namespace_pids(ns: str, grace: float = 2.0) -> None:
    """SIGTERM, then SIGKILL, every process inside namespace `ns` (all started by this harness)."""
    def pids() -> list[int]:
        out = _sh("ip", "netns", "pids", ns, check=False).stdout
        return [int(x) for x in out.split() if x.isdigit() and int(x) != os.getpid()]

    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 1.0)):
        live = pids()
        if not live:
            return
        for pid in live:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline and pids():
            time.sleep(0.05)


@functools.lru_cache(maxsize=1)
def available() -> tuple[bool, str]:
    """(True, '') if this process can build shaped namespaces, else (False, why).

    Checks root, the `ip` and `tc` tools, and then builds and deletes a probe: two namespaces, a
    veth pair between them (GSO limited), an htb qdisc with a class, a child and a u32 filter.
    """
    if os.geteuid() != 0:
        return False, "network namespaces need root (euid is %d)" % os.geteuid()
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return False, f"`{tool}` (iproute2) not found on PATH"
    tag = f"{PREFIX}{os.getpid()}-probe{random.randrange(16**4):04x}"
    a, b = tag + "-a", tag + "-b"
    try:
        _sh("ip", "netns", "add", a)
        _sh("ip", "netns", "add", b)
        _sh("ip", "-n", a, "link", "add", IFACE, "type", "veth", "peer", "name", IFACE, "netns", b)
        _sh("tc", "-n", a, "qdisc", "add", "dev", IFACE, "root", "handle", "1:", "htb", "default", "0")
        _sh("tc", "-n", a, "class", "add", "dev", IFACE, "parent", "1:", "classid", "1:10",
            "htb", "rate", "8mbit")
        _sh("tc", "-n", a, "class", "add", "dev", IFACE, "parent", "1:10", "classid", "1:11",
            "htb", "rate", "1mbit", "ceil", "8mbit", "prio", "0")
        _sh("tc", "-n", a, "filter", "add", "dev", IFACE, "parent", "1:", "protocol", "ip", "prio",
            "1", "u32", "match", "ip", "dst", "10.77.0.2/32", *_PURE_ACK_MATCHES[0].split(), "flowid", "1:11")
        _sh("ip", "-n", a, "link", "set", "dev", IFACE, "gso_max_segs", "1")
    except (RuntimeError, OSError) as e:
        return False, f"cannot build shaped namespaces: {e}"
    finally:
        for ns in (a, b):
            _sh("ip", "netns", "del", ns, check=False)
    return True, ""


# ----------------------------------------------------------------------------- the network


@dataclasses.dataclass
class RankResult:
    rank: int
    coords: Coords
    namespace: str
    address: str
    returncode: int | None
    """None if the process was killed (timeout, or fail-fast after another rank failed)."""
    stdout: str
    stderr: str
    elapsed: float
    timed_out: bool = False


class ShapedNetwork:
    """Namespaces + bridge + per-link htb shaping for `world` ranks; a context manager.

    Args:
        world: number of ranks.
        rank_coords: rank -> (replica, stage), a callable or a sequence indexed by rank
            (`replica_coords([S] * M)`: the engine's layout, DeepSpeed's PipeDataParallelTopology).
        stage_rate_bps, replica_rate_bps: egress rate of each stage / replica link in bits/s;
            None leaves that class unshaped.
        other_rate_bps: rate for links of neither class (None = unshaped).
        ack_priority: TCP segments without payload (ACKs) ahead of data on each shaped link,
            inside its rate (module docstring); False = one FIFO per link.
        gso_max_segs: TCP segments per skb on every rank's veth (module docstring); None keeps
            the veth's default (GSO bursts of up to 64 KB).
    """

    def __init__(self, world: int, rank_coords: Callable[[int], Coords] | Sequence[Coords],
                 stage_rate_bps: float | None = None, replica_rate_bps: float | None = None,
                 other_rate_bps: float | None = None, ack_priority: bool = True,
                 gso_max_segs: int | None = 1):
        if not isinstance(world, int) or world < 1:
            raise ValueError(f"world must be a positive integer, got {world!r}")
        for name, r in (("stage_rate_bps", stage_rate_bps), ("replica_rate_bps", replica_rate_bps),
                        ("other_rate_bps", other_rate_bps)):
            if r is not None and not (isinstance(r, (int, float)) and r > 0):
                raise ValueError(f"{name} must be > 0 bits/s or None, got {r!r}")
        get = rank_coords if callable(rank_coords) else rank_coords.__getitem__
        self.coords = [tuple(get(r)) for r in range(world)]
        if world > MAX_WORLD:
            raise ValueError(f"world must be at most {MAX_WORLD} (htb class ids), got {world}")
        if len(set(self.coords)) != world:
            raise ValueError(f"rank_coords maps two ranks to the same (replica, stage): {self.coords}")
        self.world = world
        self.rates = {"stage": stage_rate_bps, "replica": replica_rate_bps, "other": other_rate_bps}
        self.ack_priority = ack_priority
        if gso_max_segs is not None and not (isinstance(gso_max_segs, int) and 1 <= gso_max_segs <= 65535):
            raise ValueError(f"gso_max_segs must be an integer in 1..65535 or None, got {gso_max_segs!r}")
        self.gso_max_segs = gso_max_segs
        self.name = f"{PREFIX}{os.getpid()}-{random.randrange(16**6):06x}"
        self.hub = f"{self.name}-hub"
        self.namespaces = [f"{self.name}-{i}" for i in range(world)]
        self.addresses = [address(i) for i in range(world)]
        self._made: list[str] = []
        self._procs: list[subprocess.Popen] = []
        self._old_handler = None

    # -- lifecycle

    def __enter__(self) -> "ShapedNetwork":
        if threading.current_thread() is threading.main_thread():
            # SIGTERM would skip __exit__; turn it into an exception so teardown runs.
            def _term(signum, frame):
                raise SystemExit(128 + signum)
            self._old_handler = signal.signal(signal.SIGTERM, _term)
        try:
            self.up()
        except BaseException:
            self.down()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.down()

    def up(self) -> None:
        """Create namespaces, bridge, veths, addresses and shaping."""
        ok, why = available()
        if not ok:
            raise RuntimeError(why)
        _sh("ip", "netns", "add", self.hub)
        self._made.append(self.hub)
        hub_cmds = ["link add br0 type bridge", "link set br0 up"]
        for i, ns in enumerate(self.namespaces):
            _sh("ip", "netns", "add", ns)
            self._made.append(ns)
            _sh("ip", "-n", self.hub, "link", "add", f"p{i}", "type", "veth",
                "peer", "name", IFACE, "netns", ns)
            hub_cmds += [f"link set p{i} master br0", f"link set p{i} up"]
            gso = [] if self.gso_max_segs is None else [f"link set dev {IFACE} gso_max_segs {self.gso_max_segs}"]
            _sh("ip", "-n", ns, "-batch", "-", input="\n".join([
                "link set lo up",
                *gso,  # no GSO burst past htb (module docstring)
                f"addr add {self.addresses[i]}/16 dev {IFACE}",
                f"link set {IFACE} up",
            ]) + "\n")
            tc = self._tc_commands(i)
            if tc:
                _sh("tc", "-n", ns, "-batch", "-", input="\n".join(tc) + "\n")
        _sh("ip", "-n", self.hub, "-batch", "-", input="\n".join(hub_cmds) + "\n")

    def _tc_commands(self, i: int) -> list[str]:
        cmds = []
        for j in range(self.world):
            if j == i:
                continue
            rate = self.rates[link_class(self.coords[i], self.coords[j])]
            if rate is None:
                continue
            cmds += self._class_commands("add", j, rate)
            dst = f"match ip dst {self.addresses[j]}/32"
            if self.ack_priority:  # segments without payload -> the ACK child
                cmds += [f"filter add dev {IFACE} parent 1: protocol ip prio 1 u32 {dst} {m} flowid {_classid(j, 1)}"
                         for m in _PURE_ACK_MATCHES]
            cmds.append(f"filter add dev {IFACE} parent 1: protocol ip prio 2 u32 {dst} "
                        f"flowid {_classid(j, 2 if self.ack_priority else 0)}")
        if cmds:  # unclassified traffic (default 0) bypasses shaping
            cmds.insert(0, f"qdisc add dev {IFACE} root handle 1: htb default 0")
        return cmds

    def _class_commands(self, verb: str, peer: int, rate: float) -> list[str]:
        """htb class(es) of the link to `peer` at `rate`: `verb` is "add" or "change"."""
        def cls(parent: str, child: int, bps: float, prio: int | None = None) -> str:
            r, c = f"{max(int(bps), 8)}bit", f"{int(rate)}bit"
            tail = "" if prio is None else f" prio {prio}"
            return f"class {verb} dev {IFACE} parent {parent} classid {_classid(peer, child)} htb rate {r} ceil {c}{tail}"

        out = [cls("1:", 0, rate)]
        if self.ack_priority:
            small = rate * ACK_SHARE  # guaranteed share; either child may borrow up to the link rate
            out += [cls(_classid(peer, 0), 1, small, 0), cls(_classid(peer, 0), 2, rate - small, 1)]
        return out

    def set_rate(self, bps: float, link: str | None = None) -> None:
        """Change the rate of every shaped link (of class `link`: "stage", "replica", "other",
        or all when None) to `bps` bits/s, while processes run. Only links shaped at start exist."""
        if not (isinstance(bps, (int, float)) and bps > 0):
            raise ValueError(f"bps must be > 0, got {bps!r}")
        for i, ns in enumerate(self.namespaces):
            cmds = []
            for j in range(self.world):
                cls = link_class(self.coords[i], self.coords[j])
                if j != i and self.rates[cls] is not None and link in (None, cls):
                    cmds += self._class_commands("change", j, bps)
            if cmds:
                _sh("tc", "-n", ns, "-batch", "-", input="\n".join(cmds) + "\n")

    def down(self) -> None:
        """Kill what runs in the namespaces and delete them; safe to call twice."""
        try:
            for p in self._procs:
                if p.poll() is None:
                    _signal_group(p, signal.SIGTERM)
            for p in self._procs:
                try:
                    p.wait(timeout=3)
                except subprocess.TimeoutExpired:
                    _signal_group(p, signal.SIGKILL)
                    p.wait()
            for ns in reversed(self._made):
                _kill_namespace_pids(ns)
                _sh("ip", "netns", "del", ns, check=False)
            self._made.clear()
        finally:
            if self._old_handler is not None:
                signal.signal(signal.SIGTERM, self._old_handler)
                self._old_handler = None

    # -- running commands

    def env_for(self, rank: int, master_port: int, base: Mapping[str, str] | None = None) -> dict[str, str]:
        """The environment of `rank`: torch.distributed's env:// variables and the gloo interface.

        LOCAL_RANK = rank: all namespaces share this host's devices. OMP_NUM_THREADS defaults
        to 1 so W ranks do not oversubscribe the CPU. HETLOCO_HOST = the rank's namespace: each
        counts as a host of its own (`pipe.links.host_ids`), so the engine treats its shaped links
        as the links between hosts they stand for (on GPUs "auto" then runs the overlapped schedule
        over the process groups, as across hosts, not over the copy engines).
        """
        env = dict(os.environ if base is None else base)
        env.setdefault("OMP_NUM_THREADS", "1")
        replica, stage = self.coords[rank]
        env.update(MASTER_ADDR=self.addresses[0], MASTER_PORT=str(master_port), RANK=str(rank),
                   WORLD_SIZE=str(self.world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(self.world),
                   GLOO_SOCKET_IFNAME=IFACE, TP_SOCKET_IFNAME=IFACE, NCCL_SOCKET_IFNAME=IFACE,
                   HL_NETNS=self.namespaces[rank], HL_ADDR=self.addresses[rank], HETLOCO_HOST=self.namespaces[rank],
                   HL_REPLICA=str(replica), HL_STAGE=str(stage))
        return env

    def popen(self, rank: int, cmd: Sequence[str], env: Mapping[str, str], **kw) -> subprocess.Popen:
        """Start `cmd` inside rank's namespace (its own process group, killed by `down`, and by the
        kernel when this process dies: `launch.die_with_parent`, which `ip netns exec` keeps)."""
        p = subprocess.Popen(["ip", "netns", "exec", self.namespaces[rank], *cmd], env=dict(env),
                             start_new_session=True, preexec_fn=die_with_parent, **kw)
        self._procs.append(p)
        return p

    def run(self, cmd_for_rank: Callable[[int], Sequence[str]], timeout: float = 600.0, *,
            env: Mapping[str, str] | None = None, cwd: str | None = None,
            fail_fast: float | None = 10.0, master_port: int | None = None) -> list[RankResult]:
        """Run cmd_for_rank(r) for every rank at once and wait for all of them.

        `timeout` bounds the whole run; on expiry the remaining ranks are killed and marked
        timed_out. With `fail_fast` (seconds), once a rank exits non-zero the others get that
        long to finish before they are killed (a dead peer usually hangs a collective).
        MASTER_PORT: any port is free in a namespace this harness just made; a random one in
        20000-32767 (below Linux's ephemeral range) unless given.
        """
        port = master_port or random.randrange(20000, 32768)
        start = time.monotonic()
        with tempfile.TemporaryDirectory(prefix="hl-netlab-") as tmp:
            files, procs = [], []
            for r in range(self.world):
                out = open(os.path.join(tmp, f"{r}.out"), "w+")
                err = open(os.path.join(tmp, f"{r}.err"), "w+")
                files.append((out, err))
                procs.append(self.popen(r, list(cmd_for_rank(r)), self.env_for(r, port, env),
                                        stdout=out, stderr=err, cwd=cwd))
            ends: list[float | None] = [None] * self.world
            killed = [False] * self.world
            timed = [False] * self.world
            first_fail: float | None = None
            while any(e is None for e in ends):
                now = time.monotonic()
                for r, p in enumerate(procs):
                    if ends[r] is None and p.poll() is not None:
                        ends[r] = now
                        if p.returncode != 0 and first_fail is None:
                            first_fail = now
                over = now - start > timeout
                failed = fail_fast is not None and first_fail is not None and now - first_fail > fail_fast
                if over or failed:
                    for r, p in enumerate(procs):
                        if ends[r] is None:
                            _signal_group(p, signal.SIGKILL)
                            p.wait()
                            ends[r], killed[r], timed[r] = time.monotonic(), True, over
                    break
                time.sleep(0.02)
            results = []
            for r, p in enumerate(procs):
                out, err = files[r]
                out.seek(0)
                err.seek(0)
                results.append(RankResult(r, self.coords[r], self.namespaces[r], self.addresses[r],
                                          None if killed[r] else p.returncode, out.read(), err.read(),
                                          ends[r] - start, timed[r]))
                out.close()
                err.close()
        return results

    # -- measurement

    def link_bytes(self) -> dict[tuple[int, int], int]:
        """{(src, dst): bytes} that tc counted on each shaped link so far (L2 bytes, egress of src)."""
        out: dict[tuple[int, int], int] = {}
        for i, ns in enumerate(self.namespaces):
            text = _sh("tc", "-n", ns, "-s", "class", "show", "dev", IFACE, check=False).stdout
            for m in re.finditer(r"class htb 1:([0-9a-f]+) root .*?\n\s*Sent (\d+) bytes", text, re.S):
                out[(i, int(m.group(1), 16) - 16)] = int(m.group(2))  # a link's class counts its children
        return out


_PURE_ACK_MATCHES = [
    f"match ip protocol 6 0xff match u8 0x05 0x0f at 0 match u16 {20 + 4 * doff:#06x} 0xffff at 2 "
    f"match u8 {doff << 4:#04x} 0xf0 at 32" for doff in range(5, 16)]
"""u32 keys of a TCP segment without payload: IPv4 header of 20 bytes, TCP data offset `doff`
words, IP total length 20 + 4 * doff (ACKs with or without timestamps and SACK blocks, SYNs).
Segments that carry stream bytes stay in order behind the link's other data."""


def _classid(peer: int, child: int) -> str:
    """htb class id of the link to `peer`: child 0 the link itself, 1 its ACKs, 2 the rest."""
    return f"1:{(peer + 16) + child * CHILD_STRIDE:x}"


def run_shaped(cmd_for_rank: Callable[[int], Sequence[str]], world: int,
               rank_coords: Callable[[int], Coords] | Sequence[Coords],
               stage_rate_bps: float | None, replica_rate_bps: float | None,
               timeout: float = 600.0, *, other_rate_bps: float | None = None,
               env: Mapping[str, str] | None = None, cwd: str | None = None,
               fail_fast: float | None = 10.0, ack_priority: bool = True,
               gso_max_segs: int | None = 1) -> list[RankResult]:
    """Build a shaped network, run one command per rank in it, tear it down; the results by rank.

    Example, the engine on 2 replicas x 4 stages with 100 Mbit/s stage links and 1 Gbit/s
    replica links:

        res = run_shaped(lambda r: [sys.executable, "-m", "hetloco_ds.cli", "train", "cfg.json"],
                         8, replica_coords([4, 4]), 100e6, 1e9, timeout=600)
        assert all(x.returncode == 0 for x in res)
    """
    with ShapedNetwork(world, rank_coords, stage_rate_bps, replica_rate_bps, other_rate_bps,
                       ack_priority, gso_max_segs) as net:
        return net.run(cmd_for_rank, timeout, env=env, cwd=cwd, fail_fast=fail_fast)
