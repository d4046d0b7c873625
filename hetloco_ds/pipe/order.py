"""The order in which a pipeline stage runs its micro-batches, for both schedules (pure Python).

The engine's schedules (`pipe.schedule`) and the cost model's event simulation (`plan.model`)
both read it, so the order the model times is the order the engine runs.

blocking      DeepSpeed's TrainSchedule (1F1B): stage s runs S - s forwards before its first
              backward, then alternates; every send and receive blocks the stage.
overlapped    1F1B with a deeper warm-up: stage s keeps `depth(s)` micro-batches in flight.
              Sends and receives do not block the compute (receives are posted ahead,
              sends complete in the background), so a transfer only stalls the stage when
              its result is needed before it has arrived.

Why depth(s) = 3 (S - 1 - s) + 1 hides any transfer: in a steady state with period P (one
micro-batch per stage per P), stage s's backward of micro-batch i can only start after the
round trip through the stages below it: per link, one forward transfer T_f, the next
stage's forward and backward compute t_c = F + B, one backward transfer T_b. Stage s fills
that time with its own in-flight micro-batches, k_s periods of it, so
k_s * P >= k_{s+1} * P + t_c + T_f + T_b. With T = max(T_f, T_b) and P = max(t_c, T),
(t_c + 2T) / P <= 3, hence k_s = 3 (S - 1 - s) and depth(s) = k_s + 1 keep every stage at
the period max(t_c, T): a link as fast as the compute is fully hidden, a slower one sets the
pace at one transfer per micro-batch. Depth is capped by the micro-batches of the step;
memory for activations grows with it (stage 0 holds 3S - 2 micro-batches instead of S).

Every stage runs its backward passes in micro-batch order 0, 1, ..., so gradients accumulate
in the same order under both schedules: only timing differs.
"""
from __future__ import annotations

SCHEDULES = ("overlapped", "blocking")


TRANSPORTS = ("process_group", "copy_engine")


def links_plan(schedule: str, transport: str, device_type: str, links_cross_hosts: bool = False) -> tuple[str, str]:
    """(schedule, link transport) a stage runs for `hetloco.pipeline.schedule` and `.link_transport`
    on a device of `device_type`, when some stage link of the job does (`links.crossing_link`) or does
    not cross from one host to another. Where the copy-engine transport then fails to start, the
    engine asks again with `transport="process_group"`.

    The "auto" schedule is blocking on GPUs whose every stage link stays inside a host, overlapped
    everywhere else. Over NVLink or PCIe a transfer takes far less than its compute, so there is
    little to hide: at 1B, M = 2 x S = 2 on 4 H100s, the overlapped schedule over the copy engines
    trained no faster than blocking in the same call, and its deeper warm-up (3S - 2 micro-batches
    in flight on stage 0 against S) held more memory (bench/results/scale_h100x4/summary.json); over NCCL its posted receives also slow the
    compute (gpu_two_s2_overlapped_cta1_h100.json).

    The "auto" transport is the copy engines' for the overlapped schedule (named) on GPUs whose every
    stage link stays inside a host: a receive posted ahead then waits without holding an SM, where
    NCCL's waits as a kernel beside the stage's GEMMs, slowing them 8-10% at one CTA
    (bench/results/resident_link_ce_h100.json). Everywhere else it is the process group's (gloo on
    the CPU; NCCL across hosts, where CUDA IPC cannot reach).
    """
    if schedule not in ("auto",) + SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {schedule!r}; expected one of {('auto',) + SCHEDULES}")
    if transport not in ("auto",) + TRANSPORTS:
        raise ValueError(f"unknown link transport {transport!r}; expected one of {('auto',) + TRANSPORTS}")
    gpus_in_a_host = device_type == "cuda" and not links_cross_hosts
    if schedule == "auto":
        schedule = "overlapped" if transport == "copy_engine" or not gpus_in_a_host else "blocking"
    if transport == "auto":
        transport = "copy_engine" if gpus_in_a_host and schedule == "overlapped" else "process_group"
    return schedule, transport


