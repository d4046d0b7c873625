"""Four GPUs, one process each: M = 2 replicas x S = 2 stages, ours (heterogeneous) vs stock DeepSpeed PP x DP.

Configurations, each in 4 fresh processes (one per GPU, spawned by this script), in this order:
  ours_het   HetlocoEngine, S = 2, M = 2 (DeepSpeed topology: rank = stage*M + replica, so replica 0 =
             ranks 0, 2 and replica 1 = ranks 1, 3), SparseLoCo H = `--inner-steps` (50), replica 1
             compressed at `--ratio` (8): subspace {"ratio": 8, "compressed_replicas": [1]}, replica 0
             uncompressed. `--ours-steps` (default H + 2) steps in one run: the first `--warmup` (3)
             untimed, the outer step runs inside step H (engine.train_batch, local step 50). Stage
             parameters are hashed before step 1, after step `--hash-inner-step` (10) and right after
             the outer step.
  ds_pp_dp   stock DeepSpeed PipelineEngine (deepspeed.initialize) with the same S = 2, M = 2: a plain
             deepspeed.pipe.PipelineModule over hetloco_ds.pipe.module.layer_specs(config), topology
             PipeDataParallelTopology(num_pp=2, num_dp=2), partition_method "type:DecoderLayer",
             bf16.enabled (bf16 weights, BF16_Optimizer), a torch AdamW passed in; `--ds-steps` (8)
             timed steps after `--warmup` (3).

Every configuration: preset `--shape` (178M), vocab 32000, seq 2048, random tokens (seed 1234 + replica:
each replica its own batches, both stages of a replica the same), micro-batch `--micro` (4) x
gradient_accumulation_steps `--gas` (8) per optimizer step and replica, gradient clipping 1.0,
AdamW(lr 1e-3, betas (0.9, 0.95), wd 0.1), bf16. Ours: bf16 autocast over fp32 weights; the stage link
carries bf16 (a compressed boundary also carries the int16 ids as their 2 raw bytes, uint8 [b, 2L]).
Stock: bf16 weights; its stage link carries the layers' (hidden bf16, ids int64) pair.

Timing: each step is `train_batch` between a device synchronisation + world barrier before and a
device synchronisation after, on each rank; a step's time is the slowest of the 4 ranks (per
replica: the slower of its 2 ranks). ours_het: inner step = median over the timed steps that did not
run the outer step; outer step = max over ranks of StepRecord.outer["seconds"] (engine.outer_step:
prepare, all-gather in the stage's data-parallel group, finish, embedding resync); amortised
tokens/s/GPU = H steps' tokens / (H * inner + outer). Before step 1 (unless --no-outer-prewarm) each
rank runs one throwaway SparseLoCo prepare/all-gather/finish on a clone of its parameters (its own
SparseLoCoState; the engine's state and parameters are not touched), so the timed outer step is the
steady-state one, not the first-call one (CUDA kernel / allocator warm-up, ~0.2 s on an H200); the
throwaway's time is recorded as `outer_prewarm.seconds`.
ds_pp_dp: median over its timed steps. tokens/s/GPU = M * b * gas * L / step / (S * M).

Bytes (per optimizer step):
  ours     StepRecord.bytes (hetloco_ds.meter: every pipeline p2p send/recv, by kind; summed over the
           replica's 2 ranks), reported BY REPLICA, next to the analytic stage-link value:
             uncompressed    activation gas * b*L*d*2            activation_grad gas * b*L*d*2
             compressed      activation gas * (b*L*k*2 + b*L*2)  activation_grad gas * b*L*k*2   (k = d/ratio)
           outer sync, per replica at the outer step: StepRecord.bytes["outer_sync"] sent / recv
           (summed over the replica's 2 ranks) = the all-gather of each stage's SparseLoCo payload in
           its data-parallel group (payload sent, payload*(M-1) received per rank) + the sparse
           broadcast of the averaged T_S pseudo-gradient from stage 0 to stage 1 inside the replica
           (embedding resync, eqs. 3-4; a stage-link transfer, listed separately).
  stock    the same p2p meter (our patches wrap deepspeed.runtime.pipe.p2p.send/recv, which the stock
           engine calls too), unlabelled: on S = 2 stage 0 sends only activations and stage 1 only
           activation gradients; per replica from its stage-0 / stage-1 rank; analytic:
           gas * (b*L*d*2 + b*L*8) forward, gas * b*L*d*2 backward.
  collectives  every torch.distributed all_reduce / all_gather / all_gather_into_tensor /
           reduce_scatter_tensor / broadcast / all_reduce_coalesced call a step makes, wrapped here before
           DeepSpeed starts, keyed by the group it ran in: "dp" (one stage, all replicas: the replica
           link), "pipe" (one replica, all stages: the stage link), "world" (payload convention:
           all_reduce of N bytes = N sent + N received per rank; all_gather = own part sent, the others'
           parts received). ds_pp_dp's data-parallel bytes per step per GPU = the "dp" collectives' sent
           bytes (max over ranks); analytic per rank of stage s (P_s its parameters): BF16_Optimizer
           all-reduces the flat bf16 gradient buffer (P_s*2) and, after its step on its 1/M shard of fp32
           master weights, all-gathers the bf16 parameters (P_s*2/M sent): P_s*2 + P_s*2/M sent
           (ring wire: 2(M-1)/M * P_s*2 + (M-1)/M * P_s*2). ours_het: "dp" collectives are 0 on inner
           steps; per step amortised replica-link bytes per GPU = the outer all-gather's payload / H.

Hashes: sha256 over the bytes of `p.detach().cpu()` for `engine.trainable_params()` in order (fp32 on
ours), per rank; gathered to rank 0 with all_gather_object; per stage, `identical` = both replicas'
hashes equal. Expected: identical at init, different after an inner step (each replica trained on
its own data), identical right after the outer step.

    OUT=... bash bench/gpu.sh --gpus 4 gpu_four.py        # the GPU run
    python bench/gpu_four.py --cpu-smoke                  # tiny, seq 64, gloo, 4 ranks, H = 3
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

BENCH = os.path.dirname(os.path.abspath(__file__))
if BENCH not in sys.path:
    sys.path.insert(0, BENCH)

from _common import (  # noqa: E402 - stdlib-only at import; torch / deepspeed are imported inside
    CollectiveCounter, add_model_args, barrier, batches, build_ours, build_stock, config_row, driver_setup,
    finish_report, fmt_bytes, new_report, ours_config, ours_part_info, peak_gib, pick_configs, run_main,
    run_worker, same, spawn_workers, stage_hash, stock_config, stock_p2p_meter, stock_part_info, sync, timed_call, versions_line,
    worker_argv,
    write_report,
)

WORLD = 4
STAGES = 2
REPLICAS = WORLD // STAGES
CONFIGS = ("ours_het", "ds_pp_dp")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p)
    p.add_argument("--ratio", type=int, default=8, help="d/k of the compressed replica (replica 1)")
    p.add_argument("--inner-steps", type=int, default=50, help="H of ours_het")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--ours-steps", type=int, default=0, help="total steps of ours_het, warm-up included (0: H + 2)")
    p.add_argument("--ds-steps", type=int, default=8, help="timed steps of ds_pp_dp")
    p.add_argument("--hash-inner-step", type=int, default=10, help="hash the parameters after this (inner) step too")
    p.add_argument("--no-outer-prewarm", action="store_true",
                   help="skip the throwaway SparseLoCo prepare/all-gather/finish before step 1")
    p.add_argument("--configs", default="", help="comma-separated subset of " + ",".join(CONFIGS))
    p.add_argument("--config-timeout", type=float, default=150.0, help="seconds per configuration (all 4 ranks)")
    p.add_argument("--deadline", type=float, default=230.0,
                   help="seconds from the driver's start by which everything has ended: a configuration "
                        "gets min(--config-timeout, what is left - 5 s), and is skipped with under --min-config-s")
    p.add_argument("--min-config-s", type=float, default=40.0)
    p.add_argument("--out", default=None, help="JSON path (default $OUT/gpu_four.json or bench/results/)")
    p.add_argument("--cpu-smoke", action="store_true",
                   help="preset tiny, vocab 1024, seq 64, micro 2, gas 2, H 3, warm-up 1, gloo")
    # internal: one rank of one configuration
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--part", default=None, help=argparse.SUPPRESS)
    if "--cpu-smoke" in (sys.argv[1:] if argv is None else argv):  # defaults only: explicit flags win
        p.set_defaults(shape="tiny", vocab=1024, seq=64, micro=2, gas=2, inner_steps=3, warmup=1, ds_steps=2,
                       hash_inner_step=2, config_timeout=900.0, deadline=2400.0, min_config_s=60.0)
    args = p.parse_args(argv)
    H = args.inner_steps
    if args.ours_steps <= 0:
        args.ours_steps = H + 2
    if args.ours_steps < H + 1:
        p.error(f"--ours-steps {args.ours_steps} must reach past the outer step at step H = {H}")
    if args.warmup >= H:
        p.error(f"--warmup {args.warmup} must be below H = {H} (the outer step must be timed)")
    if not 1 <= args.hash_inner_step < H:
        p.error(f"--hash-inner-step {args.hash_inner_step} must be an inner step, 1 .. H-1 = {H - 1}")
    return args


# ============================================================================ worker side
def group_class(group) -> str:
    """"dp" (one stage, every replica), "pipe" (one replica, every stage), "world", or the ranks."""
    import torch.distributed as td

    world = td.get_world_size()
    ranks = list(range(world)) if group is None else sorted(td.get_process_group_ranks(group))
    if len(ranks) == world:
        return "world"
    if len(ranks) == REPLICAS and len({r // REPLICAS for r in ranks}) == 1:
        return "dp"
    if len(ranks) == STAGES and len({r % REPLICAS for r in ranks}) == 1:
        return "pipe"
    return "ranks" + "_".join(map(str, ranks))


COUNTER = CollectiveCounter(classify=group_class)  # collectives by group class ("dp", "pipe", "world") then op


def coll_sent(coll: dict, where: str) -> int:
    return sum(o["sent"] for o in coll.get(where, {}).values())


def coll_recv(coll: dict, where: str) -> int:
    return sum(o["recv"] for o in coll.get(where, {}).values())


def buffer_hash(t) -> str | None:
    if t is None:
        return None
    return stage_hash([t])["sha256"]


def prewarm_outer(engine) -> dict:
    """One throwaway outer step on a clone of this stage's parameters with its own SparseLoCoState:
    the same kernels, allocation sizes and all-gather (in the stage's data-parallel group, the same
    payload length) as engine.outer_step(), leaving the engine's parameters and state untouched."""
    import torch
    from deepspeed import comm as dist

    from hetloco_ds.sparseloco.outer import SparseLoCoState

    sync()
    barrier()
    t = time.perf_counter()
    with torch.no_grad():
        params = [p.detach().clone() for p in engine.trainable_params()]
        state = SparseLoCoState(params, engine.hetloco.sparseloco)
        for p in params:
            p.mul_(0.999)  # a non-zero pseudo-gradient
        payload = state.prepare(params)
        gathered = [torch.empty_like(payload) for _ in range(engine.num_replicas)]
        dist.all_gather(gathered, payload, group=engine.dp_group)
        state.finish(params, gathered, keep_average=engine.algorithm.kept_average)  # as engine.outer_step()
    sync()
    dt = time.perf_counter() - t
    del params, state, payload, gathered
    return {"seconds": dt, "what": "SparseLoCoState(clone of trainable_params) prepare + dp all_gather + finish; "
                                   "engine state untouched; includes any first-use NCCL set-up of the dp group"}


