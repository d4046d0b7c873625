"""`hetloco-ds train`: each rank's loop, after `runplan` checked everything and took the run directory.

`run_rank` plans on every rank (`runplan.plan_run`, local rank 0 first), builds the engine and runs
the loop; `main_rank` turns what stopped it into one exit code and at most one line.

Exit codes: 0 done, 1 a failure while running (a full disk, a lost rank), 2 bad input, 3 every
replica went non-finite (the last good checkpoint stays `latest`), 4 a rank stalled (watchdog),
5 an elastic replica refused by its fleet (another secret, or a config the fleet cannot sum with),
75 stopped by a signal after committing a checkpoint (`preempt.py`: every rank saves at one agreed
step; 128 + N when signal N stopped it and the save did not commit within train.preempt_grace_s).

Elastic mode (`args.fleet`, see hetloco_ds/elastic/): the job is one replica of a fleet, its run
directory OUT/replica-<id>; its outer sync goes through torchft instead of the static world. The
loop is the same: what differs sits behind the engine's `ReplicaTransport`.
"""
from __future__ import annotations

import contextlib
import dataclasses
import datetime
import importlib
import math
import os
import signal
import sys
import time
import uuid

import torch

from . import checkpoint, rundir
from .config import ConfigError
from .elastic import replica as fleet
from .elastic.replica import EXIT_REFUSED
from .preempt import EXIT_PREEMPTED, STOPPED, NoAgreement, Preemption
# TrainArgs, RunPlan and the checks stay importable from here, where tests and bench scripts take them.
from .runplan import RunPlan, TrainArgs, default_out, own_run, plan_run, prepare_inputs  # noqa: F401
from .watchdog import EXIT_STALLED, Watchdog

EXIT_FAILED, EXIT_BAD_INPUT, EXIT_NONFINITE = 1, 2, 3
PEER_GRACE_S = 5.0
"""How long a rank that lost a peer waits to be stopped by its launcher before saying so itself:
the launcher reports the rank that failed first, and this one's echo would only be noise."""
QUIET_EXIT_DELAY_S = 2.0
"""When all ranks fail together and one of them prints the line, the others exit this much later,
so the launcher (which stops every rank at the first failure) sees the printing rank go first."""

# Set by our launcher (`--nproc`) in the ranks' environment.
ENV_OWNED, ENV_JOB, ENV_TAG = "HETLOCO_OWNED", "HETLOCO_JOB", "HETLOCO_RESUME_TAG"
ENV_NO_BAR = "HETLOCO_NO_PROGRESS_BAR"
"""Set by a launcher that runs several jobs in one terminal (`--elastic`) on all but one of them."""


class Diverged(RuntimeError):
    """Every replica's update was non-finite for too many outer steps in a row."""


class Preempted(Exception):
    """The job was told to stop (`signum`) and every rank stopped at `step`; `tag` is the newest
    committed checkpoint (None: nothing was ever saved, a fresh run stopped before its first step)."""

    def __init__(self, signum: int, step: int, tag: str | None):
        super().__init__(signal.Signals(signum).name)
        self.signum, self.step, self.tag = signum, step, tag


# ------------------------------------------------------------------------------------ ranks


def _all_replicas_nonfinite(engine, rec) -> bool:
    """Whether no replica's update was usable at this sync point; the same answer on every rank.

    SparseLoCo: some stage excluded every replica's pseudo-gradient as non-finite. Plain data
    parallelism (no outer step): every replica's loss was non-finite."""
    from deepspeed import comm as dist

    if rec.outer is not None:
        bad, op = bool(rec.outer["excluded"]) and not rec.outer["contributors"], dist.ReduceOp.MAX
    else:
        bad, op = not math.isfinite(rec.loss), dist.ReduceOp.MIN
    flag = torch.tensor([1.0 if bad else 0.0], device=engine.device)
    dist.all_reduce(flag, op=op)
    return bool(flag.item())