def resident_link_kernels(schedule: str, stages: int, stage_id: int) -> int:
    """Link kernels stage `stage_id` can hold on its device at once: none under the blocking schedule
    (a transfer is waited for where it is issued); under the overlapped one, per neighbouring stage,
    a receive posted ahead and a send in flight. Each direction of a link is its own communicator,
    whose operations run one after another, so more posted receives on it queue, not co-reside."""
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {schedule!r}; expected one of {SCHEDULES}")
    if schedule == "blocking":
        return 0
    return 2 * ((stage_id > 0) + (stage_id < stages - 1))


def depth(schedule: str, stages: int, stage_id: int, micro_batches: int) -> int:
    """Micro-batches stage `stage_id` has in flight (forwarded, not yet backwarded) at most."""
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {schedule!r}; expected one of {SCHEDULES}")
    if not 0 <= stage_id < stages:
        raise ValueError(f"stage {stage_id} out of range for {stages} stages")
    below = stages - 1 - stage_id
    want = below + 1 if schedule == "blocking" else 3 * below + 1
    return max(1, min(micro_batches, want))


def compute_order(schedule: str, stages: int, stage_id: int, micro_batches: int) -> list[tuple[str, int]]:
    """[("F", i) | ("B", i), ...]: the stage's forward and backward passes in execution order."""
    w = depth(schedule, stages, stage_id, micro_batches)
    order = [("F", i) for i in range(w)]
    for i in range(micro_batches):
        order.append(("B", i))
        if i + w < micro_batches:
            order.append(("F", i + w))
    return order


def _deepspeed_step(step_id: int, stages: int, stage_id: int) -> tuple[int, bool]:
    """(micro-batch, is_forward) of DeepSpeed TrainSchedule's step `step_id` on `stage_id`."""
    even_step, even_stage = step_id % 2 == 0, stage_id % 2 == 0
    if even_step == even_stage:  # a forward step
        base = step_id // 2 if even_step else (step_id - 1) // 2
        return base - stage_id // 2, True
    if even_step:  # odd stage, backward
        return step_id // 2 - stages + (stage_id + 1) // 2, False
    return (step_id - 1) // 2 - stages + 1 + stage_id // 2, False


def link_ops(schedule: str, stages: int, stage_id: int, micro_batches: int) -> list[tuple[str, int]]:
    """Every operation of one stage's training step in order, compute and link alike:

    F, B                      forward, backward of micro-batch i
    blocking:   send_act, recv_act, send_grad, recv_grad   (each waits for its transfer)
    overlapped: post_act, wait_act, isend_act, post_grad, wait_grad, isend_grad

    blocking is DeepSpeed's TrainSchedule instruction for instruction; overlapped is what
    `pipe.schedule.OverlappedTrainSchedule` runs (it is generated from this list).
    """
    n, S, s = micro_batches, stages, stage_id
    first, last = s == 0, s == S - 1
    ops: list[tuple[str, int]] = []
    if schedule == "blocking":
        depth(schedule, S, s, n)  # validates
        prev = -1
        for step in range(2 * (n + S - 1)):
            i, forward = _deepspeed_step(step, S, s)
            if forward:
                if 0 <= prev < n and not first:
                    ops.append(("send_grad", prev))
                if 0 <= i < n and not first:
                    ops.append(("recv_act", i))
            else:
                if 0 <= i < n and not last:
                    ops.append(("recv_grad", i))
                if 0 <= prev < n and not last:
                    ops.append(("send_act", prev))
            if 0 <= i < n:
                ops.append(("F" if forward else "B", i))
            prev = i
        return ops
    ahead = 0 if first else depth(schedule, S, s - 1, n)
    if not first:
        ops += [("post_act", i) for i in range(min(ahead, n))]
    for kind, i in compute_order(schedule, S, s, n):
        if kind == "F":
            if not first:
                ops.append(("wait_act", i))
            ops.append(("F", i))
            if not last:
                ops += [("isend_act", i), ("post_grad", i)]
        else:
            if not last:
                ops.append(("wait_grad", i))
            ops.append(("B", i))
            if not first:
                ops.append(("isend_grad", i))
                if i + ahead < n:
                    ops.append(("post_act", i + ahead))
    return ops