def run_ours_het(cfg, args, part) -> None:
    import torch.distributed as td

    H = args.inner_steps
    raw = ours_config(args.micro, args.gas, STAGES, True, H, {"ratio": args.ratio, "compressed_replicas": [1]},
                      args.seq, max(256, cfg.vocab_size))
    part["ds_config"] = raw
    module, engine = build_ours(raw, cfg, args.seq, source="bench/gpu_four.py")
    assert (engine.num_stages, engine.num_replicas) == (STAGES, REPLICAS), (engine.num_stages, engine.num_replicas)
    rank = td.get_rank()
    assert rank == engine.stage_id * REPLICAS + engine.replica, (rank, engine.stage_id, engine.replica)
    part.update(ours_part_info(engine, module, cfg, compressed=True))
    part.update(schedule=engine.schedule, link_transport=engine.link_transport)  # what "auto" chose here
    data = batches(cfg, args.micro, args.seq, seed=1234 + engine.replica)  # per replica; same on its stages

    hashes = {"init": dict(stage_hash(engine.trainable_params()), step=0,
                           perp=buffer_hash(engine.algorithm.perp))}
    if not args.no_outer_prewarm:
        try:  # the same code on every rank: an error here is every rank's, so skipping it cannot hang a peer
            part["outer_prewarm"] = prewarm_outer(engine)
        except Exception as err:  # noqa: BLE001 - the measurement goes on, cold
            part["outer_prewarm_error"] = f"{type(err).__name__}: {err}"
            print(f"[gpu_four] outer prewarm failed: {part['outer_prewarm_error']}", flush=True)
    steps = []
    for i in range(1, args.ours_steps + 1):
        rec, dt, collectives = timed_call(lambda: engine.train_step(data), COUNTER)
        steps.append({"step": i, "local_step": engine.local_steps, "warmup": i <= args.warmup, "s": dt,
                      "engine_s": rec.seconds, "loss": rec.loss, "bytes": rec.bytes, "outer": rec.outer,
                      "collectives": collectives})
        if i == args.hash_inner_step:
            hashes["inner"] = dict(stage_hash(engine.trainable_params()), step=i)
        if rec.outer is not None and "after_outer" not in hashes:
            hashes["after_outer"] = dict(stage_hash(engine.trainable_params()), step=i,
                                         perp=buffer_hash(engine.algorithm.perp))
    part.update(steps=steps, hashes=hashes, peak_mem_gib=peak_gib(), local_steps=engine.local_steps,
                outer_steps_done=engine.outer_steps)
    # Every rank's hashes to rank 0, which compares the replicas stage by stage.
    mine = {"rank": rank, "stage": engine.stage_id, "replica": engine.replica, "hashes": hashes}
    try:  # the driver compares every rank's own part too, so a failed gather loses nothing
        everyone = [None] * td.get_world_size()
        td.all_gather_object(everyone, mine)
        if rank == 0:
            part["hash_table"] = compare_hashes(everyone)
    except Exception as err:  # noqa: BLE001
        part["hash_gather_error"] = f"{type(err).__name__}: {err}"


