"""Where a training run's path goes, in one rank of `hetloco-ds train --steps 1` (a measurement, not a
test): the CLI's train entry runs in this process as rank 0 of a one-rank job (one stage; the shipped
CPU config, smaller) under sys.settrace, static or (`--elastic`) as the one replica of a fleet whose
lighthouse this script starts.

Two walks, over frames of hetloco_ds only (a call through a library, such as DeepSpeed calling the
engine's hooks, counts as a call from the nearest hetloco_ds frame):
* args: the frames that hold the user's arguments (a TrainArgs or RunPlan among their locals, or as
  an attribute of their `self`);
* calls: every function the first time it is called (later calls of it, and what they call, are
  left out), i.e. the run's call tree with each function once.
For each: the files it goes through; visits, how often it enters a file (by a call, or by a return
into a caller in another file); climbs back, how many of those visits are returns.

    PYTHONPATH=$PWD python tests/args_walk.py [--elastic] [--json OUT]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile


def _holds_args(frame, kinds) -> bool:
    for value in frame.f_locals.values():
        if isinstance(value, kinds):
            return True
    me = frame.f_locals.get("self")
    return me is not None and any(isinstance(v, kinds) for v in getattr(me, "__dict__", {}).values())


class _Walk:
    def __init__(self, start: str):
        self.stack, self.path, self.visits, self.climbs = [start], [start], 0, 0

    def call(self, name: str) -> None:
        self.stack.append(name)
        self._enter(name, False)

    def ret(self) -> None:
        self.stack.pop()
        self._enter(self.stack[-1], True)

    def _enter(self, name: str, climb: bool) -> None:
        if name != self.path[-1]:
            self.visits += 1
            self.climbs += climb
            self.path.append(name)

    def result(self) -> dict:
        return {"files": len(set(self.path)), "visits": self.visits, "climbs_back": self.climbs,
                "path": self.path}


def walk(argv: list[str]) -> dict:
    import threading

    import hetloco_ds
    from hetloco_ds import cli, train

    root = os.path.dirname(os.path.abspath(hetloco_ds.__file__))
    kinds = (train.TrainArgs, train.RunPlan)
    walks = {"args": _Walk("cli.py"), "calls": _Walk("cli.py")}
    seen: set = set()
    pushed: dict = {}
    main = threading.get_ident()

    def tracer(frame, event, arg):
        path = frame.f_code.co_filename
        if event != "call" or not path.startswith(root) or threading.get_ident() != main:
            return None
        name = os.path.relpath(path, root)
        mine = []
        if frame.f_code not in seen:
            seen.add(frame.f_code)
            mine.append(walks["calls"])
        if _holds_args(frame, kinds):
            mine.append(walks["args"])
        if not mine:
            return None
        for w in mine:
            w.call(name)
        # A generator resumed later gets a "call" and a "return" per resumption, and keeps this local
        # tracer: pop only what this activation pushed.
        pushed[id(frame)] = mine
        return local

    def local(frame, event, arg):
        if event == "return":
            for w in pushed.pop(id(frame), ()):
                w.ret()
        return local

    sys.settrace(tracer)
    try:
        code = cli.main(argv)
    finally:
        sys.settrace(None)
    return {"exit": code, **{k: w.result() for k, w in walks.items()}}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--elastic", action="store_true", help="one replica of a fleet (a lighthouse started here)")
    p.add_argument("--json", help="write the result here too")
    a = p.parse_args()
    work = tempfile.mkdtemp(prefix="args_walk_")
    from hetloco_ds.config import default_config_path
    from hetloco_ds.launch import free_port

    with open(default_config_path()) as f:
        cfg = json.load(f)
    cfg["pipeline"]["stages"] = 1
    cfg["hetloco"]["subspace"]["compressed_replicas"] = []
    cfg["hetloco"]["train"].update(seq_len=32, eval_batches=1)
    cfg["train_micro_batch_size_per_gpu"] = 2
    argv = ["train", "--steps", "1", "--out", os.path.join(work, "run")]
    lighthouse = None
    if a.elastic:
        from torchft._torchft import LighthouseServer

        cfg["hetloco"]["elastic"] = {"max_replicas": 1}
        lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=1)
        os.environ["HETLOCO_FLEET_SECRET"] = "walk-" + os.urandom(16).hex()
        argv += ["--lighthouse", "http://127.0.0.1:" + lighthouse.address().rpartition(":")[2], "--replica-id", "0"]
    path = os.path.join(work, "config.json")
    with open(path, "w") as f:
        json.dump(cfg, f)
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(free_port()))
    try:
        result = walk(argv + ["--config", path])
    finally:
        if lighthouse is not None:
            lighthouse.shutdown()
    for kind in ("args", "calls"):
        r = result[kind]
        print(f"{kind}: {r['files']} files, {r['visits']} visits, {r['climbs_back']} climbs back")
    print("args path: " + " -> ".join(result["args"]["path"]))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0 if result["exit"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