def _most_of_all_ranks(engine, value: int) -> int:
    """The largest of every rank's `value` (one scalar all-reduce over the world, once a run)."""
    from deepspeed import comm as dist

    t = torch.tensor([value], dtype=torch.int64, device=engine.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def _peer_lost(err: BaseException) -> bool:
    import torch.distributed as tdist

    kinds = tuple(k for k in (getattr(tdist, "DistNetworkError", None), getattr(tdist, "DistBackendError", None)) if k)
    text = str(err)
    return isinstance(err, kinds) or any(s in text for s in ("Connection closed by peer", "Connection reset by peer",
                                                             "Broken pipe", "Socket Timeout"))


def _plan_on_every_rank(args: TrainArgs, world: int, rank: int, local_rank: int, owned: bool) -> RunPlan | None:
    """plan_run on every rank; local rank 0 first (it may build token caches the others then read).
    Any rank's failure fails all: the lowest failing rank prints its line."""
    from deepspeed import comm as dist

    # plan_run's imports (transformers' LLaMA modules: seconds of CPU) on every rank at once, before the
    # barrier that makes the other ranks wait for local rank 0's plan; inside plan_run they ran one
    # rank after another.
    for module in ("convert", "hf_export", "corpus", "batches"):
        importlib.import_module(f"{__package__}.{module}")

    def attempt():
        try:
            return plan_run(args, world, owned=owned), None
        except (ConfigError, ValueError, FileNotFoundError) as err:
            return None, str(err)

    if local_rank != 0:
        dist.barrier()
    plan, error = attempt()
    if local_rank == 0:
        dist.barrier()
    errors: list = [None] * world
    dist.all_gather_object(errors, error)
    failed = [r for r, e in enumerate(errors) if e is not None]
    if failed:
        if rank == failed[0]:
            print(f"hetloco-ds train: error: {errors[rank]}", file=sys.stderr, flush=True)
        else:
            time.sleep(QUIET_EXIT_DELAY_S)
        return None
    return plan


def run_rank(args: TrainArgs) -> int:
    """Body of one rank (launched by deepspeed, torchrun, accelerate or our --nproc)."""
    from deepspeed import comm as dist

    from .build import init_distributed

    os.environ.setdefault("LOCAL_RANK", "0")
    local_rank = int(os.environ["LOCAL_RANK"])
    init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    owned = os.environ.get(ENV_OWNED) == "1"
    if args.out is None:  # one default for all ranks, whatever their clocks say
        box = [default_out()]
        dist.broadcast_object_list(box, src=0)
        out = box[0] if args.fleet is None else fleet.replica_dir(box[0], args.fleet.replica)
        args = dataclasses.replace(args, out=out)

    plan = _plan_on_every_rank(args, world, rank, local_rank, owned)
    if plan is None:
        return EXIT_BAD_INPUT
    # Without our launcher, global rank 0 owns the run directory for the job's lifetime.
    lock = None
    shared = [None, os.environ.get(ENV_JOB), os.environ.get(ENV_TAG)]
    if rank == 0 and not owned:
        try:
            if plan.resume is not None and plan.resume.note:
                print(f"[hetloco] {plan.resume.note}", flush=True)
            lock = own_run(plan)
            shared[1] = uuid.uuid4().hex[:12]
        except (ConfigError, ValueError, OSError) as err:
            shared[0] = checkpoint.describe_os_error(err, plan.args.out) if isinstance(err, OSError) else str(err)
    dist.broadcast_object_list(shared, src=0)
    error, job, tag = shared
    if error is not None:
        if rank == 0:
            print(f"hetloco-ds train: error: {error}", file=sys.stderr, flush=True)
        else:
            time.sleep(QUIET_EXIT_DELAY_S)
        return EXIT_BAD_INPUT
    try:
        return _train(plan, job, tag or (plan.resume.tag if plan.resume else None), rank, world)
    finally:
        if lock is not None:
            lock.release()


def _train(plan: RunPlan, job: str, tag: str | None, rank: int, world: int) -> int:
    from deepspeed import comm as dist

    from . import hf_export
    from .transport.auth import FleetRefused

    out = plan.args.out
    watchdog = Watchdog(rundir.state_dir(out, "heartbeat", job), rank, world,
                        plan.run.hetloco.train.watchdog_timeout).start()
    stopper = loop = None
    try:
        stopper = _preemption(plan, job, rank, world, watchdog)
        loop = _Loop(plan, watchdog, stopper)
        loop.build(tag, rank)
        loop.run()
        with watchdog.busy("export"):
            dist.barrier()
            if rank == 0:
                hf_export.export(plan.ckpt_dir, os.path.join(out, rundir.EXPORT), overwrite=True)
                print(f"[hetloco] exported Hugging Face model to {os.path.join(out, rundir.EXPORT)}", flush=True)
            dist.barrier()
        return 0
    except FleetRefused as err:
        # Every stage of the replica may be refused at once: one line for the job, on a line of its
        # own. A progress bar leaves its line open: this rank's is ended first; one of another rank
        # (or, under --elastic, of another replica's job) may be open on the same terminal.
        shown = loop.end_progress()
        if fleet.claim_refusal(rundir.state_dir(out, "heartbeat", job)):
            print(("" if shown else "\n") + f"hetloco-ds train: error: {_first_line(err)}", file=sys.stderr, flush=True)
        else:
            time.sleep(QUIET_EXIT_DELAY_S)
        return EXIT_REFUSED
    except Preempted as stop:
        if loop.progress is not None:
            loop.progress.close()  # the bar's last line ends before the job's
        return _stopped(stop, plan.ckpt_dir, rank == 0 and stopper.claim(STOPPED))
    finally:
        watchdog.stop()
        for part in (loop, stopper):
            if part is not None:
                part.close()


STORE_TIMEOUT_S = 30.0
"""How long one request to the job's store may take before the agreement thread tries again."""


def _preemption(plan: RunPlan, job: str, rank: int, world: int, watchdog: Watchdog) -> Preemption:
    """This rank's side of the stop and interval-save agreement (`preempt.py`), signals caught from
    now on, through its own client of the store the job's ranks met at (MASTER_ADDR:MASTER_PORT)."""
    from torch.distributed import HashStore, TCPStore

    cfg, sl = plan.run.hetloco.train, plan.run.hetloco.sparseloco
    if world == 1:
        store = HashStore()
    else:
        store = TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                         timeout=datetime.timedelta(seconds=STORE_TIMEOUT_S), wait_for_workers=False)
    return Preemption(store, f"hetloco/preempt/{job}/", rank, world, grace_s=cfg.preempt_grace_s,
                      every_s=cfg.checkpoint_every_s, boundary=sl.inner_steps if sl.enabled else 1,
                      steps=plan.args.steps, claim_dir=rundir.state_dir(plan.args.out, "heartbeat", job),
                      busy=watchdog.busy).install()