def compare_hashes(entries: list[dict]) -> dict:
    """{label: {stageS: {replicaR: sha256, ..., identical: bool}}} and identical_<label> per stage."""
    labels = sorted({lab for e in entries for lab in e["hashes"]}, key=["init", "inner", "after_outer"].index)
    table: dict = {"by_label": {}}
    for lab in labels:
        rows = {}
        for s in range(STAGES):
            got = {e["replica"]: e["hashes"].get(lab, {}).get("sha256") for e in entries if e["stage"] == s}
            row = {f"replica{r}": got[r] for r in sorted(got)}
            row["identical"] = len(set(got.values())) == 1 and None not in got.values()
            steps = {e["hashes"].get(lab, {}).get("step") for e in entries if e["stage"] == s}
            row["step"] = steps.pop() if len(steps) == 1 else sorted(steps, key=str)
            perps = {e["hashes"].get(lab, {}).get("perp") for e in entries if e["stage"] == s}
            if perps != {None}:
                row["perp_identical"] = len(perps) == 1
            rows[f"stage{s}"] = row
        table["by_label"][lab] = rows
        table[f"identical_{lab}"] = {st: r["identical"] for st, r in rows.items()}
    return table


def run_ds(cfg, args, part) -> None:
    from deepspeed.runtime.pipe.topology import PipeDataParallelTopology

    config = stock_config(args.micro, args.gas, True)
    part["ds_config"] = config
    topology = PipeDataParallelTopology(num_pp=STAGES, num_dp=REPLICAS)
    module, params, engine = build_stock(cfg, config, "type:DecoderLayer", topology=topology)
    part.update(stock_part_info(engine, module, params, cfg))
    assert (part["num_stages"], part["num_replicas"]) == (STAGES, REPLICAS)
    data = batches(cfg, args.micro, args.seq, seed=1234 + engine.grid.data_parallel_id)
    meter = stock_p2p_meter()  # the stock engine's pipeline p2p, kind "control"
    steps = []
    for i in range(1, args.warmup + args.ds_steps + 1):
        meter.since_mark()
        loss, dt, collectives = timed_call(lambda: float(engine.train_batch(data)), COUNTER)
        steps.append({"step": i, "warmup": i <= args.warmup, "s": dt, "loss": loss, "p2p": meter.since_mark(),
                      "collectives": collectives})
    part.update(steps=steps, peak_mem_gib=peak_gib())


