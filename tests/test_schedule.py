"""The overlapped pipeline schedule: DeepSpeed's order where it should be, no deadlock, same bits."""
from __future__ import annotations

import hashlib
import os
import shutil
import time

import pytest
import torch

from distributed import build_from_hf, run_ranks
from hetloco_ds.pipe.order import links_plan

SEQ = 16
VOCAB = 96


def _instructions(schedule) -> list:
    return [cmd for step in schedule for cmd in step]


@pytest.mark.parametrize("stages", range(1, 9))
@pytest.mark.parametrize("micro_batches", [1, 2, 5, 12])
def test_blocking_ops_are_deepspeeds_train_schedule(stages, micro_batches):
    """order.link_ops("blocking") is DeepSpeed's TrainSchedule instruction for instruction (its
    sends, receives and passes, on the same buffers), so the cost model times the schedule the
    engine runs. Breaks if DeepSpeed changes its 1F1B order or our copy of it drifts."""
    from deepspeed.runtime.pipe import schedule as ds

    from hetloco_ds.pipe.order import compute_order, link_ops

    names = {ds.ForwardPass: "F", ds.BackwardPass: "B", ds.SendActivation: "send_act",
             ds.RecvActivation: "recv_act", ds.SendGrad: "send_grad", ds.RecvGrad: "recv_grad"}
    for s in range(stages):
        sched = ds.TrainSchedule(micro_batches, stages, s)
        theirs = [(names[type(c)], c.buffer_id) for c in _instructions(sched) if type(c) in names]
        ops = link_ops("blocking", stages, s, micro_batches)
        assert [(op, i % sched.num_pipe_buffers()) for op, i in ops] == theirs
        assert [(op, i) for op, i in ops if op in "FB"] == compute_order("blocking", stages, s, micro_batches)


def _run_streams(streams: list[list]) -> list[list[tuple[str, int]]]:
    """Execute every stage's instruction stream with instant links: a wait blocks until the
    peer has issued the matching send, and must follow its own posted receive. Returns
    each stage's compute order; raises on deadlock or a message out of order."""
    from hetloco_ds.pipe import schedule as ps
    from deepspeed.runtime.pipe.schedule import BackwardPass, ForwardPass

    S = len(streams)
    pos = [0] * S
    sent = {("act", s): [] for s in range(S)} | {("grad", s): [] for s in range(S)}  # by receiver
    posted = {("act", s): [] for s in range(S)} | {("grad", s): [] for s in range(S)}
    waited = {("act", s): 0 for s in range(S)} | {("grad", s): 0 for s in range(S)}
    done = [[] for _ in range(S)]
    while any(pos[s] < len(streams[s]) for s in range(S)):
        progressed = False
        for s in range(S):
            while pos[s] < len(streams[s]):
                cmd = streams[s][pos[s]]
                if isinstance(cmd, ps.PostRecvActivation):
                    posted[("act", s)].append(cmd.micro_batch)
                elif isinstance(cmd, ps.PostRecvGrad):
                    posted[("grad", s)].append(cmd.micro_batch)
                elif isinstance(cmd, (ps.SendActivationAsync, ps.SendGradAsync)):
                    key = ("act", s + 1) if isinstance(cmd, ps.SendActivationAsync) else ("grad", s - 1)
                    sent[key].append(cmd.micro_batch)  # non-blocking: moves once the receive is posted
                elif isinstance(cmd, (ps.WaitRecvActivation, ps.WaitRecvGrad)):
                    key = ("act", s) if isinstance(cmd, ps.WaitRecvActivation) else ("grad", s)
                    if len(sent[key]) <= waited[key]:
                        break  # blocked
                    assert sent[key][waited[key]] == cmd.micro_batch
                    assert cmd.micro_batch in posted[key], f"stage {s} waits for {key} {cmd.micro_batch} unposted"
                    waited[key] += 1
                elif isinstance(cmd, ForwardPass):
                    done[s].append(("F", cmd.buffer_id))
                elif isinstance(cmd, BackwardPass):
                    done[s].append(("B", cmd.buffer_id))
                pos[s] += 1
                progressed = True
        if not progressed:
            raise AssertionError(f"deadlock at {[str(streams[s][pos[s]]) for s in range(S) if pos[s] < len(streams[s])]}")
    for key, n in waited.items():
        assert n == len(posted[key]) == len(sent[key]), (key, n, posted[key], sent[key])
    return done