def _stopped(stop: Preempted, ckpt_dir: str, report: bool) -> int:
    """The job's line (`report`: rank 0, unless a rank ending at the deadline said it) and exit code
    once every rank stopped on a signal; before a fresh run's first step there is nothing to save, and
    it ends as a process stopped by the signal would."""
    if stop.tag is None:
        return 128 + stop.signum
    if report:
        print(f"hetloco-ds train: stopped by {stop} at step {stop.step}; checkpoint {stop.tag} is committed in "
              f"{ckpt_dir}: --resume continues from it", file=sys.stderr, flush=True)
    return EXIT_PREEMPTED


def _replica_options(plan: RunPlan, watchdog: Watchdog) -> dict:
    """`build_engine`'s replica and transport, chosen once for the run: the static world's (none
    given) without a fleet; in one, this replica's id and its `FleetTransport`."""
    a = plan.args
    if a.fleet is None:
        return {}
    return {"replica": (a.fleet.replica, plan.replicas),
            "transport": fleet.transport_factory(plan.run, plan.llama_config, a.fleet, plan.secret, watchdog)}


class _Loop:
    """One rank's training: the engine, its data stream, and what it writes (metrics rows, progress,
    validation, checkpoints). Static or elastic, the same path: the engine's transport holds the
    difference (`ReplicaTransport`: the start gate, the wait for the fleet, its state, its close)."""

    def __init__(self, plan: RunPlan, watchdog: Watchdog, stopper: Preemption):
        self.plan, self.watchdog, self.stopper = plan, watchdog, stopper
        self.cfg = plan.run.hetloco.train
        self.engine = self.writer = self.progress = None

    def build(self, tag: str | None, rank: int) -> None:
        """The engine (from `tag`'s checkpoint when given), the replica's batches, the outputs; then
        the transport's start (`--elastic`: every replica of the fleet is up)."""
        from .batches import ReplicaBatches
        from .build import build_engine, build_module
        from .metrics import MetricsWriter, Progress, RunFacts, validated_steps

        plan, cfg, watchdog = self.plan, self.cfg, self.watchdog
        torch.manual_seed(cfg.seed)
        module = build_module(plan.run, plan.llama_config, hf_dir=plan.hf_dir)
        self.engine = engine = build_engine(plan.run, module, seq_len=cfg.seq_len, **_replica_options(plan, watchdog))
        position, self.resumed_at = 0, None
        if tag is not None:
            with watchdog.busy(f"loading {tag}"):
                position = checkpoint.load(engine, plan.ckpt_dir, tag)
            self.resumed_at = engine.local_steps
        self.batches = ReplicaBatches(plan.corpus.train, engine.replica, engine.num_replicas,
                                      engine.micro_batch_size, seed=cfg.seed, position=position)
        self.needs_data = engine.is_first_stage() or engine.is_last_stage()
        engine.transport.start()

        metrics_path = os.path.join(plan.args.out, rundir.METRICS)
        facts = RunFacts.from_engine(engine)
        self.writer = MetricsWriter(metrics_path if engine.is_last_stage() else None, facts)
        # A launcher that runs several jobs in one terminal (`--elastic`) leaves one of them the bar.
        self.progress = Progress(total=plan.args.steps, initial=engine.local_steps,
                                 enabled=rank == 0 and not os.environ.get(ENV_NO_BAR), monitor=engine.monitor,
                                 facts=facts)
        every = cfg.eval_interval
        self.next_eval = (engine.local_steps // every + 1) * every if every else None
        H = plan.run.hetloco.sparseloco.inner_steps if plan.run.hetloco.sparseloco.enabled else 1
        self.ckpt_every = cfg.checkpoint_interval * H
        self.validated_at = (self.resumed_at if self.resumed_at is not None
                             and self.resumed_at in validated_steps(metrics_path) else None)
        self.last_good = tag
        self.saved_at = self.resumed_at
        self.bad_steps: list[int] = []

    def validate(self, step: int) -> None:
        from .batches import validation_batches

        engine = self.engine
        self.validated_at = step
        with self.watchdog.busy(f"validation at step {step}"):
            # Every replica evaluates through its own pipeline (a compressed one through its
            # compressed boundaries) on the same held-out batches; the row has each loss and
            # their mean, as the paper averages validation over the data-parallel replicas. The
            # job's first replica writes it: an elastic replica (its own job) knows only its own.
            val = validation_batches(self.plan.corpus.val, engine.micro_batch_size) if self.needs_data else None
            losses = engine.validation_losses(val, self.cfg.eval_batches)
            mean = sum(losses.values()) / len(losses)
            if engine.is_last_stage() and engine.module.replica_id == 0:
                self.writer.write({"kind": "validation", "step": step, "replica": engine.replica, "loss": mean,
                                   "replica_losses": [losses[m] for m in sorted(losses)], "time": time.time()})
            self.progress.validation(step, mean)

    def save(self, step: int, wait: bool = False) -> None:
        with self.watchdog.busy(f"checkpoint at step {step}"):
            self.last_good = checkpoint.save(self.engine, self.plan.ckpt_dir, step, self.batches.position,
                                             keep=self.cfg.keep_checkpoints, wait=wait)
        self.saved_at = step
        self.stopper.saved()
        self.log_commits()

    def act(self, due) -> None:
        """What the ranks agreed on for this step (`Preemption.between_steps`): a save (none over a
        step already saved, nor inside a non-finite streak: the last good checkpoint stays); on a
        stop, every save committed, then `Preempted`."""
        step = self.engine.local_steps
        if due.save and step not in (self.saved_at, 0) and not self.bad_steps:
            self.save(step, wait=due.stop is not None)
        if due.stop is not None:
            self.settle(block=True)
            self.stopper.committed()
            raise Preempted(due.stop, step, self.last_good)

    def settle(self, block: bool = False) -> None:
        if block:
            with self.watchdog.busy("committing the last checkpoint"):
                checkpoint.settle(self.engine, block=True)
        else:
            checkpoint.settle(self.engine)
        self.log_commits()

    def log_commits(self) -> None:
        """A metrics row per committed checkpoint (what it cost training and the disk), written once."""
        for c in checkpoint.committed(self.engine):
            if self.engine.module.replica_id == 0:
                self.writer.write({"kind": "checkpoint", **c, "time": time.time()})

    def diverged(self) -> "Diverged":
        self.settle(block=True)  # the last good one, written in the background
        return Diverged(_diverged_line(self.bad_steps, self.plan.ckpt_dir, self.last_good))

    def run(self) -> None:
        engine, steps, every = self.engine, self.plan.args.steps, self.cfg.eval_interval
        self.stopper.begin(engine.local_steps)
        while engine.local_steps < steps:
            due = self.stopper.between_steps(engine.local_steps)
            if due is not None:
                self.act(due)
                continue  # asked again at this step: a stop may have been agreed meanwhile
            # The last step always ends with an outer sync, so the export and the final
            # validation see the synced model even when steps is not a multiple of H.
            last = engine.local_steps + 1 == steps
            with _profiled(self.cfg.profile_step, engine, self.plan.args.out, engine.global_rank):
                rec = engine.train_step(self.batches if self.needs_data else None, force_outer=last)
            waited = engine.transport.waited_seconds(rec.outer) if rec.outer is not None else 0.0
            self.watchdog.progress(f"step {rec.step}", rec.seconds - waited)
            at_boundary = rec.outer is not None or not engine.algorithm.sparseloco
            self.writer.step(rec)
            self.progress.update(rec)
            if at_boundary and self.cfg.max_nonfinite_outer_steps:
                if _all_replicas_nonfinite(engine, rec):
                    self.bad_steps.append(rec.step)
                    if len(self.bad_steps) >= self.cfg.max_nonfinite_outer_steps:
                        raise self.diverged()
                    continue  # no validation of, and no checkpoint over, a model that did not move
                self.bad_steps.clear()
            if self.next_eval is not None and at_boundary and rec.step >= self.next_eval:
                self.validate(rec.step)
                self.next_eval = (rec.step // every + 1) * every
            if at_boundary:  # a background write that every rank has finished is committed here
                self.settle()
            if self.ckpt_every and at_boundary and rec.step % self.ckpt_every == 0 and rec.step < steps:
                self.save(rec.step)
        if self.bad_steps:  # the run ended inside a non-finite streak: keep the last good checkpoint
            raise self.diverged()
        if self.validated_at != engine.local_steps:  # also at --steps 0
            self.validate(engine.local_steps)
        if engine.local_steps != self.resumed_at:  # a resume with nothing left to train already has it
            self.save(engine.local_steps, wait=True)
        self.settle(block=True)
        signum = _most_of_all_ranks(engine, self.stopper.stop_signal)
        self.stopper.committed()  # a stop from here on (the export) has nothing left to save
        if signum:  # a stop that came after the last step started: its checkpoint is the run's last one
            raise Preempted(signum, engine.local_steps, self.last_good)
        self.progress.close()
        self.writer.close()

    def end_progress(self) -> bool:
        """End the progress bar now (before a line that must start one of its own); whether this
        rank showed it."""
        progress, self.progress = self.progress, None
        return progress is not None and progress.close()

    def close(self) -> None:
        if self.engine is not None:
            self.engine.transport.close()
        if self.progress is not None:
            self.progress.close()
        if self.writer is not None:
            self.writer.close()


def _profiled(step: int, engine, out: str, rank: int):
    """`profiling.record_step` around the step numbered `step` (train.profile_step), else nothing."""
    if step != engine.local_steps + 1:
        return contextlib.nullcontext()
    from . import profiling

    return profiling.record_step(os.path.join(out, "profile"), rank, torch.device(engine.device))


def _diverged_line(bad_steps: list[int], ckpt_dir: str, last_good: str | None) -> str:
    kept = (f"{os.path.join(ckpt_dir, checkpoint.LATEST)} still names {last_good}, the last good checkpoint"
            if last_good else "no checkpoint had been written")
    return (f"every replica's update was non-finite at {len(bad_steps)} consecutive outer steps "
            f"(steps {', '.join(map(str, bad_steps))}); stopped without exporting; {kept}")


def main_rank(args: TrainArgs) -> int:
    """One rank: its exit code, and at most one line on stderr for the job."""
    from deepspeed import comm as dist

    rank = int(os.environ.get("RANK", "0"))
    try:
        return run_rank(args)
    except Diverged as err:
        if rank == 0:
            print(f"hetloco-ds train: error: {err}", file=sys.stderr, flush=True)
        else:
            time.sleep(QUIET_EXIT_DELAY_S)
        return EXIT_NONFINITE
    except (checkpoint.CheckpointError, NoAgreement) as err:
        if err.report:
            print(f"hetloco-ds train: error: {err}", file=sys.stderr, flush=True)
        else:
            time.sleep(QUIET_EXIT_DELAY_S)
        return EXIT_FAILED
    except (OSError, RuntimeError) as err:
        line = checkpoint.describe_os_error(err, getattr(err, "filename", None) or args.out or ".")
        if line.startswith("no space left"):  # outside a checkpoint: metrics, the export
            print(f"hetloco-ds train: error: rank {rank}: {line}", file=sys.stderr, flush=True)
            return EXIT_FAILED
        if not _peer_lost(err):
            raise
        # Another rank died or stopped; our launcher is about to stop this one and name that rank.
        time.sleep(PEER_GRACE_S)
        print(f"hetloco-ds train: error: rank {rank} lost contact with another rank ({_first_line(err)})",
              file=sys.stderr, flush=True)
        return EXIT_FAILED
    finally:
        try:
            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - a broken group cannot be torn down cleanly
            pass


__all__ = ["TrainArgs", "RunPlan", "plan_run", "own_run", "run_rank", "main_rank",
           "EXIT_FAILED", "EXIT_BAD_INPUT", "EXIT_NONFINITE", "EXIT_STALLED", "EXIT_REFUSED", "EXIT_PREEMPTED"]
