"""Fault injection for tests/test_faults.py, loaded into every Python process whose PYTHONPATH
starts with this folder (Python imports `sitecustomize` at start-up).

HETLOCO_FAULT="<rank>:<event>:<n>[:<action>]" makes the process of global rank <rank> act at its
n-th <event>; processes of other ranks, and those without the variable, are untouched. <rank>
"launcher" is the `--nproc` launcher (the process without RANK).

events  step  a torch AdamW step (inside a training step: after forward and backward)
        holdsync  an elastic replica's outer-sync quorums (ElasticTransport.begin, inside the outer
              sync and so inside the watchdog's waiting phase); the action is a folder: from the n-th
              on, quorum number k waits while FOLDER/hold-k exists (an elastic test holds a fleet at
              chosen boundaries until late replicas are ready to join)
        holdstep  a torch AdamW step; the action is a folder: the n-th creates FOLDER/held and waits
              while FOLDER/hold exists, and every stop or save round this rank's preemption thread
              sees agreed writes its step to FOLDER/agreed-<round> (a test signals a job at a known
              step and lets it go on once its ranks agree where to save)
        sync  an outer step's payload exchange (hetloco_ds.transport.static.GroupTransport.exchange)
        poison  an outer step's payloads as StageAlgorithm.prepare returns them; the action is an attack
              of hetloco_ds.sparseloco.attacks (flip, scale, noise, constant): from the n-th outer
              step on, this rank's payloads go out corrupted that way (a peer sending bad bytes)
        own   the launcher taking --out (hetloco_ds.runplan.own_run, after every check passed); the action is
              a folder: it creates FOLDER/checked, then waits while FOLDER/hold exists (a test lets
              another run take the directory meanwhile)
        ckpt  inside hetloco_ds.checkpoint: a file written (write_durably) or a directory
              fsynced (_fsync_dir: after the manifest, after the rename, after `latest`)
actions kill  SIGKILL (default); at a file write, half of the file's bytes are written first
              and the process lingers half a second (a slow disk), so a torn file is left behind
              and the other ranks run ahead as far as they are allowed to
        stop  SIGSTOP (the watchdog's case)
"""
import importlib.abc
import importlib.util
import io
import os
import signal
import sys
import time

_SPEC = os.environ.get("HETLOCO_FAULT")
_RANK = os.environ.get("RANK")


def _parse(spec):
    rank, event, n, *action = spec.split(":")
    return rank, event, int(n), (action[0] if action else "kill")


class _Fault:
    def __init__(self, event, n, action):
        self.event, self.n, self.action, self.count = event, n, action, 0

    def hit(self, event):
        """True when this call is the n-th of `event`."""
        if event != self.event:
            return False
        self.count += 1
        return self.count == self.n

    def fire(self):
        sys.stderr.write(f"[fault_inject] rank {os.environ.get('RANK')}: {self.action} at {self.event} #{self.n}\n")
        sys.stderr.flush()
        os.kill(os.getpid(), signal.SIGSTOP if self.action == "stop" else signal.SIGKILL)


def _install(fault):
    import torch

    from hetloco_ds import checkpoint
    from hetloco_ds.transport import static

    step = torch.optim.AdamW.step

    def adamw_step(self, *args, **kwargs):
        if fault.hit("step"):
            fault.fire()
        return step(self, *args, **kwargs)

    torch.optim.AdamW.step = adamw_step

    exchange = static.GroupTransport.exchange

    def exchange_then_fault(self, *args, **kwargs):
        if fault.hit("sync"):
            fault.fire()
        return exchange(self, *args, **kwargs)

    static.GroupTransport.exchange = exchange_then_fault

    write_durably = checkpoint.write_durably

    def torn_write(path, write):
        if fault.hit("ckpt"):
            if fault.action == "kill":
                buf = io.BytesIO()
                write(buf)
                data = buf.getvalue()
                with open(path, "wb") as f:
                    f.write(data[: len(data) // 2])
                time.sleep(0.5)
            fault.fire()
        return write_durably(path, write)

    checkpoint.write_durably = torn_write

    fsync_dir = checkpoint._fsync_dir

    def fsync_then_fault(path):
        fsync_dir(path)
        if fault.hit("ckpt"):
            fault.fire()

    checkpoint._fsync_dir = fsync_then_fault

    if fault.event == "own":
        from hetloco_ds import runplan, train

        own_run = runplan.own_run

        def held_own_run(plan):
            if fault.hit("own"):
                open(os.path.join(fault.action, "checked"), "w").close()
                while os.path.exists(os.path.join(fault.action, "hold")):
                    time.sleep(0.05)
            return own_run(plan)

        # The launcher imports it from runplan when it runs; a rank holds train's name for it.
        runplan.own_run = train.own_run = held_own_run

    if fault.event == "holdstep":
        from hetloco_ds import preempt

        def adamw_step_held(self, *args, **kwargs):
            fault.count += 1
            if fault.count == fault.n:
                open(os.path.join(fault.action, "held"), "w").close()
                while os.path.exists(os.path.join(fault.action, "hold")):
                    time.sleep(0.02)
            return step(self, *args, **kwargs)

        torch.optim.AdamW.step = adamw_step_held
        resolve = preempt.Preemption._resolve

        def resolve_noted(self, r):
            resolve(self, r)
            if r.step is not None:
                path = os.path.join(fault.action, f"agreed-{r.key}")
                with open(path + ".tmp", "w") as f:
                    f.write(str(r.step))
                os.replace(path + ".tmp", path)

        preempt.Preemption._resolve = resolve_noted

    if fault.event == "poison":
        from hetloco_ds.algorithm import StageAlgorithm
        from hetloco_ds.sparseloco.attacks import corrupt_

        prepare = StageAlgorithm.prepare

        def poisoned_prepare(self):
            payloads = prepare(self)
            fault.count += 1
            if fault.count >= fault.n:
                sys.stderr.write(f"[fault_inject] rank {os.environ.get('RANK')}: {fault.action} payloads of outer "
                                 f"step {fault.count}\n")
                for state, payload in zip(self.outer.states, payloads):
                    corrupt_(state, payload, fault.action, torch.Generator().manual_seed(fault.count))
            return payloads

        StageAlgorithm.prepare = poisoned_prepare

    if fault.event == "holdsync":  # torchft only where it is asked for
        from hetloco_ds.transport import elastic

        begin = elastic.ElasticTransport.begin

        def hold_then_begin(self, *args, **kwargs):
            fault.count += 1
            hold = os.path.join(fault.action, f"hold-{fault.count}")
            if fault.count >= fault.n and os.path.exists(hold):
                sys.stderr.write(f"[fault_inject] rank {os.environ.get('RANK')}: held at quorum #{fault.count}\n")
                while os.path.exists(hold):
                    time.sleep(0.05)
            return begin(self, *args, **kwargs)

        elastic.ElasticTransport.begin = hold_then_begin


class _AfterTrain(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Installs the fault once hetloco_ds.train has been imported (before the engine is)."""

    def __init__(self, fault):
        self.fault = fault

    def find_spec(self, name, path, target=None):
        if name != "hetloco_ds.train":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        self.inner = spec.loader
        spec.loader = self
        return spec

    def create_module(self, spec):
        return self.inner.create_module(spec)

    def exec_module(self, module):
        self.inner.exec_module(module)
        _install(self.fault)


if _SPEC:
    _rank, _event, _n, _action = _parse(_SPEC)
    if _RANK == _rank or (_RANK is None and _rank == "launcher"):
        sys.meta_path.insert(0, _AfterTrain(_Fault(_event, _n, _action)))
