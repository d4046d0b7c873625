"""One stage rank of one elastic replica, for tests/test_elastic_transport.py.

A tiny pure-tensor "model": a few parameter tensors per stage, moved by seeded noise in each inner
step (a stand-in for H AdamW steps: deterministic per replica, stage, outer step and inner step),
synced by SparseLoCoState through ElasticTransport. No DeepSpeed engine.

The test reads what each rank did from its JSONL log (one line per committed outer step, flushed).
`simulate` replays the same model in one process, with the payload list handed over directly (what
the static all-gather hands `finish`), for any membership schedule: the reference.
"""
from __future__ import annotations

import hashlib
import json
import os
import signal
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from hetloco_ds.config import SparseLoCoConfig  # noqa: E402
from hetloco_ds.sparseloco.outer import SparseLoCoState  # noqa: E402
from hetloco_ds.transport.auth import SECRET_ENV, FleetRefused, read_fleet_secret  # noqa: E402
from hetloco_ds.transport.elastic import ElasticConfig, ElasticTransport  # noqa: E402
from hetloco_ds.transport.torchft_adapter import replica_store  # noqa: E402

SHAPES = {0: [(8, 8), (16,), (5, 8)], 1: [(8, 8), (12,)]}
CFG = SparseLoCoConfig(preset="paper", chunk_size=16, topk=8, error_decay=0.9, outer_lr=0.7)
CLIPPED = SparseLoCoConfig(preset="paper", chunk_size=16, topk=8, error_decay=0.9, outer_lr=0.7, norm_clip="median")
SCREENED = SparseLoCoConfig(preset="paper", chunk_size=16, topk=8, error_decay=0.9, outer_lr=0.7, screen="agreement")
INNER = 4
SCALE = 1000.0


def initial_params(stage: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + stage)
    return [torch.randn(s, generator=g) for s in SHAPES[stage]]


def inner_steps(params, name: str, stage: int, outer: int, sleep: float = 0.0) -> None:
    """This replica's data for outer step `outer`: seeded by (replica, stage, outer step, inner step)."""
    for h in range(INNER):
        seed = int.from_bytes(hashlib.sha256(f"{name}/{stage}/{outer}/{h}".encode()).digest()[:8], "little")
        g = torch.Generator().manual_seed(seed)
        for p in params:
            p.add_(torch.randn(p.shape, generator=g), alpha=-0.05)
        if sleep:
            time.sleep(sleep)


def digest(params) -> str:
    return hashlib.sha256(b"".join(p.contiguous().numpy().tobytes() for p in params)).hexdigest()


def scale_delta(params, theta_prev) -> None:
    """A replica gone wild: its pseudo-gradient theta_prev - theta becomes SCALE times as large."""
    for p, t in zip(params, theta_prev):
        p.copy_(t + SCALE * (p - t))


def simulate(schedule: list[tuple[str, ...]], names: list[str], stage: int, cfg: SparseLoCoConfig = CFG,
             scaled: tuple[str, int] | None = None) -> list[str]:
    """Parameter digest after each outer step when step k applies the payloads of `schedule[k]`.

    A replica absent at step k and present at k+1 joined at k: it was healed (synced state, zero error
    buffer) and from k+1 on runs its own inner steps like the others. `scaled`: (replica, step) whose
    pseudo-gradient is scaled by SCALE.
    """
    theta = initial_params(stage)
    reps: dict[str, tuple[list, SparseLoCoState]] = {}
    out = []
    for k, members in enumerate(schedule):
        for n in names:
            if n not in members:
                reps.pop(n, None)
            elif n not in reps:
                p = [t.clone() for t in theta]
                reps[n] = (p, SparseLoCoState(p, cfg))
        payloads = {}
        for n in sorted(members):
            p, st = reps[n]
            inner_steps(p, n, stage, k)
            if scaled == (n, k):
                scale_delta(p, st.theta_prev)
            payloads[n] = st.prepare(p)
        for n in sorted(members):
            p, st = reps[n]
            st.finish(p, [payloads[m] for m in sorted(members)])
        theta = [t.clone() for t in reps[sorted(members)[0]][0]]
        out.append(digest(theta))
    return out


def _store_and_port(stage: int, port_file: str, timeout: float):
    """Stage 0: the store, on a port the kernel picks, published at `port_file` (a port the parent
    picked and a child binds later can be taken meanwhile as the ephemeral port of another process's
    connection: EADDRINUSE). Other stages: (None, that port)."""
    if stage == 0:
        store = replica_store("127.0.0.1", 0)
        with open(port_file + ".tmp", "w") as f:
            f.write(str(store.port))
        os.replace(port_file + ".tmp", port_file)
        return store, store.port
    end = time.monotonic() + 12 * timeout
    while not os.path.exists(port_file):
        if time.monotonic() > end:
            raise TimeoutError(f"stage 0 published no store port at {port_file} in {12 * timeout:g}s")
        time.sleep(0.02)
    with open(port_file) as f:
        return None, int(f.read())


