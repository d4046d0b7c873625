"""Shaped links on one Linux host: one network namespace per rank, tc-limited per link class.

Layout (all of it inside namespaces this module creates; the host's interfaces, addresses and
routes are never touched):

    hl-<pid>-<tag>-hub :  bridge br0 with ports p0 .. p{W-1}   (no address)
    hl-<pid>-<tag>-<i> :  lo up, veth hl0 = 10.77.x.y/16 (peer p<i> on the hub's bridge)

Every rank reaches every other rank through the bridge. Shaping is on each rank's egress (hl0):
an htb root whose unclassified traffic passes unshaped, plus one htb class per peer whose link
has a rate, selected by a u32 match on the peer's address. A link is

* "stage": same replica, adjacent stages (activations one way, gradients the other);
* "replica": same stage, different replicas (the SparseLoCo outer sync);
* "other": anything else (rendezvous, DeepSpeed's global collectives), unshaped by default.

Egress shaping on both ends makes each link full duplex at its rate, as plan.py assumes.

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

PREFIX = "hl-"
"""Every namespace this module creates is named PREFIX + '<creator pid>-<tag>-...'."""
IFACE = "hl0"
"""The veth interface name inside every rank namespace (use it for *_SOCKET_IFNAME)."""
SUBNET = "10.77"
"""Rank i gets SUBNET.{(i+1)//256}.{(i+1)%256}/16 — inside its own namespace only."""

Coords = tuple[int, int]  # (replica, stage)


# ----------------------------------------------------------------------------- topology helpers


def deepspeed_coords(replicas: int) -> Callable[[int], Coords]:
    """rank -> (replica, stage) for DeepSpeed's PipeDataParallelTopology(num_pp=S, num_dp=M).

    Its axes are ['pipe', 'data'] with data fastest: rank = stage * M + replica.
    """
    return lambda rank: (rank % replicas, rank // replicas)


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
    veth pair between them, an htb qdisc with a class and a u32 filter.
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
        _sh("tc", "-n", a, "filter", "add", "dev", IFACE, "parent", "1:", "protocol", "ip", "prio",
            "1", "u32", "match", "ip", "dst", "10.77.0.2/32", "flowid", "1:10")
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
            (`deepspeed_coords(M)` matches DeepSpeed's PipeDataParallelTopology).
        stage_rate_bps, replica_rate_bps: egress rate of each stage / replica link in bits/s;
            None leaves that class unshaped.
        other_rate_bps: rate for links of neither class (None = unshaped).
    """

    def __init__(self, world: int, rank_coords: Callable[[int], Coords] | Sequence[Coords],
                 stage_rate_bps: float | None = None, replica_rate_bps: float | None = None,
                 other_rate_bps: float | None = None):
        if not isinstance(world, int) or world < 1:
            raise ValueError(f"world must be a positive integer, got {world!r}")
        for name, r in (("stage_rate_bps", stage_rate_bps), ("replica_rate_bps", replica_rate_bps),
                        ("other_rate_bps", other_rate_bps)):
            if r is not None and not (isinstance(r, (int, float)) and r > 0):
                raise ValueError(f"{name} must be > 0 bits/s or None, got {r!r}")
        get = rank_coords if callable(rank_coords) else rank_coords.__getitem__
        self.coords = [tuple(get(r)) for r in range(world)]
        if len(set(self.coords)) != world:
            raise ValueError(f"rank_coords maps two ranks to the same (replica, stage): {self.coords}")
        self.world = world
        self.rates = {"stage": stage_rate_bps, "replica": replica_rate_bps, "other": other_rate_bps}
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
            _sh("ip", "-n", ns, "-batch", "-", input="\n".join([
                "link set lo up",
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
            cid = f"1:{j + 16:x}"
            r = f"{int(rate)}bit"
            cmds += [f"class add dev {IFACE} parent 1: classid {cid} htb rate {r} ceil {r}",
                     f"filter add dev {IFACE} parent 1: protocol ip prio 1 u32 match ip dst "
                     f"{self.addresses[j]}/32 flowid {cid}"]
        if cmds:  # unclassified traffic (default 0) bypasses shaping
            cmds.insert(0, f"qdisc add dev {IFACE} root handle 1: htb default 0")
        return cmds

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
        to 1 so W ranks do not oversubscribe the CPU.
        """
        env = dict(os.environ if base is None else base)
        env.setdefault("OMP_NUM_THREADS", "1")
        replica, stage = self.coords[rank]
        env.update(MASTER_ADDR=self.addresses[0], MASTER_PORT=str(master_port), RANK=str(rank),
                   WORLD_SIZE=str(self.world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(self.world),
                   GLOO_SOCKET_IFNAME=IFACE, TP_SOCKET_IFNAME=IFACE, NCCL_SOCKET_IFNAME=IFACE,
                   HL_NETNS=self.namespaces[rank], HL_ADDR=self.addresses[rank],
                   HL_REPLICA=str(replica), HL_STAGE=str(stage))
        return env

    def popen(self, rank: int, cmd: Sequence[str], env: Mapping[str, str], **kw) -> subprocess.Popen:
        """Start `cmd` inside rank's namespace (its own process group, killed by `down`)."""
        p = subprocess.Popen(["ip", "netns", "exec", self.namespaces[rank], *cmd], env=dict(env),
                             start_new_session=True, **kw)
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
            for m in re.finditer(r"class htb 1:([0-9a-f]+) .*?\n\s*Sent (\d+) bytes", text, re.S):
                out[(i, int(m.group(1), 16) - 16)] = int(m.group(2))
        return out


def _signal_group(p: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(p.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def run_shaped(cmd_for_rank: Callable[[int], Sequence[str]], world: int,
               rank_coords: Callable[[int], Coords] | Sequence[Coords],
               stage_rate_bps: float | None, replica_rate_bps: float | None,
               timeout: float = 600.0, *, other_rate_bps: float | None = None,
               env: Mapping[str, str] | None = None, cwd: str | None = None,
               fail_fast: float | None = 10.0) -> list[RankResult]:
    """Build a shaped network, run one command per rank in it, tear it down; the results by rank.

    Example, the engine on 2 replicas x 4 stages with 100 Mbit/s stage links and 1 Gbit/s
    replica links:

        res = run_shaped(lambda r: [sys.executable, "-m", "hetloco_ds.cli", "train", "cfg.json"],
                         8, deepspeed_coords(2), 100e6, 1e9, timeout=600)
        assert all(x.returncode == 0 for x in res)
    """
    with ShapedNetwork(world, rank_coords, stage_rate_bps, replica_rate_bps, other_rate_bps) as net:
        return net.run(cmd_for_rank, timeout, env=env, cwd=cwd, fail_fast=fail_fast)
