"""Robust outer sync (issue 58, item 3): one of M replicas sends corrupted payloads from the first outer
step; does `sparseloco.screen: "agreement"` keep the model where the honest replicas alone take it, and
what does the screen cost when nobody attacks?

    python bench/robust_outer.py --out $OUT/robust_outer.json              # the issue's size: 20M, M = 4, GPU
    python bench/robust_outer.py --shape tiny --vocab 2048 --device cpu ...  # what a CPU affords (README row)
    python bench/robust_outer.py --cpu-smoke --out /tmp/robust_outer.json  # tiny, 3 outer steps, 4 rows

Rows, each trained by the batched simulator (`sim.rows.simulate_variant`: the outer step is the
engine's StageAlgorithm) for the same steps, corpus, seed and settings:

    honest_alone     M replicas, the last one absent from every outer step (sparseloco/attacks.py
                     "absent": its payload marked non-finite): the M - 1 honest replicas alone, on
                     exactly the data shards they train on beside an attacker. The reference
    honest_alone_separate  a run of M - 1 replicas (their data shards cut M - 1 ways): how far a
                     run of the same size moves with other data alone
    clean            M honest replicas, no screen
    clean_screen     M honest replicas, screen on: does it drop an honest one, does it change the loss
    <attack>_screen  replica M - 1 corrupts every payload it sends (sparseloco/attacks.py: flip, scale,
                     noise, constant), screen on
    <attack>         the same without the screen: what the attack does unchecked (--unscreened)
    het_clean_screen M honest replicas, the last M // 2 compressing their stage boundaries at
                     --het-ratio (the paper's Het), screen on: does it take them for outliers
                     (--het-ratio > 1)

The attack is injected after the payloads are gathered (sim/core.py, `Variant.attack`), so every
replica, the attacker too, receives the corrupted bytes, as from a peer; the attacker's own state is
honest. Every other setting is the config's default (`sparseloco.aggregation`, `norm_clip`, ...),
or what --sparseloco sets.

Written to --out, after every row ("status" "partial" until the last): "card" (the GPU's name, or
"cpu" with the CPU's), "command", "settings" (and the screen's thresholds), "rows", "verdict".
Per row:
    val_loss                      held-out loss after the last sync, mean over the replicas
    delta_pct_vs_honest_alone     100 (val_loss - honest_alone's) / honest_alone's (and _separate's)
    final_train_loss, outer_steps, seconds, outer_seconds (the row's time in outer steps)
    stage_decisions               outer steps x stages: the screen decides per stage payload
    judged_by_agreement           decisions whose median agreement reached the screen's
                                  min_median_agreement (where failing to agree is enough to be dropped)
    median_agreement_range        the smallest and largest median agreement of a decision
    attacker_screened             decisions that dropped the attacker
    false_positives               decisions that dropped an honest replica (counted per replica)
    honest_min_agreement_ratio    the smallest honest replica's agreement / that decision's median
                                  agreement (the screen drops below its min_agreement_ratio), over
                                  decisions with a positive median
    honest_max_norm_ratio         the largest honest norm ratio seen (dropped above max_norm_ratio)
    attacker_max_agreement_ratio, attacker_min_norm_ratio   the attacker's closest approach
    screen_trace                  every decision: [outer step, stage, median agreement, screened,
                                  agreement by replica, norm ratio by replica]
With --resume, rows already in --out that this run would train alike are kept, not trained again.
The verdict: each attack contained (|delta_pct_vs_honest_alone| <= 1 with the screen), and
clean_screen's false positives and delta_pct_vs_clean.
With --outer-timing, "outer_step_seconds": one replica's `prepare` and `finish` of one stage of --shape
(the first of --stages, M payloads of a random pseudo-gradient, the run's sparseloco settings), finish
with the screen off and on, each the median of 5 after one warm-up; the screen's cost is the difference
of the two finishes (prepare, the top-k, is the same either way).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

ATTACKS = ("flip", "scale", "noise", "constant")
LIMIT_PCT = 1.0
ROW_SETTINGS = ("shape", "replicas", "stages", "steps", "inner_steps", "micro", "seq", "vocab", "data", "lr",
                "eval_batches", "seed", "sparseloco", "device", "compile")
"""What a row's training depends on: --resume keeps a row of --out only where these are the same
(and, for a screened row, the screen's thresholds)."""


def card(device: str) -> str:
    import torch

    if device.startswith("cuda"):
        return torch.cuda.get_device_name(0)
    return f"cpu ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"


def load(args):
    """(run config, LlamaConfig, corpus): --data's blocks (bench/make_corpus.py), else the stdlib corpus
    tokenized by the default tokenizer at --vocab (offline, what a CPU machine has)."""
    import torch

    from hetloco_ds import data
    from hetloco_ds.config import parse_config
    from hetloco_ds.data import Corpus
    from hetloco_ds.presets import model_config_for

    if args.data:
        blob = torch.load(args.data, weights_only=True)  # a corpus file: tensors and plain data, nothing run
        corpus = Corpus(train=blob["train"].to(torch.int32), val=blob["val"].to(torch.int32),
                        description=blob["description"], cache_path=args.data)
        vocab, seq = blob["vocab_size"], corpus.train.shape[1]
    else:
        tokenizer = data.default_tokenizer(vocab_size=args.vocab)
        vocab, seq = len(tokenizer), args.seq
        corpus = data.load_corpus(None, tokenizer, seq, progress=False)
    run = parse_config({
        "train_micro_batch_size_per_gpu": args.micro, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
        "bf16": {"enabled": args.device.startswith("cuda")},
        "optimizer": {"type": "AdamW", "params": {"lr": args.lr, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1}},
        "scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": args.steps,
                                                           "warmup_num_steps": max(1, args.steps // 20),
                                                           "warmup_min_ratio": 0.0, "cos_min_ratio": 0.1}},
        "hetloco": {"sparseloco": {"inner_steps": args.inner_steps, **args.sparseloco},
                    "train": {"seq_len": seq, "vocab_size": vocab, "eval_batches": args.eval_batches,
                              "seed": args.seed}}})
    llama = model_config_for(args.shape, vocab)
    llama.max_position_embeddings = max(llama.max_position_embeddings, seq)
    return run, llama, corpus


