"""Where the user's arguments travel in one rank of `hetloco-ds train --steps 1` (a measurement, not
a test): run the CLI's train entry in this process as rank 0 of a one-rank job (one stage, one
replica, the shipped CPU config otherwise) under sys.settrace, and follow the frames that hold the
arguments - a TrainArgs or a RunPlan among their locals, or as an attribute of their `self`.

Printed: the files those frames are in; visits, how often the walk enters a file (by a call, or by
a return into a caller in another file); climbs back, how many of those visits are returns.

    PYTHONPATH=$PWD python tests/args_walk.py [--json OUT]
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


def walk(argv: list[str]) -> dict:
    import hetloco_ds
    from hetloco_ds import cli, train

    root = os.path.dirname(os.path.abspath(hetloco_ds.__file__))
    kinds = (train.TrainArgs, train.RunPlan)
    stack: list[str] = ["cli.py"]  # the files of the walk's frames, innermost last
    state = {"visits": 0, "climbs": 0, "files": {"cli.py"}, "path": ["cli.py"]}

    def enter(name: str, climb: bool) -> None:
        if name != state["path"][-1]:
            state["visits"] += 1
            state["climbs"] += climb
            state["files"].add(name)
            state["path"].append(name)

    def tracer(frame, event, arg):
        path = frame.f_code.co_filename
        if event != "call" or not path.startswith(root) or not _holds_args(frame, kinds):
            return None
        name = os.path.relpath(path, root)
        stack.append(name)
        enter(name, False)

        def local(f, ev, a):
            if ev == "return":
                stack.pop()
                enter(stack[-1], True)
            return local
        return local

    sys.settrace(tracer)
    try:
        code = cli.main(argv)
    finally:
        sys.settrace(None)
    return {"exit": code, "files": sorted(state["files"]), "visits": state["visits"], "climbs_back": state["climbs"],
            "path": state["path"]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", help="write the result here too")
    a = p.parse_args()
    work = tempfile.mkdtemp(prefix="args_walk_")
    from hetloco_ds.config import default_config_path

    with open(default_config_path()) as f:
        cfg = json.load(f)
    cfg["pipeline"]["stages"] = 1
    cfg["hetloco"]["subspace"]["compressed_replicas"] = []
    cfg["hetloco"]["train"].update(seq_len=32, eval_batches=1)
    cfg["train_micro_batch_size_per_gpu"] = 2
    path = os.path.join(work, "config.json")
    with open(path, "w") as f:
        json.dump(cfg, f)
    from hetloco_ds.launch import free_port

    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(free_port()))
    result = walk(["train", "--steps", "1", "--config", path, "--out", os.path.join(work, "run")])
    print(json.dumps({k: v for k, v in result.items() if k != "path"}))
    print(" -> ".join(result["path"]))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0 if result["exit"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
