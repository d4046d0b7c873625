"""`hetloco-ds lighthouse`: the torchft lighthouse that elastic replicas take their quorums from.

It only decides membership; no payload or state passes through it. torchft 0.2.0's lighthouse has
no authentication (anyone who reaches it can join quorums, and its HTTP page can stop replicas
through `POST /replica/<id>/kill`), so it binds localhost unless told otherwise: bind it to an
address only the fleet's hosts reach.
"""
from __future__ import annotations

import argparse
import os
import signal
import socket
import sys
import threading

DEFAULT_BIND = "127.0.0.1:29510"


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hetloco-ds lighthouse", description=__doc__.splitlines()[0])
    p.add_argument("--bind", default=DEFAULT_BIND,
                   help=f"HOST:PORT to listen on (default {DEFAULT_BIND}; port 0 picks a free one)")
    p.add_argument("--min-replicas", type=int, default=1,
                   help="replicas a quorum needs when membership changes (default 1)")
    p.add_argument("--join-timeout", type=float, default=60.0,
                   help="seconds to wait for live replicas that have not reached the outer boundary (default 60)")
    p.add_argument("--heartbeat-timeout", type=float, default=5.0,
                   help="seconds without a heartbeat after which a replica is dead (default 5)")
    return p


def _split_bind(bind: str) -> tuple[str, int]:
    host, sep, port = bind.rpartition(":")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise ValueError(f"--bind {bind!r} must be HOST:PORT, e.g. {DEFAULT_BIND} or [::1]:0")
    return host, int(port)


def main(argv: list[str] | None = None) -> int:
    return run(parser().parse_args(argv))


def run(args, stop: threading.Event | None = None, out=None) -> int:
    """Start the lighthouse, print its address (one line, flushed), serve until SIGINT/SIGTERM or `stop`."""
    out = out or sys.stdout
    try:
        host, _ = _split_bind(args.bind)
        if args.min_replicas < 1:
            raise ValueError(f"--min-replicas {args.min_replicas} must be >= 1")
        for flag, value in (("--join-timeout", args.join_timeout), ("--heartbeat-timeout", args.heartbeat_timeout)):
            if not value > 0:
                raise ValueError(f"{flag} {value} must be > 0")
    except ValueError as err:
        print(f"hetloco-ds lighthouse: error: {err}", file=sys.stderr)
        return 2
    os.environ.setdefault("RUST_LOG", "warn")  # read once when torchft's extension loads; INFO logs every quorum
    try:
        from torchft._torchft import LighthouseServer
    except ImportError:
        print("hetloco-ds lighthouse: error: torchft is not installed: pip install 'hetloco_ds[elastic]'",
              file=sys.stderr)
        return 2

    try:
        server = LighthouseServer(bind=args.bind, min_replicas=args.min_replicas,
                                  join_timeout_ms=int(args.join_timeout * 1000),
                                  heartbeat_timeout_ms=int(args.heartbeat_timeout * 1000))
    except Exception as err:  # noqa: BLE001 - a Rust bind error arrives as a plain exception
        print(f"hetloco-ds lighthouse: error: cannot listen on {args.bind}: {err}", file=sys.stderr)
        return 2
    # torchft's address() names the machine's hostname; peers must use the address we bound.
    port = server.address().rpartition(":")[2]
    shown = socket.gethostname() if host.strip("[]") in ("0.0.0.0", "::") else host
    print(f"lighthouse listening on http://{shown}:{port}", file=out, flush=True)
    stop = stop or threading.Event()
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stop.set())
    try:
        while not stop.wait(0.5):
            pass
    finally:
        server.shutdown()
    return 0