def variants(args) -> list[tuple[object, int]]:
    """(Variant, replicas) of every row asked for, in order."""
    from hetloco_ds.sim.rows import Variant

    M, rows = args.replicas, []
    screen = {"screen": "agreement"}
    rows.append((Variant("honest_alone", seed=args.seed, attack="absent"), M))
    rows.append((Variant("honest_alone_separate", seed=args.seed), M - 1))
    rows.append((Variant("clean", seed=args.seed), M))
    rows.append((Variant("clean_screen", seed=args.seed, sparseloco=screen), M))
    for attack in (a for a in args.attacks if a != "absent"):
        rows.append((Variant(f"{attack}_screen", seed=args.seed, sparseloco=screen, attack=attack), M))
        if args.unscreened:
            rows.append((Variant(attack, seed=args.seed, attack=attack), M))
    if args.het_ratio > 1:
        rows.append((Variant("het_clean_screen", seed=args.seed, sparseloco=screen, ratio=args.het_ratio,
                             compressed=M // 2), M))
    return [(v, m) for v, m in rows if not args.rows or v.name in args.rows]


def outer_timing(args, run, llama) -> dict:
    """Seconds of one replica's `finish` over M gathered payloads of stage 0, screen off and on."""
    import statistics

    import torch

    from hetloco_ds import plan
    from hetloco_ds.sparseloco.outer import SparseLoCoState

    shapes = [s for _, s in plan.stage_tensors(plan.ModelShape.preset(args.shape, vocab=llama.vocab_size), args.stages)[0]]
    device = torch.device(args.device)
    out = {"tensors": len(shapes), "parameters": sum(torch.Size(s).numel() for s in shapes)}
    for screen in ("none", "agreement"):
        cfg = run.hetloco.sparseloco.model_copy(update={"screen": screen})
        g = torch.Generator().manual_seed(0)
        theta = [torch.randn(s, generator=g).to(device) for s in shapes]
        params = [[t.clone() for t in theta] for _ in range(args.replicas)]
        states = [SparseLoCoState(p, cfg) for p in params]
        times, prepares = [], []
        for _ in range(6):
            for replica in params:
                for p in replica:
                    p.add_(torch.randn(p.shape, generator=g).to(device), alpha=1e-3)
            t0 = _synced(device)
            payloads = [states[0].prepare(params[0])]
            t1 = _synced(device)
            payloads += [s.prepare(p) for s, p in zip(states[1:], params[1:])]
            t2 = _synced(device)
            states[0].finish(params[0], payloads)
            times.append(_synced(device) - t2)
            prepares.append(t1 - t0)
            for s, p in zip(states[1:], params[1:]):
                s.finish(p, payloads)
        out[f"finish_screen_{screen}"] = statistics.median(times[1:])
        out["prepare"] = statistics.median(prepares[1:])
    return out


def _synced(device) -> float:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter()


def row_key(replicas: int, attack, screen: str, compressed: int) -> tuple:
    """What tells rows apart within one run's settings (a kept row is found by it, not by its name)."""
    return replicas, attack, screen, compressed


def reusable(path: str, settings: dict) -> dict:
    """The rows of an earlier run at `path` that this run would train alike (`ROW_SETTINGS`), by `row_key`."""
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        old = json.load(f)
    if any(old["settings"].get(k) != settings[k] for k in ROW_SETTINGS):
        return {}
    same_screen = old["settings"].get("screen_thresholds") == settings["screen_thresholds"]
    return {row_key(r["replicas"], r["attack"], r["screen"], r.get("compressed", 0)): r
            for r in old["rows"].values() if r["screen"] == "none" or same_screen}


def screen_trace(outer_rows: list[dict]) -> list[list]:
    """Every screen decision: [outer step, stage, median agreement, screened, agreement by replica,
    norm ratio by replica], rounded."""
    trace = []
    for row in outer_rows:
        for stage, d in sorted(row.get("screen", {}).items()):
            agreement = [round(d["agreement"][m], 3) for m in sorted(d["agreement"], key=int)]
            trace.append([row["outer_step"], int(stage.removeprefix("stage")),
                          round(sorted(agreement)[(len(agreement) - 1) // 2], 3), d["screened"], agreement,
                          [round(d["norm_ratio"][m], 4) for m in sorted(d["norm_ratio"], key=int)]])
    return trace


def screen_facts(outer_rows: list[dict], attacker: int | None) -> dict:
    """What the row's outer steps say of the screen's decisions (the module docstring's fields)."""
    from hetloco_ds.sparseloco.aggregate import SCREENS

    floor = SCREENS["agreement"].min_median_agreement
    facts = {"stage_decisions": 0, "attacker_screened": 0, "false_positives": 0, "judged_by_agreement": 0}
    honest_agree, honest_norm, bad_agree, bad_norm, medians = [], [], [], [], []
    for row in outer_rows:
        for decision in row.get("screen", {}).values():
            facts["stage_decisions"] += 1
            screened = set(decision["screened"])
            facts["attacker_screened"] += attacker in screened
            facts["false_positives"] += len(screened - {attacker})
            agreement = {int(m): v for m, v in decision["agreement"].items()}
            norm = {int(m): v for m, v in decision["norm_ratio"].items()}
            median = sorted(agreement.values())[(len(agreement) - 1) // 2]
            medians.append(median)
            facts["judged_by_agreement"] += median >= floor
            for m in agreement:
                (bad_norm if m == attacker else honest_norm).append(norm[m])
                if median > 0:
                    (bad_agree if m == attacker else honest_agree).append(agreement[m] / median)
    if not facts["stage_decisions"]:
        return {}
    facts["median_agreement_range"] = [min(medians), max(medians)]
    facts["honest_min_agreement_ratio"] = min(honest_agree, default=None)
    facts["honest_max_norm_ratio"] = max(honest_norm, default=None)
    if attacker is not None:
        facts["attacker_max_agreement_ratio"] = max(bad_agree, default=None)
        facts["attacker_min_norm_ratio"] = min(bad_norm, default=None)
    return facts


def verdict(rows: dict) -> dict:
    ref = rows.get("honest_alone", {}).get("val_loss")
    out = {}
    for name, r in rows.items():
        for base in ("honest_alone", "honest_alone_separate"):
            b = rows.get(base, {}).get("val_loss")
            if b is not None:
                r[f"delta_pct_vs_{base}"] = 100.0 * (r["val_loss"] - b) / b
    for attack in ATTACKS:
        r = rows.get(f"{attack}_screen")
        if r is not None and ref is not None:
            out[f"{attack}_contained"] = abs(r["delta_pct_vs_honest_alone"]) <= LIMIT_PCT
    clean, screened = rows.get("clean"), rows.get("clean_screen")
    if screened is not None:
        out["clean_false_positives"] = screened.get("false_positives")
        if clean is not None:
            out["clean_screen_delta_pct_vs_clean"] = 100.0 * (screened["val_loss"] - clean["val_loss"]) / clean["val_loss"]
    return out


def add_corpus_args(p) -> None:
    """The corpus and schedule options `load` and the rows read, shared with optimizer_state.py."""
    p.add_argument("--seq", type=int, default=256, help="tokens a sequence (without --data)")
    p.add_argument("--vocab", type=int, default=8192, help="default tokenizer's vocabulary (without --data)")
    p.add_argument("--data", default="", help="bench/make_corpus.py's blocks instead of the stdlib corpus")
    p.add_argument("--lr", type=float, default=2e-3, help="inner AdamW lr (warmup 5%%, cosine to 10%%)")
    p.add_argument("--eval-batches", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)


def add_run_args(p) -> None:
    """The options a bench of batched-simulator rows written to one resumable JSON takes (this one and
    optimizer_state.py): where it runs, compiled or not, the JSON, and --resume."""
    p.add_argument("--device", default="cuda")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--compile", action="store_true", help="torch.compile the batched simulator's forward")
    p.add_argument("--out", required=True, help="the JSON to write")
    p.add_argument("--resume", action="store_true", help="keep the rows --out already holds for these settings")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="20M", help="model preset")
    p.add_argument("--replicas", type=int, default=4, help="M (the attacker is replica M - 1)")
    p.add_argument("--stages", type=int, default=2)
    p.add_argument("--steps", type=int, default=2000, help="inner steps a row (2000 at H = 20: 100 outer syncs)")
    p.add_argument("--inner-steps", type=int, default=20, help="H")
    p.add_argument("--micro", type=int, default=16, help="sequences a replica step")
    add_corpus_args(p)
    p.add_argument("--attacks", default=",".join(ATTACKS))
    p.add_argument("--unscreened", action="store_true", help="also each attack without the screen")
    p.add_argument("--het-ratio", type=int, default=0, help="> 1: add row het_clean_screen at this ratio")
    p.add_argument("--outer-timing", action="store_true", help="time the outer step with the screen off and on")
    p.add_argument("--rows", default="", help="only these rows (comma-separated names)")
    p.add_argument("--sparseloco", default="{}", help="JSON of hetloco.sparseloco fields every row sets")
    add_run_args(p)
    p.add_argument("--cpu-smoke", action="store_true",
                   help="preset tiny, vocab 512, M 4 x S 2, H 2, 6 steps, micro 2 x seq 32, rows honest_alone, "
                        "clean_screen, scale_screen, scale, the outer-step timing, CPU, 1 thread")
    if "--cpu-smoke" in (sys.argv[1:] if argv is None else argv):  # defaults only: explicit flags win
        p.set_defaults(shape="tiny", vocab=512, stages=2, steps=6, inner_steps=2, micro=2, seq=32, eval_batches=1,
                       attacks="scale", unscreened=True, rows="honest_alone,clean_screen,scale_screen,scale",
                       device="cpu", threads=1, outer_timing=True)
    args = p.parse_args(argv)
    args.attacks = [a for a in args.attacks.split(",") if a]
    args.rows = [r for r in args.rows.split(",") if r]
    args.sparseloco = json.loads(args.sparseloco)
    if args.replicas < 3:
        raise SystemExit(f"robust_outer: --replicas {args.replicas}: the screen needs 3 or more replicas to decide")

    import torch

    from hetloco_ds.sim.rows import simulate_variant
    from hetloco_ds.sparseloco.aggregate import SCREENS

    if args.threads:
        torch.set_num_threads(args.threads)
    run, llama, corpus = load(args)
    device = torch.device(args.device)
    report = {"status": "partial", "card": card(args.device), "versions": {"torch": torch.__version__},
              "command": " ".join(shlex.quote(a) for a in [sys.executable] + (sys.argv if argv is None else ["robust_outer.py", *argv])),
              "settings": {**{k: v for k, v in vars(args).items() if k != "cpu_smoke"},
                           "sparseloco_section": run.hetloco.sparseloco.model_dump(),
                           "screen_thresholds": repr(SCREENS["agreement"]), "corpus": corpus.description},
              "rows": {}, "verdict": {}}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    kept = reusable(args.out, report["settings"]) if args.resume else {}
    if args.outer_timing:
        report["outer_step_seconds"] = outer_timing(args, run, llama)
        print(f"[robust_outer] outer step {json.dumps(report['outer_step_seconds'])}", flush=True)
    for v, replicas in variants(args):
        key = row_key(replicas, v.attack, v.sparseloco.get("screen", "none"), v.compressed)
        if key in kept:
            report["rows"][v.name] = kept[key]
            print(f"[robust_outer] {v.name}: kept from {args.out}", flush=True)
            continue
        t0 = time.perf_counter()
        r = simulate_variant(run, v, llama, corpus, replicas, args.stages, args.steps, device, progress=False,
                             compile=args.compile)
        attacker = replicas - 1 if v.attack else None
        row = {"replicas": replicas, "attack": v.attack, "attacker": attacker, "screen": v.sparseloco.get("screen", "none"),
               "compressed": v.compressed, "ratio": v.ratio,
               "val_loss": r["val_loss"], "final_train_loss": r["final_train_loss"], "outer_steps": r["outer_steps"],
               "diverged_at_step": r.get("diverged_at_step"), "seconds": round(time.perf_counter() - t0, 1),
               "outer_seconds": r["seconds_by_phase"]["outer"],
               **screen_facts(r["outer"], attacker), "screen_trace": screen_trace(r["outer"])}
        report["rows"][v.name] = row
        report["verdict"] = verdict(report["rows"])
        print(f"[robust_outer] {v.name}: val {row['val_loss']:.4f}, "
              f"delta vs honest_alone {row.get('delta_pct_vs_honest_alone', float('nan')):+.2f}%, "
              f"screened attacker {row.get('attacker_screened')}/{row.get('stage_decisions')}, "
              f"false positives {row.get('false_positives')}, {row['seconds']} s", flush=True)
        with open(args.out + ".tmp", "w") as f:
            json.dump(report, f, indent=1)
        os.replace(args.out + ".tmp", args.out)
    report["status"], report["verdict"] = "done", verdict(report["rows"])
    with open(args.out + ".tmp", "w") as f:
        json.dump(report, f, indent=1)
    os.replace(args.out + ".tmp", args.out)
    print(f"[robust_outer] verdict {json.dumps(report['verdict'])}; wrote {args.out}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
