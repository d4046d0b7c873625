"""Does SparseLoCo's gap to AdamW, and compression's cost, change with model size? (issue 32)

The paper-table regime (bench/paper_tables.py: M = 8 replicas x S = 4 virtual stages, H = 50,
32 x 2 x 256 = 16,384 tokens per replica step, the compiled batched simulator) at the sizes of
`SIZES`, every row trained on the same number of tokens per parameter (`TOKENS_PER_PARAM`, every
replica's tokens counted; steps rounded up to whole outer steps). Rows: SparseLoCo and AdamW, each
with its inner lr bracketed (`LR_BRACKETS`, widened by one lr a call until the best on seed 0 has a
worse lr on either side: the tuned lr), DiLoCo with its own Nesterov outer step; at the largest
size also PP-Compress and Het at 1/8 and 1/96. The second seed repeats SparseLoCo and AdamW at their
tuned lrs and DiLoCo; a gap read while a bracket is open is marked provisional (ringed in the plot).

Four verbs, each a step of spending device time in pieces:

    python bench/size_sweep.py plan                          # each size's rows, steps and GPU-minutes
    OUT=$OUT bash bench/gpu.sh --gpus 2 size_sweep.py run --model 20M --out $OUT [--seeds 1]
    OUT=$OUT bash bench/gpu.sh --gpus 2 size_sweep.py run --model 105M --gpus-per-row 2 --out $OUT [--resume-only]
    OUT=$OUT bash bench/gpu.sh --gpus 2 size_sweep.py fill --regimes one_pass,one_pass/micro8 --budget-s 560
    python bench/size_sweep.py summarize                     # bench/results/size_sweep/summary.json + .png
    ... plan | run | summarize --one-pass                    # every row within one pass: size_sweep/one_pass/
    ... plan | run | fill --set penalty --one-pass --micro 8  # issue 57's item 2 rows by name (PENALTY_ROWS)
    python bench/size_sweep.py penalty --one-pass --micro 8  # penalty.json + .png: the penalty against k/d and k

`run` builds the corpus on the GPU machine once (bench/make_corpus.py: its Python and CUDA sources,
BPE-8192 from `.benchdata/tokenizer`, which the call carries), then runs the size's unfinished rows
(`--model 20M,60M`: each size's in turn, within one budget; with `--side-by-side` at once, each on
its share of the GPUs, so that a size's last row does not leave the other GPUs idle)
through paper_tables.py, spread over the GPUs, rows already committed under
bench/results/size_sweep/<model>/ skipped and rows stopped by the budget saved in
runs/size_sweep_state/<model>/ (resumed by the next call on the same warm machine; `--whole-rows`
starts only rows that finish within the budget and saves none, for a call the machine may not
outlive: it then ends when its last row does; `--resume-only` continues the saved rows and starts
none, ending when they do, and ends at once on a machine lent afresh: the later calls of a chain,
sent the moment the last returns, since 30 s idle give the machine and its saved rows back). Its JSONs go
to $OUT/<model>/, to be committed beside the others. `--gpus-per-row G` runs each row on G GPUs
together, each holding M/G of its replicas (paper_tables.py --gpus-per-row): a 105M row, 46 minutes
alone on an H200, then fits one session's 30 device-minutes on 2 GPUs; its saved state resumes only
with the same G. Rows also validate every `VAL_EVERY` steps: the corpus is 130M tokens, so 10 tokens
per parameter repeats it (8 passes at 105M), and `summarize` reports, beside each row's final loss,
its loss after one pass, its validation - train loss and how its train loss falls at each new pass.
`--one-pass` is the regime without repetition: every size runs the same 950 steps (19 outer syncs,
the whole outer steps that fit in one pass), at 6.1 tokens per parameter at 20M and 1.2 at 105M.
`--micro 8` (any regime, every verb) runs the same tokens in replica steps of micro-batch 8, four
times the outer syncs (79 in one pass), under <regime's folder>/micro8/, validating on the same
held-out sequences (EVAL_SEQS).
`fill` keeps every GPU of a short call busy with whole rows, one a GPU, across regimes, sizes and
seeds (a mode's seed 1 as soon as its own bracket closes, in the same call), and saves no state: the
calls of a session whose machine may go back between them. Its rows go to runs/size_sweep_fill/
<regime>/<model>/ on the machine (a later call skips them); `tar czf $OUT/fill.tgz -C runs
size_sweep_fill` brings them back, and `ingest <the device tool's files_at> --tag TAG` puts them
(and the call's log) under bench/results/size_sweep/: before the next call, which a fresh machine
runs from the carried tree alone.
A row run a second time with the same seed goes under <results>/repeats/<model>/: `summarize`
sets it beside the committed run (`same_seed_repeats`) and leaves it out of everything else.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import functools
import glob
import itertools
import json
import math
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

import summarize_tables  # noqa: E402

RESULTS = os.path.join(HERE, "results", "size_sweep")
# --one-pass: every row within one pass over the corpus (the same steps at every size), no token seen twice
ONE_PASS = os.path.join(RESULTS, "one_pass")
SIZES = ("20M", "60M", "105M")
TOKENS_PER_PARAM = 10.0
REPLICAS, STAGES, H, MICRO, GAS, SEQ = 8, 4, 50, 32, 2, 256
SPARSELOCO_LR = 2e-3  # the best inner lr of SparseLoCo at 20M over 5000 steps (paper_tables_lr5k_h100x2)
ADAMW_LRS = (2e-3, 4e-3, 1e-3)  # 4e-3 was AdamW's best at 20M over 5000 steps; one step either side
# The inner lrs each tuned mode runs on seed 0 at every size, widened one lr at a time (lr_bracket)
# until its best has a worse lr run on either side. Both modes, not AdamW alone: larger models take
# smaller lrs, and a gap read between a bracketed AdamW and a SparseLoCo held at 20M's lr would
# grow with size by that drift alone.
LR_BRACKETS = {"sparseloco": (SPARSELOCO_LR,), "adamw": ADAMW_LRS}
DILOCO = "diloco:outer_lr=0.7:outer_momentum=0.9:norm_clip=none"  # dense, Nesterov (Douillard et al.)
COMPRESSED = ("pp:8", "het:8", "pp:96", "het:96")
# Validation every 5 outer syncs: the corpus's one epoch (994 steps of 8 x 16,384 tokens) falls
# within 6 steps of a point, and 16 eval micro-batches every 250 steps add about 1% to a row.
VAL_EVERY = 5 * H
# Every regime validates on the same held-out sequences (paper_tables' 16 eval micro-batches of MICRO,
# read in order): another micro-batch validates on EVAL_SEQS // micro of its own.
EVAL_SEQS = 16 * MICRO
# A row's seconds beyond its steps at the long rows' pace, on one GPU: compile, validation, a resume
# in the next call. Measured in the one-pass rows (4x H100): 30-70 s with the compile cache warm,
# 150-190 s for a machine's first row or a row resumed across calls.
ROW_OVERHEAD_S = 120
# What `fill` adds to a row's steps at its measured pace before it starts one: paper_tables' own
# last-minute margin (it starts no row within 60 s of its deadline) and its start (11 s on 2x H200,
# 2026-11-28). Every second counts: a fresh machine's call has about 525 s left after the corpus,
# and a 105M micro-batch-8 row takes 467 s.
FILL_MARGIN_S = 75

# The paper's points (DCLM, M = 8, S = 4, H = 50): degradation over SparseLoCo in % (Table 1: 178M,
# 512M; Table 2: 512M; Table 7: 1B), and SparseLoCo's gap to AdamW at 512M (Tables 1 and 4).
PAPER_PARAMS = {"178M": 178e6, "512M": 512e6, "1B": 1e9}
# 512M from summarize_tables' record of the paper's Tables 1, 2 and 4.
_TABLE = summarize_tables.PAPER
PAPER_DEGRADATION = {
    "pp:8": {"178M": 100 * (3.14 - 3.07) / 3.07, "512M": _TABLE["pp:8"], "1B": 100 * (2.910 - 2.747) / 2.747},
    "het:8": {"178M": 100 * (3.12 - 3.07) / 3.07, "512M": _TABLE["het:8"]},
    "pp:96": {"512M": _TABLE["pp:96"]},
    "het:96": {"512M": _TABLE["het:96"]},
}
_LOSS = summarize_tables.PAPER_LOSS
PAPER_GAP_PCT = {"512M": 100 * (_LOSS["sparseloco"] - _LOSS["adamw"]) / _LOSS["adamw"]}
# Ours at 20M over 5000 steps (32 tokens per parameter, 100 outer syncs), each at its best lr, seed 0
# (paper_tables_lr5k_h100x2: SparseLoCo 1.7636 at 2e-3, AdamW 1.5723 at 4e-3): the longer horizon.
LONG_20M_GAP_PCT = 100 * (1.7636 - 1.5723) / 1.5723
# The same 5000-step row as a point of gaps_by_outer_steps: 100 syncs, on that run's own corpus
# (123.6M train tokens, so 5.3 passes).
LONG_20M = {"model": "20M", "n_params": 20453760, "outer_steps": 100,
            "epochs": 5000 * REPLICAS * MICRO * GAS * SEQ / 123559936,
            "gap_pct": LONG_20M_GAP_PCT, "seeds": [0], "regime": "5000 steps (paper_tables_lr5k_h100x2)",
            "lr": 2e-3, "adamw_lr": 4e-3,
            # AdamW 2e-3 / 3e-3 / 4e-3 / 6e-3: 4e-3 inside; SparseLoCo 2e-3 / 3e-3: 2e-3 at the low edge
            "adamw_bracket_complete": True, "sparseloco_bracket_complete": False}


def lr_flag(lr: float) -> str:
    return f"lr={lr:g}"


def first_seed_rows(model: str, widen: list[str] | tuple = ()) -> list[str]:
    """Seed 0's rows of `model` in the order they start: SparseLoCo and AdamW, the rows that widen
    their open lr brackets (`bracket_rows`: the gap waits on them), DiLoCo, the compressed rows."""
    rows = [f"sparseloco:{lr_flag(SPARSELOCO_LR)}", *(f"adamw:{lr_flag(lr)}" for lr in ADAMW_LRS), *widen,
            f"{DILOCO}:{lr_flag(SPARSELOCO_LR)}"]
    if model == SIZES[-1]:
        rows += [f"{c}:{lr_flag(SPARSELOCO_LR)}" for c in COMPRESSED]
    return rows


def load_runs(folder: str) -> tuple[list[dict], dict] | None:
    """The run JSONs' rows and settings in `folder`; None when it is missing or holds none."""
    if not os.path.isdir(folder) or not summarize_tables.input_files([folder]):
        return None
    rows, meta, _ = summarize_tables.load_rows([folder])
    return rows, meta