def run_replica(lighthouse: str, name: str, port_file: str, steps: int, log: str, stage: int = 0,
                stages: int = 1, sleep: float = 0.05, go: str | None = None, timeout: float = 5.0,
                secret_file: str | None = None, secret_env: str | None = None, die_in_exchange: int = -1,
                diverge_at: int = -1, scale_at: int = -1, clip: bool = False, screen: bool = False) -> None:
    """Body of one stage process (a forkserver child, so torch and torchft are already imported).

    Runs until `steps` outer steps are committed; writes one JSONL line per step to `log`, stdout and
    stderr to `log`.out / `log`.err; exits 0, 2 (bad secret setting) or 3 (refused by the fleet).
    `die_in_exchange`: SIGKILL itself in that outer step, after the hello round, before its payload.
    `diverge_at`: before that outer step, replace its history (chain) as a split brain would have.
    `scale_at`: in that outer step, its pseudo-gradient is SCALE times as large. `clip`: CLIPPED config;
    `screen`: SCREENED config (each log line then names the replicas screened out of that step).
    `port_file`: where stage 0 publishes the port of the replica's store, of the kernel's choosing.
    """
    out = os.open(log + ".out", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    err = os.open(log + ".err", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.dup2(out, 1)
    os.dup2(err, 2)
    sys.exit(_run(lighthouse, name, port_file, steps, log, stage, stages, sleep, go, timeout, secret_file,
                  secret_env, die_in_exchange, diverge_at, scale_at, clip, screen))


def _run(lighthouse, name, port_file, steps, log, stage, stages, sleep, go, timeout, secret_file, secret_env,
         die_in_exchange, diverge_at, scale_at, clip, screen) -> int:
    torch.set_num_threads(1)
    if secret_env is not None:
        os.environ[SECRET_ENV] = secret_env
    else:
        os.environ.pop(SECRET_ENV, None)
    try:
        secret = read_fleet_secret(secret_file)
    except ValueError as err:
        print(f"hetloco-ds: error: {err}", file=sys.stderr)
        return 2
    # Stage 0 hosts this replica's store, as rank 0 of a launched job does (here on localhost only).
    store, store_port = _store_and_port(stage, port_file, timeout)
    params = initial_params(stage)
    state = SparseLoCoState(params, SCREENED if screen else CLIPPED if clip else CFG)
    counter = {"outer": 0}

    def state_dict():
        return {"theta": [t.clone() for t in state.theta_prev], "outer": counter["outer"]}

    def load_state_dict(s):
        # A peer's synced state; this replica's error feedback restarts at zero. In place, and not
        # through SparseLoCoState.load_state_dict: a heal can come between prepare and finish.
        with torch.no_grad():
            for i, (p, t) in enumerate(zip(params, s["theta"])):
                p.copy_(t)
                state.rebase(i, t)
            for e in state.error:
                e.zero_()
        counter["outer"] = s["outer"]

    cfg = ElasticConfig(lighthouse=lighthouse, replica_id=name, stage=stage, stages=stages, secret=secret,
                        timeout=timeout, quorum_timeout=60.0, store_addr="127.0.0.1", store_port=store_port)
    transport = ElasticTransport(cfg, state_dict, load_state_dict)
    if die_in_exchange >= 0:
        real = transport._all_gather

        def dying(t, rank, n, pairwise):
            if pairwise and counter["outer"] == die_in_exchange:
                os.kill(os.getpid(), signal.SIGKILL)
            return real(t, rank, n, pairwise)

        transport._all_gather = dying
    if go:
        with open(log + ".ready", "w"):
            pass
        while not os.path.exists(go):
            time.sleep(0.02)
    with open(log, "a") as f:
        try:
            while counter["outer"] < steps:
                inner_steps(params, name, stage, counter["outer"], sleep)
                if counter["outer"] == diverge_at:
                    diverged = transport.state_dict()
                    diverged["chain"] = hashlib.sha256(b"another history").digest()
                    transport.load_state_dict(diverged)
                t0 = time.time()
                transport.begin()
                if counter["outer"] == scale_at:
                    with torch.no_grad():
                        scale_delta(params, state.theta_prev)
                payload = state.prepare(params)
                gathered = transport.exchange(payload)
                k = counter["outer"]  # after exchange: a heal inside it replaces the counter with the fleet's
                report = state.finish(params, gathered.payloads)
                counter["outer"] = k + 1
                r = transport.last_report
                f.write(json.dumps({"outer": k, "members": list(gathered.members), "participants": list(r.participants),
                                    "left": list(r.left), "joined": list(r.joined), "attempts": r.attempts,
                                    "healed": r.healed, "t_begin": t0, "t_end": time.time(), "digest": digest(params),
                                    "screened": [gathered.members[i] for i in report.screened]})
                        + "\n")
                f.flush()
        except FleetRefused as err:
            print(f"hetloco-ds: {err}", file=sys.stderr)
            return 3
    transport.close()
    del store  # held until here: the other stages and the fleet's groups rendezvous through it
    return 0