@pytest.mark.parametrize("stages", range(2, 9))
@pytest.mark.parametrize("micro_batches", [1, 3, 8, 32])
def test_overlapped_schedule_never_deadlocks_and_backwards_run_in_order(stages, micro_batches):
    """Every stage's overlapped stream, run against its neighbours: each wait follows its posted
    receive and is eventually met, in message order, nothing is left posted, and each
    stage runs backward passes in micro-batch order (the gradient sum order of the blocking
    schedule). Breaks on a receive posted too late or a wait that comes too early (deadlock)."""
    from hetloco_ds.pipe.order import compute_order, depth
    from hetloco_ds.pipe.schedule import OverlappedTrainSchedule

    streams = [_instructions(OverlappedTrainSchedule(micro_batches, stages, s)) for s in range(stages)]
    done = _run_streams(streams)
    for s in range(stages):
        order = compute_order("overlapped", stages, s, micro_batches)
        w = depth("overlapped", stages, s, micro_batches)
        assert done[s] == [(k, i % w) for k, i in order]
        assert [i for k, i in order if k == "B"] == list(range(micro_batches))
        assert w == min(micro_batches, 3 * (stages - 1 - s) + 1)


# ---------------------------------------------------------------------------- processes
def _config(schedule: str, tied_embeddings: str | None = None, stages: int = 2, compressed=(1,)) -> dict:
    sparseloco = {"inner_steps": 2, "topk": 32, "error_decay": 0.95, "outer_lr": 1.0}
    if tied_embeddings is not None:
        sparseloco["tied_embeddings"] = tied_embeddings
    return {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 3,
        "gradient_clipping": 1.0,
        "pipeline": {"stages": stages},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "betas": [0.9, 0.95], "weight_decay": 0.1}},
        "hetloco": {
            "sparseloco": sparseloco,
            "subspace": {"ratio": 4, "compressed_replicas": compressed if compressed == "all" else list(compressed)},
            "pipeline": {"schedule": schedule},
            "train": {"seq_len": SEQ},
        },
    }


def _batches(replica: int, step: int):
    g = torch.Generator().manual_seed(1000 * replica + step)
    ids = torch.randint(0, VOCAB, (3, 2, SEQ), generator=g)
    return [(m, m) for m in ids]