def load_size(model: str, results: str = RESULTS) -> tuple[list[dict], dict] | None:
    runs = load_runs(os.path.join(results, model))
    return None if runs is None else (summarize_tables.summarize(*runs), runs[1])


def lr_bracket(summary: list[dict], mode: str) -> dict:
    """`mode`'s plain rows on seed 0 (summarize_tables.summarize's rows), by lr: {"best": the best lr
    run so far (None without one), "complete": whether a worse lr was run on either side of it,
    "next": the lr to run next}. "next" is None until every lr of LR_BRACKETS[mode] has run, and
    once complete; else half the best at the low edge, twice it at the high edge (the low side
    first when only one lr has run)."""
    return bracket({r["lr"]: r["val_loss_per_seed"][r["seeds"].index(0)] for r in summary
                    if r["table_row"] == mode and not r["sparseloco"] and 0 in r["seeds"]}, mode)


def bracket(loss_by_lr: dict[float, float], mode: str) -> dict:
    """`lr_bracket`'s {"best", "complete", "next"} of `mode`'s losses by lr, wherever they were read."""
    if not loss_by_lr:
        return {"best": None, "complete": False, "next": None}
    # A diverged lr (NaN loss) is the worst, wherever the rows list it: min() would keep a leading NaN.
    best = min(loss_by_lr, key=lambda lr: loss_by_lr[lr] if math.isfinite(loss_by_lr[lr]) else math.inf)
    if not all(any(math.isclose(lr, x) for x in loss_by_lr) for lr in LR_BRACKETS[mode]):
        return {"best": best, "complete": False, "next": None}
    nxt = best / 2 if best == min(loss_by_lr) else best * 2 if best == max(loss_by_lr) else None
    return {"best": best, "complete": nxt is None, "next": nxt}


def done_row_seeds(summary: list[dict]) -> set[tuple[str, int]]:
    """(row, seed) of every finished row-seed of a size's rows (`load_size`'s summary)."""
    return {(r["row"], s) for r in summary for s in r["seeds"]}


def bracket_rows(summary: list[dict]) -> list[str]:
    """The rows (seed 0) that widen the open lr brackets of a size's rows (`load_size`'s summary) by
    one lr each."""
    return [f"{mode}:{lr_flag(b['next'])}" for mode in LR_BRACKETS
            if (b := lr_bracket(summary, mode))["next"] is not None]


def open_lr_brackets(summary: list[dict]) -> list[str]:
    """Each mode whose lr bracket is open in a size's rows (`load_size`'s summary), with its best
    and next lr so far."""
    brackets = {mode: lr_bracket(summary, mode) for mode in LR_BRACKETS}
    return [f"{mode} (best so far {'none' if b['best'] is None else lr_flag(b['best'])}"
            + (f", next {lr_flag(b['next'])})" if b["next"] else ")") for mode, b in brackets.items() if not b["complete"]]


def tuned_rows(summary: list[dict]) -> list[str]:
    """Seed 1's rows that can run: SparseLoCo and AdamW each at its tuned lr once its own bracket is
    complete (one mode's seed 1 does not wait on the other's bracket), DiLoCo at its one lr."""
    return [f"{mode}:{lr_flag(b['best'])}" for mode in LR_BRACKETS if (b := lr_bracket(summary, mode))["complete"]] + \
        [f"{DILOCO}:{lr_flag(SPARSELOCO_LR)}"]


def second_seed_rows(model: str, results: str = RESULTS) -> list[str]:
    """Seed 1's rows (`tuned_rows`); refused while a bracket is open."""
    loaded = load_size(model, results)
    summary = loaded[0] if loaded else []
    if open_ := open_lr_brackets(summary):
        raise SystemExit(f"size_sweep: {model}'s lr bracket of {'; '.join(open_)} is not complete under "
                         f"{os.path.join(results, model)}: run seed 0's rows first (plan lists them)")
    return tuned_rows(summary)


def rows_ready(model: str, summary: list[dict]) -> list[tuple[str, int]]:
    """(row, seed) of a size that can start now, in the order they should: seed 0's rows with the
    widening rows of its open brackets, then seed 1's (`tuned_rows`: a mode's once its own bracket is
    complete); none finished."""
    done = done_row_seeds(summary)
    ready = [(r, 0) for r in first_seed_rows(model, bracket_rows(summary))] + [(r, 1) for r in tuned_rows(summary)]
    return [x for x in ready if x not in done]


# Issue 57, item 2: what sets compression's cost. The one-pass micro-batch-8 regime (79 syncs, every
# SparseLoCo bracket closed) at its narrowest and widest sizes, each row at SparseLoCo's tuned lr
# there, so that no row is measured against an lr that regime does not train at. 105M's PP-Compress
# at 1/16 keeps k = 48, 20M's k at 1/8, which parts k from k/d. Both seeds: a row of this regime
# takes 3-8 minutes on an H200 (the committed rows' seconds), under the issue's 10 for a second seed.
PENALTY_REGIME = "one_pass/micro8"
PENALTY_ROWS = {"20M": ("pp:8", "het:8", "pp:96", "het:96"), "105M": ("pp:8", "het:8", "pp:96", "het:96", "pp:16")}
PENALTY_SEEDS = (0, 1)
SETS = ("sweep", "penalty")


def penalty_rows(model: str, summary: list[dict]) -> list[str]:
    """`model`'s rows of issue 57's item 2 (PENALTY_ROWS) at SparseLoCo's tuned lr among `summary`
    (the size's rows in PENALTY_REGIME); refused at another size and while that bracket is open."""
    if model not in PENALTY_ROWS:
        raise SystemExit(f"size_sweep: --set penalty has rows at {', '.join(PENALTY_ROWS)}, not {model}")
    b = lr_bracket(summary, "sparseloco")
    if not b["complete"]:
        raise SystemExit(f"size_sweep: --set penalty: {model}'s SparseLoCo lr bracket is open (best so far "
                         f"{b['best']}): its rows run at the tuned lr, so close it first")
    return [f"{row}:{lr_flag(b['best'])}" for row in PENALTY_ROWS[model]]


def rows_of_set(name: str, model: str, summary: list[dict]) -> list[tuple[str, int]]:
    """(row, seed) of the named set (SETS) that can start now, none finished: "sweep", the size
    sweep's own (`rows_ready`); "penalty", `penalty_rows` on every seed of PENALTY_SEEDS, seed 0 first."""
    if name == "sweep":
        return rows_ready(model, summary)
    done = done_row_seeds(summary)
    return [(r, s) for s in PENALTY_SEEDS for r in penalty_rows(model, summary) if (r, s) not in done]


def check_set(name: str, sub: str) -> None:
    """A set's rows belong to one regime (its folder under RESULTS): "penalty" to PENALTY_REGIME."""
    if name == "penalty" and os.path.normpath(sub) != PENALTY_REGIME:
        raise SystemExit(f"size_sweep: --set penalty runs in {PENALTY_REGIME} (--one-pass --micro 8), not {sub!r}")


def results_folder(one_pass: bool, micro: int = MICRO) -> str:
    """Where a regime's committed rows live: a micro-batch other than MICRO (the same tokens in more,
    smaller replica steps, so more outer syncs) in a sub-folder of its own."""
    base = ONE_PASS if one_pass else RESULTS
    return base if micro == MICRO else os.path.join(base, f"micro{micro}")


def regime_name(one_pass: bool, micro: int = MICRO) -> str:
    name = "one pass" if one_pass else f"{TOKENS_PER_PARAM:g} tokens per parameter"
    return name if micro == MICRO else f"{name}, micro-batch {micro} ({micro * GAS * SEQ:,} tokens a replica step)"


def regimes() -> list[tuple[str, str]]:
    """(name, folder) of every regime with a folder: the two of micro-batch MICRO, then each other
    micro-batch's."""
    out = [(regime_name(False), RESULTS), (regime_name(True), ONE_PASS)]
    for one_pass in (False, True):
        for folder in sorted(glob.glob(os.path.join(results_folder(one_pass), "micro*"))):
            micro = os.path.basename(folder)[len("micro"):]
            if micro.isdigit():
                out.append((regime_name(one_pass, int(micro)), folder))
    return out


def steps_for(model: str, one_pass: bool = False, micro: int = MICRO) -> tuple[int, int]:
    """(steps, parameters) of a row of `model` (paper_tables' own rules and count, vocab 8192); one
    pass over the corpus the committed rows record."""
    import paper_tables
    from hetloco_ds.presets import model_config_for

    llama = model_config_for(model, 8192)
    args = argparse.Namespace(tokens_per_param=TOKENS_PER_PARAM, replicas=REPLICAS, micro=micro, gas=GAS,
                              inner_steps=H)
    steps = paper_tables.steps_for_passes(1.0, corpus_tokens(), args, SEQ) if one_pass else \
        paper_tables.steps_for_tokens(llama, args, SEQ)
    return steps, paper_tables.n_params(llama)


def corpus_tokens() -> int:
    """The training tokens of the corpus the committed rows ran on (every size builds the same one)."""
    for model in SIZES:
        loaded = load_size(model, RESULTS)
        if loaded:
            return loaded[1]["corpus_train_tokens"]
    raise SystemExit(f"size_sweep: no committed rows under {RESULTS} record the corpus's size")


def results_of(args) -> str:
    return args.results or results_folder(args.one_pass, args.micro)


