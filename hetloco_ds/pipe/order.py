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