def worker_main(args) -> int:
    def body(cfg, part):
        import torch.distributed as td

        part["backend"] = td.get_backend()
        (run_ours_het if args.worker == "ours_het" else run_ds)(cfg, args, part)

    return run_worker(args, COUNTER, body)


# ============================================================================ driver side
def _timed(p: dict) -> list[dict]:
    return [s for s in p["steps"] if not s["warmup"]]


def _per_step_max(parts: list[dict], steps_of) -> list[float]:
    return [max(xs) for xs in zip(*[[s["s"] for s in steps_of(p)] for p in parts])]


def _base_row(name: str, parts: list[dict], args) -> dict:
    p0 = parts[0]
    res = {"config": name, "stages": p0.get("num_stages"), "replicas": p0.get("num_replicas"),
           "micro_batch": args.micro, "gas": args.gas, "seq": args.seq, "parts_layers": p0.get("parts"),
           "optimizer": p0.get("optimizer"), "backend": p0.get("backend"),
           "rank_layout": {p["rank"]: {"stage": p.get("stage"), "replica": p.get("replica")} for p in parts},
           "n_params_by_stage": {f"stage{p['stage']}": p.get("n_params_local") for p in parts},
           "peak_mem_gib": max((p.get("peak_mem_gib") or 0) for p in parts) or None,
           "ds_config": p0.get("ds_config")}
    for key in ("param_dtype", "grad_acc_dtype", "communication_data_type"):
        if key in p0:
            res[key] = p0[key]
    return res