def _digest(module) -> str:
    h = hashlib.sha256()
    for p in module.parameters():
        h.update(p.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def _both_schedules_body(rank, cases, steps, tag):
    """Per case, train `steps` steps under each schedule in turn, from the same checkpoint and batches.
    "shared slots": the overlapped schedule through `pipe.copy_engine`'s protocol, on host streams."""
    import hetloco_ds.pipe.links as links_module
    from host_streams import HostStreamsBackend

    real = links_module.CopyEngineLinks
    links_module.CopyEngineLinks = lambda *a, **k: real(*a, backend=HostStreamsBackend(tag, rank), **k)
    out = {}
    for name, hf_dir, tied_embeddings, stages in cases:
        # "first blocking": the overlapped schedule after one blocking step, as the engine runs it on CUDA.
        for schedule in ("blocking", "overlapped", "shared slots") + (("first blocking",) if name == "untied" else ()):
            cfg = _config("blocking" if schedule == "blocking" else "overlapped", tied_embeddings, stages,
                          (1,) if stages == 2 else "all")
            if schedule == "shared slots":
                cfg["hetloco"]["pipeline"]["link_transport"] = "copy_engine"
            engine, module, _ = build_from_hf(hf_dir, cfg, SEQ)
            assert engine.schedule == cfg["hetloco"]["pipeline"]["schedule"]
            assert isinstance(engine.links.backend, real) == (schedule == "shared slots")
            engine._blocking_steps_left = int(schedule == "first blocking")
            rows = []
            for step in range(1, steps + 1):
                rec = engine.train_step(iter(_batches(engine.replica, step)))
                rows.append((rec.loss, _digest(module), rec.outer is not None,
                             rec.bytes["activation"], rec.bytes["activation_grad"]))
            out[name, schedule] = rows
    return out


def test_overlapped_and_blocking_schedules_train_bitwise_alike(hf_untied, hf_tied):
    """2 replicas x 2 stages, replica 1 compressed (ratio 4), 3 micro-batches a step, through an
    outer step: every step's replica loss, every stage's parameters (hash of the bits) and the
    stage-link bytes are the same under both schedules, for an untied model and a tied one
    (either way of tying); and for 4 stages of one compressed replica (tied apart). Breaks if
    the overlapped schedule reorders gradient accumulation, hands a micro-batch the wrong
    message or buffer, or drops or duplicates a transfer."""
    cases = [("untied", hf_untied, None, 2), ("tied apart", hf_tied, "outer_step", 2),
             ("tied exactly", hf_tied, "every_step", 2), ("S=4 tied apart", hf_tied, "outer_step", 4)]
    tag = f"schedules-{os.getpid()}-{time.monotonic_ns()}"
    try:
        results = run_ranks(_both_schedules_body, 4, cases, 3, tag)
    finally:
        shutil.rmtree(f"/dev/shm/hetloco-test-{tag}", ignore_errors=True)
    for r in results:
        for name, *_ in cases:
            assert any(row[2] for row in r[name, "blocking"])  # an outer step happened
            assert r[name, "overlapped"] == r[name, "blocking"], name
            assert r[name, "shared slots"] == r[name, "blocking"], name
        assert r["untied", "first blocking"] == r["untied", "blocking"]


def test_auto_is_blocking_on_gpus_inside_a_host_and_overlapped_where_links_are_slow():
    """The defaults: on CPU (gloo) and on CUDA across hosts, overlapped over process groups; on CUDA
    with every stage link inside a host, blocking (overlapping NVLink transfers bought no speed and
    cost activation memory); the copy engines there when the overlapped schedule is named. A named
    schedule or transport is kept; a bad name is refused naming it. Which links cross is read from
    the stage links, not from the replicas: replicas on different hosts with their stages together
    cross nothing."""
    from hetloco_ds.pipe.links import crossing_link

    auto = {(d, c): links_plan("auto", "auto", d, c) for d in ("cpu", "cuda") for c in (False, True)}
    assert auto == {("cpu", False): ("overlapped", "process_group"), ("cpu", True): ("overlapped", "process_group"),
                    ("cuda", False): ("blocking", "process_group"), ("cuda", True): ("overlapped", "process_group")}
    assert links_plan("auto", "process_group", "cuda") == ("blocking", "process_group")
    assert links_plan("auto", "process_group", "cuda", True) == ("overlapped", "process_group")
    assert links_plan("auto", "copy_engine", "cuda") == ("overlapped", "copy_engine")
    assert links_plan("overlapped", "auto", "cuda") == ("overlapped", "copy_engine")
    assert links_plan("overlapped", "process_group", "cuda") == ("overlapped", "process_group")
    assert links_plan("blocking", "auto", "cuda") == ("blocking", "process_group")
    assert links_plan("overlapped", "copy_engine", "cpu") == ("overlapped", "copy_engine")  # the engine refuses it
    with pytest.raises(ValueError, match="'overlaped'"):
        links_plan("overlaped", "auto", "cpu")
    with pytest.raises(ValueError, match="'nvlink'"):
        links_plan("auto", "nvlink", "cpu")
    hosts = ["a", "a", "b", "b"]
    assert not crossing_link([[0, 1], [2, 3]], hosts)
    assert crossing_link([[0, 2], [1, 3]], hosts)
    assert crossing_link([[0, 1, 2, 3]], hosts)
    assert not crossing_link([[0], [1], [2], [3]], hosts)


@pytest.mark.parametrize("stages", range(1, 7))
def test_resident_link_kernels_are_the_link_communicators_a_stage_posts_on(stages):
    """The count behind `pipeline.gemm_sm_carveout: "auto"`: a stage of the overlapped schedule holds at
    most one kernel per link communicator (its operations run in order), so as many as the
    communicators its own operation list posts on (`link_ops`, what the engine runs); the blocking
    schedule holds none. Breaks if the schedule came to post on more communicators than the carveout
    leaves SMs for. On the CPU the carveout changes nothing, whatever its setting."""
    from hetloco_ds.pipe.links import gemm_sm_carveout
    from hetloco_ds.pipe.order import link_ops, resident_link_kernels

    link = {"post_act": ("prev", "down"), "isend_grad": ("prev", "up"),
            "isend_act": ("next", "down"), "post_grad": ("next", "up")}
    for s in range(stages):
        used = {link[k] for k, _ in link_ops("overlapped", stages, s, 8) if k in link}
        assert resident_link_kernels("overlapped", stages, s) == len(used) == 2 * ((s > 0) + (s < stages - 1))
        assert resident_link_kernels("blocking", stages, s) == 0
    before = torch._C._get_sm_carveout_experimental()
    assert gemm_sm_carveout("auto", 1, 4, torch.device("cpu")) == 0
    assert gemm_sm_carveout(8, None, 2, torch.device("cpu")) == 0
    assert torch._C._get_sm_carveout_experimental() == before


def _hosts_body(rank):
    from hetloco_ds.meter import ByteMeter
    from hetloco_ds.pipe.links import host_ids, nccl_link_options

    meter = ByteMeter()
    ids = host_ids(torch.device("cpu"), meter)
    return ids, meter.snapshot()["control"], nccl_link_options(1)


def _named_hosts_body(rank):
    from hetloco_ds.meter import ByteMeter
    from hetloco_ds.pipe.links import HOST_ENV, host_ids

    os.environ[HOST_ENV] = f"hl-ns-{rank % 2}"
    return host_ids(torch.device("cpu"), ByteMeter())


def test_a_rank_counts_itself_on_the_host_hetloco_host_names():
    """$HETLOCO_HOST (netlab sets it to each rank's namespace) is the host a rank counts itself on:
    ranks 0 and 2 share one, rank 1 has another, and a stage link between them crosses hosts. Breaks if
    the engine goes back to the host name under --link, where every namespace shares it."""
    from hetloco_ds.pipe.links import crossing_link

    named = [hashlib.sha256(f"hl-ns-{r % 2}".encode()).digest() for r in range(3)]
    for ids in run_ranks(_named_hosts_body, 3):
        assert ids == named
        assert crossing_link([[0, 1], [2]], ids) == (0, 1) and not crossing_link([[0, 2], [1]], ids)


def test_host_ids_are_every_ranks_host_with_exact_control_bytes():
    """Three gloo ranks on this host: each learns the same three host ids, each the SHA-256 of this
    host's name, and meters 32 (W - 1) control bytes each way; gloo gets no NCCL options. Breaks if
    the gather mixes ranks up, if the ids stop being host names, or if the bytes go unmetered."""
    import socket

    here = hashlib.sha256(socket.gethostname().encode()).digest()
    for ids, control, options in run_ranks(_hosts_body, 3):
        assert ids == [here] * 3
        assert control == {"sent": 64, "recv": 64}
        assert options is None


def _copy_engine_refusals_body(rank, hf_dir):
    """The engine's one-line errors for copy-engine links it cannot build: ranks of a stage link on
    two hosts (host ids made to differ), then a rank without a GPU (this CPU)."""
    import hetloco_ds.pipe.links as links_module

    cfg = _config("overlapped", compressed=())
    cfg["hetloco"]["pipeline"]["link_transport"] = "copy_engine"
    errors = []
    for hosts in ([b"host a", b"host b"], [b"host a", b"host a"]):
        links_module.host_ids = lambda device, meter, hosts=hosts: hosts
        try:
            build_from_hf(hf_dir, cfg, SEQ)
            errors.append(None)
        except ValueError as err:
            errors.append(str(err))
    return errors


def test_copy_engine_links_are_refused_across_hosts_and_without_gpus(hf_untied):
    """Breaks if copy-engine links were attempted between hosts (CUDA IPC cannot reach there) or on
    a rank without a GPU, or if either failure stopped being one line that says why."""
    for errors in run_ranks(_copy_engine_refusals_body, 2, hf_untied):
        assert errors == [
            'hetloco.pipeline.link_transport = "copy_engine" needs both ranks of every stage link on one host; '
            "ranks 0 and 1 are on different hosts",
            'rank 0: hetloco.pipeline.link_transport = "copy_engine" needs CUDA GPUs; this rank runs on cpu']


def _fallback_body(rank, hf_dir, tag):
    """The engine as on GPUs inside a host (`links_plan` told the device is CUDA), its copy-engine
    links on host streams; per case, what it chose and 2 steps' losses and parameter hashes, or its
    error. In the "fails" cases rank 1 cannot map its peer's memory."""
    import logging

    import hetloco_ds.pipe.links as links_module
    from host_streams import HostStreamsBackend

    class Refusing(HostStreamsBackend):
        def map_peer(self, path, dtype, numel, peer):
            raise RuntimeError("no peer access to the GPU of rank 0")

    real_plan, real_links = links_module.order.links_plan, links_module.CopyEngineLinks
    links_module.order.links_plan = lambda s, t, device_type, c=False: real_plan(s, t, "cuda", c)
    warned = []
    handler = logging.Handler()
    handler.emit = lambda record: warned.append(record.getMessage())
    links_module.log.addHandler(handler)
    out = {}
    for case, schedule, transport, fails in [("auto", "auto", "auto", False), ("overlapped", "overlapped", "auto", False),
                                             ("overlapped, fails", "overlapped", "auto", True),
                                             ("copy_engine, fails", "auto", "copy_engine", True)]:
        backend = (Refusing if fails and rank == 1 else HostStreamsBackend)(f"{tag}-{len(out)}", rank)
        links_module.CopyEngineLinks = lambda *a, backend=backend, **k: real_links(*a, backend=backend, **k)
        cfg = _config(schedule, compressed=())
        cfg["hetloco"]["pipeline"]["link_transport"] = transport
        del warned[:]
        try:
            engine, module, _ = build_from_hf(hf_dir, cfg, SEQ)
        except ValueError as err:
            out[case] = str(err)
            continue
        rows = []
        for step in range(1, 3):
            rec = engine.train_step(iter(_batches(engine.replica, step)))
            rows.append((rec.loss, _digest(module)))
        out[case] = (engine.schedule, engine.link_transport, isinstance(engine.links.backend, real_links),
                     isinstance(engine.links.backend, links_module.DirectedGroups), list(warned), rows)
    return out


def test_the_copy_engines_fall_back_to_process_groups_on_every_rank_when_a_rank_cannot_start_them(hf_untied):
    """One pipeline of 2 stages as on GPUs inside a host. Schedule and transport "auto": blocking over
    the default group, no copy engines. Schedule "overlapped", transport "auto": the copy engines when
    both ranks can map each other; when rank 1 cannot, both ranks run overlapped over process groups
    and rank 0 says why in one warning. All three train the same bits. A named "copy_engine" that
    cannot start is an error on both ranks naming the rank. Breaks if one rank fell back and the
    other did not (the job would hang to the test's timeout or train apart), or if the fallback kept
    a copy-engine or a missing group."""
    tag = f"fallback-{os.getpid()}-{time.monotonic_ns()}"
    try:
        results = run_ranks(_fallback_body, 2, hf_untied, tag)
    finally:
        for i in range(4):
            shutil.rmtree(f"/dev/shm/hetloco-test-{tag}-{i}", ignore_errors=True)
    why = "rank 1: no peer access to the GPU of rank 0"
    for rank, r in enumerate(results):
        assert r["auto"][:5] == ("blocking", "process_group", False, False, [])
        assert r["overlapped"][:5] == ("overlapped", "copy_engine", True, False, [])
        assert r["overlapped, fails"][:5] == ("overlapped", "process_group", False, True, [
            f"copy-engine stage links unavailable ({why}); running the overlapped schedule over process groups"][:1 - rank])
        assert r["overlapped"][5] == r["overlapped, fails"][5] == r["auto"][5]
        assert r["copy_engine, fails"] == why
    assert [loss for loss, _ in results[0]["auto"][5]] == [loss for loss, _ in results[1]["auto"][5]]  # the replica's


def _cast_body(rank, hf_dir, steps):
    """Per setting of `cast_weights_once`: every step's loss and parameter hash, and how many fp32 ->
    bf16 casts of this stage's weight matrices each step made (a dispatch mode below autocast sees
    only the casts autocast did not take from its cache; the norms' weight vectors are cast by the
    model's own code, outside autocast's cache, and are not counted)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class CountParamCasts(TorchDispatchMode):
        def __init__(self, ptrs):
            super().__init__()
            self.ptrs, self.n = ptrs, 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            src = args[0] if args else None
            if (func is torch.ops.aten._to_copy.default and isinstance(src, torch.Tensor)
                    and src.dtype == torch.float32 and kwargs.get("dtype") == torch.bfloat16
                    and src.dim() == 2 and src.data_ptr() in self.ptrs):
                self.n += 1
            return func(*args, **kwargs)

    out = {}
    for once in (False, True):
        cfg = _config("overlapped", compressed=())
        cfg["bf16"] = {"enabled": True}
        engine, module, _ = build_from_hf(hf_dir, cfg, SEQ)
        engine.cast_weights_once = once
        rows = []
        for step in range(1, steps + 1):
            counter = CountParamCasts({p.data_ptr() for p in module.parameters()})
            with counter:
                rec = engine.train_step(iter(_batches(engine.replica, step)))
            rows.append((rec.loss, _digest(module), counter.n))
        out[once] = rows
    return out


def test_bf16_weights_cast_once_per_step_with_the_same_bits(hf_untied):
    """Under bf16 (autocast over fp32 weights) each weight matrix is cast to bf16 once per optimizer step,
    not once per micro-batch, and the losses and parameters are bitwise those of the per-micro-batch
    casts, through an outer step (2 stages, 3 micro-batches, overlapped). Breaks if the cast cache
    is lost between micro-batches (3x the casts) or outlives the step (stale weights: other bits)."""
    results = run_ranks(_cast_body, 2, hf_untied, 3)
    for r in results:
        assert [row[:2] for row in r[True]] == [row[:2] for row in r[False]]
        once, each = [row[2] for row in r[True]], [row[2] for row in r[False]]
        assert min(once) > 0 and each == [3 * n for n in once], (once, each)


def _grad_order_body(rank, hf_dir, steps):
    """For the step-cached casts (`casts.step_casts`) and for autocast's cache alone (the casts
    before it): per micro-batch of a step, how many weight matrices' gradients reach their fp32
    parameter after the backward has reached the stage's first decoder layer. Events: a full
    backward hook on the stage's last and first decoder layers (a micro-batch's backward starts at
    the one, reaches the other) and a post-accumulate hook on every matrix."""
    from hetloco_ds.model import DecoderLayer

    out = {}
    for mode in ("step_casts", "autocast_cache"):
        cfg = _config("blocking", compressed=())
        cfg["bf16"] = {"enabled": True}
        engine, module, _ = build_from_hf(hf_dir, cfg, SEQ)
        out.setdefault("chose", []).append(engine.step_casts)
        engine.step_casts = mode == "step_casts"  # whichever the size rule chose for this tiny stage
        events: list = []
        layers = [m for m in module.modules() if isinstance(m, DecoderLayer)]
        layers[-1].register_full_backward_hook(lambda *_: events.append("start"))
        layers[0].register_full_backward_hook(lambda *_: events.append("first"))
        matrices = [p for p in module.parameters() if p.dim() == 2 and p.requires_grad]
        for p in matrices:
            p.register_post_accumulate_grad_hook(lambda p: events.append("grad"))
        for step in range(1, steps + 1):
            events.clear()
            engine.train_step(iter(_batches(engine.replica, step)))
            tails: list = []
            counting = False
            for e in events:
                if e in ("first", "start"):
                    counting = e == "first"
                    tails += [0] if counting else []
                elif counting:
                    tails[-1] += 1
            out.setdefault(mode, []).append(tails)
        out["matrices"], out["per_layer"] = len(matrices), sum(p.dim() == 2 for p in layers[0].parameters())
    return out


def test_each_micro_batchs_weight_gradients_leave_its_backward_as_they_are_made(hf_untied):
    """Under bf16 with each weight cast once per step: autocast's own cache makes the cast's
    backward node in the step's first micro-batch, so in every later one autograd runs it last and
    every weight's bf16 gradient waits for the end of the backward (on an 8B stage of 8 layers, 3.3
    GiB that outweighed the activations). With `casts.step_casts`, once a micro-batch's backward
    reaches the stage's first decoder layer only that layer's matrices (and the embedding, which is
    looked up, not cast) are still to arrive, in every micro-batch; autocast's cache alone (the
    control) leaves every matrix of the stage to the end from the second micro-batch on. Breaks if
    the per-micro-batch nodes are lost (or this check goes blind: the control must show the pile-up)."""
    for r in run_ranks(_grad_order_body, 2, hf_untied, 2):
        n, per_layer = r["matrices"], r["per_layer"]
        assert r["chose"][0] == r["chose"][1] in (True, False)
        assert per_layer + 1 < n
        for tails in r["step_casts"]:
            assert len(tails) == 3 and all(t <= per_layer + 1 for t in tails), (tails, per_layer, n)
        for tails in r["autocast_cache"]:
            assert len(tails) == 3 and tails[1:] == [n, n], (tails, n)


def test_step_casts_are_used_where_the_deferred_gradients_would_be_the_peak():
    """`sizes.step_casts_pay`, which the engine asks once: on a Llama-3-8B stage of 8 layers at
    1024 tokens a micro-batch (16 a step) the deferred bf16 gradients (3.3 GiB, 3.5 with the head)
    outweigh one micro-batch's activations (1.7 GiB): yes, on the first stage and the last. At 1B's
    4096 tokens (16 layers on one GPU, or 8 a stage) and 178M's 16384 the activations outweigh them:
    no, the per-micro-batch nodes would cost host time for nothing. Never without bf16 or with one
    micro-batch a step. Breaks if the rule turns them on where they cannot lower the peak, or off
    where they do."""
    from hetloco_ds import sizes

    def case(d, ffn, kv, layers, tokens, head=0, micro_batches=16, bf16=True):
        layer = 2 * d * d + 2 * d * kv + 3 * d * ffn
        return sizes.step_casts_pay(layers * layer + head, micro_batches, layers, tokens, d, ffn, kv, bf16)

    assert case(4096, 14336, 1024, 8, 1024) and case(4096, 14336, 1024, 8, 1024, head=8192 * 4096)
    assert not case(2048, 8192, 2048, 16, 4096, head=8192 * 2048) and not case(2048, 8192, 2048, 8, 4096)
    assert not case(1024, 2688, 1024, 5, 16384)
    assert not case(4096, 14336, 1024, 8, 1024, bf16=False) and not case(4096, 14336, 1024, 8, 1024, micro_batches=1)
    # the boundary: the gradients must outweigh the activations, not tie with them
    per_token = sizes.layer_activation_bytes(8, 16, 8)
    assert not sizes.step_casts_pay(per_token * 4 // 2, 2, 1, 4, 8, 16, 8)
    assert sizes.step_casts_pay(per_token * 4 // 2 + 1, 2, 1, 4, 8, 16, 8)
