"""The seams between the method's drivers and what they are driven through: read from the source
and the import graph, no process started."""
from __future__ import annotations

import ast
import os

ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "hetloco_ds")


def _probes_of_transports() -> list[str]:
    """Every getattr/hasattr whose object is named like a transport, as file:line."""
    found = []
    for folder, _, files in os.walk(ROOT):
        for name in files:
            if not name.endswith(".py"):
                continue
            path = os.path.join(folder, name)
            for node in ast.walk(ast.parse(open(path).read(), path)):
                if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                        and node.func.id in ("getattr", "hasattr") and node.args
                        and "transport" in ast.unparse(node.args[0]).lower()):
                    found.append(f"{os.path.relpath(path, ROOT)}:{node.lineno}")
    return found


def test_every_replica_transport_declares_what_its_callers_call():
    """The engine, checkpoints and the training loop call a transport's hooks without asking whether it
    has them: every transport is a ReplicaTransport (whose no-ops a fixed group keeps), and no module
    probes one with getattr/hasattr. Breaks if a transport stops being one, or a caller goes back to
    probing for optional methods."""
    from hetloco_ds.elastic.replica import FleetTransport
    from hetloco_ds.transport import LocalExchange, ReplicaTransport
    from hetloco_ds.transport.elastic import ElasticTransport
    from hetloco_ds.transport.static import GroupTransport

    for cls in (GroupTransport, LocalExchange, ElasticTransport, FleetTransport):
        assert issubclass(cls, ReplicaTransport), cls
    static = LocalExchange([])
    assert (static.state_dict(), static.outer_fields(), static.waited_seconds({"seconds": 3.0})) == (None, {}, 0.0)
    assert FleetTransport.waited_seconds(None, {"seconds": 3.0}) == 3.0
    assert _probes_of_transports() == []


def _imports(module: str) -> set[str]:
    """The hetloco_ds modules `module` imports anywhere in its source (function-level imports too)."""
    path = os.path.join(os.path.dirname(ROOT), *module.split("."))
    is_pkg = os.path.isdir(path)
    path = os.path.join(path, "__init__.py") if is_pkg else path + ".py"
    package = module if is_pkg else module.rpartition(".")[0]
    found = set()
    if not os.path.exists(path):  # a namespace package (pipe/): nothing of its own
        return found
    for node in ast.walk(ast.parse(open(path).read(), path)):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package
            for _ in range(node.level - 1):
                base = base.rpartition(".")[0]
            base = f"{base}.{node.module}" if node.level and node.module else (base if node.level else node.module)
            names = [base] + [f"{base}.{a.name}" for a in node.names]
        else:
            continue
        for name in names:
            stem = os.path.join(os.path.dirname(ROOT), *name.split("."))
            if name.startswith("hetloco_ds") and (os.path.isdir(stem) or os.path.exists(stem + ".py")):
                found.add(name)
    return found


def _reachable(module: str) -> set[str]:
    seen, todo = set(), [module]
    while todo:
        m = todo.pop()
        if m not in seen:
            seen.add(m)
            todo += _imports(m)
    return seen


def test_the_elastic_launcher_imports_train_and_nothing_the_replica_runs_imports_the_launcher():
    """`train` (and through it every rank, elastic or not) imports the replica side of elastic mode,
    never the `--elastic` launcher, which imports `train`: no cycle between them, counting imports
    inside functions. Breaks if the replica side, the engine or train came to import the launcher."""
    assert "hetloco_ds.train" in _imports("hetloco_ds.elastic.launcher")
    ranks = _reachable("hetloco_ds.train") | _reachable("hetloco_ds.engine")
    assert "hetloco_ds.elastic.replica" in ranks
    assert "hetloco_ds.elastic.launcher" not in ranks