def summarize_ours(parts: list[dict], args) -> dict:
    res = _base_row("ours_het", parts, args)
    S, M, H = STAGES, REPLICAS, args.inner_steps
    b, L, gas = args.micro, args.seq, args.gas
    d = parts[0]["hidden_size"]
    tokens_replica = b * gas * L
    nsteps = len(parts[0]["steps"])
    outer_idx = [i for i in range(nsteps) if any(p["steps"][i]["outer"] for p in parts)]
    timed_idx = [i for i in range(nsteps) if not parts[0]["steps"][i]["warmup"]]
    inner_idx = [i for i in timed_idx if i not in outer_idx]
    per_step = [max(p["steps"][i]["s"] for p in parts) for i in range(nsteps)]
    inner = statistics.median(per_step[i] for i in inner_idx)
    by_rep = {r: [p for p in parts if p["replica"] == r] for r in range(M)}
    rep_inner = {f"replica{r}": statistics.median(max(p["steps"][i]["s"] for p in ps) for i in inner_idx)
                 for r, ps in by_rep.items()}
    res.update(
        H=H, steps_total=nsteps, warmup=args.warmup, timed_steps=len(timed_idx), inner_steps_timed=len(inner_idx),
        outer_step_at=[parts[0]["steps"][i]["local_step"] for i in outer_idx],
        inner_step_s_median=inner, inner_step_s_min=min(per_step[i] for i in inner_idx),
        inner_step_s_max=max(per_step[i] for i in inner_idx),
        inner_step_s_median_by_replica=rep_inner,
        step_s_all_incl_warmup=[round(x, 5) for x in per_step],
        tokens_per_step_per_replica=tokens_replica,
        tokens_per_s_per_gpu=tokens_replica * M / inner / (S * M),
        last_loss_by_replica={f"replica{r}": ps[0]["steps"][-1]["loss"] for r, ps in by_rep.items()},
        outer_prewarm_s={p["rank"]: round(p["outer_prewarm"]["seconds"], 4) for p in parts if "outer_prewarm" in p},
        outer_prewarm_errors=[p["outer_prewarm_error"] for p in parts if "outer_prewarm_error" in p],
        links_by_rank={p["rank"]: f"{p.get('schedule')} over {p.get('link_transport')}" for p in parts},
    )
    # ---- stage link, by replica (records are replica sums: take the replica's stage-0 rank)
    link = {}
    for r, ps in by_rep.items():
        p = next(q for q in ps if q["stage"] == 0)
        recs = [p["steps"][i]["bytes"] for i in timed_idx]
        inner_rec = p["steps"][inner_idx[-1]]["bytes"]
        ratio, k, idb = p["ratio_engine"], p["k"], p["id_bytes"]
        compressed = ratio > 1
        fwd = b * L * k * 2 + (b * L * idb if compressed else 0)
        bwd = b * L * k * 2
        act, grad = inner_rec["activation"]["sent"], inner_rec["activation_grad"]["sent"]
        link[f"replica{r}"] = {
            "compressed": compressed, "ratio": ratio, "k": k, "id_bytes": idb if compressed else 0,
            "activation_sent": act, "activation_sent_analytic": gas * fwd,
            "activation_grad_sent": grad, "activation_grad_sent_analytic": gas * bwd,
            "formula_forward": "gas * (b*L*k*2 + b*L*2)" if compressed else "gas * b*L*d*2",
            "formula_backward": "gas * b*L*k*2" if compressed else "gas * b*L*d*2",
            "match": act == gas * fwd and grad == gas * bwd,
            "stage_link_bytes_per_step": act + grad,
            "vs_uncompressed_analytic_x": 2 * gas * b * L * d * 2 / (act + grad) if act + grad else None,
            "activation_bytes_constant_over_timed_steps": same(
                [(x["activation"], x["activation_grad"]) for x in recs]),
            "control_sent_per_step": inner_rec["control"]["sent"],
            "step_record": inner_rec,
        }
    res["stage_link_by_replica"] = link
    # ---- inner steps: no replica-link traffic
    res["inner_steps_dp_collective_sent_max"] = max(
        coll_sent(p["steps"][i]["collectives"], "dp") for p in parts for i in inner_idx)
    res["inner_steps_outer_sync_sent_max"] = max(
        p["steps"][i]["bytes"]["outer_sync"]["sent"] for p in parts for i in inner_idx)
    # ---- the outer step
    if outer_idx:
        i = outer_idx[0]
        outer_s = max(p["steps"][i]["outer"]["seconds"] for p in parts)
        wall = per_step[i]
        by_rank = {}
        for p in parts:
            s = p["steps"][i]
            by_rank[p["rank"]] = {"stage": p["stage"], "replica": p["replica"], "outer": s["outer"],
                                  "collectives": s["collectives"], "step_s": s["s"]}
        per_replica = {}
        for r, ps in by_rep.items():
            rec = ps[0]["steps"][i]["bytes"]  # replica sum
            ag = sum(q["steps"][i]["outer"]["payload_bytes"] for q in ps)
            per_replica[f"replica{r}"] = {
                "outer_sync_sent": rec["outer_sync"]["sent"], "outer_sync_recv": rec["outer_sync"]["recv"],
                "all_gather_payload_sent": ag, "all_gather_payload_recv": ag * (M - 1),
                "payload_by_stage": {f"stage{q['stage']}": q["steps"][i]["outer"]["payload_bytes"] for q in ps},
                "embedding_resync_broadcast_sent": rec["outer_sync"]["sent"] - ag,
                "dp_collectives_sent_measured": sum(coll_sent(q["steps"][i]["collectives"], "dp") for q in ps),
                "dp_collectives_recv_measured": sum(coll_recv(q["steps"][i]["collectives"], "dp") for q in ps),
            }
        payload_max = max(q["steps"][i]["outer"]["payload_bytes"] for q in parts)
        res.update(
            outer_step_s=outer_s, outer_step_s_by_rank={p["rank"]: p["steps"][i]["outer"]["seconds"] for p in parts},
            outer_step_wall_s=wall, outer_step_wall_minus_inner_s=wall - inner,
            outer_by_replica=per_replica, outer_by_rank=by_rank,
            amortized_step_s=(H * inner + outer_s) / H,
            tokens_per_s_per_gpu_amortized=tokens_replica * M * H / (H * inner + outer_s) / (S * M),
            replica_link_bytes_per_step_per_gpu=payload_max / H,
            outer_excluded=[p["steps"][i]["outer"]["excluded"] for p in parts],
        )
    # ---- hashes (rank 0 gathered and compared them; the driver checks against every rank's own part)
    table = parts[0].get("hash_table")
    from_parts = compare_hashes([{"rank": p["rank"], "stage": p["stage"], "replica": p["replica"],
                                  "hashes": p["hashes"]} for p in parts])
    res["hash_source"] = "rank 0 (all_gather_object)" if table else "driver, from each rank's part (gather failed)"
    res["hash_gather_consistent"] = (table == from_parts) if table else None
    res["hash_gather_errors"] = [p["hash_gather_error"] for p in parts if "hash_gather_error" in p]
    table = table or from_parts
    res["hashes"] = table
    if table:
        res["identical_after_outer"] = table.get("identical_after_outer")
        res["identical_after_inner"] = table.get("identical_inner")
        res["identical_at_init"] = table.get("identical_init")
        res["hash_seconds_max"] = max(h["seconds"] for p in parts for h in p["hashes"].values())
        res["hash_bytes_by_stage"] = {f"stage{p['stage']}": p["hashes"]["init"]["bytes"] for p in parts}
        expected = {"init": True, "inner": False, "after_outer": True}
        res["hashes_expected_identical"] = expected
        res["hashes_as_expected"] = all(
            all(v == want for v in (table.get(f"identical_{lab}") or {"missing": None}).values())
            for lab, want in expected.items())
    return res


