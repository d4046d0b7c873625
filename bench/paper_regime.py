"""The paper's own regime at 178M (issue 57, item 3), and the fidelity table that sets ours beside the paper's.

Table 9's 178M shape (9 layers, d 1024, 8 heads; vocabulary 8192, our corpus's tokenizer, not the
paper's 32K, so 128.9M parameters), seq 2048, 32 sequences a replica step (micro-batch 8 x 4
accumulated: the batched simulator holds every replica's micro-batch at once), M = 8 x S = 4,
H = 50, so 524,288 tokens a global step as in the paper; warm-up 500 steps, then cosine (to 0.1 of
the peak, as every bench row); 1000 steps (20 syncs), validation every 100 steps on 128 held-out
sequences a replica. Rows (ROWS), one seed: SparseLoCo at inner lr 1e-3 (Table 9), PP-Compress
and Het-PP-Compress at 1/8 with the baseline's lr (Table 1's unstarred rows), AdamW DDP (H = 1)
at 3e-4 on the same global batch (Table 9), and DiLoCo (dense, Nesterov outer step, the size
sweep's) at 1e-3. Every row runs the method as it stands since issue 57.

A row is a chain of calls of one machine: `run` builds the seq-2048 corpus where the machine has
none, trains the row until its budget and saves it (paper_tables.py --state-dir) at its last
outer-step boundary; `run --resume-only`, sent the moment the last call returns, goes on. The
saved state is 12 to 21 GB (`plan`), so it can never come back from the device: a row ends within
the one machine's life, and each call's JSON carries the validation curve the row reached.

    python bench/paper_regime.py plan [--s-per-step X]      # steps, GPU-minutes, what fits a session
    OUT=$OUT bash bench/gpu.sh --gpus 1 --timeout 590 paper_regime.py run --row sparseloco --budget-s 570 --tag s1a
    OUT=$OUT bash bench/gpu.sh --gpus 1 --timeout 590 paper_regime.py run --row sparseloco --budget-s 570 --tag s1b --resume-only
    python bench/paper_regime.py run --row het:8 --cpu-smoke --out /tmp/regime   # the same path on a CPU, tiny
    python bench/paper_regime.py fidelity                   # fidelity.json and the README's table
"""
from __future__ import annotations

import argparse
import glob
import json
import math
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

import size_sweep  # noqa: E402
import summarize_tables  # noqa: E402

RESULTS = os.path.join(HERE, "results", "paper_regime")
MODELS = {"178M": "178M", "178M_emb1": os.path.join(HERE, "models", "178M_emb1.json")}
"""Name -> what paper_tables trains: the preset (our torch init) and the same shape with the token
embedding drawn N(0, 1) as the authors' TorchTitan model draws it (issue 57 item 4: at 20M that init
took PP 1/8's penalty from +16.3% to +3.2%, init_ablation/summary_20m_h200.json)."""
REPLICAS, STAGES, H, SEQ = 8, 4, 50, 2048
MICRO, GAS = 8, 4  # 32 sequences a replica step
STEPS, WARMUP, VAL_EVERY, EVAL_BATCHES = 1000, 500, 100, 16
SPARSELOCO_LR, ADAMW_LR = 1e-3, 3e-4  # Table 9
ROWS = {"sparseloco": f"sparseloco:lr={SPARSELOCO_LR:g}", "pp:8": f"pp:8:lr={SPARSELOCO_LR:g}",
        "het:8": f"het:8:lr={SPARSELOCO_LR:g}", "adamw": f"adamw:lr={ADAMW_LR:g}",
        "diloco": f"{size_sweep.DILOCO}:lr={SPARSELOCO_LR:g}"}
# What the estimates in `plan` stand on, each from a committed file:
# the compiled batched simulator, 8 replicas of 105M on one H200 (MFU by 6N + 12 L d seq a token)
TIMED = os.path.join(HERE, "results", "sim_throughput_105M_m8_h200", "sim_throughput_105M_m8_{}_h200.json")
# a 105M row on two H200s together: AdamW 1e-3 and 4e-3 (call s52c), compile, validation and resumes in
TWO_GPU_ROWS = os.path.join(size_sweep.RESULTS, "105M", "paper_tables_s52c_g*p0.json")
CORPUS_S = 58  # the seq-256 corpus build on one H200 (size_sweep/60M/size_sweep_s54ab.log); the same text
SESSION_S = 1500  # about 25 usable device-minutes a session
CALL_BUDGET_S = 570  # paper_tables' budget in a call of gpu.sh --timeout 590 (the device's limit is 600)