def measured_pace(loaded: tuple[list[dict], dict] | None, card: str | None = None, gpus: int = 1) -> float | None:
    """Seconds a step of a row on `gpus` GPUs, from a size's finished rows (`load_size`; None without
    any): the median of the rows run that way on `card` where there are any (a fresh card alone can
    be faster than the rows that shared a machine, and a sharded row takes more than 1/G of its
    GPU-time), else the median GPU-seconds a step over `gpus`."""
    seeds = [(s / loaded[1]["steps"], g, c or loaded[1]["card"]) for r in (loaded[0] if loaded else [])
             for s, g, c in zip(r["seconds_per_seed"], r["gpus_per_seed"], r["card_per_seed"]) if s]
    paces = sorted(p for p, g, c in seeds if card is not None and (c, g) == (card, gpus)) or \
        sorted(p * g / gpus for p, g, _ in seeds)
    return paces[len(paces) // 2] if paces else None


def estimated_paces(one_pass: bool, micro: int, results: str, mfu: float, load=load_size) -> dict[str, tuple[float, str]]:
    """Each size's GPU-seconds a step in a regime and how it was found: from a measured pace
    (seconds a step of a finished row of that size, else of `paper_tables.py --calibrate` alone on a
    GPU, committed as calibration_<model>_<card>_alone.json), else FLOPs at `mfu`."""
    import paper_tables
    from hetloco_ds.presets import model_config_for

    # GPU-seconds a step, the same in either regime: a row run on G GPUs together took G GPUs' time.
    # The long rows first: a 950-step row's time is mostly its fixed cost (ROW_OVERHEAD_S).
    base = {m: measured_pace(next((x for x in (load(m, RESULTS), load(m, ONE_PASS)) if x), None)) for m in SIZES}
    own = {m: measured_pace(load(m, results)) if micro != MICRO else None for m in SIZES}
    # Another micro-batch without rows of its own at a size: micro-batch MICRO's pace times the ratio
    # the sizes that have both measured (small rows do not scale with their tokens), else the tokens'.
    ratios = sorted(own[m] / base[m] for m in SIZES if own[m] and base[m])
    ratio, ratio_how = ((ratios[len(ratios) // 2], f"x {ratios[len(ratios) // 2]:.2f}, measured at "
                         + ", ".join(m for m in SIZES if own[m] and base[m])) if ratios
                        else (micro / MICRO, "scaled by the tokens"))
    out = {}
    for model in SIZES:
        timed = sorted(glob.glob(os.path.join(RESULTS, f"calibration_{model}_*_alone.json")))
        if own[model]:
            out[model] = own[model], "measured rows"
        elif base[model]:
            out[model] = (base[model] * (1.0 if micro == MICRO else ratio),
                          "measured rows" + ("" if micro == MICRO else f" of micro-batch {MICRO} {ratio_how}"))
        elif timed:
            with open(timed[0]) as f:
                doc = json.load(f)
            out[model] = (doc["levels"][0]["s_per_step"][0] * (1.0 if micro == MICRO else ratio),
                          f"calibrated on {doc['card']}" + ("" if micro == MICRO else f" at micro-batch {MICRO} {ratio_how}"))
        else:
            llama = model_config_for(model, 8192)
            ns = argparse.Namespace(steps=1, replicas=REPLICAS, micro=micro, gas=GAS)
            out[model] = paper_tables.row_flops(llama, ns, SEQ) / (paper_tables.PEAK_FLOPS * mfu), f"MFU {mfu}"
    return out


def plan(args) -> int:
    """Each size's rows, steps and GPU-minutes (`estimated_paces`)."""
    if args.set == "penalty":
        return plan_penalty(args)
    total, results = 0.0, results_of(args)
    load = functools.lru_cache(maxsize=None)(load_size)  # a folder read once, whichever of the roles below it plays
    paces = estimated_paces(args.one_pass, args.micro, results, args.mfu, load)
    for model in SIZES:
        steps, n = steps_for(model, args.one_pass, args.micro)
        loaded = load(model, results)
        pace, how = paces[model]
        summary = loaded[0] if loaded else []
        done = done_row_seeds(summary)
        # seed 0: every row of the size, and the next lr of each open bracket (at least one more row
        # each); seed 1: SparseLoCo and AdamW at the best lr of seed 0 so far, DiLoCo
        left_rows = [(r, 0) for r in first_seed_rows(model, bracket_rows(summary)) if (r, 0) not in done]
        best = {mode: lr_bracket(summary, mode)["best"] for mode in LR_BRACKETS}
        left_rows += [(r, 1) for r in (f"sparseloco:{lr_flag(best['sparseloco'] or SPARSELOCO_LR)}",
                                       f"adamw:{lr_flag(best['adamw'] or ADAMW_LRS[0])}",
                                       f"{DILOCO}:{lr_flag(SPARSELOCO_LR)}") if (r, 1) not in done]
        minutes = (pace * steps + ROW_OVERHEAD_S) / 60
        left = minutes * len(left_rows)
        total += left
        print(f"{model}: {n / 1e6:.1f}M parameters, {steps} steps ({steps // H} outer), {pace:.4f} s a step ({how}): "
              f"{minutes:.1f} GPU-minutes a row; {len(left_rows)} row-seeds left, {left:.0f} GPU-minutes")
        if left_rows:
            print("  left: " + ", ".join(f"{r}@seed{seed}" for r, seed in left_rows))
    print(f"all sizes: about {total / 60:.1f} GPU-hours left")
    return 0


def plan_penalty(args, card: str = "NVIDIA H200") -> int:
    """The penalty set's row-seeds left at each size and their GPU-minutes on `card`, one row a GPU:
    the median seconds a step of the size's committed rows in the regime on that card, times its
    steps (those rows' seconds hold their compile and validation; a fresh machine also builds the
    corpus, 38-58 s)."""
    results = results_of(args)
    check_set("penalty", os.path.relpath(results, RESULTS))
    total = 0.0
    for model in PENALTY_ROWS:
        loaded = load_size(model, results)
        left = rows_of_set("penalty", model, loaded[0] if loaded else [])
        steps, _ = steps_for(model, args.one_pass, args.micro)
        pace = measured_pace(loaded, card, 1)
        minutes = pace * steps / 60
        total += minutes * len(left)
        print(f"{model}: {steps} steps at {pace:.4f} s a step on one {card} (committed rows): {minutes:.1f} "
              f"GPU-minutes a row; {len(left)} row-seeds left, {minutes * len(left):.0f} GPU-minutes")
        if left:
            print("  left: " + ", ".join(f"{r}@seed{seed}" for r, seed in left))
    print(f"penalty set: about {total:.0f} GPU-minutes left")
    return 0


def side_by_side(work: dict[str, tuple[int, float]], blocks: list[list[str]]) -> list[tuple[list[str], list[str]]]:
    """Sizes run side by side on one machine: lanes of (GPU ids, the sizes they run in turn), from
    each size's (rows left, seconds a row) and the machine's GPU blocks (one block runs one row).
    With a block for every size or more: a lane a size, each further block to the size whose rows
    would end last, never more blocks than rows. With fewer: a lane a block, the longest size first
    to the lane that ends first. Sizes with no row left get none."""
    todo = {m: w for m, w in work.items() if w[0]}
    if len(blocks) >= len(todo):
        share = dict.fromkeys(todo, 1)
        for _ in range(len(blocks) - len(todo)):
            wider = [m for m in todo if share[m] < todo[m][0]]
            if not wider:
                break
            share[max(wider, key=lambda m: math.ceil(todo[m][0] / share[m]) * todo[m][1])] += 1
        out, i = [], 0
        for m in todo:
            out.append(([g for b in blocks[i:i + share[m]] for g in b], [m]))
            i += share[m]
        return out
    ends, lanes = [0.0] * len(blocks), [[] for _ in blocks]
    for m in sorted(todo, key=lambda m: -todo[m][0] * todo[m][1]):
        j = min(range(len(blocks)), key=ends.__getitem__)
        lanes[j].append(m)
        ends[j] += todo[m][0] * todo[m][1]
    return [(blocks[j], lanes[j]) for j in range(len(blocks)) if lanes[j]]


def ensure_corpus(args, seq_len: int = SEQ) -> None:
    if not os.path.isfile(args.data):
        # Its own process, with the Rust tokenizer's threads on: gpu.sh turns them off for the
        # benches, and serial encoding took 225 of the build's 232 s on a 32-core machine.
        subprocess.run([sys.executable, os.path.join(HERE, "make_corpus.py"), "--tokenizer", args.tokenizer,
                        "--out", args.data, "--max-bytes", "1e9", "--seq-len", str(seq_len),
                        "--roots", *[r for r in args.roots.split(",") if r]],
                       env=dict(os.environ, TOKENIZERS_PARALLELISM="true"), check=True)


def smoke_corpus(path: str, vocab: int = 512) -> str:
    """A corpus of random tokens in make_corpus.py's format for `run --cpu-smoke`: the recipe's rows
    and flags run end to end on a CPU without a tokenizer or a corpus build."""
    import torch

    g = torch.Generator().manual_seed(0)
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    torch.save({"train": torch.randint(vocab, (256, 32), generator=g, dtype=torch.int16),
                "val": torch.randint(vocab, (16, 32), generator=g, dtype=torch.int16),
                "vocab_size": vocab, "description": "random tokens (size_sweep.py run --cpu-smoke)"}, path)
    return path


def cores_a_gpu(gpus: list[str]) -> int:
    """The cores each GPU's paper_tables gets when several share the machine (one process a GPU)."""
    return max(1, (os.cpu_count() or 1) // max(1, len(gpus)))


def sizes_of(arg: str) -> list[str]:
    models = arg.split(",")
    bad = [m for m in models if m not in SIZES]
    if bad or not models:
        raise SystemExit(f"size_sweep: --model {arg}: {', '.join(bad) or 'none'} not among {', '.join(SIZES)}")
    return models


def paper_tables_argv(data: str, model: str, one_pass: bool, micro: int, rows: list[str], seeds: str, budget_s: float,
                      tag: str, out: str) -> list[str]:
    """paper_tables.py's options for `rows` of `model` in a regime of this sweep."""
    length = ["--passes", "1"] if one_pass else ["--tokens-per-param", str(TOKENS_PER_PARAM)]
    return ["--data", data, "--model", model, *length,
            "--replicas", str(REPLICAS), "--stages", str(STAGES), "--inner-steps", str(H), "--micro", str(micro),
            "--gas", str(GAS), "--lr", str(SPARSELOCO_LR), "--rows", ",".join(rows), "--seeds", seeds,
            "--compile", "--budget-s", str(budget_s),
            "--val-every", str(VAL_EVERY), "--eval-batches", str(EVAL_SEQS // micro), "--tag", tag, "--out", out]


def run(args) -> int:
    """Each size of --model in turn (comma-separated), its rows through paper_tables within what is
    left of the one budget; with --side-by-side the sizes share the machine's GPUs at once
    (`side_by_side`)."""
    import paper_tables
    import torch

    t0 = time.time()
    card = torch.cuda.get_device_name() if torch.cuda.is_available() else None  # the rows' pace on it, if measured
    models = sizes_of(args.model)
    results = results_of(args)
    load = functools.lru_cache(maxsize=None)(load_size)  # a size's folder read once: its rows, then its pace

    def summary(model: str) -> list[dict]:
        return (load(model, results) or ([], None))[0]

    sub = os.path.relpath(results_folder(args.one_pass, args.micro), RESULTS)  # ".", one_pass, one_pass/micro8, ...
    check_set(args.set, sub)
    if args.set == "penalty":
        args.seeds = args.seeds or ",".join(map(str, PENALTY_SEEDS))
        rows = {m: penalty_rows(m, summary(m)) for m in models}
    else:
        args.seeds = args.seeds or "0"
        rows = {m: second_seed_rows(m, results) if args.seeds == "1" and not args.rows else
                (args.rows.split(",") if args.rows else first_seed_rows(m, bracket_rows(summary(m))))
                for m in models}  # refused before the corpus
    lanes, threads_a_gpu = [(None, models)], 0
    if args.side_by_side:
        gpus = paper_tables.gpu_ids("cuda")
        threads_a_gpu = cores_a_gpu(gpus)
        blocks = paper_tables.gpu_blocks(args, gpus)
        if not blocks:
            raise SystemExit(f"size_sweep: --side-by-side: {len(gpus)} GPU(s) visible, fewer than --gpus-per-row "
                             f"{args.gpus_per_row} (CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r})")
        paces = {m: measured_pace(load(m, results), card, args.gpus_per_row) for m in models}
        work = {}
        for m in models:
            steps, n = steps_for(m, args.one_pass, args.micro)
            done = done_row_seeds(summary(m))
            left = sum((r, int(seed)) not in done for r in rows[m] for seed in args.seeds.split(","))
            # measured seconds a row where every size has some, else in proportion to its FLOPs
            work[m] = (left, paces[m] * steps + ROW_OVERHEAD_S if all(paces.values()) else n * steps)
        lanes = side_by_side(work, blocks)
        if not lanes:
            print(f"size_sweep: no row left at {args.model}", flush=True)
            return 0
        print("side by side: " + "; ".join(f"GPUs {','.join(g)}: {', '.join(ms)}" for g, ms in lanes), flush=True)
    state_dir = args.state_dir + ("" if sub == "." else "_" + sub.replace(os.sep, "_"))
    if args.resume_only:
        saved = {m: paper_tables.resumable(os.path.join(state_dir, m)) for m in models}
        if not any(saved.values()):
            # before the corpus: a machine lent afresh ends the call in seconds, not a budget later
            print(f"size_sweep: --resume-only: no row of {args.model} is saved under {state_dir}/: nothing to "
                  "resume (the machine was given back since the call that saved them)", flush=True)
            return 0
        lanes = [(g, kept) for g, ms in lanes if (kept := [m for m in ms if saved[m]])]
    if args.cpu_smoke:
        args.data = smoke_corpus(os.path.join(args.out, "smoke_corpus.pt"))
    else:
        ensure_corpus(args)

    def lane(gpus: list[str] | None, sizes: list[str]) -> int:
        status = 0
        for model in sizes:
            left = args.budget_s - (time.time() - t0)
            if left < 60:  # paper_tables starts no row in its last minute (a saved one stops there): nothing would run
                print(f"size_sweep: {model} not started, {left:.0f} s of the budget left", flush=True)
                break
            done = os.path.join(results, model)
            out = os.path.normpath(os.path.join(args.out, sub, model))
            if args.cpu_smoke:  # the same rows and seeds, paper_tables' tiny CPU schedule
                argv = ["--data", args.data, "--cpu-smoke", "--model", model, "--rows", ",".join(rows[model]),
                        "--seeds", args.seeds, "--val-every", "1", "--tag", args.tag, "--out", out]
                status = max(status, paper_tables.main(argv))
                continue
            argv = paper_tables_argv(args.data, model, args.one_pass, args.micro, rows[model], args.seeds, left,
                                     args.tag, out)
            if not args.whole_rows:
                argv += ["--state-dir", os.path.join(state_dir, model)] + (["--resume-only"] if args.resume_only else [])
            elif (pace := measured_pace(load(model, results), card, args.gpus_per_row)) is not None:
                # paper_tables then starts no row it cannot finish by the budget, and the call ends when
                # the last one does
                argv += ["--s-per-step", f"{pace:.4f}"]
            if args.gpus_per_row > 1:
                argv += ["--gpus-per-row", str(args.gpus_per_row)]
            if gpus is not None:
                # each lane's paper_tables would otherwise give its workers every core of the machine
                argv += ["--gpu-ids", ",".join(gpus), "--threads", str(threads_a_gpu)]
            if os.path.isdir(done):
                argv += ["--skip-done", done]
            status = max(status, paper_tables.main(argv))
        return status

    if len(lanes) == 1:
        return lane(*lanes[0])
    # paper_tables.main only waits on its worker processes, so a thread a lane; result() re-raises
    # a lane's SystemExit here
    with concurrent.futures.ThreadPoolExecutor(len(lanes)) as pool:
        return max(f.result() for f in [pool.submit(lane, *x) for x in lanes])


def regime_of(sub: str) -> tuple[bool, int]:
    """(one_pass, micro) of a regime named by its folder under bench/results/size_sweep/ (".",
    "one_pass", "one_pass/micro8", "micro8")."""
    parts = [x for x in os.path.normpath(sub).split(os.sep) if x != "."]
    one_pass = parts[:1] == ["one_pass"]
    rest = parts[1:] if one_pass else parts
    micro = MICRO
    if rest and rest[0].startswith("micro") and rest[0][len("micro"):].isdigit():
        micro = int(rest.pop(0)[len("micro"):])
    if rest or micro < 1 or EVAL_SEQS % micro or \
            os.path.relpath(results_folder(one_pass, micro), RESULTS) != os.path.normpath(sub):
        raise SystemExit(f"size_sweep: --regimes: {sub!r} is not a regime's folder (one of ., one_pass, micro8, "
                         f"one_pass/micro8, ...: micro<N> with N dividing {EVAL_SEQS}, not {MICRO})")
    return one_pass, micro


def fill(args) -> int:
    """Whole rows of several regimes and sizes on every visible GPU until the budget. Each GPU in
    turn takes the first row that can start (regime order, then seed 0 before seed 1, then size,
    then the size's own order: `rows_ready`) and that it can finish in the time left at the row's
    measured pace on this card, one GPU a row. The rows are read again before every pick, from the
    committed results and this machine's --out together, so a row that closes an lr bracket lets
    that size's seed 1 start in the same call, and a later call on the same machine skips what an
    earlier one finished; a GPU with nothing to start waits while rows run, since one may. No state
    is saved: a machine given back between calls takes nothing with it."""
    import threading

    import paper_tables
    import torch

    t0 = time.time()
    models = sizes_of(args.model)
    regimes = {sub: regime_of(sub) for sub in dict.fromkeys(args.regimes.split(","))}
    for sub in regimes:
        check_set(args.set, sub)
    gpus = paper_tables.gpu_ids("cuda")
    if not gpus:
        raise SystemExit("size_sweep: fill: no CUDA device visible "
                         f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r})")
    card = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    threads = cores_a_gpu(gpus)
    steps = functools.lru_cache(maxsize=None)(steps_for)
    guess = {sub: estimated_paces(*regimes[sub], results_folder(*regimes[sub]), 0.25) for sub in regimes}
    ensure_corpus(args)
    running, tried, order = set(), set(), itertools.count(1)
    ended = threading.Condition()  # a row ended; its lock guards running and tried
    stamp = time.strftime("%m%d%H%M")  # with the pick's number, a file name no other call on the machine gives

    def rows_now(sub: str, model: str) -> tuple[list[dict], float]:
        """The size's finished rows in the committed results and --out together, and its pace."""
        runs = [x for x in (load_runs(os.path.join(results_folder(*regimes[sub]), model)),
                            load_runs(os.path.join(args.out, sub, model))) if x]
        if not runs:
            return [], guess[sub][model][0]
        names = {r["variant"]["name"] for r in runs[0][0]}
        rows = runs[0][0] + [r for x in runs[1:] for r in x[0] if r["variant"]["name"] not in names]
        loaded = (summarize_tables.summarize(rows, runs[0][1]), runs[0][1])
        return loaded[0], measured_pace(loaded, card, 1) or guess[sub][model][0]

    def pick() -> tuple | None:
        """The next row for a free GPU; while none can start but rows still run, waits for one of
        them to end (it may close a bracket and so let seed 1 start)."""
        with ended:
            while (got := first_fit(args.budget_s - (time.time() - t0))) is None and running:
                ended.wait(timeout=30)
            return got

    def first_fit(left: float) -> tuple | None:
        """The first row ready (regime, seed, size, the size's order) that fits `left` seconds; rows
        that do not fit are said once and not tried again, as the budget only shrinks. Called with
        `ended` held."""
        for sub in regimes:
            ready = {m: rows_now(sub, m) for m in models}
            for seed in (0, 1):
                for model in models:
                    summary, pace = ready[model]
                    for row, s in rows_of_set(args.set, model, summary):
                        key = (sub, model, row, s)
                        if s != seed or key in running or key in tried:
                            continue
                        need = pace * steps(model, *regimes[sub])[0] + FILL_MARGIN_S
                        if need > left:
                            tried.add(key)
                            print(f"fill: {sub}/{model} {row}@seed{s} not started: {need:.0f} s at {pace:.3f} s "
                                  f"a step, {left:.0f} s of the budget left", flush=True)
                            continue
                        running.add(key)
                        return key, pace, next(order)
        return None

    def lane(gpu: str) -> tuple[int, int, float]:
        """(exit status, rows finished, seconds busy) of one GPU's rows."""
        status, finished, busy = 0, 0, 0.0
        while (got := pick()) is not None:
            (sub, model, row, seed), pace, n = got
            out = os.path.normpath(os.path.join(args.out, sub, model))
            print(f"fill: GPU {gpu}: {sub}/{model} {row}@seed{seed} at {pace:.3f} s a step", flush=True)
            start = time.time()
            try:
                argv = paper_tables_argv(args.data, model, *regimes[sub], [row], str(seed),
                                         args.budget_s - (time.time() - t0), f"{args.tag}{stamp}_{n}", out)
                status = max(status, paper_tables.main(argv + ["--s-per-step", f"{pace:.4f}", "--gpu-ids", gpu,
                                                               "--threads", str(threads)]))
            finally:
                busy += time.time() - start
                with ended:  # finished, it leaves the queue by its JSON; not finished, it is not tried again
                    running.discard((sub, model, row, seed))
                    tried.add((sub, model, row, seed))
                    ended.notify_all()
            finished += (row, seed) in done_row_seeds(rows_now(sub, model)[0])
        return status, finished, busy

    print(f"fill: {', '.join(models)} in {', '.join(regimes)} on GPUs {','.join(gpus)}, {args.budget_s:.0f} s",
          flush=True)
    with concurrent.futures.ThreadPoolExecutor(len(gpus)) as pool:
        lanes = [f.result() for f in [pool.submit(lane, g) for g in gpus]]
    # what the call's GPU time bought, for the call's notes
    print(f"fill: {sum(x[1] for x in lanes)} rows finished in {time.time() - t0:.0f} s; busy "
          + ", ".join(f"GPU {g} {x[2]:.0f} s" for g, x in zip(gpus, lanes)), flush=True)
    return max(x[0] for x in lanes)


def ingest(args) -> int:
    """A GPU call's rows put where plan, fill and summarize read them. Each of args.paths is a
    folder the device tool filled (its .tgz files, gpu.sh's bench.tgz and fill's fill.tgz, are
    opened in it), a .tgz, or a folder of results; every paper_tables_*.json found at
    [size_sweep_fill/]<regime>/<model>/ goes to that regime's folder of the committed results, or to
    its repeats/<model>/ when every row in it has a committed run already (`same_seed_repeats`), and
    the call's size_sweep.log beside it as size_sweep_<tag>.log. Everything is checked before
    anything is written (a file at no regime's folder, a row half committed, settings that differ
    from the folder's, a name taken by other content: one line, nothing written); a file already in
    place is skipped, so ingesting a call twice changes nothing. Each file is written aside and then
    renamed."""
    import filecmp
    import shutil
    import tarfile
    import tempfile

    def read(path: str) -> bytes:
        with open(path, "rb") as f:
            return f.read()

    with tempfile.TemporaryDirectory() as tmp:
        roots = []  # (folder to search, what names its files to the user before their relative path)
        for i, src in enumerate(args.paths):
            archives = [src] if os.path.isfile(src) else sorted(glob.glob(os.path.join(src, "*.tgz")))
            if os.path.isdir(src):
                roots.append((src, os.path.join(src, "")))
            elif not src.endswith(".tgz") or not os.path.isfile(src):
                raise SystemExit(f"size_sweep: ingest: {src!r} is neither a folder nor a .tgz")
            for j, a in enumerate(archives):
                into = os.path.join(tmp, f"{i}_{j}")
                try:
                    with tarfile.open(a) as tar:
                        tar.extractall(into, filter="data")  # no path out of `into`, no links
                except (tarfile.TarError, OSError) as e:
                    raise SystemExit(f"size_sweep: ingest: {a}: not a readable .tgz ({e})") from None
                roots.append((into, a + ":"))
        files, logs, seen, shown = [], {}, set(), {}  # logs: {content: path}; seen: JSON contents
        for root, label in roots:
            for folder, _, names in sorted(os.walk(root)):
                for name in sorted(names):
                    path = os.path.join(folder, name)
                    shown[path] = label + os.path.relpath(path, root)
                    if name == "size_sweep.log":
                        logs.setdefault(read(path), path)
                    if not (name.startswith("paper_tables_") and name.endswith(".json")) or \
                            (key := read(path)) in seen:
                        continue
                    seen.add(key)
                    parts = os.path.relpath(path, root).split(os.sep)
                    parts = parts[1:] if parts[0] == "size_sweep_fill" else parts
                    sub, model = os.sep.join(parts[:-2]) or ".", parts[-2] if len(parts) > 1 else ""
                    try:
                        regime = regime_of(sub)
                    except SystemExit:
                        regime = None
                    if model not in SIZES or regime is None:
                        raise SystemExit(f"size_sweep: ingest: {shown[path]}: not at <regime>/<model>/ (regime {sub!r}, "
                                         f"model {model!r}; models {', '.join(SIZES)})")
                    files.append((path, regime, model))
        if not files:
            raise SystemExit(f"size_sweep: ingest: no paper_tables_*.json under {', '.join(args.paths)}")
        # the loose log and bench.tgz's copy of it, packed up to 15 s earlier: the longest, if the others
        # are where it started
        texts = sorted(logs, key=len)
        if any(not texts[-1].startswith(t) for t in texts[:-1]):
            raise SystemExit(f"size_sweep: ingest: {len(logs)} different size_sweep.log "
                             f"({', '.join(shown[p] for p in logs.values())}): "
                             "ingest one call at a time")
        log = logs[texts[-1]] if texts else None
        if log and not args.tag:
            raise SystemExit("size_sweep: ingest: the call's size_sweep.log needs --tag (it lands as "
                             "size_sweep_<tag>.log beside the rows)")

        writes, skipped, new_in = [], [], {}
        for path, regime, model in files:
            name = os.path.basename(path)
            try:
                with open(path) as f:
                    rows = [r["variant"]["name"] for r in json.load(f)["rows"]]
            except (ValueError, KeyError, TypeError) as e:
                raise SystemExit(f"size_sweep: ingest: {shown[path]}: not a paper_tables run JSON ({e!r})") from None
            home = os.path.join(results_folder(*regime), model)
            repeats = os.path.join(results_folder(*regime), "repeats", model)
            if not rows:
                skipped.append(f"{shown[path]}: no finished row")
                continue
            there = [os.path.join(d, name) for d in (home, repeats) if os.path.exists(os.path.join(d, name))]
            if there:
                if not filecmp.cmp(there[0], path, shallow=False):
                    raise SystemExit(f"size_sweep: ingest: {there[0]} exists with other content than {shown[path]}")
                skipped.append(f"{there[0]}: already in")
                continue
            committed = {r["variant"]["name"] for r in (load_runs(home) or ([], {}))[0]}
            again = [r for r in rows if r in committed]
            if again and len(again) < len(rows):
                raise SystemExit(f"size_sweep: ingest: {shown[path]}: {', '.join(again)} committed under {home} already, "
                                 f"{', '.join(r for r in rows if r not in committed)} not: split the file by hand")
            dest = repeats if again else home
            writes.append((path, dest, name))
            new_in.setdefault(dest, []).append(path)
        for dest, paths in new_in.items():  # what summarize will read, read now: settings, a row twice
            try:
                summarize_tables.load_rows((summarize_tables.input_files([dest]) if os.path.isdir(dest) else []) + paths)
            except SystemExit as e:
                said = str(e)
                for path in paths:
                    said = said.replace(path, shown[path])
                raise SystemExit(f"size_sweep: ingest: {dest}: {said}") from None
        log_name = f"size_sweep_{args.tag}.log"
        log_dests = sorted({d for _, d, _ in writes}) if log else []
        for dest in log_dests:
            there = os.path.join(dest, log_name)
            if os.path.exists(there) and not filecmp.cmp(there, log, shallow=False):
                raise SystemExit(f"size_sweep: ingest: {there} exists with another log: pick another --tag")

        def place(src: str, dest: str, name: str) -> None:
            os.makedirs(dest, exist_ok=True)
            part = os.path.join(dest, f".{name}.part")
            shutil.copyfile(src, part)
            os.replace(part, os.path.join(dest, name))
            print(f"ingest: {os.path.relpath(os.path.join(dest, name))}", flush=True)

        for src, dest, name in writes:
            place(src, dest, name)
        for dest in log_dests:
            place(log, dest, log_name)
        for line in skipped:
            print(f"ingest: skipped {line}", flush=True)
    for regime in dict.fromkeys(r for _, r, _ in files):
        one_pass, micro = regime
        print("next: python bench/size_sweep.py summarize" + (" --one-pass" if one_pass else "")
              + (f" --micro {micro}" if micro != MICRO else ""), flush=True)
    return 0


def one_epoch_point(curve: list[dict] | None, steps_per_epoch: float, schedule_step: int | None = None,
                    diverged_at: int | None = None) -> dict | None:
    """The validation point of `curve` nearest one pass over the corpus ({"step", "epochs", "loss"}),
    or None for a row run without a curve. `schedule_step`: that point's step on the size's
    schedule (`epoch_step`); a row that diverged (`diverged_at`) at or before it has NaN there,
    the worst, not its last point before it failed."""
    if not curve:
        return None
    if diverged_at is not None and schedule_step is not None and diverged_at <= schedule_step:
        return {"step": schedule_step, "epochs": schedule_step / steps_per_epoch, "loss": math.nan}
    p = min(curve, key=lambda p: abs(p["step"] - steps_per_epoch))
    return {"step": p["step"], "epochs": p["step"] / steps_per_epoch, "loss": p["loss"]}


def epoch_step(summary: list[dict], steps_per_epoch: float) -> int | None:
    """The validation step nearest one pass on a size's schedule: read off the curves of its rows
    that ran their schedule (all of a size's rows validate at the same steps)."""
    steps = {one_epoch_point(c, steps_per_epoch)["step"] for r in summary
             for c, d in zip(r["val_curve_per_seed"], r["diverged_at_step_per_seed"])
             if c and d is None}
    return max(steps) if steps else None


def summary_rows(model: str, summary: list[dict], meta: dict) -> list[dict]:
    brackets = {mode: lr_bracket(summary, mode) for mode in LR_BRACKETS}

    def best_so_far(r: dict) -> bool:
        return r["table_row"] in brackets and not r["sparseloco"] and r["lr"] == brackets[r["table_row"]]["best"]

    steps_per_epoch = summarize_tables.steps_per_pass(meta, meta)
    at_epoch = epoch_step(summary, steps_per_epoch) if steps_per_epoch else None
    out = []
    for r in summary:
        mode = "diloco" if r["table_row"] == "diloco" else r["table_row"]
        cards = [c or meta["card"] for c in r["card_per_seed"]]
        out.append({
            "mode": mode, "model": model, "n_params": meta["n_params"], "lr": r["lr"],
            # Tuned only where the row's own mode has a closed lr bracket with this lr its best on seed
            # 0. DiLoCo runs at one lr, and a compressed row at whatever lr it was given: neither
            # inherits SparseLoCo's bracket (the paper marks rows tuned for the compressed setting
            # apart, Table 1's *), so a row run at one lr never reads as tuned.
            "best_lr_so_far": best_so_far(r),
            "tuned": mode in brackets and best_so_far(r) and brackets[mode]["complete"],
            "val_loss_mean": r["val_loss_mean"], "seeds": r["seeds"], "per_seed": r["val_loss_per_seed"],
            "outer_steps": r["outer_steps"], "tokens_per_param": r["tokens_per_param"],
            "tokens_per_replica_step": r["tokens_per_replica_step"], "epochs": r["epochs"],
            "degradation_pct": r["delta_pct_mean"], "seconds_per_seed": r["seconds_per_seed"],
            "card": " + ".join(dict.fromkeys(cards)), "card_per_seed": cards,
            # Held-out loss above the final train loss: what repeating the corpus costs a row.
            "train_loss_per_seed": r["final_train_loss_per_seed"],
            "val_minus_train_per_seed": [v - t for v, t in zip(r["val_loss_per_seed"], r["final_train_loss_per_seed"])],
            "one_epoch_per_seed": [one_epoch_point(c, steps_per_epoch, at_epoch, d) for c, d in
                                   zip(r["val_curve_per_seed"], r["diverged_at_step_per_seed"])],
            "train_drop_per_seed": r["train_drop_per_seed"],
            "first_pass_fresh_per_seed": r["first_pass_fresh_per_seed"],
        })
    return out


def final_loss(r: dict, seed: int) -> float:
    return r["per_seed"][r["seeds"].index(seed)]


def point_loss(key: str):
    """loss(row, seed) of a summary row's per-seed points under `key` (None where a seed has none)."""
    return lambda r, seed: (r[key][r["seeds"].index(seed)] or {}).get("loss")


def best_at(rows: list[dict], mode: str, loss) -> tuple[dict | None, bool]:
    """`mode`'s row with the lowest `loss(row, 0)` among `rows` (one size's), and whether its
    bracket is complete at that point (`bracket`, lr_bracket's rule: an lr that diverged by then,
    NaN there, was run and is the worst; a row without the point is not counted)."""
    there = {r["lr"]: r for r in rows if r["mode"] == mode and 0 in r["seeds"] and loss(r, 0) is not None}
    b = bracket({lr: loss(r, 0) for lr, r in there.items()}, mode)
    return (None if b["best"] is None else there[b["best"]]), b["complete"]


def gaps(rows: list[dict], loss=final_loss, best_there: bool = False) -> list[dict]:
    """Per size: SparseLoCo's (at its tuned lr) and DiLoCo's gap to the tuned AdamW, on the seeds
    they share where `loss(row, seed)` has a value (the final validation, or `point_loss`'s points).
    Where a mode's lr bracket is still open, its best lr on seed 0 so far stands in, and the gap says
    so (provisional). `best_there`: each mode at its best lr at that point instead (`best_at`), not
    at the lr that ends best: an lr that ends best by memorising least a corpus seen many times can
    be the worst one early."""
    out = []
    for model in dict.fromkeys(r["model"] for r in rows):
        if best_there:
            size = [r for r in rows if r["model"] == model]
            picked = {mode: best_at(size, mode, loss) for mode in LR_BRACKETS}
            pick = {mode: r for mode, (r, _) in picked.items() if r is not None}
            pick |= {r["mode"]: r for r in size if r["mode"] == "diloco"}
            complete = {mode: done for mode, (_, done) in picked.items()}
        else:
            pick = {r["mode"]: r for r in rows
                    if r["model"] == model and (r["mode"] == "diloco" or r["best_lr_so_far"])}
            complete = {mode: mode in pick and pick[mode]["tuned"] for mode in LR_BRACKETS}
        if "adamw" not in pick:
            continue
        a = pick["adamw"]
        for mode in ("sparseloco", "diloco"):
            if mode not in pick:
                continue
            r = pick[mode]
            seeds = [s for s in r["seeds"] if s in a["seeds"] and None not in (loss(r, s), loss(a, s))]
            if not seeds:
                continue
            diff = [loss(r, s) - loss(a, s) for s in seeds]
            mean_a = sum(loss(a, s) for s in seeds) / len(seeds)
            out.append({"model": model, "n_params": r["n_params"], "mode": mode, "lr": r["lr"], "adamw_lr": a["lr"],
                        "seeds": seeds, "gap_nats": sum(diff) / len(diff), "gap_pct": 100 * sum(diff) / len(diff) / mean_a,
                        "per_seed_nats": diff, "adamw_bracket_complete": complete["adamw"],
                        # DiLoCo runs at SparseLoCo's base lr: only AdamW's bracket bears on its gap
                        "sparseloco_bracket_complete": complete["sparseloco"] if mode == "sparseloco" else None})
    return out


def gaps_by_outer_steps() -> list[dict]:
    """SparseLoCo's final gap to the tuned AdamW at each size in each regime of the committed runs
    (and the 5000-step 20M row, LONG_20M), with the outer syncs and passes over the corpus behind
    it: the two regimes differ in both, and so do the sizes of one regime, so the points are read
    against syncs as well as parameters."""
    out = []
    for regime, folder in regimes():
        rows = []
        for model in SIZES:
            loaded = load_size(model, folder)
            if loaded:
                rows += summary_rows(model, *loaded)
        sl = {r["model"]: r for r in rows if r["mode"] == "sparseloco"}
        for g in gaps(rows):
            if g["mode"] == "sparseloco":
                r = sl[g["model"]]
                out.append({k: g[k] for k in ("model", "n_params", "gap_pct", "seeds", "lr", "adamw_lr",
                                              "adamw_bracket_complete", "sparseloco_bracket_complete")}
                           | {"outer_steps": r["outer_steps"], "epochs": r["epochs"], "regime": regime})
    return out + [dict(LONG_20M)]


def same_seed_repeats(results: str) -> list[dict]:
    """Rows run twice with the same seed on different machines (the second run's JSONs under
    `results`/repeats/<model>/, left out of every other field), beside the committed run. The rows
    do not ask for deterministic GPU kernels, so a rerun differs; how much bounds what a difference
    between two rows can mean."""
    out = []
    for model in SIZES:
        again = os.path.join(results, "repeats", model)
        repeats = load_runs(again)
        if repeats is None:
            continue
        first = {r["variant"]["name"]: r for r in summarize_tables.load_rows([os.path.join(results, model)])[0]}
        for r in repeats[0]:
            name = r["variant"]["name"]
            if name not in first:
                raise SystemExit(f"size_sweep: {again}/{r['file']}: {name} has no committed run under "
                                 f"{os.path.join(results, model)} to repeat")
            a, b = first[name]["val_loss"], r["val_loss"]
            out.append({"model": model, "row": name, "val_loss": [a, b], "diff_nats": b - a,
                        "diff_pct": 100 * (b - a) / a, "cards": [first[name]["card"], r["card"]],
                        "files": [first[name]["file"], r["file"]]})
    return out


def brackets_complete(g: dict) -> bool:
    """Whether every lr bracket a gap (of `gaps`) depends on is complete."""
    return g["adamw_bracket_complete"] and g["sparseloco_bracket_complete"] is not False


def open_brackets(g: dict) -> str:
    return " and ".join(f"{mode}'s lr bracket is open ({lr_flag(g[key])} is the best so far)" for mode, key, done in
                        (("SparseLoCo", "lr", g["sparseloco_bracket_complete"]),
                         ("AdamW", "adamw_lr", g["adamw_bracket_complete"])) if done is False)


def plot(rows: list[dict], gap_rows: list[dict], early: dict[str, list[dict]], by_syncs: list[dict],
         path: str) -> None:
    """`early`: more gap series by label (the gap after one pass, on the first pass's unseen batches);
    `by_syncs`: gaps_by_outer_steps."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    fig, (left, mid, right) = plt.subplots(1, 3, figsize=(16, 6.2))
    for i, model in enumerate(SIZES):
        pts = sorted((g["outer_steps"], g["gap_pct"], brackets_complete(g)) for g in by_syncs
                     if g["model"] == model)
        if pts:
            mid.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", color=f"C{i + 2}", label=f"ours: {model}")
            for x, y, complete in pts:
                if not complete:
                    mid.plot([x], [y], "o", markersize=13, markerfacecolor="none", color="grey")
    smaller = [g for g in by_syncs if "micro-batch" in g["regime"]]
    if smaller:  # the same tokens in smaller replica steps: more syncs, not more passes
        mid.plot([g["outer_steps"] for g in smaller], [g["gap_pct"] for g in smaller], "D", markersize=11,
                 markerfacecolor="none", color="black", label="smaller micro-batch, one pass")
    labels = {}  # sizes at the same syncs and passes share one label (at the highest of their points)
    for g in by_syncs:
        key = (g["outer_steps"], f"{g['epochs']:.1f} ep")
        labels[key] = max(labels.get(key, g["gap_pct"]), g["gap_pct"])
    for (x, text), y in labels.items():
        mid.annotate(text, (x, y), textcoords="offset points", xytext=(5, 4), fontsize=7)
    mid.axhline(0, color="grey", lw=0.5)
    mid.set(xscale="log", xlabel="outer syncs (H = 50)", ylabel="SparseLoCo - tuned AdamW (% of AdamW)",
            title="SparseLoCo's gap against outer syncs")
    mid.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=3)
    for mode, marker in (("sparseloco", "o"), ("diloco", "s")):
        pts = sorted((g["n_params"], g["gap_pct"]) for g in gap_rows if g["mode"] == mode)
        if pts:
            left.plot(*zip(*pts), marker=marker, label=f"ours: {mode} - tuned AdamW")
        open_ = [(g["n_params"], g["gap_pct"]) for g in gap_rows if g["mode"] == mode and not brackets_complete(g)]
        if open_:  # ringed: an lr bracket the gap depends on is not yet complete at that size
            left.plot(*zip(*open_), "o", markersize=13, markerfacecolor="none", color="grey",
                      label="lr bracket still open (ringed)" if mode == "sparseloco" else None)
        for (label, series), ls in zip(early.items(), ("--", ":")):
            pts = sorted((g["n_params"], g["gap_pct"]) for g in series if g["mode"] == mode)
            if pts:
                left.plot(*zip(*pts), marker=marker, ls=ls, color="C0" if mode == "sparseloco" else "C1",
                          label=f"ours: {mode} - AdamW, {label}")
    epochs = {r["model"]: (r["n_params"], r["epochs"]) for r in rows if r.get("epochs")}
    for model, (n, e) in epochs.items():  # a row's final loss is after this many passes over the corpus
        left.annotate(f"{e:.1f} epochs", (n, 0), textcoords="offset points", xytext=(0, -12), ha="center", fontsize=7)
    left.plot([PAPER_PARAMS[k] for k in PAPER_GAP_PCT], list(PAPER_GAP_PCT.values()), "k*", markersize=12,
              label="paper: SparseLoCo - AdamW")
    left.plot([LONG_20M["n_params"]], [LONG_20M_GAP_PCT], "C0x", markersize=9,
              label="ours: sparseloco - AdamW, 20M at 32 tokens/param")
    left.axhline(0, color="grey", lw=0.5)
    left.set(xscale="log", xlabel="parameters", ylabel="loss gap (% of AdamW); solid: final validation",
             title="gap to AdamW")
    left.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.16))
    for i, mode in enumerate(COMPRESSED):
        color = f"C{i}"
        pts = sorted((r["n_params"], r["degradation_pct"]) for r in rows
                     if r["mode"] == mode and r["degradation_pct"] is not None)
        if pts:
            right.plot(*zip(*pts), marker="o", color=color, label=f"ours {mode}")
        paper = PAPER_DEGRADATION.get(mode, {})
        right.plot([PAPER_PARAMS[k] for k in paper], list(paper.values()), "*", color=color, markersize=12,
                   label=f"paper {mode}")
    right.set(xscale="log", xlabel="parameters", ylabel="degradation over SparseLoCo (%)",
              title="cost of compression")
    right.legend(fontsize=7, ncol=2, loc="upper center", bbox_to_anchor=(0.5, -0.16))
    for ax in (left, mid, right):
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def summarize(args) -> int:
    rows, cards, settings, results = [], set(), {}, results_of(args)
    for model in SIZES:
        loaded = load_size(model, results)
        if loaded is None:
            continue
        summary, meta = loaded
        size_rows = summary_rows(model, summary, meta)
        rows += size_rows
        size_cards = sorted({c for r in size_rows for c in r["card_per_seed"]})
        cards.update(size_cards)
        settings[model] = {k: meta.get(k) for k in ("n_params", "steps", "replicas", "stages", "inner_steps",
                                                     "micro_batch", "grad_accum", "seq_len", "corpus_train_tokens",
                                                     "data", "compile")} | {"cards": size_cards}
    if not rows:
        raise SystemExit(f"size_sweep: no results under {results}")
    gap_rows = gaps(rows)
    regime = regime_name(args.one_pass, args.micro)
    doc = {"cards": sorted(cards), "regime": regime,
           "tokens_per_param_target": None if args.one_pass else TOKENS_PER_PARAM, "settings": settings,
           "rows": rows, "gaps": gap_rows, "gaps_one_epoch": gaps(rows, point_loss("one_epoch_per_seed")),
           "gaps_first_pass_fresh": gaps(rows, point_loss("first_pass_fresh_per_seed")),
           "gaps_first_pass_fresh_best_there": gaps(rows, point_loss("first_pass_fresh_per_seed"), best_there=True),
           "gaps_by_outer_steps": gaps_by_outer_steps(), "same_seed_repeats": same_seed_repeats(results),
           "paper": {"params": PAPER_PARAMS, "degradation_pct": PAPER_DEGRADATION, "gap_pct": PAPER_GAP_PCT},
           "command": "python bench/size_sweep.py summarize" + (" --one-pass" if args.one_pass else "")
                      + ("" if args.micro == MICRO else f" --micro {args.micro}")}
    os.makedirs(results, exist_ok=True)
    with open(os.path.join(results, "summary.json"), "w") as f:
        json.dump(doc, f, indent=1)
    fresh = [p["step"] for r in rows for p in r["first_pass_fresh_per_seed"] if p]
    early = {} if args.one_pass else {"after one pass": doc["gaps_one_epoch"]}  # one pass: the final loss
    if fresh:
        step = max(set(fresh), key=fresh.count)
        early[f"step {step} ({(step - 1) // H} syncs), unseen batches, each at its best lr there"] = \
            doc["gaps_first_pass_fresh_best_there"]
    plot(rows, gap_rows, early, doc["gaps_by_outer_steps"], os.path.join(results, "size_sweep.png"))
    for when, some in (("end", gap_rows), ("one epoch", doc["gaps_one_epoch"]),
                       ("the first pass's last sync, on unseen batches", doc["gaps_first_pass_fresh"]),
                       ("the same point, each mode at its best lr there", doc["gaps_first_pass_fresh_best_there"])):
        for g in some:
            print(f"{g['model']:>5} {g['mode']:<10} - AdamW (lr {g['adamw_lr']:g}) at {when}: "
                  f"{g['gap_nats']:+.4f} nats ({g['gap_pct']:+.2f}%), seeds {g['seeds']}"
                  + ("" if brackets_complete(g) else f"; provisional: {open_brackets(g)}"))
    for r in rows:
        if r["mode"] in ("sparseloco", "adamw", "diloco"):
            drops = "; ".join(f"{d['new_pass']:.3f} at a new pass, "
                              + ("-" if d["mid_pass"] is None else f"{d['mid_pass']:.3f}") + " mid-pass"
                              for d in r["train_drop_per_seed"] if d)
            print(f"{r['model']:>5} {r['mode']:<10} lr {r['lr']:g}, {r['epochs']:.1f} epochs: validation - train "
                  + ", ".join(f"{d:+.3f}" for d in r["val_minus_train_per_seed"]) + f" (seeds {r['seeds']})"
                  + (f"; train loss falls {drops}" if drops else ""))
    for g in doc["gaps_by_outer_steps"]:
        print(f"{g['model']:>5} sparseloco - AdamW after {g['outer_steps']} syncs, {g['epochs']:.1f} epochs "
              f"({g['regime']}): {g['gap_pct']:+.2f}%, seeds {g['seeds']}"
              + ("" if brackets_complete(g) else f"; provisional: {open_brackets(g)}"))
    for x in doc["same_seed_repeats"]:
        print(f"{x['model']:>5} {x['row']} run twice: {x['val_loss'][0]:.4f} then {x['val_loss'][1]:.4f} "
              f"({x['diff_pct']:+.2f}%)")
    for r in rows:
        if r["degradation_pct"] is not None and r["mode"] in COMPRESSED:
            print(f"{r['model']:>5} {r['mode']:<10} {r['degradation_pct']:+.2f}% over SparseLoCo, seeds {r['seeds']}")
    print(f"wrote {results}/summary.json and size_sweep.png")
    return 0


def method_of(variant: dict) -> str:
    """Which method a compressed row ran under, from its JSON's variant: rows written before issue 57
    lack its two switches and ran the old one (T_S projected after every inner step, weight decay on
    T_S alone)."""
    if "project_embedding_every_step" not in variant:
        return "before issue 57"
    ablated = [f for f, on in (("stepproj", variant["project_embedding_every_step"]),
                               ("tsdecay", variant.get("embedding_weight_decay") == "t_s")) if on]
    return "ablation: " + ",".join(ablated) if ablated else "issue 57"


def penalties(results: str) -> list[dict]:
    """Every compressed SparseLoCo row of a regime's committed runs (`results`, its <model>/ folders)
    against the uncompressed SparseLoCo row of the same seed, lr and outer-step settings: its
    penalty in % and in nats per seed and their mean over the seeds that have both, with k = d /
    ratio, k/d, the lr and whether it is SparseLoCo's tuned lr at that size, and the method."""
    out = []
    for model in SIZES:
        runs = load_runs(os.path.join(results, model))
        if runs is None:
            continue
        rows, meta = runs
        d = meta["model_config"]["hidden_size"]
        tuned = lr_bracket(summarize_tables.summarize(rows, meta), "sparseloco")
        base = {summarize_tables.base_key(r["variant"]): r["val_loss"] for r in rows if not r["variant"]["compressed"]}
        groups: dict[str, list[dict]] = {}
        for r in sorted(rows, key=lambda r: r["variant"]["seed"]):
            if r["variant"]["compressed"] and r["variant"]["mode"] == "sparseloco":
                groups.setdefault(r["variant"]["name"].split("@")[0], []).append(r)
        for name, group in groups.items():
            v = group[0]["variant"]
            paired = [(r["variant"]["seed"], r["val_loss"], b) for r in group
                      if (b := base.get(summarize_tables.base_key(r["variant"]))) is not None]
            pct = [100 * (x - b) / b for _, x, b in paired]
            nats = [x - b for _, x, b in paired]
            out.append({"model": model, "n_params": meta["n_params"], "d": d, "row": name, "kind": name.split(":")[0],
                        "ratio": v["ratio"], "k": d // v["ratio"], "k_over_d": 1 / v["ratio"], "lr": v["lr"],
                        "at_tuned_sparseloco_lr": tuned["complete"] and v["lr"] == tuned["best"],
                        "method": method_of(v), "seeds": [s for s, _, _ in paired],
                        "val_loss_per_seed": [x for _, x, _ in paired],
                        "sparseloco_val_loss_per_seed": [b for _, _, b in paired],
                        "penalty_pct_per_seed": pct, "penalty_nats_per_seed": nats,
                        "penalty_pct": sum(pct) / len(pct) if pct else None,
                        "penalty_nats": sum(nats) / len(nats) if nats else None})
    return out


def paper_penalties() -> list[dict]:
    """The paper's penalties with their k: Table 2 (512M, every ratio) and Table 1 (178M, 1/8)."""
    table1 = summarize_tables.PAPER_TABLE1_LOSS["178M"]
    out = [{"model": "512M", "kind": kind, "ratio": ratio, "k": summarize_tables.PAPER_WIDTH["512M"] // ratio,
            "k_over_d": 1 / ratio, "penalty_pct": pct, "source": "Table 2"}
           for kind, by_ratio in summarize_tables.PAPER_TABLE2_PCT.items() for ratio, pct in by_ratio.items()]
    return out + [{"model": "178M", "kind": kind, "ratio": 8, "k": summarize_tables.PAPER_WIDTH["178M"] // 8,
                   "k_over_d": 1 / 8, "source": "Table 1",
                   "penalty_pct": 100 * (table1[f"{kind}:8"] - table1["sparseloco"]) / table1["sparseloco"]}
                  for kind in ("pp", "het")]


def plot_penalties(rows: list[dict], paper: list[dict], path: str) -> None:
    """The penalty against k/d (left) and against k (right): ours by size (issue 57's method filled
    and joined, older methods hollow, each seed's range as a bar), the paper's as stars."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(13, 5.4))
    for ax, x, label in ((axes[0], "k_over_d", "k/d"), (axes[1], "k", "k (dimensions a boundary sends)")):
        for i, model in enumerate(dict.fromkeys(r["model"] for r in rows)):
            for kind, marker, ls in (("pp", "o", "-"), ("het", "s", "--")):
                for method in dict.fromkeys(r["method"] for r in rows):
                    pts = sorted((r[x], r) for r in rows if r["model"] == model and r["kind"] == kind
                                 and r["method"] == method and r["penalty_pct"] is not None)
                    if not pts:
                        continue
                    new = method == "issue 57"
                    ys = [r["penalty_pct"] for _, r in pts]
                    err = [[y - min(r["penalty_pct_per_seed"]) for y, (_, r) in zip(ys, pts)],
                           [max(r["penalty_pct_per_seed"]) - y for y, (_, r) in zip(ys, pts)]]
                    ax.errorbar([p for p, _ in pts], ys, yerr=err, marker=marker, ls=ls if new else "none", capsize=3,
                                color=f"C{i}", markerfacecolor=None if new else "none",
                                label=f"ours {model} {kind}" + ("" if new else f" ({method})"))
        for j, (source, kind) in enumerate(dict.fromkeys((p["source"], p["kind"]) for p in paper)):
            pts = sorted((p[x], p["penalty_pct"]) for p in paper if (p["source"], p["kind"]) == (source, kind))
            model = next(p["model"] for p in paper if p["source"] == source)
            ax.plot(*zip(*pts), "*" + ("-" if kind == "pp" else "--"), color="k" if source == "Table 2" else "grey",
                    markersize=11, lw=0.8, label=f"paper {model} {kind} ({source})")
        ax.set(xscale="log", xlabel=label, ylabel="penalty: validation loss over SparseLoCo (%)",
               title=f"compression's penalty against {label.split(' ')[0]}")
        ax.grid(alpha=0.3)
    axes[1].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def penalty(args) -> int:
    """penalty.json and penalty.png in a regime's folder: every compressed row's penalty (`penalties`)
    beside the paper's (`paper_penalties`)."""
    results = args.results or results_folder(args.one_pass, args.micro)
    rows = penalties(results)
    if not rows:
        raise SystemExit(f"size_sweep: no compressed rows under {results}")
    doc = {"regime": regime_name(args.one_pass, args.micro), "rows": rows, "paper": paper_penalties(),
           "command": "python bench/size_sweep.py penalty" + (" --one-pass" if args.one_pass else "")
                      + ("" if args.micro == MICRO else f" --micro {args.micro}")}
    with open(os.path.join(results, "penalty.json"), "w") as f:
        json.dump(doc, f, indent=1)
    plot_penalties(rows, doc["paper"], os.path.join(results, "penalty.png"))
    for r in rows:
        per = ", ".join(f"{p:+.2f}" for p in r["penalty_pct_per_seed"])
        print(f"{r['model']:>5} {r['row']:<18} k {r['k']:>3} (k/d 1/{r['ratio']}), {r['method']}"
              + ("" if r["at_tuned_sparseloco_lr"] else ", not SparseLoCo's tuned lr")
              + (f": {r['penalty_pct']:+.2f}% ({per}; seeds {r['seeds']})" if r["seeds"] else ": no SparseLoCo row to compare"))
    print(f"wrote {results}/penalty.json and penalty.png")
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    verbs = p.add_subparsers(dest="verb", required=True)
    pl = verbs.add_parser("plan", help="rows, steps and GPU-minutes per size")
    pl.add_argument("--mfu", type=float, default=0.25)
    pl.add_argument("--results", default="")
    r = verbs.add_parser("run", help="one size's unfinished rows on this machine's GPUs")
    r.add_argument("--model", required=True,
                   help=f"one of {', '.join(SIZES)}, or several, comma-separated, run in turn")
    r.add_argument("--seeds", default=None, help='"0" (the default): every row of the size and the next lr of each '
                   'open bracket; "1": SparseLoCo and AdamW at their tuned lrs, DiLoCo; with --set penalty '
                   f'{",".join(map(str, PENALTY_SEEDS))} by default')
    r.add_argument("--cpu-smoke", action="store_true",
                   help="the rows and seeds this call would run, on the CPU: a corpus of random tokens, paper_tables' "
                        "tiny schedule (M = 2 x S = 2, 2 steps) at the size's own width")
    r.add_argument("--rows", default="", help="comma-separated rows instead of the size's own")
    fl = verbs.add_parser("fill", help="whole rows of several regimes and sizes, one a GPU, until the budget")
    fl.add_argument("--model", default=",".join(SIZES), help="sizes, comma-separated, in the order their rows go first")
    fl.add_argument("--regimes", required=True,
                    help="regimes by their folders under bench/results/size_sweep, comma-separated, in the order "
                         "their rows go first: e.g. one_pass,one_pass/micro8")
    fl.add_argument("--tag", default="fill")
    fl.add_argument("--out", default="runs/size_sweep_fill",
                    help="<regime>/<model>/ of finished rows: keep it on the machine, so that a later call skips them")
    for verb in (r, fl):
        verb.add_argument("--data", default="runs/size_sweep_corpus_seq256.pt")
        verb.add_argument("--tokenizer", default=".benchdata/tokenizer")
        verb.add_argument("--roots", default="/opt/torch/.venv/lib/python3.12/site-packages,/usr/lib/python3.12,"
                                             "/usr/local/cuda/include")
        verb.add_argument("--budget-s", type=float, default=500, help="seconds from start (the corpus build "
                          "included) after which no row starts or continues")
    r.add_argument("--state-dir", default="runs/size_sweep_state")
    r.add_argument("--whole-rows", action="store_true",
                   help="start only rows that finish within the budget (at the regime's measured pace, of rows run on "
                        "this card and as many GPUs a row where there are any) and save "
                        "none: for a call after which the machine may go back, taking any saved state with it")
    r.add_argument("--resume-only", action="store_true",
                   help="start no row: only continue those an earlier call saved in --state-dir, ending when they "
                        "end; on a machine given back in between, the call ends at once (a chain's later calls)")
    r.add_argument("--side-by-side", action="store_true",
                   help="run the sizes of --model at once, each on its share of the visible GPUs (more to the "
                        "size with the most rows left), not in turn on all of them")
    r.add_argument("--gpus-per-row", type=int, default=1,
                   help="GPUs that run one row together (paper_tables.py --gpus-per-row): 2 puts a 105M row in "
                        "one session; a saved row resumes only with the same value")
    r.add_argument("--tag", default="run")
    r.add_argument("--out", default=os.environ.get("OUT", "runs/size_sweep_out"))
    r.add_argument("--results", default="", help="finished rows to skip and read seed 1's tuned AdamW lr from "
                   f"(default {RESULTS}, {ONE_PASS} with --one-pass): e.g. an earlier call's --out on the same "
                   "machine, before its JSONs are committed")
    ig = verbs.add_parser("ingest", help="a GPU call's rows (the device tool's folder, or its .tgz) into the "
                                         "committed results")
    ig.add_argument("paths", nargs="+", help="the device tool's files_at folder, a .tgz, or a folder of results")
    ig.add_argument("--tag", default="", help="the call's tag: its size_sweep.log lands as size_sweep_<tag>.log")
    s = verbs.add_parser("summarize", help="summary.json and the plot from the committed runs")
    s.add_argument("--results", default="", help=f"default {RESULTS} ({ONE_PASS} with --one-pass)")
    pe = verbs.add_parser("penalty", help="penalty.json and penalty.png: each compressed row's penalty against "
                                          "k/d and k, beside the paper's (issue 57, item 2)")
    pe.add_argument("--results", default="", help="default: the regime's folder")
    for verb in (pl, r, fl):
        verb.add_argument("--set", choices=SETS, default="sweep",
                          help="which rows: the size sweep's own (sweep), or issue 57's item 2 (penalty: "
                               + "; ".join(f"{m} {', '.join(v)}" for m, v in PENALTY_ROWS.items())
                               + f", at SparseLoCo's tuned lr, seeds {PENALTY_SEEDS}; {PENALTY_REGIME} only)")
    for verb in (pl, r, s, pe):
        verb.add_argument("--one-pass", action="store_true",
                          help="the regime without repetition: every row within one pass over the corpus "
                               f"(results under {os.path.relpath(ONE_PASS, HERE)})")
        verb.add_argument("--micro", type=int, default=MICRO,
                          help=f"sequences a replica micro-batch (default {MICRO}; {GAS} a step): the same tokens "
                               "in more replica steps, so more outer syncs (results under .../micro<N>/)")
    args = p.parse_args(argv)
    if hasattr(args, "micro") and (args.micro < 1 or EVAL_SEQS % args.micro):
        raise SystemExit(f"size_sweep: --micro {args.micro}: must divide the {EVAL_SEQS} held-out sequences every "
                         "regime validates on")
    if getattr(args, "resume_only", False) and args.whole_rows:
        raise SystemExit("size_sweep: --resume-only continues saved rows and --whole-rows saves none: give one")
    return {"plan": plan, "run": run, "fill": fill, "ingest": ingest, "summarize": summarize,
            "penalty": penalty}[args.verb](args)


if __name__ == "__main__":
    sys.exit(main())