def summarize_ds(parts: list[dict], args) -> dict:
    res = _base_row("ds_pp_dp", parts, args)
    S, M = STAGES, REPLICAS
    b, L, gas = args.micro, args.seq, args.gas
    d = parts[0]["hidden_size"]
    tokens_replica = b * gas * L
    per_step = _per_step_max(parts, _timed)
    step = statistics.median(per_step)
    res.update(step_s_median=step, step_s_min=min(per_step), step_s_max=max(per_step),
               step_s_all=[round(x, 5) for x in per_step],
               warmup_s_all=[[round(s["s"], 3) for s in p["steps"] if s["warmup"]] for p in parts],
               tokens_per_step_per_replica=tokens_replica,
               tokens_per_s_per_gpu=tokens_replica * M / step / (S * M),
               last_loss_by_replica={f"replica{p['replica']}": p["steps"][-1]["loss"] for p in parts
                                     if p["stage"] == S - 1})
    fwd = b * L * d * 2 + b * L * 8
    bwd = b * L * d * 2
    link = {}
    for r in range(M):
        s0 = next(p for p in parts if p["replica"] == r and p["stage"] == 0)
        s1 = next(p for p in parts if p["replica"] == r and p["stage"] == 1)
        act = _timed(s0)[-1]["p2p"]["control"]["sent"]  # stage 0 sends only activations
        grad = _timed(s1)[-1]["p2p"]["control"]["sent"]  # stage 1 sends only activation gradients
        link[f"replica{r}"] = {
            "activation_sent": act, "activation_sent_analytic": gas * fwd,
            "activation_grad_sent": grad, "activation_grad_sent_analytic": gas * bwd,
            "formula_forward": "gas * (b*L*d*2 + b*L*8) (hidden bf16 + ids int64)",
            "formula_backward": "gas * b*L*d*2",
            "match": act == gas * fwd and grad == gas * bwd,
            "stage_link_bytes_per_step": act + grad,
            "bytes_constant_over_timed_steps": same([s["p2p"] for s in _timed(s0)]) and same(
                [s["p2p"] for s in _timed(s1)]),
        }
    res["stage_link_source"] = ("patches.p2p_meter around deepspeed.runtime.pipe.p2p send/recv: stage 0's sent = "
                                "activations, stage 1's sent = activation gradients")
    res["stage_link_by_replica"] = link
    # data-parallel (replica-link) traffic: the "dp" group's collectives
    dp = {}
    for p in parts:
        coll = _timed(p)[-1]["collectives"]
        P = p["n_params_local"]
        dp[f"rank{p['rank']}"] = {
            "stage": p["stage"], "replica": p["replica"], "n_params": P,
            "dp_sent": coll_sent(coll, "dp"), "dp_recv": coll_recv(coll, "dp"),
            "analytic_sent": P * 2 + P * 2 // M,
            "analytic_ring_wire_sent": int(2 * (M - 1) / M * P * 2 + (M - 1) / M * P * 2),
            "collectives": coll,
            "dp_bytes_constant_over_timed_steps": same([coll_sent(s["collectives"], "dp") for s in _timed(p)]),
        }
    res["dp_by_rank"] = dp
    res["dp_bytes_per_step_per_gpu"] = max(v["dp_sent"] for v in dp.values())
    res["dp_bytes_per_step_per_gpu_analytic"] = max(v["analytic_sent"] for v in dp.values())
    res["dp_bytes_per_step_all_gpus"] = sum(v["dp_sent"] for v in dp.values())
    res["dp_analytic_how"] = (
        "BF16_Optimizer (bf16.enabled, ZeRO 0, pipeline engine; grad_accum_dtype default = model dtype bf16): "
        "one all_reduce of the stage's flat bf16 gradient buffer in its data-parallel group (P_s*2 bytes, + "
        "alignment padding), then after the fp32 master-shard step an all_gather_into_tensor of the bf16 "
        "parameters (P_s*2/M own shard sent); plus scalar all-reduces (loss)")
    return res