def width(model: str) -> int:
    from hetloco_ds.presets import model_config_for

    return model_config_for(MODELS.get(model, model), 8192).hidden_size


def n_params(model: str = "178M", vocab: int = 8192) -> int:
    import paper_tables
    from hetloco_ds.presets import model_config_for

    return paper_tables.n_params(model_config_for(MODELS.get(model, model), vocab))


def flops_per_step(model: str = "178M", vocab: int = 8192, seq: int = SEQ, tokens: int = REPLICAS * MICRO * GAS * SEQ) -> float:
    """Training FLOPs of one global step (paper_tables.row_flops' convention, 6 N + 12 L d seq a token)."""
    from hetloco_ds.presets import model_config_for

    llama = model_config_for(MODELS.get(model, model), vocab)
    return (6 * n_params(model, vocab) + 12 * llama.num_hidden_layers * llama.hidden_size * seq) * tokens


def estimate(model: str = "178M") -> dict:
    """Seconds a step of a row on one H200 and on two, and its saved state's bytes, from committed
    measurements (TIMED, TWO_GPU_ROWS) scaled by FLOPs and parameters."""
    import paper_tables

    timed = {}
    for variant in ("sparseloco", "adamw"):
        with open(TIMED.format(variant)) as f:
            timed[variant] = json.load(f)["results"][0]
    mfu = timed["sparseloco"]["mfu"]
    step = flops_per_step(model) / (paper_tables.PEAK_FLOPS * mfu)
    outer = timed["sparseloco"]["outer_step_s_median"] * n_params(model) / timed["sparseloco"]["n_params"]
    two = []
    for path in sorted(glob.glob(TWO_GPU_ROWS)):
        with open(path) as f:
            doc = json.load(f)
        two += [r["seconds"] / r["steps"] for r in doc["rows"] if doc.get("gpus_per_row") == 2]
    # both sides AdamW, so no outer step on either: one GPU's step against two GPUs' whole row
    speedup = timed["adamw"]["step_s_median"] / (sum(two) / len(two))
    n = n_params(model)
    eval_tokens = REPLICAS * EVAL_BATCHES * MICRO * SEQ  # a validation: the forward, a third of a step's FLOPs a token
    validation = flops_per_step(model, tokens=eval_tokens) / 3 / (paper_tables.PEAK_FLOPS * mfu)
    return {"model": model, "n_params": n, "mfu_105m": mfu, "s_per_step_1gpu": step, "validation_s": validation,
            "outer_step_s": outer, "s_per_step_2gpu": step / speedup, "two_gpu_speedup_105m": speedup,
            "compile_s": timed["sparseloco"]["warmup_s_all"][0],
            # fp32 weights and AdamW's two moments a replica, SparseLoCo's theta_prev and error buffer beside them
            "state_bytes": {"adamw": 12 * n * REPLICAS, "sparseloco": 20 * n * REPLICAS}}


def per_step(e: dict, s_per_step: float) -> float:
    """A step's seconds with its share of the outer steps and validations (`estimate`'s)."""
    return s_per_step + e["outer_step_s"] / H + e["validation_s"] * s_per_step / e["s_per_step_1gpu"] / VAL_EVERY