def print_tables(report: dict) -> None:
    s = report["settings"]
    print(versions_line(report))
    print(f"shape {s['shape']}  vocab {s['vocab']}  seq {s['seq']}  micro {s['micro']}  gas {s['gas']}  bf16  "
          f"S = {STAGES}, M = {REPLICAS} (rank = stage*M + replica)")
    by = {r["config"]: r for r in report["results"]}
    o, ds = by.get("ours_het", {}), by.get("ds_pp_dp", {})
    for name, r in (("ours_het", o), ("ds_pp_dp", ds)):
        if r and "error" in r or r and "skipped" in r:
            print(f"\n{name}: -- {str(r.get('error') or r.get('skipped'))[:300]}")
    if "inner_step_s_median" in o:
        print(f"\nours_het: H = {o['H']}, replica 1 compressed at ratio {s['ratio']}, replica 0 uncompressed; "
              f"{o['steps_total']} steps ({o['warmup']} warm-up), outer at step {o['outer_step_at']}")
        rep = o["inner_step_s_median_by_replica"]
        print(f"  inner step {o['inner_step_s_median'] * 1e3:.1f} ms (median of {o['inner_steps_timed']}; "
              + ", ".join(f"{k} {x * 1e3:.1f}" for k, x in rep.items()) + ")  "
              f"tok/s/GPU {o['tokens_per_s_per_gpu']:.0f}")
        if "outer_step_s" in o:
            print(f"  outer step {o['outer_step_s'] * 1e3:.1f} ms (StepRecord.outer, max over ranks; step wall "
                  f"{o['outer_step_wall_s'] * 1e3:.1f} ms)  amortised over H + 1: tok/s/GPU "
                  f"{o['tokens_per_s_per_gpu_amortized']:.0f}   prewarm (throwaway) s: {o['outer_prewarm_s']}")
        print(f"  {'stage link/step':16} {'activation sent (meas / analytic)':>36} "
              f"{'activation_grad sent (meas / analytic)':>40} {'match':>5} {'x vs d':>6}")
        for rk, l in o["stage_link_by_replica"].items():
            a = f"{l['activation_sent']} / {l['activation_sent_analytic']}"
            g = f"{l['activation_grad_sent']} / {l['activation_grad_sent_analytic']}"
            tag = f"{rk} r{l['ratio']}"
            print(f"  {tag:16} {a:>36} {g:>40} {str(l['match']):>5} {l['vs_uncompressed_analytic_x']:6.2f}")
        if "outer_by_replica" in o:
            print(f"  {'outer sync':16} {'outer_sync sent':>16} {'recv':>12} {'all-gather sent':>16} "
                  f"{'resync bcast':>13} {'dp coll. sent':>14}")
            for rk, x in o["outer_by_replica"].items():
                print(f"  {rk:16} {x['outer_sync_sent']:16} {x['outer_sync_recv']:12} "
                      f"{x['all_gather_payload_sent']:16} {x['embedding_resync_broadcast_sent']:13} "
                      f"{x['dp_collectives_sent_measured']:14}")
            print(f"  replica link per step per GPU (payload / H): {fmt_bytes(o['replica_link_bytes_per_step_per_gpu'])}"
                  f"  (inner steps: dp collectives {o['inner_steps_dp_collective_sent_max']} B, outer_sync "
                  f"{o['inner_steps_outer_sync_sent_max']} B)")
        h = o.get("hashes") or {}
        for lab, rows in (h.get("by_label") or {}).items():
            cells = "  ".join(f"{st}: {'identical' if r['identical'] else 'differ'}"
                              + (f" ({str(r.get('replica0'))[:10]} / {str(r.get('replica1'))[:10]})")
                              for st, r in rows.items())
            step = next(iter(rows.values()))["step"]
            print(f"  hash {lab:12} (step {step}): {cells}")
        print(f"  identical_after_outer {o.get('identical_after_outer')}  hashes as expected (init identical, "
              f"inner differ, after outer identical): {o.get('hashes_as_expected')}  ({o.get('hash_source')}; "
              f"rank-0 gather == parts: {o.get('hash_gather_consistent')})")
    if "step_s_median" in ds:
        print(f"\nds_pp_dp (stock PipelineEngine, bf16, BF16_Optimizer): step {ds['step_s_median'] * 1e3:.1f} ms "
              f"(median of {len(ds['step_s_all'])})  tok/s/GPU {ds['tokens_per_s_per_gpu']:.0f}")
        for rk, l in ds["stage_link_by_replica"].items():
            print(f"  {rk:16} activation {l['activation_sent']} / {l['activation_sent_analytic']}   activation_grad "
                  f"{l['activation_grad_sent']} / {l['activation_grad_sent_analytic']}   match {l['match']}")
        for rk, x in ds["dp_by_rank"].items():
            ops = {w: {n: (q["calls"], q["sent"]) for n, q in ops.items()} for w, ops in x["collectives"].items()}
            print(f"  {rk} (stage {x['stage']}) dp sent/step {x['dp_sent']} (analytic {x['analytic_sent']}, "
                  f"P = {x['n_params']})  ops (calls, sent): {ops}")
    if "tokens_per_s_per_gpu" in o and "tokens_per_s_per_gpu" in ds:
        print("\nours_het vs ds_pp_dp")
        print(f"  tok/s/GPU: ours inner {o['tokens_per_s_per_gpu']:.0f}, ours amortised "
              f"{o.get('tokens_per_s_per_gpu_amortized', float('nan')):.0f}, stock {ds['tokens_per_s_per_gpu']:.0f}")
        for rk, l in o["stage_link_by_replica"].items():
            dl = ds["stage_link_by_replica"][rk]
            print(f"  stage link bytes/step {rk}: ours {fmt_bytes(l['stage_link_bytes_per_step'])}, stock "
                  f"{fmt_bytes(dl['stage_link_bytes_per_step'])} ({dl['stage_link_bytes_per_step'] / l['stage_link_bytes_per_step']:.2f}x)")
        if o.get("replica_link_bytes_per_step_per_gpu"):
            print(f"  replica link bytes/step/GPU: ours {fmt_bytes(o['replica_link_bytes_per_step_per_gpu'])} "
                  f"(amortised), stock {fmt_bytes(ds['dp_bytes_per_step_per_gpu'])} "
                  f"({ds['dp_bytes_per_step_per_gpu'] / o['replica_link_bytes_per_step_per_gpu']:.0f}x)")


def driver_main(args) -> int:
    t0 = time.perf_counter()
    out_path = driver_setup(args, "gpu_four.json")
    configs = pick_configs(list(CONFIGS), args.configs, list(CONFIGS))
    report = new_report(
        args, ("this script spawns 4 processes per configuration (fresh), one per GPU; rank 0 gathers the "
               "parameter hashes; the driver (rank 0's parent, same stdout) writes this file"),
        __doc__.split("Timing:")[1].split("    python")[0].strip())
    passthru = worker_argv(args, ["--shape", "--vocab", "--seq", "--micro", "--gas", "--ratio", "--inner-steps",
                                  "--warmup", "--ours-steps", "--ds-steps", "--hash-inner-step"],
                           ["--no-outer-prewarm", "--cpu-smoke"])
    ok = True
    with tempfile.TemporaryDirectory(prefix="gpu_four_") as tmp:
        for name in configs:
            elapsed = time.perf_counter() - t0
            left = args.deadline - elapsed - 5
            if left < args.min_config_s:
                res = {"config": name, "skipped": f"deadline: {elapsed:.0f} s elapsed, {left:.0f} s left "
                                                  f"< {args.min_config_s:.0f} s"}
                print(f"[gpu_four] skip {name}: {res['skipped']}", flush=True)
                report["results"].append(res)
                ok = False
                continue
            timeout = min(args.config_timeout, left)
            print(f"[gpu_four] {name} ({elapsed:.0f} s, timeout {timeout:.0f} s) ...", flush=True)
            parts, error, wall = spawn_workers(__file__, name, WORLD, passthru, tmp, timeout, args.cpu_smoke,
                                               "gpu_four", tail_chars=2500)
            summarize = summarize_ours if name == "ours_het" else summarize_ds
            res, row_ok = config_row(report, name, parts, error, lambda: summarize(parts, args))
            ok = ok and row_ok
            if name == "ours_het" and res.get("identical_after_outer") is not None:
                if not all(res["identical_after_outer"].values()):
                    ok = False
                    print("[gpu_four] ours_het: replicas NOT identical after the outer step", flush=True)
            res["wall_s"] = wall
            report["results"].append(res)
            write_report(report, out_path, t0)
            print(f"[gpu_four] {name}: {'ok' if 'error' not in res else 'FAILED ' + str(res['error'])[:200]}  "
                  f"wall {wall:.0f} s", flush=True)
    return finish_report(report, out_path, t0, print_tables, "gpu_four", ok)


if __name__ == "__main__":
    sys.exit(run_main(parse_args, worker_main, driver_main))