def session_steps(s_per_step: float, compile_s: float, calls: int, first_call_corpus: bool = True) -> int:
    """Steps a row reaches in one session's SESSION_S of calls of CALL_BUDGET_S at `s_per_step`
    (`per_step`'s): each call compiles and keeps paper_tables' 60 s margin to save; the first builds
    the corpus. Whole outer steps."""
    import paper_tables

    margin = paper_tables.row_margin_s("state")
    left = SESSION_S
    steps = 0.0
    for call in range(calls):
        budget = min(CALL_BUDGET_S, left)
        left -= budget
        budget -= compile_s + margin + (CORPUS_S if call == 0 and first_call_corpus else 0)
        steps += max(0.0, budget) / s_per_step
    return int(steps // H * H)


def plan(args) -> int:
    """A row's size, tokens, passes and device time; whether it fits a session; its state's size."""
    e = estimate(args.model)
    corpus = size_sweep.corpus_tokens()
    tokens = REPLICAS * MICRO * GAS * SEQ
    print(f"{args.model} (Table 9 shape, vocab 8192): {e['n_params'] / 1e6:.1f}M parameters; {tokens:,} tokens a step "
          f"({REPLICAS} x {MICRO * GAS} x {SEQ}); {STEPS} steps = {STEPS // H} syncs = {STEPS * tokens / 1e6:.1f}M tokens, "
          f"{STEPS * tokens / corpus:.2f} passes over the {corpus / 1e6:.1f}M-token corpus (one pass: {corpus / tokens:.1f} "
          "steps; validation points after it have seen repeated tokens)")
    s1 = args.s_per_step or e["s_per_step_1gpu"]
    how = "given" if args.s_per_step else (f"FLOPs at the {100 * e['mfu_105m']:.1f}% MFU of 105M's 8 replicas on one "
                                           "H200, sim_throughput_105M_m8_h200/")
    print(f"one H200: {s1:.3f} s a step ({how}); outer step {e['outer_step_s']:.2f} s ({STEPS // H} of them); "
          f"validation {e['validation_s']:.1f} s ({STEPS // VAL_EVERY}); compile {e['compile_s']:.0f} s a call; "
          f"corpus {CORPUS_S} s on a fresh machine")
    row_s = STEPS * per_step(e, s1)
    print(f"  a {STEPS}-step row: {row_s:.0f} s of steps, syncs and validations ({row_s / 60:.1f} GPU-minutes), "
          f"against a session's ~{SESSION_S} s; in one session's calls it reaches about step "
          f"{session_steps(per_step(e, s1), e['compile_s'], 3)}")
    s2 = s1 / e["two_gpu_speedup_105m"]
    row2 = STEPS * per_step(e, s2)
    print(f"two H200s (--gpus-per-row 2; {e['two_gpu_speedup_105m']:.2f}x, 105M's rows on two against one): "
          f"{s2:.3f} s a step, {row2:.0f} s a row, about step {session_steps(per_step(e, s2), e['compile_s'], 3)} "
          "in a session")
    print("saved state of a row (8 replicas): " + ", ".join(f"{k} {v / 1e9:.1f} GB" for k, v in e["state_bytes"].items())
          + "; the device returns 16 MB a file and 64 MB a call, so a row never leaves its machine")
    for label, key in (("SparseLoCo, PP, Het, DiLoCo", "sparseloco"), ("AdamW", "adamw")):
        print(f"  {label}: {e['state_bytes'][key] / 16e6:.0f}x one file's limit")
    return 0


def row_argv(args, row: str, data: str, out: str, state: str) -> list[str]:
    """paper_tables.py's options for `row` of the paper regime (the --cpu-smoke ones on the CPU)."""
    if args.cpu_smoke:  # paper_tables' tiny model and schedule (M = 2 x S = 2, H = 1), the row's own flags
        return ["--data", data, "--cpu-smoke", "--rows", ROWS[row], "--steps", "3", "--warmup-steps", "1",
                "--val-every", "1", "--budget-s", str(args.budget_s), "--state-dir", state, "--tag", args.tag,
                "--out", out] + (["--resume-only"] if args.resume_only else [])
    return ["--data", data, "--model", MODELS[args.model], "--steps", str(STEPS), "--warmup-steps", str(WARMUP),
            "--replicas", str(REPLICAS), "--stages", str(STAGES), "--inner-steps", str(H), "--micro", str(args.micro),
            "--gas", str(MICRO * GAS // args.micro), "--lr", f"{SPARSELOCO_LR:g}", "--rows", ROWS[row], "--seeds", "0",
            "--compile", "--budget-s", str(args.budget_s), "--val-every", str(VAL_EVERY),
            "--eval-batches", str(EVAL_BATCHES * MICRO // args.micro), "--state-dir", state, "--tag", args.tag,
            "--out", out] + (["--resume-only"] if args.resume_only else []) + \
        (["--gpus-per-row", str(args.gpus_per_row)] if args.gpus_per_row > 1 else [])


def run(args) -> int:
    """One row of the regime through paper_tables, saved at the budget and resumed by the next call."""
    import paper_tables

    if (MICRO * GAS) % args.micro:
        raise SystemExit(f"paper_regime: --micro {args.micro} must divide the {MICRO * GAS} sequences a replica step")
    out = os.path.join(args.out, args.model)
    state = os.path.join(args.state_dir, args.model)
    if args.resume_only and not paper_tables.resumable(state):
        print(f"paper_regime: --resume-only: nothing saved under {state}/ (a machine lent afresh): nothing to resume",
              flush=True)
        return 0
    if args.cpu_smoke:
        data = size_sweep.smoke_corpus(os.path.join(args.out, "smoke_corpus.pt"))
    else:
        data = args.data
        size_sweep.ensure_corpus(args, SEQ)
    done = os.path.join(RESULTS, args.model)
    return paper_tables.main(row_argv(args, args.row, data, out, state)
                             + (["--skip-done", done] if os.path.isdir(done) and not args.cpu_smoke else []))


def curves(folder: str) -> dict[str, dict]:
    """Each row's validation curve in a folder of the regime's run JSONs: a finished row's, else the
    longest an unfinished entry brought back. {row without its seed: {"curve", "finished", "steps"}}."""
    out: dict[str, dict] = {}
    for path in summarize_tables.input_files([folder]) if os.path.isdir(folder) else []:
        with open(path) as f:
            doc = json.load(f)
        for r in doc["rows"]:
            out[r["variant"]["name"].split("@")[0]] = {"curve": r["val_curve"], "finished": True, "steps": r["steps"]}
        for u in doc.get("unfinished", []):
            name = u["row"].split("@")[0]
            have = out.get(name)
            if u.get("val_curve") and not (have and (have["finished"] or len(have["curve"]) >= len(u["val_curve"]))):
                out[name] = {"curve": u["val_curve"], "finished": False, "steps": u["steps"]}
    return out


def at_matched_step(by_row: dict[str, dict]) -> tuple[int | None, dict[str, float]]:
    """The largest validation step every row reached, and each row's loss there."""
    steps = [{p["step"] for p in c["curve"]} for c in by_row.values()]
    shared = set.intersection(*steps) if steps else set()
    if not shared:
        return None, {}
    step = max(shared)
    return step, {name: next(p["loss"] for p in c["curve"] if p["step"] == step) for name, c in by_row.items()}


def pct(x: float | None, base: float | None) -> float | None:
    return None if x is None or base is None else 100 * (x - base) / base


def size_sweep_points() -> list[dict]:
    """20M and 105M in the penalty regime (size_sweep.PENALTY_REGIME): each penalty row run under
    issue 57's method at SparseLoCo's tuned lr (size_sweep.penalties; none before), and SparseLoCo's
    and DiLoCo's final gaps to the tuned AdamW (size_sweep.gaps), all at the same steps."""
    folder = os.path.join(size_sweep.RESULTS, size_sweep.PENALTY_REGIME)
    pens = [p for p in size_sweep.penalties(folder) if p["method"] == "issue 57" and p["at_tuned_sparseloco_lr"]]
    rows = []
    for model in size_sweep.PENALTY_ROWS:
        loaded = size_sweep.load_size(model, folder)
        rows += size_sweep.summary_rows(model, *loaded) if loaded else []
    gap = {(g["model"], g["mode"]): g for g in size_sweep.gaps(rows)}
    out = []
    for model in size_sweep.PENALTY_ROWS:
        syncs = next((r["outer_steps"] for r in rows if r["model"] == model and r["mode"] == "sparseloco"), None)
        mine = [p for p in pens if p["model"] == model]
        seeds = sorted({s for p in mine for s in p["seeds"]})
        sl_gap = gap.get((model, "sparseloco"))
        point = {"size": model, "d": width(model),
                 # the penalties and the gaps to AdamW can rest on different seeds, so each says its own
                 "regime": f"{size_sweep.regime_name(True, 8)}, {syncs} syncs, final"
                           + (f", penalties on seeds {','.join(map(str, seeds))}" if seeds else "")
                           + (f", gaps on seeds {','.join(map(str, sl_gap['seeds']))}" if sl_gap else ""),
                 "penalty_pct": {p["row"].split(":lr=")[0]: p["penalty_pct"] for p in mine},
                 "seeds": {p["row"].split(":lr=")[0]: p["seeds"] for p in mine}}
        for mode in ("sparseloco", "diloco"):
            g = gap.get((model, mode))
            point[f"{mode}_minus_adamw_pct"] = g and g["gap_pct"]
        out.append(point)
    return out


INIT_ABLATIONS = {
    # bench/init_ablation.py's summaries: what each model config is called, and the regime its rows ran in
    os.path.join(HERE, "results", "init_ablation", "summary_20m_h200.json"): (
        {"20M_emb1": "20M, embedding N(0, 1)", "20M_torchtitan": "20M, TorchTitan's init"}, "as 20M's row above"),
    os.path.join(HERE, "results", "init_ablation", "summary_tiny_cpu.json"): (
        {"tiny_emb0.02": "tiny, embedding N(0, 0.02)", "tiny_emb1.0": "tiny, embedding N(0, 1)",
         "tiny_torchtitan": "tiny, TorchTitan's init"},
        "CPU: M = 4 x S = 2, H = 10, 1,024 tokens a replica step, 400 steps, inner lr 2e-3 (not tuned)"),
}


def init_ablation_points(*paths: str) -> list[dict]:
    """The penalty rows under another init (bench/init_ablation.py's summaries; by default every one
    in INIT_ABLATIONS), each against its own init's uncompressed row, as the mean over its seeds."""
    out = []
    for path in paths or tuple(INIT_ABLATIONS):
        if not os.path.exists(path):
            continue
        labels, regime = INIT_ABLATIONS[os.path.abspath(path)]
        with open(path) as f:
            doc = json.load(f)
        rows = [r for r in doc["rows"] if r["model"].endswith(".json")]
        for model in sorted({r["model"] for r in rows}):
            mine = [r for r in rows if r["model"] == model]
            means = [o for o in doc["over_seeds"] if o["model"] == model]
            seeds = sorted({r["seed"] for r in mine})
            name = os.path.splitext(os.path.basename(model))[0]
            out.append({"size": labels.get(name, name), "d": width(os.path.join(os.path.dirname(HERE), model)),
                        "regime": f"{regime}, {max(r['outer_steps'] for r in mine)} syncs, final, "
                                  + ("seeds " if len(seeds) == 1 else "mean of seeds ") + ",".join(map(str, seeds)),
                        "penalty_pct": {o["row"].split(":lr=")[0]: o["penalty_pct_mean"] for o in means},
                        "seeds": {o["row"].split(":lr=")[0]: o["seeds"] for o in means},
                        "sparseloco_minus_adamw_pct": None, "diloco_minus_adamw_pct": None})
    return out


def regime_point(model: str, folder: str) -> dict | None:
    """`model` in the paper's regime: the penalties and gaps to AdamW at the largest validation step
    every row reached (its steps and which rows finished said beside)."""
    by_row = curves(folder)
    names = {key: ROWS[key] for key in ROWS}
    have = {key: by_row[name] for key, name in names.items() if name in by_row}
    if "sparseloco" not in have:
        return None
    step, loss = at_matched_step(have)
    base = loss.get("sparseloco")
    return {"size": model, "d": width(model),
            "regime": f"paper regime (seq {SEQ}, 512K tokens a step), step {step} of {STEPS}, seed 0",
            "step": step, "rows": {k: {"finished": v["finished"], "last_step": v["curve"][-1]["step"]} for k, v in have.items()},
            "loss": loss, "penalty_pct": {k: pct(loss[k], base) for k in ("pp:8", "het:8") if k in loss},
            "seeds": {k: [0] for k in ("pp:8", "het:8") if k in loss},
            "sparseloco_minus_adamw_pct": pct(base, loss.get("adamw")),
            "diloco_minus_adamw_pct": pct(loss.get("diloco"), loss.get("adamw"))}


def paper_points() -> list[dict]:
    t1 = summarize_tables.PAPER_TABLE1_LOSS
    t2 = summarize_tables.PAPER_TABLE2_PCT
    return [{"size": "paper 178M", "d": 1024, "regime": "DCLM, 5.8K steps, 116 syncs (Table 1)",
             "penalty_pct": {k: pct(t1["178M"][k], t1["178M"]["sparseloco"]) for k in ("pp:8", "het:8")},
             "sparseloco_minus_adamw_pct": None, "diloco_minus_adamw_pct": None},
            {"size": "paper 512M", "d": 1536, "regime": "DCLM, 19.5K steps, 391 syncs (Tables 1, 2, 4; AdamW's H = 1)",
             "penalty_pct": {**{f"{kind}:{ratio}": t2[kind][ratio] for kind in ("pp", "het") for ratio in (8, 96)},
                             **{k: summarize_tables.PAPER[k] for k in ("adamw-pp:8", "adamw-het:8")}},
             "sparseloco_minus_adamw_pct": pct(t1["512M"]["sparseloco"], t1["512M"]["adamw"]),
             "diloco_minus_adamw_pct": None}]


COLUMNS = ("pp:8", "het:8", "pp:96", "het:96", "pp:16", "adamw-pp:8", "adamw-het:8")


def fidelity(args) -> int:
    """fidelity.json and the README's table: each size's penalties and gaps to AdamW beside the paper's."""
    points = size_sweep_points() + init_ablation_points()
    for model in MODELS:
        got = regime_point(model, os.path.join(args.results, model))
        points.append(got or {"size": model, "d": width(model), "regime": "paper regime: not run yet", "penalty_pct": {},
                              "sparseloco_minus_adamw_pct": None, "diloco_minus_adamw_pct": None})
    points += paper_points()
    os.makedirs(args.results, exist_ok=True)
    with open(os.path.join(args.results, "fidelity.json"), "w") as f:
        json.dump({"points": points, "command": "python bench/paper_regime.py fidelity"}, f, indent=1)

    def cell(x: float | None) -> str:
        return "–" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:+.1f}%"

    names = {"pp": "PP-Compress", "het": "Het", "adamw-pp": "AdamW-PP", "adamw-het": "AdamW-Het"}
    print("| size (d) | regime | " + " | ".join(f"{names[c.split(':')[0]]} 1/{c.split(':')[1]}" for c in COLUMNS)
          + " | SparseLoCo - AdamW | DiLoCo - AdamW |")
    print("| --- " * (len(COLUMNS) + 4) + "|")
    for p in points:
        print(f"| {p['size']} ({p['d']}) | {p['regime']} | "
              + " | ".join(cell(p["penalty_pct"].get(c)) for c in COLUMNS)
              + f" | {cell(p['sparseloco_minus_adamw_pct'])} | {cell(p['diloco_minus_adamw_pct'])} |")
    print(f"wrote {os.path.relpath(os.path.join(args.results, 'fidelity.json'))}")
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    verbs = p.add_subparsers(dest="verb", required=True)
    pl = verbs.add_parser("plan", help="a row's steps, tokens, device time and saved state; what fits a session")
    pl.add_argument("--s-per-step", type=float, default=0.0, help="a measured pace on one H200 instead of the estimate")
    r = verbs.add_parser("run", help="one row, saved at the budget and resumed by the next call (--resume-only)")
    r.add_argument("--row", required=True, choices=list(ROWS))
    r.add_argument("--budget-s", type=float, default=CALL_BUDGET_S)
    r.add_argument("--resume-only", action="store_true",
                   help="continue the row an earlier call saved on this machine; on a machine lent afresh, end at once")
    r.add_argument("--gpus-per-row", type=int, default=1, help="GPUs that run the row together (2: about 1.5x)")
    r.add_argument("--micro", type=int, default=MICRO,
                   help=f"sequences a micro-batch; the accumulation makes up {MICRO * GAS} a replica step")
    r.add_argument("--tag", default="run", help="names the call's JSON: new every call of a chain")
    r.add_argument("--out", default=os.environ.get("OUT", "runs/paper_regime_out"))
    r.add_argument("--state-dir", default="runs/paper_regime_state")
    r.add_argument("--data", default=f"runs/paper_regime_corpus_seq{SEQ}.pt")
    r.add_argument("--tokenizer", default=".benchdata/tokenizer")
    r.add_argument("--roots", default="/opt/torch/.venv/lib/python3.12/site-packages,/usr/lib/python3.12,"
                                      "/usr/local/cuda/include")
    r.add_argument("--cpu-smoke", action="store_true",
                   help="the row's chain on the CPU: random tokens, paper_tables' tiny model, 3 steps")
    fi = verbs.add_parser("fidelity", help="fidelity.json and the README's table of ours beside the paper's")
    fi.add_argument("--results", default=RESULTS)
    for verb in (pl, r):
        verb.add_argument("--model", default="178M", choices=list(MODELS))
    args = p.parse_args(argv)
    return {"plan": plan, "run": run, "fidelity": fidelity}[args.verb](args)


if __name__ == "__main__":
    sys.exit(main())
