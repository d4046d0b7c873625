"""bench/summarize_tables.py's choice of each mode's tuned lr, which `paper_tables.py --lr-from` trains with."""
from __future__ import annotations

import importlib.util
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench"


def bench_module(name: str):
    """bench/NAME.py as a module (bench/ is scripts, not a package)."""
    spec = importlib.util.spec_from_file_location(f"{name}_bench", BENCH / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def flags(argv: list[str]) -> dict[str, str]:
    """An argv's options by name: each --flag and the value after it."""
    return {argv[i]: argv[i + 1] for i in range(len(argv) - 1) if argv[i].startswith("--")}


def add_row(folder: Path, like: str, name: str, dloss: float, into: Path | None = None, file: str = "") -> None:
    """A made-up row `name` in `into` (default `folder`; a file of its own, `file` or the next
    paper_tables_made_<n>_g0p0.json): the committed row `like` of `folder` renamed, its lr and seed
    read from the new name, its validation loss `dloss` above the original."""
    import json

    into = into or folder
    for f in sorted(folder.glob("paper_tables_*.json")):
        doc = json.loads(f.read_text())
        found = [r for r in doc["rows"] if r["variant"]["name"] == like]
        if found:
            r = found[0]
            r["variant"] = dict(r["variant"], name=name, lr=float(name.rsplit(":lr=")[1].split("@")[0]),
                                seed=int(name.split("@seed")[1]))
            r["val_loss"] += dloss
            doc["rows"], doc["unfinished"] = [r], []
            into.mkdir(parents=True, exist_ok=True)
            file = file or f"paper_tables_made_{len(list(into.glob('paper_tables_made_*')))}_g0p0.json"
            # aside, then renamed, as paper_tables writes: fill's other lane reads the folder meanwhile
            (into / f".{file}.part").write_text(json.dumps(doc))
            (into / f".{file}.part").replace(into / file)
            return
    raise AssertionError(f"no row {like} under {folder}")


def results_without(ss, tmp_path: Path, monkeypatch, drop: dict[str, list[str]]) -> Path:
    """size_sweep's committed results copied under tmp_path without the rows `drop` names (by
    "<regime>/<model>" folder, e.g. "one_pass/micro8/20M"), and `ss` reading the copy: a test
    of what is left to run then holds as later rows are committed."""
    import json
    import shutil

    copy = tmp_path / "results"
    shutil.copytree(ss.RESULTS, copy)
    for sub, names in drop.items():
        for f in (copy / sub).glob("paper_tables_*.json"):
            doc = json.loads(f.read_text())
            doc["rows"] = [r for r in doc["rows"] if r["variant"]["name"] not in names]
            if doc["rows"]:
                f.write_text(json.dumps(doc))
            else:
                f.unlink()
    monkeypatch.setattr(ss, "RESULTS", str(copy))
    monkeypatch.setattr(ss, "ONE_PASS", str(copy / "one_pass"))
    return copy


def _row(mode: str, lr: float, per_seed: dict[int, float], **extra) -> dict:
    return {"mode": mode, "lr": lr, "compressed_replicas": 0, "sparseloco": {}, "seeds": list(per_seed),
            "val_loss_per_seed": list(per_seed.values()),
            "val_loss_mean": sum(per_seed.values()) / len(per_seed), **extra}


def test_best_lr_compares_rows_on_the_seeds_they_all_ran():
    # The committed 5000-step sweep: 4e-3 beats 3e-3 on seed 0 (1.5723 vs 1.5745); its second seed
    # (1.5858) lifts its mean above 3e-3's single seed, which must not decide.
    st = bench_module("summarize_tables")
    rows = [_row("adamw", 2e-3, {0: 1.5827}), _row("adamw", 3e-3, {0: 1.5745}),
            _row("adamw", 4e-3, {0: 1.5723, 1: 1.5858}), _row("adamw", 6e-3, {0: 1.5882}),
            _row("sparseloco", 2e-3, {0: 1.7636, 1: 1.7586}), _row("sparseloco", 3e-3, {0: 1.7707}),
            # compressed rows and SparseLoCo variants are not candidates, however low their loss
            _row("adamw", 1e-2, {0: 1.0}, compressed_replicas=4),
            _row("sparseloco", 1e-2, {0: 1.0}, sparseloco={"aggregation": "mean"})]
    assert st.best_lr(rows) == {"adamw": {"lr": 4e-3, "seeds": [0]}, "sparseloco": {"lr": 2e-3, "seeds": [0]}}
    # a diverged lr listed first is the worst, not min()'s pick
    assert st.best_lr([_row("adamw", 8e-3, {0: float("nan")})] + rows)["adamw"]["lr"] == 4e-3


def test_best_lr_without_a_shared_seed_falls_back_to_each_rows_mean_and_lr_from_reads_both_forms(tmp_path):
    st, pt = bench_module("summarize_tables"), bench_module("paper_tables")
    rows = [_row("adamw", 3e-3, {0: 1.60}), _row("adamw", 4e-3, {1: 1.58, 2: 1.61})]
    best = st.best_lr(rows)
    assert best == {"adamw": {"lr": 4e-3, "seeds": None}}
    new, old = tmp_path / "new.json", tmp_path / "old.json"
    new.write_text('{"best_lr": {"adamw": {"lr": 0.004, "seeds": null}}}')
    old.write_text('{"best_lr": {"adamw": 0.002}}')  # summaries committed before the seeds were recorded
    assert pt.best_lrs(str(new)) == {"adamw": 0.004} and pt.best_lrs(str(old)) == {"adamw": 0.002}


def test_size_sweep_steps_give_each_size_the_same_tokens_per_parameter():
    ss = bench_module("size_sweep")
    for model, n in (("20M", 20453760), ("60M", 61208640), ("105M", 104614656)):
        steps, params = ss.steps_for(model)
        assert params == n
        tokens = steps * ss.REPLICAS * ss.MICRO * ss.GAS * ss.SEQ
        assert steps % ss.H == 0  # whole outer steps
        # at least the target, and less than one outer step of tokens above it
        assert ss.TOKENS_PER_PARAM * n <= tokens < ss.TOKENS_PER_PARAM * n + ss.H * tokens / steps
    assert ss.steps_for("20M")[0] == 1600 and ss.steps_for("105M")[0] == 8000


def test_one_pass_rows_stay_within_one_pass_over_the_corpus(tmp_path, monkeypatch):
    """--one-pass: every size gets the same whole outer steps, the most whose tokens fit in one pass
    over the committed rows' corpus; paper_tables refuses a corpus smaller than one outer step
    (naming the tokens) and --passes beside --tokens-per-param; `size_sweep run --one-pass` hands
    paper_tables --passes 1 (not --tokens-per-param), its own output and state folders, and the
    validation curve, for each size of a comma-separated --model in turn, an unknown size refused
    before anything runs. Breaks if a one-pass row could reach a token twice."""
    import json
    import shutil
    import sys

    import pytest

    ss = bench_module("size_sweep")
    pt = bench_module("paper_tables")
    # the micro-batch-8 brackets as they stood before SparseLoCo's lower lrs ran there (and so before
    # the seed 1s that wait on them), and 20M's at 10 tokens per parameter before SparseLoCo's 1e-3
    seed1 = ["sparseloco:lr=0.0005@seed1", "adamw:lr=0.001@seed1", f"{ss.DILOCO}:lr=0.002@seed1"]
    results_without(ss, tmp_path, monkeypatch, {
        **{f"one_pass/micro8/{m}": ["sparseloco:lr=0.0005@seed0", "sparseloco:lr=0.00025@seed0"] + seed1
           for m in ("20M", "60M")},
        "20M": ["sparseloco:lr=0.001@seed0", "sparseloco:lr=0.004@seed0"]})
    corpus = json.loads((Path(ss.RESULTS) / "summary.json").read_text())["settings"]["20M"]["corpus_train_tokens"]
    per_step = ss.REPLICAS * ss.MICRO * ss.GAS * ss.SEQ
    for model in ss.SIZES:
        steps, _ = ss.steps_for(model, one_pass=True)
        assert steps % ss.H == 0 and steps * per_step <= corpus < (steps + ss.H) * per_step
    assert ss.steps_for("105M", one_pass=True)[0] == 950
    small = type("A", (), {"replicas": 8, "micro": 32, "gas": 2, "inner_steps": 50})()
    with pytest.raises(SystemExit, match="--passes 1 of 1000 tokens"):
        pt.steps_for_passes(1.0, 1000, small, 256)
    data = tmp_path / "c.pt"
    data.write_bytes(b"")
    with pytest.raises(SystemExit, match="not both"):
        pt.main(["--data", str(data), "--passes", "1", "--tokens-per-param", "10", "--out", str(tmp_path)])

    calls = []
    monkeypatch.setitem(sys.modules, "paper_tables", type(sys)("paper_tables"))
    sys.modules["paper_tables"].main = lambda argv: calls.append(argv) or 0
    with pytest.raises(SystemExit, match="--model 20M,80M: 80M not among"):
        ss.main(["run", "--model", "20M,80M", "--data", str(data), "--out", str(tmp_path / "o")])
    assert calls == []
    assert ss.main(["run", "--model", "60M,20M", "--one-pass", "--data", str(data), "--out", str(tmp_path / "o")]) == 0
    assert len(calls) == 2  # the sizes in the order given, one budget
    # every bracket of both sizes is closed at one pass (SparseLoCo's 5e-4 at 60M and 4e-3 at 20M lost
    # to their best), so no further lr; at micro-batch 8 SparseLoCo's 1e-3 beat 2e-3 at both sizes, so
    # its 5e-4 comes after the bracketed rows, before DiLoCo
    bracketed = ["sparseloco:lr=0.002", "adamw:lr=0.002", "adamw:lr=0.004", "adamw:lr=0.001"]
    assert ss.main(["run", "--model", "60M,20M", "--one-pass", "--micro", "8", "--data", str(data),
                    "--out", str(tmp_path / "o")]) == 0
    for model, argv in zip(("60M", "20M"), calls[2:]):
        flag = flags(argv)
        assert flag["--rows"] == ",".join(bracketed + ["sparseloco:lr=0.0005", f"{ss.DILOCO}:lr=0.002"])
        assert flag["--micro"] == "8" and flag["--out"] == str(tmp_path / "o" / "one_pass" / "micro8" / model)
    del calls[2:]
    for model, argv in zip(("60M", "20M"), calls):
        flag = flags(argv)
        assert flag["--model"] == model and flag["--rows"] == ",".join(bracketed + [f"{ss.DILOCO}:lr=0.002"])
        assert flag["--passes"] == "1" and "--tokens-per-param" not in flag and flag["--val-every"] == str(ss.VAL_EVERY)
        assert flag["--out"] == str(tmp_path / "o" / "one_pass" / model)
        assert flag["--state-dir"] == f"runs/size_sweep_state_one_pass/{model}"
        assert flag.get("--skip-done", ss.ONE_PASS).startswith(ss.ONE_PASS) and 0 < float(flag["--budget-s"]) <= 500
    # --results: an earlier call's output on the same machine decides what is done and seed 1's rows
    done = tmp_path / "o" / "one_pass" / "20M"
    done.mkdir(parents=True)
    for f in (Path(ss.RESULTS) / "20M").glob("paper_tables_*.json"):
        shutil.copy(f, done)
    with pytest.raises(SystemExit, match=r"20M's lr bracket of sparseloco \(best so far lr=0.002, next lr=0.001\) "
                                         "is not complete"):
        ss.second_seed_rows("20M", str(tmp_path / "o" / "one_pass"))
    for lr in ("0.001", "0.004"):  # worse on either side: 2e-3 bracketed
        add_row(done, "sparseloco:lr=0.002@seed0", f"sparseloco:lr={lr}@seed0", +0.01)
    calls.clear()
    assert ss.main(["run", "--model", "20M", "--one-pass", "--seeds", "1", "--data", str(data),
                    "--out", str(tmp_path / "p"), "--results", str(tmp_path / "o" / "one_pass")]) == 0
    flag = flags(calls[0])
    assert flag["--skip-done"] == str(done) and flag["--seeds"] == "1"
    assert flag["--rows"] == ",".join(["sparseloco:lr=0.002", "adamw:lr=0.002", f"{ss.DILOCO}:lr=0.002"])
    with pytest.raises(SystemExit, match=r"60M's lr bracket of sparseloco \(best so far none\); adamw \(best so far "
                                         r"none\) is not complete"):  # the one-pass folder has none yet
        ss.main(["run", "--model", "60M", "--one-pass", "--seeds", "1", "--data", str(data),
                 "--out", str(tmp_path / "p"), "--results", str(tmp_path / "o" / "one_pass")])


def test_size_sweep_summary_of_the_committed_runs(tmp_path):
    """summary.json's rows and gaps, recomputed by hand from the committed 20M run JSONs."""
    import json
    import shutil

    ss = bench_module("size_sweep")
    shutil.copytree(Path(ss.RESULTS) / "20M", tmp_path / "20M")
    assert ss.main(["summarize", "--results", str(tmp_path)]) == 0
    doc = json.loads((tmp_path / "summary.json").read_text())
    assert (tmp_path / "size_sweep.png").stat().st_size > 10_000
    seed_rows = {}
    for f in sorted((tmp_path / "20M").glob("paper_tables_*.json")):
        for r in json.loads(f.read_text())["rows"]:
            seed_rows[r["variant"]["name"]] = r["val_loss"]
    by = {(r["mode"], r["lr"]): r for r in doc["rows"]}
    adamw = {lr: by[("adamw", lr)]["per_seed"][0] for lr in ss.ADAMW_LRS}
    best = min(adamw, key=adamw.get)
    assert [r["lr"] for r in doc["rows"] if r["mode"] == "adamw" and r["tuned"]] == [best]
    for r in doc["rows"]:
        assert set(r) >= {"mode", "model", "n_params", "val_loss_mean", "seeds", "per_seed", "outer_steps",
                          "tokens_per_param", "tokens_per_replica_step", "card"}
        # AdamW averages every step: no outer step
        assert r["card"].startswith("NVIDIA") and r["tokens_per_param"] >= 10
        assert r["outer_steps"] == (0 if r["mode"] == "adamw" else 1600 // ss.H)
    gap = next(g for g in doc["gaps"] if g["mode"] == "sparseloco")
    diffs = [seed_rows[f"sparseloco:lr=0.002@seed{s}"] - seed_rows[f"adamw:lr={best:g}@seed{s}"] for s in (0, 1)]
    assert gap["seeds"] == [0, 1] and abs(gap["gap_nats"] - sum(diffs) / 2) < 1e-12


def test_committed_size_sweep_summaries_rebuild_byte_for_byte_from_their_runs(tmp_path):
    """Each regime's committed summary.json is what `summarize` makes of the committed run JSONs
    today: a change to the summary code that is not followed by regenerating the summaries (or a
    summary edited by hand) fails here."""
    import shutil

    ss = bench_module("size_sweep")
    for one_pass, micro in ((False, ss.MICRO), (True, ss.MICRO), (True, 8)):
        folder = Path(ss.results_folder(one_pass, micro))
        copy = tmp_path / f"{int(one_pass)}_{micro}"
        for sub in (*ss.SIZES, "repeats"):
            if (folder / sub).is_dir():
                shutil.copytree(folder / sub, copy / sub)
        argv = ["summarize", "--results", str(copy)] + (["--one-pass"] if one_pass else []) + \
            ([] if micro == ss.MICRO else ["--micro", str(micro)])
        assert ss.main(argv) == 0
        assert (copy / "summary.json").read_bytes() == (folder / "summary.json").read_bytes(), folder


def test_only_a_modes_best_lr_inside_its_closed_bracket_is_tuned_never_a_compressed_or_diloco_row(tmp_path,
                                                                                                   monkeypatch):
    """`tuned` in the summary rows: SparseLoCo's and AdamW's best lr of a closed bracket on seed 0,
    nothing else. A compressed row run at SparseLoCo's tuned lr (5e-4 at 105M, micro-batch 8) and
    DiLoCo at its one lr are not tuned: they have no bracket of their own (the committed summaries
    marked both tuned until issue 57)."""
    ss = bench_module("size_sweep")
    copy = results_without(ss, tmp_path, monkeypatch, {})
    home = copy / "one_pass" / "micro8" / "105M"
    add_row(home, "pp:8:lr=0.002@seed0", "pp:8:lr=0.0005@seed0", -0.2)
    summary, meta = ss.load_size("105M", str(copy / "one_pass" / "micro8"))
    rows = ss.summary_rows("105M", summary, meta)
    assert sorted((r["mode"], r["lr"]) for r in rows if r["tuned"]) == [("adamw", 0.001), ("sparseloco", 0.0005)]
    assert {r["mode"] for r in rows if not r["tuned"]} >= {"pp:8", "het:8", "pp:96", "het:96", "diloco"}
    # an open bracket tunes nothing, not even its best lr so far
    opened = results_without(ss, tmp_path / "open", monkeypatch, {"one_pass/micro8/105M": ["sparseloco:lr=0.00025@seed0"]})
    summary, meta = ss.load_size("105M", str(opened / "one_pass" / "micro8"))
    rows = ss.summary_rows("105M", summary, meta)
    assert [(r["mode"], r["lr"]) for r in rows if r["tuned"]] == [("adamw", 0.001)]
    assert any(r["mode"] == "sparseloco" and r["lr"] == 0.0005 and r["best_lr_so_far"] for r in rows)
    # the committed summaries as read: every compressed row (20M PP-Compress 1/8 at SparseLoCo's tuned
    # 1e-3, 105M's at 2e-3) untuned, and a tuned row only at its own mode's closed-bracket best lr
    import json

    summaries = sorted((BENCH / "results" / "size_sweep").glob("**/summary.json"))
    assert len(summaries) == 3
    for summary in summaries:
        doc = json.loads(summary.read_text())
        assert not any(r["tuned"] for r in doc["rows"] if r["mode"] not in ("sparseloco", "adamw", "diloco")), summary
        for r in (r for r in doc["rows"] if r["tuned"]):
            seed0 = {x["lr"]: x["per_seed"][x["seeds"].index(0)] for x in doc["rows"]
                     if x["model"] == r["model"] and x["mode"] == r["mode"] and 0 in x["seeds"]}
            b = ss.bracket(seed0, r["mode"]) if r["mode"] in ss.LR_BRACKETS else {}
            assert b.get("complete") and b["best"] == r["lr"], (summary, r["model"], r["mode"], r["lr"])


def test_size_sweep_gap_against_outer_syncs_from_the_committed_runs():
    """gaps_by_outer_steps: in each regime, SparseLoCo's gap to the best AdamW lr of seed 0 at each
    size, recomputed by hand from the committed run JSONs, with the syncs (steps / H) and passes over
    the corpus behind it; the one-pass rows all sync 19 times within one pass."""
    import json

    ss = bench_module("size_sweep")
    points = ss.gaps_by_outer_steps()
    micro8 = "one pass, micro-batch 8 (4,096 tokens a replica step)"
    for regime, folder in (("10 tokens per parameter", ss.RESULTS), ("one pass", ss.ONE_PASS),
                           (micro8, Path(ss.ONE_PASS) / "micro8")):
        for model in ss.SIZES:
            loss, steps, corpus = {}, {}, None
            for f in (Path(folder) / model).glob("paper_tables_*.json"):
                doc = json.loads(f.read_text())
                corpus, micro = doc["corpus_train_tokens"], doc["micro_batch"]
                for r in doc["rows"]:
                    name, seed = r["variant"]["name"].split("@seed")
                    loss.setdefault(name, {})[int(seed)] = r["val_loss"]
                    steps[name] = r["steps"]
            # each mode at its best lr of seed 0 so far (SparseLoCo's variant rows carry more flags)
            adamw = [n for n in loss if n.startswith("adamw:") and 0 in loss[n]]
            plain = [n for n in loss if n.startswith("sparseloco:lr=") and n.count(":") == 1 and 0 in loss[n]]
            if not plain or not adamw:
                continue
            best = min(adamw, key=lambda n: loss[n][0])
            sl_best = min(plain, key=lambda n: loss[n][0])
            seeds = sorted(set(loss[sl_best]) & set(loss[best]))
            a = sum(loss[best][s] for s in seeds) / len(seeds)
            sl = sum(loss[sl_best][s] for s in seeds) / len(seeds)
            (p,) = [p for p in points if p["regime"] == regime and p["model"] == model]
            assert abs(p["gap_pct"] - 100 * (sl - a) / a) < 1e-9 and p["seeds"] == seeds
            assert p["outer_steps"] == steps[sl_best] // ss.H
            assert abs(p["epochs"] - steps[sl_best] * ss.REPLICAS * micro * ss.GAS * ss.SEQ / corpus) < 1e-9
            if regime == "one pass":
                assert p["outer_steps"] == 19 and p["epochs"] <= 1
            if regime == micro8:  # the same pass in a quarter of the tokens a step: four times the syncs
                assert micro == 8 and p["outer_steps"] == 79 and p["epochs"] <= 1
    assert {p["regime"] for p in points} >= {"10 tokens per parameter", "one pass", micro8}
    assert points[-1]["outer_steps"] == 100 and points[-1]["gap_pct"] == ss.LONG_20M_GAP_PCT


def test_same_seed_repeats_set_a_rerun_beside_its_committed_row(tmp_path):
    """same_seed_repeats: each row under one_pass/repeats/<model>/ beside the committed run of the
    same row and seed, recomputed by hand from the JSONs; a repeat with no committed run is refused."""
    import json
    import shutil

    import pytest

    ss = bench_module("size_sweep")
    found = ss.same_seed_repeats(ss.ONE_PASS)
    want = []
    for model in ss.SIZES:
        for f in sorted((Path(ss.ONE_PASS) / "repeats" / model).glob("paper_tables_*.json")):
            for r in json.loads(f.read_text())["rows"]:
                (a,) = [x["val_loss"] for g in (Path(ss.ONE_PASS) / model).glob("paper_tables_*.json")
                        for x in json.loads(g.read_text())["rows"] if x["variant"]["name"] == r["variant"]["name"]]
                want.append((model, r["variant"]["name"], a, r["val_loss"]))
    assert want and [(x["model"], x["row"], *x["val_loss"]) for x in found] == want
    assert all(abs(x["diff_pct"] - 100 * (x["val_loss"][1] - x["val_loss"][0]) / x["val_loss"][0]) < 1e-9
               and x["val_loss"][0] != x["val_loss"][1] for x in found)
    # A repeat whose row was never committed: the folder of that size lacks it.
    orphan = tmp_path / "repeats" / "60M"
    orphan.mkdir(parents=True)
    shutil.copy(next((Path(ss.ONE_PASS) / "repeats" / "105M").glob("paper_tables_*.json")), orphan)
    shutil.copytree(Path(ss.ONE_PASS) / "60M", tmp_path / "60M")
    with pytest.raises(SystemExit, match="pp:8:lr=0.002@seed0 has no committed run"):
        ss.same_seed_repeats(str(tmp_path))


def test_size_sweep_plan_prices_rows_at_the_long_rows_pace(capsys):
    """plan --one-pass: each size's pace is the median GPU-seconds a step of its committed
    10-tokens-per-parameter rows (not the one-pass rows, whose time is mostly fixed cost), each row
    adds ROW_OVERHEAD_S, and the row-seeds left are the size's rows with no committed one-pass JSON.
    Recomputed by hand from the JSONs."""
    import json
    import re

    ss = bench_module("size_sweep")
    assert ss.main(["plan", "--one-pass"]) == 0
    out = capsys.readouterr().out
    for model in ss.SIZES:
        paces, done = [], set()
        for f in (Path(ss.RESULTS) / model).glob("paper_tables_*.json"):
            doc = json.loads(f.read_text())
            paces += [r["seconds"] * doc.get("gpus_per_row", 1) / r["steps"] for r in doc["rows"]]
        seed0 = {"sparseloco": {}, "adamw": {}}  # mode -> {lr: validation loss of seed 0}
        for f in (Path(ss.ONE_PASS) / model).glob("paper_tables_*.json"):
            for r in json.loads(f.read_text())["rows"]:
                done.add(r["variant"]["name"])
                name, seed = r["variant"]["name"].split("@seed")
                mode, *flags = name.split(":")
                if seed == "0" and mode in seed0 and len(flags) == 1:
                    seed0[mode][float(flags[0][len("lr="):])] = r["val_loss"]
        pace = sorted(paces)[len(paces) // 2]
        # seed 0: the size's rows and one more lr of each bracket whose best sits at an edge (the
        # bracket's own lrs all run); seed 1: SparseLoCo and AdamW at their best so far, DiLoCo
        wanted = [f"{r}@seed0" for r in ss.first_seed_rows(model) if f"{r}@seed0" not in done]
        best = {}
        for mode, tried in seed0.items():
            best[mode] = min(tried, key=tried.get)
            if set(ss.LR_BRACKETS[mode]) <= set(tried) and best[mode] in (min(tried), max(tried)):
                wanted.append(f"{mode}:lr={best[mode] / 2 if best[mode] == min(tried) else best[mode] * 2:g}@seed0")
        wanted += [r for r in (f"sparseloco:lr={best['sparseloco']:g}@seed1", f"adamw:lr={best['adamw']:g}@seed1",
                               f"{ss.DILOCO}:lr=0.002@seed1") if r not in done]
        lines = out.splitlines()
        i = next(i for i, line in enumerate(lines) if line.startswith(f"{model}:"))
        got = re.search(r"([0-9.]+) s a step .*: ([0-9.]+) GPU-minutes a row; (\d+) row-seeds left", lines[i])
        assert abs(float(got[1]) - pace) < 5e-4, lines[i]
        assert abs(float(got[2]) - (pace * 950 + ss.ROW_OVERHEAD_S) / 60) < 0.05 and int(got[3]) == len(wanted), lines[i]
        assert (lines[i + 1] == "  left: " + ", ".join(wanted)) if wanted else not lines[i + 1].startswith("  left:")
    # every bracket is closed at one pass (SparseLoCo's 5e-4 at 60M and 4e-3 at 20M lost to their best)
    # and every size has both seeds of its tuned rows: nothing is left
    assert "  left:" not in out and "20M: 20.5M parameters" in out
    assert all(re.search(rf"^{m}: .* 0 row-seeds left", out, re.M) for m in ("20M", "60M", "105M"))


def test_size_sweep_reads_each_rows_loss_after_one_epoch_and_its_train_validation_gap(tmp_path):
    """The committed 20M and 60M run JSONs, 20M's rows given a validation curve every 250 steps
    (loss made up per row and step): each 20M summary row's one-epoch point is the curve's step
    1000 (the corpus is 994.4 steps of 8 x 16,384 tokens), `gaps_one_epoch` is SparseLoCo's and
    DiLoCo's gap to the tuned AdamW at that point on the seeds they share; a 60M row's point is its
    own committed curve's step 1000 where it has one (only its later rows do), else none; every
    row's validation - train loss is its JSON's, per seed. Recomputed by hand."""
    import json
    import shutil

    ss = bench_module("size_sweep")
    for size in ("20M", "60M"):
        shutil.copytree(Path(ss.RESULTS) / size, tmp_path / size)
    at = {}  # (row name, seed) -> loss at step 1000
    raw = {}
    for f in (tmp_path / "20M").glob("paper_tables_*.json"):
        doc = json.loads(f.read_text())
        for i, r in enumerate(doc["rows"]):
            base = 3.0 + 0.1 * len(r["variant"]["name"]) % 0.7 + 0.01 * r["variant"]["seed"] + 0.001 * i
            r["val_curve"] = [{"step": s, "loss": base + 100.0 / s} for s in range(250, 1600, 250)] + \
                [{"step": 1600, "loss": r["val_loss"]}]
            at[(r["variant"]["name"].split("@")[0], r["variant"]["seed"])] = base + 0.1
        f.write_text(json.dumps(doc))
    curve60 = {}  # (row name, seed) -> the committed 60M curve's step 1000, None without a curve
    for size in ("20M", "60M"):
        for f in (tmp_path / size).glob("paper_tables_*.json"):
            for r in json.loads(f.read_text())["rows"]:
                raw[(size, r["variant"]["name"])] = r["val_loss"] - r["final_train_loss"]
                if size == "60M":
                    curve60[(r["variant"]["name"].split("@")[0], r["variant"]["seed"])] = next(
                        (c["loss"] for c in r.get("val_curve") or [] if c["step"] == 1000), None)
    assert any(v is None for v in curve60.values()) and any(v is not None for v in curve60.values())
    assert ss.main(["summarize", "--results", str(tmp_path)]) == 0
    doc = json.loads((tmp_path / "summary.json").read_text())
    for r in doc["rows"]:
        name = r["mode"] if r["mode"] != "diloco" else ss.DILOCO
        name = f"{name}:lr={r['lr']:g}"
        assert r["val_minus_train_per_seed"] == [raw[(r["model"], f"{name}@seed{s}")] for s in r["seeds"]]
        for s, p in zip(r["seeds"], r["one_epoch_per_seed"]):
            if r["model"] == "60M":
                assert (p and p["loss"]) == curve60[(name, s)]
            else:
                assert p["step"] == 1000 and abs(p["epochs"] - 1000 / (130334720 / (8 * 16384))) < 1e-12
                assert p["loss"] == at[(name, s)]
    best = next(r["lr"] for r in doc["rows"] if r["model"] == "20M" and r["mode"] == "adamw" and r["tuned"])
    early = {g["mode"]: g for g in doc["gaps_one_epoch"]}
    assert sorted(early) == ["diloco", "sparseloco"] and all(g["model"] == "20M" for g in early.values())
    for mode, name in (("sparseloco", "sparseloco:lr=0.002"), ("diloco", f"{ss.DILOCO}:lr=0.002")):
        diffs = [at[(name, s)] - at[(f"adamw:lr={best:g}", s)] for s in (0, 1)]
        assert early[mode]["seeds"] == [0, 1] and abs(early[mode]["gap_nats"] - sum(diffs) / 2) < 1e-12


def test_size_sweep_gap_is_provisional_while_the_adamw_bracket_is_open(tmp_path):
    """60M without its AdamW 4e-3 row (dropped from a copy of the committed run JSONs): its gap is
    to the better of the two lrs run on seed 0, over the seeds SparseLoCo and that lr share, marked
    provisional; 20M's (whole bracket) is not. Recomputed from the run JSONs."""
    import json
    import shutil

    ss = bench_module("size_sweep")
    for size in ("20M", "60M"):
        shutil.copytree(Path(ss.RESULTS) / size, tmp_path / size)
    for f in (tmp_path / "60M").glob("paper_tables_*.json"):
        doc = json.loads(f.read_text())
        doc["rows"] = [r for r in doc["rows"] if not r["variant"]["name"].startswith("adamw:lr=0.004@")]
        f.write_text(json.dumps(doc))
    assert ss.main(["summarize", "--results", str(tmp_path)]) == 0
    doc = json.loads((tmp_path / "summary.json").read_text())
    loss = {}  # (row name, seed) -> final validation loss
    for f in sorted((tmp_path / "60M").glob("paper_tables_*.json")):
        for r in json.loads(f.read_text())["rows"]:
            loss[(r["variant"]["name"].split("@")[0], r["variant"]["seed"])] = r["val_loss"]
    adamw = {lr: loss[(f"adamw:lr={lr:g}", 0)] for lr in (0.002, 0.001)}
    best = min(adamw, key=adamw.get)
    seeds = sorted(s for (n, s) in loss if n == "sparseloco:lr=0.002" and (f"adamw:lr={best:g}", s) in loss)
    diffs = [loss[("sparseloco:lr=0.002", s)] - loss[(f"adamw:lr={best:g}", s)] for s in seeds]
    gap = next(g for g in doc["gaps"] if g["model"] == "60M" and g["mode"] == "sparseloco")
    assert gap["adamw_bracket_complete"] is False and gap["adamw_lr"] == best and gap["seeds"] == seeds
    assert abs(gap["gap_nats"] - sum(diffs) / len(diffs)) < 1e-12
    assert all(g["adamw_bracket_complete"] for g in doc["gaps"] if g["model"] == "20M")
    assert not any(r["tuned"] for r in doc["rows"] if r["model"] == "60M" and r["mode"] == "adamw")


def test_size_sweep_names_the_card_of_every_seed_where_a_sizes_seeds_ran_on_different_cards(tmp_path):
    """60M's seed 0 ran on an H200 and its later rows on H100s: each summary row names the card of
    each of its seeds (read from the run JSON that holds it), `card` joins them in seed order, and
    the size's settings list both. Breaks if a size's first file names the card of every row."""
    import json
    import shutil

    ss = bench_module("size_sweep")
    shutil.copytree(Path(ss.RESULTS) / "60M", tmp_path / "60M")
    assert ss.main(["summarize", "--results", str(tmp_path)]) == 0
    doc = json.loads((tmp_path / "summary.json").read_text())
    card_of = {}
    for f in (tmp_path / "60M").glob("paper_tables_*.json"):
        run = json.loads(f.read_text())
        for r in run["rows"]:
            name, seed = r["variant"]["name"].split("@seed")
            card_of[(name.split(":")[0], r["variant"].get("lr"), int(seed))] = run["card"]
    assert len(set(card_of.values())) == 2
    for r in doc["rows"]:
        want = [card_of[(r["mode"], r["lr"], s)] for s in r["seeds"]]
        assert r["card_per_seed"] == want and r["card"] == " + ".join(dict.fromkeys(want)), r
    assert doc["settings"]["60M"]["cards"] == sorted(set(card_of.values())) == doc["cards"]


def test_size_sweep_second_seed_waits_for_every_lr_bracket(tmp_path, monkeypatch):
    """Seed 1 runs SparseLoCo and AdamW at their tuned lrs: with both brackets complete (committed
    20M rows: SparseLoCo's 1e-3 and 4e-3 lost to 2e-3), the best of each on seed 0; refused, naming
    the bracket and its next lr, on the same rows without SparseLoCo's 1e-3 and 4e-3 (only 2e-3
    run), then without AdamW's 1e-3."""
    import pytest

    ss = bench_module("size_sweep")
    assert ss.second_seed_rows("20M") == ["sparseloco:lr=0.002", "adamw:lr=0.002", f"{ss.DILOCO}:lr=0.002"]
    results = results_without(ss, tmp_path / "a", monkeypatch, {"20M": ["sparseloco:lr=0.001@seed0",
                                                                         "sparseloco:lr=0.004@seed0"]})
    with pytest.raises(SystemExit, match=r"sparseloco \(best so far lr=0.002, next lr=0.001\) is not complete"):
        ss.second_seed_rows("20M", str(results))
    monkeypatch.undo()  # the next copy from the committed rows again
    results = results_without(ss, tmp_path / "b", monkeypatch, {"20M": ["adamw:lr=0.001@seed0"]})
    with pytest.raises(SystemExit, match=r"lr bracket of adamw \(best so far lr=0.002\) is not complete"):
        ss.second_seed_rows("20M", str(results))


def test_pass_drops_reads_a_fall_at_each_new_pass_and_none_between():
    """A train loss that falls by 0.5 at the start of each of 4 passes of 1000 steps and is flat
    in between (recorded every 10 steps, as paper_tables keeps it): 0.5 at a new pass over the 3
    boundaries with a window on each side, 0 mid-pass; a gentle slope adds its own 180-step fall
    to both; a row shorter than one pass has none. Breaks if the windows or the recorded steps
    are read off by one sample."""
    st = bench_module("summarize_tables")
    steps = [1 + 10 * i for i in range(400)]
    flat = {"steps": 4000, "train_losses": [3.0 - 0.5 * (s // 1000) for s in steps]}
    d = st.pass_drops(flat, 1000.0)
    assert d == {"new_pass": 0.5, "mid_pass": 0.0, "boundaries": 3}
    sloped = {"steps": 4000, "train_losses": [3.0 - 0.5 * (s // 1000) - 1e-4 * s for s in steps]}
    d = st.pass_drops(sloped, 1000.0)
    assert abs(d["new_pass"] - (0.5 + 1e-4 * 110)) < 1e-9 and abs(d["mid_pass"] - 1e-4 * 110) < 1e-9
    assert st.pass_drops({"steps": 900, "train_losses": [1.0] * 90}, 1000.0) is None
    # A row whose steps are no whole ten keeps its stride as written (1605 // 161 would read 9)
    odd = st.recorded_losses({"steps": 1605, "train_losses": [0.0] * 161, "train_losses_every": 10})
    assert list(odd)[-2:] == [1591, 1601]


def test_first_pass_fresh_reads_the_step_after_the_last_sync_inside_the_first_pass():
    """Recorded losses that are their own step numbers: with syncs every 50 steps and one pass of
    994.4 steps the point is step 951 (the first after the sync at 950), also for a row recorded
    every 20 steps (901: 951 - 1 is no multiple of 20); a run shorter than its first sync has
    none. And on the committed 20M rows, SparseLoCo's gap to the tuned AdamW there is recomputed
    from the run JSONs' step 951 (index 95 of every 10th step)."""
    import json
    import shutil
    import tempfile

    st = bench_module("summarize_tables")
    ten = {"steps": 4000, "train_losses": [float(1 + 10 * i) for i in range(400)]}
    assert st.first_pass_fresh(ten, 994.4, 50) == {"step": 951, "loss": 951.0}
    twenty = {"steps": 2000, "train_losses": [float(1 + 20 * i) for i in range(100)]}
    assert st.first_pass_fresh(twenty, 994.4, 50) == {"step": 901, "loss": 901.0}
    assert st.first_pass_fresh({"steps": 40, "train_losses": [1.0] * 4}, 994.4, 50) is None

    ss = bench_module("size_sweep")
    with tempfile.TemporaryDirectory() as tmp:
        shutil.copytree(Path(ss.RESULTS) / "20M", Path(tmp) / "20M")
        assert ss.main(["summarize", "--results", tmp]) == 0
        doc = json.loads((Path(tmp) / "summary.json").read_text())
        at = {}
        for f in (Path(tmp) / "20M").glob("paper_tables_*.json"):
            for r in json.loads(f.read_text())["rows"]:
                at[r["variant"]["name"]] = r["train_losses"][95]
    best = next(r["lr"] for r in doc["rows"] if r["mode"] == "adamw" and r["tuned"])
    gap = next(g for g in doc["gaps_first_pass_fresh"] if g["mode"] == "sparseloco")
    want = [at[f"sparseloco:lr=0.002@seed{s}"] - at[f"adamw:lr={best:g}@seed{s}"] for s in (0, 1)]
    assert gap["seeds"] == [0, 1] and abs(gap["gap_nats"] - sum(want) / 2) < 1e-12


def test_first_pass_gap_at_each_modes_best_lr_there_not_the_lr_that_ends_best():
    """best_at / gaps(best_there=True): at 105M AdamW 4e-3 ends best (it memorises 8 passes least)
    but is the worst of its three lrs on the first pass's unseen batches (1.670 against 1e-3's
    1.460); the point's gap takes each mode at its best lr there, and calls that bracket open
    while the best sits at the edge of the lrs run. A NaN point is no candidate. Recomputed by
    hand from the summary's own per-seed points."""
    import json

    import pytest

    ss = bench_module("size_sweep")
    doc = json.loads((Path(ss.RESULTS) / "summary.json").read_text())
    size = [r for r in doc["rows"] if r["model"] == "105M"]
    at = ss.point_loss("first_pass_fresh_per_seed")
    adamw = {r["lr"]: at(r, 0) for r in size if r["mode"] == "adamw"}
    assert adamw[1e-3] < adamw[2e-3] < adamw[4e-3]
    row, complete = ss.best_at(size, "adamw", at)
    assert row["lr"] == min(adamw, key=adamw.get) == 1e-3 and complete is False  # 5e-4 never ran
    sl = next(r for r in size if r["mode"] == "sparseloco" and r["lr"] == 2e-3)
    gap = next(g for g in ss.gaps(size, at, best_there=True) if g["mode"] == "sparseloco")
    assert gap["adamw_lr"] == 1e-3 and gap["adamw_bracket_complete"] is False
    assert gap["gap_nats"] == pytest.approx(at(sl, 0) - adamw[1e-3], abs=1e-12)
    end = next(g for g in ss.gaps(size, at) if g["mode"] == "sparseloco")
    assert end["adamw_lr"] >= 4e-3 and end["gap_nats"] < gap["gap_nats"]
    fake = [{"mode": "adamw", "lr": lr, "seeds": [0], "first_pass_fresh_per_seed": [{"loss": x}]}
            for lr, x in ((1e-3, 1.5), (2e-3, float("nan")), (4e-3, 1.7))]
    assert ss.best_at(fake, "adamw", at)[0]["lr"] == 1e-3


def test_a_row_that_diverged_before_a_point_ran_there_and_is_the_worst_lr():
    """A row that diverged before the first pass's last sync (or one pass's validation) has NaN at
    the schedule's point, not its last finite loss at an earlier step; and best_at counts that lr
    as run and worst, as lr_bracket does with a NaN final loss: AdamW 8e-3 diverging closes the
    bracket at 4e-3 where 4e-3 is the best of the rest. Without the point (no curve) a row is not
    counted."""
    import math

    st, ss = bench_module("summarize_tables"), bench_module("size_sweep")
    # recorded every 10 steps up to step 491, then NaN from 481: ended at 500
    diverged = {"steps": 4000, "train_losses_every": 10, "train_losses": [float(1 + 10 * i) for i in range(50)],
                "diverged_at_step": 481, "ended_at_step": 500}
    p = st.first_pass_fresh(diverged, 994.4, 50)
    assert p["step"] == 951 and math.isnan(p["loss"])
    ran = dict(diverged, diverged_at_step=None, train_losses=[float(1 + 10 * i) for i in range(400)])
    assert st.first_pass_fresh(ran, 994.4, 50) == {"step": 951, "loss": 951.0}

    curve = [{"step": s, "loss": 5.0 - s / 1000} for s in (250, 500, 750)]
    assert ss.one_epoch_point(curve, 994.4, 1000, None)["step"] == 750  # no divergence: the row's own nearest
    late = ss.one_epoch_point(curve, 994.4, 1000, 800)
    assert late["step"] == 1000 and math.isnan(late["loss"])
    summary = [{"seeds": [0, 1], "val_curve_per_seed": [curve + [{"step": 1000, "loss": 4.0}], curve],
                "diverged_at_step_per_seed": [None, 800]}]
    assert ss.epoch_step(summary, 994.4) == 1000

    at = ss.point_loss("first_pass_fresh_per_seed")
    fake = [{"mode": "adamw", "lr": lr, "seeds": [0], "first_pass_fresh_per_seed": [x and {"loss": x}]}
            for lr, x in ((1e-3, 1.7), (2e-3, 1.6), (4e-3, 1.5), (8e-3, float("nan")))]
    row, complete = ss.best_at(fake, "adamw", at)
    assert row["lr"] == 4e-3 and complete is True
    row, complete = ss.best_at(fake[:3] + [dict(fake[3], first_pass_fresh_per_seed=[None])], "adamw", at)
    assert row["lr"] == 4e-3 and complete is False


def test_size_sweep_smaller_micro_batch_syncs_more_often_on_the_same_tokens_and_validation(tmp_path, monkeypatch,
                                                                                          capsys):
    """--micro 8: the same pass over the corpus in 4x the steps (79 outer syncs, not 19), its own
    results, output and state folders, and validation on the same held-out sequences as micro-batch
    32 (64 eval micro-batches of 8, not 16: the rows read them in order); every committed row of
    every regime validated on those 512 sequences. A micro-batch that does not divide them is
    refused, naming it, before anything runs. `plan` prices a size without rows of its own at its
    micro-batch-32 pace times the ratio measured where both exist."""
    import json
    import re
    import shutil
    import sys

    import pytest

    ss = bench_module("size_sweep")
    assert ss.steps_for("60M", one_pass=True, micro=8)[0] == 79 * ss.H == 4 * ss.steps_for("60M", one_pass=True)[0] + 150

    def pace(folder):  # the median GPU-seconds a step of the folder's rows, by hand
        p = sorted(r["seconds"] * doc.get("gpus_per_row", 1) / r["steps"] for f in Path(folder).glob("paper_tables_*.json")
                   for doc in [json.loads(f.read_text())] for r in doc["rows"])
        return p[len(p) // 2]

    # plan, on a copy holding only 20M's micro-batch-8 rows: 20M at its own rows' pace; 60M at its
    # micro-batch-32 pace times 20M's measured ratio
    only20 = tmp_path / "only20"
    shutil.copytree(Path(ss.ONE_PASS) / "micro8" / "20M", only20 / "20M")
    assert ss.main(["plan", "--one-pass", "--micro", "8", "--results", str(only20)]) == 0
    out = {line.split(":")[0]: line for line in capsys.readouterr().out.splitlines()}
    own20 = pace(Path(ss.ONE_PASS) / "micro8" / "20M")
    ratio = own20 / pace(Path(ss.RESULTS) / "20M")
    for model, want in (("20M", own20), ("60M", pace(Path(ss.RESULTS) / "60M") * ratio)):
        got = float(re.search(r"([0-9.]+) s a step", out[model])[1])
        assert abs(got - want) < 6e-5 and "3950 steps (79 outer)" in out[model], out[model]
    assert f"x {ratio:.2f}, measured at 20M" in out["60M"] and 0.3 < ratio < 1.5
    assert ss.results_folder(True, 8) == str(Path(ss.ONE_PASS) / "micro8") and ss.results_folder(True) == ss.ONE_PASS
    data = tmp_path / "c.pt"
    data.write_bytes(b"")
    calls = []
    monkeypatch.setitem(sys.modules, "paper_tables", type(sys)("paper_tables"))
    sys.modules["paper_tables"].main = lambda argv: calls.append(argv) or 0
    for bad in ("0", "7", "1024"):
        with pytest.raises(SystemExit, match=f"--micro {bad}: must divide the 512 held-out sequences"):
            ss.main(["run", "--model", "20M", "--one-pass", "--micro", bad, "--data", str(data), "--out", str(tmp_path)])
    assert calls == []
    assert ss.main(["run", "--model", "20M", "--one-pass", "--micro", "8", "--data", str(data),
                    "--out", str(tmp_path / "o")]) == 0
    flag = flags(calls[0])
    assert flag["--micro"] == "8" and flag["--eval-batches"] == "64" and flag["--passes"] == "1"
    assert flag["--out"] == str(tmp_path / "o" / "one_pass" / "micro8" / "20M")
    assert flag["--state-dir"] == "runs/size_sweep_state_one_pass_micro8/20M"
    assert flag["--skip-done"] == str(Path(ss.ONE_PASS) / "micro8" / "20M")
    calls.clear()
    ss.main(["run", "--model", "20M", "--data", str(data), "--out", str(tmp_path / "d")])
    flag = flags(calls[0])
    assert flag["--micro"] == "32" and flag["--eval-batches"] == "16" and flag["--out"] == str(tmp_path / "d" / "20M")
    seen = set()
    for f in Path(ss.RESULTS).glob("**/paper_tables_*.json"):
        doc = json.loads(f.read_text())
        assert doc["eval_batches"] * doc["micro_batch"] == ss.EVAL_SEQS == 512, f
        seen.add(doc["micro_batch"])
    assert seen == {8, 32}


def test_size_sweep_widens_each_lr_bracket_until_its_best_is_inside(tmp_path, monkeypatch):
    """lr_bracket: a mode's best lr on seed 0 is tuned once a worse lr was run on either side of it;
    at an edge the next lr is half (low edge, or the only lr run) or twice (high edge) the best; no
    widening before the bracket's own lrs have all run. On the committed one-pass micro-batch-8 rows
    without their lower lrs (`results_without`), 105M's AdamW and SparseLoCo both did best at 1e-3,
    their lowest lr, so `run` adds both 5e-4 rows; on a copy of 60M's rows (SparseLoCo's 1e-3 beat 2e-3, AdamW's 1e-3 beat 5e-4 and 2e-3), then a
    made-up SparseLoCo 5e-4, the gap follows each mode's best lr and is marked provisional until
    both brackets close; `--whole-rows` judges a row by the pace of rows run on
    the same card and GPUs a row where there are any. Recomputed by hand."""
    import json
    import shutil
    import sys

    import pytest

    ss = bench_module("size_sweep")

    def rows(mode, by_lr):
        return [{"table_row": mode, "sparseloco": {}, "lr": lr, "seeds": [0], "val_loss_per_seed": [x]}
                for lr, x in by_lr.items()]

    adamw = {1e-3: 1.5, 2e-3: 1.6, 4e-3: 1.8}
    assert ss.lr_bracket(rows("adamw", adamw), "adamw") == {"best": 1e-3, "complete": False, "next": 5e-4}
    assert ss.lr_bracket(rows("adamw", adamw | {5e-4: 1.55}), "adamw") == {"best": 1e-3, "complete": True, "next": None}
    assert ss.lr_bracket(rows("adamw", adamw | {5e-4: 1.45}), "adamw")["next"] == 2.5e-4
    assert ss.lr_bracket(rows("adamw", {1e-3: 1.8, 2e-3: 1.6, 4e-3: 1.5}), "adamw")["next"] == 8e-3
    assert ss.lr_bracket(rows("adamw", {1e-3: 1.0, 2e-3: 1.6}), "adamw") == {"best": 1e-3, "complete": False, "next": None}
    assert ss.lr_bracket(rows("sparseloco", {2e-3: 1.0}), "sparseloco")["next"] == 1e-3
    # a diverged lr is the worst wherever it sits: 105M's AdamW bracket if 8e-3 blew up
    nan = float("nan")
    assert ss.lr_bracket(rows("adamw", {8e-3: nan, 1e-3: 1.52, 2e-3: 1.51, 4e-3: 1.45}), "adamw") == \
        {"best": 4e-3, "complete": True, "next": None}
    assert ss.lr_bracket(rows("adamw", {5e-4: nan, 1e-3: 1.5, 2e-3: 1.6, 4e-3: 1.8}), "adamw") == \
        {"best": 1e-3, "complete": True, "next": None}
    assert ss.lr_bracket(rows("sparseloco", {2e-3: 1.0, 1e-3: 1.1}), "sparseloco")["next"] == 4e-3
    # a SparseLoCo variant (its own sparseloco settings) is no candidate, however low its loss
    variant = rows("sparseloco", {5e-4: 0.1})[0] | {"sparseloco": {"aggregation": "mean"}}
    assert ss.lr_bracket(rows("sparseloco", {2e-3: 1.0, 1e-3: 1.1, 4e-3: 1.2}) + [variant], "sparseloco") == \
        {"best": 2e-3, "complete": True, "next": None}

    # the brackets as they stood before the lower lrs ran at micro-batch 8
    results_without(ss, tmp_path, monkeypatch, {
        "one_pass/micro8/105M": ["sparseloco:lr=0.0005@seed0", "adamw:lr=0.0005@seed0", "sparseloco:lr=0.00025@seed0",
                                 "sparseloco:lr=0.0005@seed1", "adamw:lr=0.001@seed1",
                                 f"{ss.DILOCO}:lr=0.002@seed0", f"{ss.DILOCO}:lr=0.002@seed1",
                                 "pp:8:lr=0.002@seed0", "het:8:lr=0.002@seed0", "pp:96:lr=0.002@seed0",
                                 "het:96:lr=0.002@seed0"],
        "one_pass/micro8/60M": ["sparseloco:lr=0.0005@seed0", "sparseloco:lr=0.00025@seed0"]})
    micro8 = Path(ss.ONE_PASS) / "micro8"
    seed0 = {}
    for f in (micro8 / "105M").glob("paper_tables_*.json"):
        for r in json.loads(f.read_text())["rows"]:
            if r["variant"]["name"].startswith("adamw:") and r["variant"]["seed"] == 0:
                seed0[r["variant"]["lr"]] = r["val_loss"]
    assert min(seed0, key=seed0.get) == min(seed0) == 1e-3
    assert ss.bracket_rows(ss.load_size("105M", str(micro8))[0]) == ["sparseloco:lr=0.0005", "adamw:lr=0.0005"]
    calls = []
    monkeypatch.setitem(sys.modules, "paper_tables", type(sys)("paper_tables"))
    sys.modules["paper_tables"].main = lambda argv: calls.append(argv) or 0
    data = tmp_path / "c.pt"
    data.write_bytes(b"")
    assert ss.main(["run", "--model", "105M", "--one-pass", "--micro", "8", "--data", str(data), "--out", str(tmp_path)]) == 0
    base = ss.first_seed_rows("105M")  # the widening rows start before DiLoCo and the compressed rows
    assert calls[0][calls[0].index("--rows") + 1].split(",") == base[:4] + ["sparseloco:lr=0.0005", "adamw:lr=0.0005"] + \
        base[4:]
    assert "--s-per-step" not in calls[0] and calls[0][calls[0].index("--state-dir") + 1].endswith("micro8/105M")
    # --whole-rows: no saved state; paper_tables judges each start by the regime's median pace (2 GPUs a row: half)
    paces = sorted(r["seconds"] / r["steps"] for f in (micro8 / "105M").glob("paper_tables_*.json")
                   for r in json.loads(f.read_text())["rows"])
    calls.clear()
    assert ss.main(["run", "--model", "105M", "--one-pass", "--micro", "8", "--data", str(data), "--out", str(tmp_path),
                    "--whole-rows", "--gpus-per-row", "2"]) == 0
    assert "--state-dir" not in calls[0]
    assert abs(float(calls[0][calls[0].index("--s-per-step") + 1]) - paces[len(paces) // 2] / 2) < 1e-4
    # on a card that has run rows of the size on as many GPUs a row: those rows' own median seconds a
    # step (105M one pass: 1 GPU a row on an H200 beside 2 GPUs a row on H100s); else GPU-seconds / G
    timed = [(doc["card"], doc.get("gpus_per_row", 1), r["seconds"] / r["steps"])
             for f in (Path(ss.ONE_PASS) / "105M").glob("paper_tables_*.json")
             for doc in [json.loads(f.read_text())] for r in doc["rows"]]
    loaded = ss.load_size("105M", ss.ONE_PASS)
    for card, gpus in (("NVIDIA H200", 1), ("NVIDIA H100 80GB HBM3", 2)):
        own = sorted(p for c, g, p in timed if (c, g) == (card, gpus))
        assert len(own) >= 3 and ss.measured_pace(loaded, card, gpus) == own[len(own) // 2]
    gpu_s = sorted(p * g for _, g, p in timed)
    for card, gpus in (("NVIDIA H200", 2), ("NVIDIA B200", 1), (None, 1)):
        assert ss.measured_pace(loaded, card, gpus) == pytest.approx(gpu_s[len(gpu_s) // 2] / gpus)

    folder = tmp_path / "r" / "60M"
    shutil.copytree(micro8 / "60M", folder)
    loss = {}
    for f in folder.glob("paper_tables_*.json"):
        for r in json.loads(f.read_text())["rows"]:
            loss[r["variant"]["name"]] = r["val_loss"]
    # SparseLoCo's 1e-3 at the low edge of its bracket; AdamW's 1e-3 bracketed
    assert loss["sparseloco:lr=0.001@seed0"] < loss["sparseloco:lr=0.002@seed0"]
    assert loss["adamw:lr=0.001@seed0"] < min(loss["adamw:lr=0.0005@seed0"], loss["adamw:lr=0.002@seed0"])
    assert "sparseloco:lr=0.0005@seed0" not in loss

    def summary():
        assert ss.main(["summarize", "--results", str(tmp_path / "r")]) == 0
        return json.loads((tmp_path / "r" / "summary.json").read_text())

    doc = summary()
    g = next(g for g in doc["gaps"] if g["mode"] == "sparseloco")
    a = loss["adamw:lr=0.001@seed0"]
    assert (g["lr"], g["adamw_lr"], g["adamw_bracket_complete"], g["sparseloco_bracket_complete"]) == \
        (0.001, 0.001, True, False)
    assert abs(g["gap_pct"] - 100 * (loss["sparseloco:lr=0.001@seed0"] - a) / a) < 1e-9
    assert [(r["mode"], r["lr"]) for r in doc["rows"] if r["tuned"] and r["mode"] in ("sparseloco", "adamw")] == \
        [("adamw", 0.001)]
    assert next(g for g in doc["gaps"] if g["mode"] == "diloco")["sparseloco_bracket_complete"] is None
    add_row(folder, "sparseloco:lr=0.002@seed0", "sparseloco:lr=0.0005@seed0", +0.01)  # worse: 1e-3 bracketed
    doc = summary()
    g = next(g for g in doc["gaps"] if g["mode"] == "sparseloco")
    assert g["adamw_bracket_complete"] and g["sparseloco_bracket_complete"] and g["lr"] == 0.001
    assert sorted((r["mode"], r["lr"]) for r in doc["rows"] if r["tuned"] and r["mode"] in ("sparseloco", "adamw")) == \
        [("adamw", 0.001), ("sparseloco", 0.001)]
    assert ss.bracket_rows(ss.load_size("60M", str(tmp_path / "r"))[0]) == []


def test_size_sweep_resume_only_continues_saved_rows_and_ends_at_once_on_a_fresh_machine(tmp_path, monkeypatch,
                                                                                          capsys):
    """A chain's later call (`run --resume-only`): the sizes with rows an earlier call saved, each told
    to resume only; with none saved (the machine was given back between the calls) no corpus build
    and no paper_tables, so the call costs seconds."""
    import sys

    import pytest

    ss = bench_module("size_sweep")
    calls, built = [], []
    stub = type(sys)("paper_tables")
    stub.main = lambda argv: calls.append(argv) or 0
    stub.resumable = bench_module("paper_tables").resumable
    monkeypatch.setitem(sys.modules, "paper_tables", stub)
    monkeypatch.setattr(ss, "ensure_corpus", lambda args: built.append(args.data))
    state = tmp_path / "state"
    base = ["run", "--model", "60M,105M", "--gpus-per-row", "2", "--data", str(tmp_path / "c.pt"),
            "--state-dir", str(state), "--out", str(tmp_path / "out")]
    assert ss.main(base + ["--resume-only"]) == 0
    assert not built and not calls and "--resume-only: no row of 60M,105M is saved" in capsys.readouterr().out
    # 105M's AdamW 4e-3 saved by a 2-GPU group (a file a block); at 60M only a finished row's mark
    (state / "105M").mkdir(parents=True)
    for block in ("g0", "g1"):
        (state / "105M" / f"adamw_lr-0.004@seed0.pt.{block}").write_bytes(b"")
    (state / "60M").mkdir()
    (state / "60M" / "sparseloco_lr-0.001@seed0.done").write_text("1.5\n")
    assert ss.main(base + ["--resume-only"]) == 0
    assert built == [str(tmp_path / "c.pt")] and len(calls) == 1
    flag = dict(zip(calls[0], calls[0][1:]))
    assert flag["--model"] == "105M" and flag["--state-dir"] == str(state / "105M") and "--resume-only" in calls[0]
    calls.clear()
    assert ss.main(base) == 0  # a chain's first call: both sizes, rows started anew where none is saved
    assert [c[c.index("--model") + 1] for c in calls] == ["60M", "105M"] and all("--resume-only" not in c for c in calls)
    with pytest.raises(SystemExit, match="--resume-only continues saved rows and --whole-rows saves none"):
        ss.main(base + ["--resume-only", "--whole-rows"])


def test_size_sweep_fill_keeps_each_gpu_on_whole_rows_and_starts_seed_1_once_its_bracket_closes(tmp_path, monkeypatch,
                                                                                                  capsys):
    """fill over the one-pass regime and its micro-batch-8 regime at 20M and 60M on two GPUs, the
    committed rows done but those `results_without` drops (60M's one-pass seed 1 of SparseLoCo;
    20M's and 60M's micro-batch-8 SparseLoCo 5e-4 and the seed-1 rows after it), and a stand-in
    paper_tables.main that finishes each row at once (writing it into --out from the committed
    row of its mode): 60M's one-pass seed 1 goes first (its regime first); then 20M's SparseLoCo
    5e-4 at micro-batch 8, and, once that lost to 1e-3 and closed the bracket, 20M's seed 1 of
    SparseLoCo 1e-3 in the same call; 60M's micro-batch-8 rows, 350-400 s at their measured pace
    with the margin, do not fit 350 s and are said not started. Each row once, one GPU a row, its
    pace passed on, no state saved; a second call on the same --out starts nothing. A mode whose
    bracket is closed starts its seed 1 beside the other mode's open bracket. Breaks if fill read
    the rows only once, ignored --out, started a row it cannot finish, let a GPU go while a running
    row could still give it work, or left a GPU idle while a seed-1 row could run."""
    import sys
    import time

    import pytest

    ss = bench_module("size_sweep")
    pt = bench_module("paper_tables")
    seed1 = [("sparseloco:lr=0.001", 1), ("adamw:lr=0.001", 1), (f"{ss.DILOCO}:lr=0.002", 1)]
    results_without(ss, tmp_path, monkeypatch, {
        "one_pass/60M": ["sparseloco:lr=0.001@seed1"],
        "one_pass/micro8/20M": ["sparseloco:lr=0.0005@seed0", "sparseloco:lr=0.001@seed1"],
        "one_pass/micro8/60M": ["sparseloco:lr=0.0005@seed0", "sparseloco:lr=0.00025@seed0"]
        + [f"{r}@seed{s}" for r, s in seed1]})
    calls, gpu_of = [], {}
    budget, out_dir = 350, tmp_path / "o"

    def fake_main(argv):
        flag = flags(argv)
        row, seed = flag["--rows"], int(flag["--seeds"])
        sub = "one_pass" if flag["--micro"] == "32" else "one_pass/micro8"
        calls.append((sub, flag["--model"], row, seed))
        gpu_of[(flag["--model"], row, seed)] = flag["--gpu-ids"]
        time.sleep(0.1)  # a row takes time: the other GPU looks for work meanwhile
        assert "--state-dir" not in flag and flag["--passes"] == "1" and flag["--gpu-ids"] in ("0", "1")
        assert float(flag["--budget-s"]) <= budget and flag["--out"] == str(out_dir / sub / flag["--model"])
        mode = row.split(":lr=")[0]
        like = f"{mode}:lr={0.002 if mode == ss.DILOCO else 0.001}@seed0"  # each mode's committed row
        add_row(Path(ss.RESULTS) / sub / flag["--model"], like, f"{row}@seed{seed}",
                0.05 if row == "sparseloco:lr=0.0005" else 0.0,  # worse than 1e-3
                into=Path(flag["--out"]), file=f"paper_tables_{flag['--tag']}_g0p0.json")
        return 0

    monkeypatch.setattr(pt, "main", fake_main)
    monkeypatch.setitem(sys.modules, "paper_tables", pt)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    data = tmp_path / "c.pt"
    data.write_bytes(b"")
    argv = ["fill", "--model", "20M,60M", "--regimes", "one_pass,one_pass/micro8", "--data", str(data),
            "--out", str(tmp_path / "o"), "--budget-s", "350"]
    assert ss.main(argv) == 0
    assert calls[0] == ("one_pass", "60M", "sparseloco:lr=0.001", 1)
    assert sorted(calls[1:]) == [("one_pass/micro8", "20M", "sparseloco:lr=0.0005", 0),
                                 ("one_pass/micro8", "20M", "sparseloco:lr=0.001", 1)]
    assert calls.index(("one_pass/micro8", "20M", "sparseloco:lr=0.001", 1)) == 2
    out = capsys.readouterr().out
    micro8 = ss.results_folder(True, 8)
    pace = ss.measured_pace(ss.load_size("60M", micro8))
    need = pace * ss.steps_for("60M", True, 8)[0] + ss.FILL_MARGIN_S
    assert 350 < need < 400 and f"one_pass/micro8/60M sparseloco:lr=0.0005@seed0 not started: {need:.0f} s" in out
    assert "fill: 3 rows finished in " in out
    assert len({p.name for p in (tmp_path / "o").glob("**/paper_tables_*.json")}) == 3
    calls.clear()
    assert ss.main(argv) == 0 and calls == []
    with pytest.raises(SystemExit, match="'one_pass/micro32' is not a regime's folder"):
        ss.main(argv[:4] + ["one_pass/micro32"] + argv[5:])
    # 60M alone at micro-batch 8 with time enough: SparseLoCo's bracket is open (5e-4 not run), AdamW's
    # closed, so the other GPU starts AdamW's seed 1 (and DiLoCo's) beside SparseLoCo 5e-4 instead of
    # waiting on it (a GPU idled a whole call so on 2x H200); SparseLoCo's seed 1 waits for 5e-4 to
    # lose to 1e-3
    calls.clear()
    budget, out_dir = 100000, tmp_path / "o2"
    argv = ["fill", "--model", "60M", "--regimes", "one_pass/micro8", "--data", str(data),
            "--out", str(out_dir), "--budget-s", str(budget)]
    assert ss.main(argv) == 0
    rows = [c[2:] for c in calls]
    assert sorted(rows[:2]) == [("adamw:lr=0.001", 1), ("sparseloco:lr=0.0005", 0)]
    assert sorted(rows) == sorted(seed1 + [("sparseloco:lr=0.0005", 0)])
    assert rows.index(("sparseloco:lr=0.001", 1)) > rows.index(("sparseloco:lr=0.0005", 0))
    assert {gpu_of[("60M", *r)] for r in seed1} == {"0", "1"}


def test_size_sweep_side_by_side_shares_the_gpus_among_the_sizes(monkeypatch, capsys):
    """run --side-by-side: each size of --model on its own share of the visible GPUs at once (the
    further GPU to the size whose rows would end last, by the committed rows' pace), each size's
    paper_tables told its GPUs (--gpu-ids) and its share of the cores; with fewer GPUs than sizes, the longest size alone and
    the others in turn beside it; a lane's error reaches the caller; no GPU, one line. Breaks if two
    sizes could be handed the same GPU or a GPU went to a size with no row left for it."""
    import os
    import sys

    import pytest

    ss = bench_module("size_sweep")
    pt = bench_module("paper_tables")
    assert pt.gpu_ids("cuda", "3,5") == ["3", "5"]
    big, mid, small = (7, 500.0), (2, 300.0), (1, 200.0)
    four = [["0"], ["1"], ["2"], ["3"]]
    assert ss.side_by_side({"105M": big, "60M": mid, "20M": small}, four) == \
        [(["0", "1"], ["105M"]), (["2"], ["60M"]), (["3"], ["20M"])]
    assert ss.side_by_side({"105M": big, "60M": mid, "20M": small}, four[:2]) == \
        [(["0"], ["105M"]), (["1"], ["60M", "20M"])]
    assert ss.side_by_side({"105M": (0, 500.0), "20M": small}, four) == [(["0"], ["20M"])]  # one row: one GPU
    assert ss.side_by_side({"105M": (2, 500.0), "60M": (1, 300.0)}, [["0", "1"], ["2", "3"], ["4", "5"]]) == \
        [(["0", "1", "2", "3"], ["105M"]), (["4", "5"], ["60M"])]

    calls = []

    def fake_main(argv):
        flag = flags(argv)
        calls.append((flag["--model"], flag["--gpu-ids"], flag["--rows"]))
        assert flag["--threads"] == str(max(1, (os.cpu_count() or 1) // len(os.environ["CUDA_VISIBLE_DEVICES"].split(","))))
        if flag["--model"] == "20M" and "fail" in flag["--tag"]:
            raise SystemExit("paper_tables: made up")
        return 0

    monkeypatch.setattr(pt, "main", fake_main)
    monkeypatch.setitem(sys.modules, "paper_tables", pt)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2")
    rows = "sparseloco:lr=0.0001,adamw:lr=0.0001,pp:8:lr=0.0001"  # never run: three rows left at each size
    base = ["run", "--model", "20M,105M", "--one-pass", "--rows", rows, "--data", __file__, "--side-by-side"]
    assert ss.main(base + ["--out", "/tmp/unused"]) == 0
    # 105M's rows take longer at the committed pace: it gets the third GPU
    assert sorted(calls) == [("105M", "1,2", rows), ("20M", "0", rows)]
    assert "side by side: GPUs 0: 20M; GPUs 1,2: 105M" in capsys.readouterr().out
    calls.clear()
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4")
    assert ss.main(base + ["--model", "20M,60M,105M", "--out", "/tmp/unused"]) == 0
    assert [c[:2] for c in calls] == [("105M", "4"), ("60M", "4"), ("20M", "4")]  # one lane, longest first
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    with pytest.raises(SystemExit, match="made up"):
        ss.main(base + ["--tag", "fail", "--out", "/tmp/unused"])
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    with pytest.raises(SystemExit, match=r"--side-by-side: 1 GPU\(s\) visible, fewer than --gpus-per-row 2 "
                                         r"\(CUDA_VISIBLE_DEVICES='0'\)"):
        ss.main(base + ["--gpus-per-row", "2", "--out", "/tmp/unused"])


def test_size_sweep_ingest_puts_a_calls_rows_where_plan_reads_them_and_nothing_twice(tmp_path, monkeypatch, capsys):
    """ingest of a device folder as the 2026-11-28 calls left it (fill.tgz with size_sweep_fill/<regime>/
    <model>/, bench.tgz with the log three folders up, the log loose beside them): each JSON lands in
    its regime's committed folder and the log beside it as size_sweep_<tag>.log, after which plan no
    longer lists the rows; ingesting again changes nothing; a JSON whose rows are all committed goes
    to repeats/<model>/; a file at no regime's folder, a row half committed, a taken name or a missing
    --tag is one line and writes nothing. Breaks if ingest could write a row twice or a file half."""
    import io
    import json
    import tarfile

    import pytest

    ss = bench_module("size_sweep")
    rows = ["sparseloco:lr=0.0005@seed0", "sparseloco:lr=0.00025@seed0"]
    copy = results_without(ss, tmp_path, monkeypatch, {"one_pass/micro8/60M": rows})
    home = copy / "one_pass" / "micro8" / "60M"
    made = tmp_path / "made"
    for i, name in enumerate(rows):  # the dropped rows, back from a call
        add_row(home, "sparseloco:lr=0.001@seed0", name, 0.0, into=made, file=f"paper_tables_u3_{i}_g0p0.json")

    def tgz(path: Path, files: dict[str, bytes]) -> None:
        with tarfile.open(path, "w:gz") as tar:
            for name, data in files.items():
                info = tarfile.TarInfo(name)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))

    log = b"fill: 60M in one_pass/micro8 on GPUs 0,1, 530 s\n"
    device = tmp_path / "device"
    device.mkdir()
    tgz(device / "fill.tgz", {f"size_sweep_fill/one_pass/micro8/60M/{f.name}": f.read_bytes()
                              for f in sorted(made.glob("*.json"))})
    tgz(device / "bench.tgz", {"./env.txt": b"cards", "./size_sweep.log": log[:20]})  # packed before the end
    (device / "size_sweep.log").write_bytes(log)

    def left():
        ss.main(["plan", "--one-pass", "--micro", "8"])
        return capsys.readouterr().out.split("60M:")[1].split("\n105M")[0]

    assert "sparseloco:lr=0.0005@seed0" in left()
    before = sorted(p.name for p in home.iterdir())
    with pytest.raises(SystemExit, match="needs --tag"):
        ss.main(["ingest", str(device)])
    assert sorted(p.name for p in home.iterdir()) == before
    assert ss.main(["ingest", str(device), "--tag", "tingest"]) == 0
    assert sorted(p.name for p in home.iterdir()) == sorted(before + ["paper_tables_u3_0_g0p0.json",
                                                                      "paper_tables_u3_1_g0p0.json", "size_sweep_tingest.log"])
    assert (home / "size_sweep_tingest.log").read_bytes() == log
    assert (home / "paper_tables_u3_0_g0p0.json").read_bytes() == (made / "paper_tables_u3_0_g0p0.json").read_bytes()
    assert "sparseloco:lr=0.0005@seed0" not in left() and "60M sparseloco:lr=0.00025@seed0" not in left()
    capsys.readouterr()
    assert ss.main(["ingest", str(device), "--tag", "tingest"]) == 0  # again: nothing new
    assert capsys.readouterr().out.count("already in") == 2
    assert sorted(p.name for p in home.iterdir()) == sorted(before + ["paper_tables_u3_0_g0p0.json",
                                                                      "paper_tables_u3_1_g0p0.json", "size_sweep_tingest.log"])

    # the same row from a later call (other file name): a same-seed repeat
    rerun = tmp_path / "rerun"
    add_row(home, "sparseloco:lr=0.0005@seed0", "sparseloco:lr=0.0005@seed0", 0.003, into=rerun / "one_pass" /
            "micro8" / "60M", file="paper_tables_v1_1_g0p0.json")
    assert ss.main(["ingest", str(rerun)]) == 0
    assert (copy / "one_pass" / "micro8" / "repeats" / "60M" / "paper_tables_v1_1_g0p0.json").exists()

    def refused(folder: Path, match: str, *extra: str) -> None:
        files = sorted(str(p) for p in copy.rglob("*"))
        with pytest.raises(SystemExit, match=match):
            ss.main(["ingest", str(folder), *extra])
        assert sorted(str(p) for p in copy.rglob("*")) == files

    half = tmp_path / "half" / "one_pass" / "micro8" / "60M"
    add_row(home, "sparseloco:lr=0.0005@seed0", "sparseloco:lr=0.0005@seed0", 0.0, into=half, file="paper_tables_h_g0p0.json")
    doc = json.loads((half / "paper_tables_h_g0p0.json").read_text())
    other = json.loads((made / "paper_tables_u3_0_g0p0.json").read_text())["rows"][0]
    doc["rows"].append(dict(other, variant=dict(other["variant"], name="sparseloco:lr=0.004@seed0", lr=0.004)))
    (half / "paper_tables_h_g0p0.json").write_text(json.dumps(doc))
    refused(tmp_path / "half", r"sparseloco:lr=0.0005@seed0 committed under .* already, sparseloco:lr=0.004@seed0 not")
    odd = tmp_path / "odd" / "one_pass" / "micro8" / "70M"
    odd.mkdir(parents=True)
    (odd / "paper_tables_x_g0p0.json").write_text("{}")
    refused(tmp_path / "odd", r"not at <regime>/<model>/ \(regime 'one_pass/micro8', model '70M'")
    taken = tmp_path / "taken" / "one_pass" / "micro8" / "60M"
    add_row(home, "sparseloco:lr=0.0005@seed0", "sparseloco:lr=0.004@seed0", 0.1, into=taken,
            file="paper_tables_u3_0_g0p0.json")
    refused(tmp_path / "taken", "exists with other content")
    refused(tmp_path / "nothing.txt", "neither a folder nor a .tgz")
    (device / "size_sweep.log").write_bytes(b"another call\n")
    refused(device, r"2 different size_sweep.log \((?=.*bench.tgz:size_sweep.log)(?=.*device/size_sweep.log)",
            "--tag", "tingest2")
    broken = tmp_path / "broken"
    broken.mkdir()
    tgz(broken / "fill.tgz", {"size_sweep_fill/one_pass/micro8/60M/paper_tables_b_g0p0.json": b"{\"rows\": [{}]}"})
    refused(broken, r"broken/fill.tgz:size_sweep_fill/one_pass/micro8/60M/paper_tables_b_g0p0.json: not a paper_tables "
            "run JSON")


def test_penalty_set_runs_each_sizes_compressed_rows_at_sparselocos_tuned_lr_on_both_seeds(tmp_path, monkeypatch,
                                                                                           capsys):
    """Issue 57, item 2, by name: `--set penalty` at 20M and 105M in the micro-batch-8 one-pass regime
    is PP-Compress and Het at 1/8 and 1/96 (and PP-Compress at 1/16 at 105M: k = 48, 20M's k at 1/8)
    at SparseLoCo's tuned lr there (1e-3, 5e-4), seeds 0 and 1, seed 0 first; run hands exactly
    these to paper_tables with the regime's own flags; plan prices them at the committed rows'
    H200 pace; another regime, another size or an open bracket is refused before anything runs.
    Breaks if a penalty row could run at an untuned lr or outside its regime."""
    import sys

    import pytest

    ss = bench_module("size_sweep")
    from hetloco_ds.presets import model_config_for

    d = {m: model_config_for(m, 8192).hidden_size for m in ss.PENALTY_ROWS}
    assert [d["20M"] // int(r.split(":")[1]) for r in ss.PENALTY_ROWS["20M"]] == [48, 48, 4, 4]
    assert [d["105M"] // int(r.split(":")[1]) for r in ss.PENALTY_ROWS["105M"]] == [96, 96, 8, 8, 48]
    tuned = {"20M": "0.001", "105M": "0.0005"}
    # a committed row is not asked for again: 20M PP-Compress 1/8 seed 0 ran (call p65a)
    left = ss.rows_of_set("penalty", "20M", ss.load_size("20M", ss.results_folder(True, 8))[0])
    assert ("pp:8:lr=0.001", 0) not in left and ("pp:8:lr=0.001", 1) in left
    # the rest reads the penalty rows as they stood before any ran, so it holds as more are committed
    unrun = {"one_pass/micro8/20M": ["pp:8:lr=0.001@seed0"]}
    results_without(ss, tmp_path / "unrun", monkeypatch, unrun)
    micro8 = ss.results_folder(True, 8)
    for model in ss.PENALTY_ROWS:
        left = ss.rows_of_set("penalty", model, ss.load_size(model, micro8)[0])
        want = [f"{r}:lr={tuned[model]}" for r in ss.PENALTY_ROWS[model]]
        assert left == [(r, 0) for r in want] + [(r, 1) for r in want]
    assert ss.main(["plan", "--set", "penalty", "--one-pass", "--micro", "8"]) == 0
    out = capsys.readouterr().out
    pace = ss.measured_pace(ss.load_size("105M", micro8), "NVIDIA H200", 1)
    assert f"105M: 3950 steps at {pace:.4f} s a step" in out and "10 row-seeds left" in out
    assert "20M: 3950 steps" in out and "8 row-seeds left" in out

    calls = []
    monkeypatch.setitem(sys.modules, "paper_tables", type(sys)("paper_tables"))
    sys.modules["paper_tables"].main = lambda argv: calls.append(argv) or 0
    data = tmp_path / "c.pt"
    data.write_bytes(b"")
    base = ["run", "--set", "penalty", "--data", str(data), "--out", str(tmp_path / "o"), "--whole-rows"]
    assert ss.main(base + ["--model", "20M,105M", "--one-pass", "--micro", "8"]) == 0
    for model, argv in zip(("20M", "105M"), calls):
        flag = flags(argv)
        assert flag["--rows"] == ",".join(f"{r}:lr={tuned[model]}" for r in ss.PENALTY_ROWS[model])
        assert flag["--seeds"] == "0,1" and flag["--micro"] == "8" and flag["--passes"] == "1"
        assert flag["--out"] == str(tmp_path / "o" / "one_pass" / "micro8" / model)
    calls.clear()
    with pytest.raises(SystemExit, match="--set penalty runs in one_pass/micro8"):
        ss.main(base + ["--model", "20M", "--one-pass"])
    with pytest.raises(SystemExit, match="--set penalty has rows at 20M, 105M, not 60M"):
        ss.main(base + ["--model", "60M", "--one-pass", "--micro", "8"])
    results_without(ss, tmp_path, monkeypatch, {"one_pass/micro8/105M": ["sparseloco:lr=0.00025@seed0"]})
    with pytest.raises(SystemExit, match="105M's SparseLoCo lr bracket is open"):
        ss.main(base + ["--model", "105M", "--one-pass", "--micro", "8"])
    with pytest.raises(SystemExit, match="--set penalty runs in one_pass/micro8"):
        ss.main(["fill", "--set", "penalty", "--regimes", "one_pass", "--data", str(data)])
    assert calls == []
    # fill, one GPU, time enough: every row-seed once, seed 0 of both sizes first, --model's order within
    monkeypatch.undo()
    results_without(ss, tmp_path / "fill", monkeypatch, unrun)
    pt = bench_module("paper_tables")
    monkeypatch.setattr(pt, "main", lambda argv: calls.append(argv) or 0)
    monkeypatch.setitem(sys.modules, "paper_tables", pt)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    assert ss.main(["fill", "--set", "penalty", "--model", "105M,20M", "--regimes", "one_pass/micro8",
                    "--data", str(data), "--out", str(tmp_path / "f"), "--budget-s", "100000"]) == 0
    picked = [(flags(a)["--model"], flags(a)["--rows"], flags(a)["--seeds"]) for a in calls]
    assert picked == [(m, f"{r}:lr={tuned[m]}", str(s)) for s in (0, 1) for m in ("105M", "20M")
                      for r in ss.PENALTY_ROWS[m]]
    assert all(flags(a)["--micro"] == "8" and flags(a)["--gpu-ids"] == "0" for a in calls)


def _penalty_row(folder: Path, like: str, name: str, ratio: int, compressed: int, loss: float) -> None:
    """A made-up compressed row run under issue 57's method (its variant's two switches at their
    defaults), from the committed row `like`."""
    import json

    add_row(folder, like, name, 0.0)
    made = sorted(folder.glob("paper_tables_made_*"), key=lambda p: int(p.name.split("_")[3]))[-1]
    doc = json.loads(made.read_text())
    doc["rows"][0]["variant"].update(ratio=ratio, compressed=compressed, project_embedding_every_step=False,
                                     embedding_weight_decay="table")
    doc["rows"][0]["val_loss"] = loss
    made.write_text(json.dumps(doc))


def test_penalty_reads_each_compressed_row_against_sparseloco_at_its_seed_and_lr_and_plots_k_and_k_over_d(tmp_path):
    """size_sweep penalty: every compressed row of a regime against the SparseLoCo row of the same
    seed and lr, in % and nats per seed and their mean, with k = d / ratio, whether its lr is
    SparseLoCo's tuned one, and the method its JSON records (the committed rows: before issue 57);
    the plot of it against k/d and k is written. Made-up rows at 20M and 105M, recomputed by hand."""
    import json
    import shutil

    ss = bench_module("size_sweep")
    copy = tmp_path / "micro8"
    shutil.copytree(ss.results_folder(True, 8), copy)
    sl = {}  # (model, seed) -> SparseLoCo's committed loss at the tuned lr
    for model, lr in (("20M", "0.001"), ("105M", "0.0005")):
        for f in (copy / model).glob("paper_tables_*.json"):
            for r in json.loads(f.read_text())["rows"]:
                if r["variant"]["name"].startswith(f"sparseloco:lr={lr}@"):
                    sl[(model, r["variant"]["seed"])] = r["val_loss"]
    # 20M PP-Compress 1/8 seed 0 is committed (call p65a, issue 57's method); its seed 1 is made up
    made = {("20M", "pp:8:lr=0.001", 0): next(
        r["val_loss"] for f in (copy / "20M").glob("paper_tables_p65a*.json")
        for r in json.loads(f.read_text())["rows"] if r["variant"]["name"] == "pp:8:lr=0.001@seed0")}
    made |= {("20M", "pp:8:lr=0.001", 1): 2.45, ("105M", "pp:16:lr=0.0005", 0): 2.20}
    for (model, name, seed), loss in list(made.items())[1:]:
        ratio = int(name.split(":")[1])
        _penalty_row(copy / model, f"sparseloco:lr={name.split('lr=')[1]}@seed{seed}", f"{name}@seed{seed}",
                     ratio, 8, loss)
    assert ss.main(["penalty", "--one-pass", "--micro", "8", "--results", str(copy)]) == 0
    doc = json.loads((copy / "penalty.json").read_text())
    rows = {(r["model"], r["row"]): r for r in doc["rows"]}
    pp8 = rows[("20M", "pp:8:lr=0.001")]
    want = [100 * (made[("20M", "pp:8:lr=0.001", s)] - sl[("20M", s)]) / sl[("20M", s)] for s in (0, 1)]
    assert pp8["seeds"] == [0, 1] and pp8["penalty_pct_per_seed"] == want and pp8["penalty_pct"] == sum(want) / 2
    assert abs(pp8["penalty_pct_per_seed"][0] - 16.246912463658553) < 1e-9  # the committed penalty.json's
    assert (pp8["k"], pp8["d"], pp8["method"], pp8["at_tuned_sparseloco_lr"]) == (48, 384, "issue 57", True)
    pp16 = rows[("105M", "pp:16:lr=0.0005")]
    assert (pp16["k"], pp16["k_over_d"], pp16["seeds"]) == (48, 1 / 16, [0])
    assert pp16["penalty_nats_per_seed"] == [made[("105M", "pp:16:lr=0.0005", 0)] - sl[("105M", 0)]]
    old = rows[("105M", "pp:8:lr=0.002")]
    assert (old["method"], old["at_tuned_sparseloco_lr"], old["k"]) == ("before issue 57", False, 96)
    assert abs(old["penalty_pct"] - 27.845691597904015) < 1e-9  # the committed summary's degradation_pct
    paper = {(p["model"], p["kind"], p["ratio"]): p for p in doc["paper"]}
    assert paper[("512M", "pp", 96)]["penalty_pct"] == 8.4 and paper[("512M", "het", 8)]["k"] == 192
    assert abs(paper[("178M", "pp", 8)]["penalty_pct"] - 100 * 0.07 / 3.07) < 1e-9
    assert (copy / "penalty.png").stat().st_size > 10_000


def test_paper_regime_row_is_the_papers_178m_regime_and_cannot_finish_on_one_h200_in_a_session():
    """paper_regime.py's row: Table 9's 178M shape at seq 2048, 32 sequences a replica step, M = 8 x
    S = 4, H = 50, 1000 steps, warm-up 500, validation every 100 steps, SparseLoCo and its
    compressed rows at 1e-3, AdamW at 3e-4, saved in a state folder. The estimate: FLOPs at the
    MFU the committed 105M eight-replica run measured on one H200, recomputed by hand; at it a
    row's calls within one session do not reach step 1000 on one GPU (bench/README's plan rests on
    this), and a row's state is far over what a call brings back."""
    import argparse
    import json

    pr = bench_module("paper_regime")
    args = argparse.Namespace(cpu_smoke=False, model="178M", micro=8, budget_s=570.0, resume_only=False, gpus_per_row=1,
                              tag="a")
    for row, lr in (("sparseloco", "0.001"), ("pp:8", "0.001"), ("het:8", "0.001"), ("adamw", "0.0003"),
                    ("diloco", "0.001")):
        flag = flags(pr.row_argv(args, row, "c.pt", "o", "s"))
        assert flag["--rows"].startswith(row.split(":")[0]) and flag["--rows"].endswith(f":lr={lr}")
        assert (flag["--model"], flag["--steps"], flag["--warmup-steps"], flag["--val-every"]) == ("178M", "1000", "500", "100")
        assert (flag["--replicas"], flag["--stages"], flag["--inner-steps"]) == ("8", "4", "50")
        assert int(flag["--micro"]) * int(flag["--gas"]) == 32 and flag["--state-dir"] == "s"
        assert int(flag["--eval-batches"]) * int(flag["--micro"]) == 128
    with open(BENCH / "results" / "sim_throughput_105M_m8_h200" / "sim_throughput_105M_m8_sparseloco_h200.json") as f:
        timed = json.load(f)["results"][0]
    n = 128863232  # 178M's Table 9 shape at vocab 8192 (paper_tables.n_params)
    flops = (6 * n + 12 * 9 * 1024 * 2048) * 8 * 32 * 2048
    e = pr.estimate()
    assert e["n_params"] == n and abs(e["s_per_step_1gpu"] - flops / (989e12 * timed["mfu"])) < 1e-9
    assert pr.session_steps(pr.per_step(e, e["s_per_step_1gpu"]), e["compile_s"], 3) < pr.STEPS
    assert min(e["state_bytes"].values()) > 64e6 * 100


def test_fidelity_sets_our_penalties_and_gaps_beside_the_papers_at_matched_steps(tmp_path, monkeypatch, capsys):
    """paper_regime fidelity: at 20M and 105M the penalty rows run under issue 57's method at the
    tuned lr (rows of older methods or other lrs left out) and SparseLoCo's final gap to the tuned
    AdamW; at 178M every row at the largest validation step all of them reached (a row the session
    stopped reports its curve through its call's `unfinished` entry), penalties and gaps at that
    step; then the paper's Table 1 (178M, 512M), Table 2 and Table 4 values. Made-up rows,
    recomputed by hand; breaks if rows at different steps were compared."""
    import json

    ss = bench_module("size_sweep")
    pr = bench_module("paper_regime")
    copy = results_without(ss, tmp_path, monkeypatch, {})
    monkeypatch.setattr(pr.size_sweep, "RESULTS", ss.RESULTS)
    monkeypatch.setattr(pr.size_sweep, "ONE_PASS", ss.ONE_PASS)
    micro8 = copy / "one_pass" / "micro8"
    _penalty_row(micro8 / "20M", "sparseloco:lr=0.001@seed0", "het:8:lr=0.001@seed0", 8, 4, 2.30)
    regime = tmp_path / "regime" / "178M"
    regime.mkdir(parents=True)

    def curve(losses):
        return [{"step": 100 * (i + 1), "loss": x} for i, x in enumerate(losses)]

    finished = {"sparseloco:lr=0.001@seed0": [5.0, 4.0, 3.6, 3.4, 3.3, 3.2, 3.1, 3.05, 3.0, 2.95],
                "adamw:lr=0.0003@seed0": [4.5, 3.8, 3.4, 3.2, 3.1, 3.0, 2.9, 2.85, 2.8, 2.75]}
    (regime / "paper_tables_a_g0p0.json").write_text(json.dumps({"rows": [
        {"variant": {"name": n}, "steps": 1000, "val_curve": curve(x)} for n, x in finished.items()]}))
    for tag, points in (("b", [5.2, 4.3, 3.9]), ("c", [5.2, 4.3, 3.9, 3.7, 3.6, 3.5, 3.45])):  # calls b, then c
        (regime / f"paper_tables_{tag}_g0p0.json").write_text(json.dumps({"rows": [], "unfinished": [
            {"row": "pp:8:lr=0.001@seed0", "status": "saved", "step": 100 * len(points), "steps": 1000,
             "val_curve": curve(points)}]}))
    assert pr.main(["fidelity", "--results", str(tmp_path / "regime")]) == 0
    doc = json.loads((tmp_path / "regime" / "fidelity.json").read_text())
    at = {p["size"]: p for p in doc["points"]}
    # 178M: pp:8 reached step 700 (call c), so every row is read there
    assert at["178M"]["step"] == 700 and at["178M"]["rows"]["pp:8"] == {"finished": False, "last_step": 700}
    assert at["178M"]["penalty_pct"] == {"pp:8": 100 * (3.45 - 3.1) / 3.1}
    assert at["178M"]["sparseloco_minus_adamw_pct"] == 100 * (3.1 - 2.9) / 2.9
    # 20M: the issue-57 rows at the tuned lr, the committed PP-Compress 1/8 (call p65a) and the made-up
    # Het; 105M's committed rows are the old method's
    sl = [json.loads(f.read_text()) for f in (micro8 / "20M").glob("paper_tables_*.json")]
    loss = {r["variant"]["name"]: r["val_loss"] for d in sl for r in d["rows"]}
    base = loss["sparseloco:lr=0.001@seed0"]
    assert at["20M"]["penalty_pct"] == {"pp:8": 100 * (loss["pp:8:lr=0.001@seed0"] - base) / base,
                                        "het:8": 100 * (2.30 - base) / base}
    assert at["105M"]["penalty_pct"] == {}
    assert at["20M"]["regime"].endswith("79 syncs, final, penalties on seeds 0, gaps on seeds 0,1")
    summary = json.loads((micro8 / "summary.json").read_text())
    gap = {g["model"]: g["gap_pct"] for g in summary["gaps"] if g["mode"] == "sparseloco"}
    assert at["20M"]["sparseloco_minus_adamw_pct"] == gap["20M"] and at["105M"]["sparseloco_minus_adamw_pct"] == gap["105M"]
    assert abs(at["paper 178M"]["penalty_pct"]["pp:8"] - 100 * (3.14 - 3.07) / 3.07) < 1e-9
    assert at["paper 512M"]["penalty_pct"]["het:96"] == 7.7
    assert abs(at["paper 512M"]["sparseloco_minus_adamw_pct"] - 100 * (2.73 - 2.75) / 2.75) < 1e-9
    table = capsys.readouterr().out
    assert "| 178M (1024) | paper regime (seq 2048, 512K tokens a step), step 700 of 1000, seed 0 | +11.3% |" in table


def test_init_ablation_sets_each_compressed_row_against_its_own_inits_sparseloco(tmp_path, monkeypatch):
    """bench/init_ablation.py: a penalty is taken against the SparseLoCo row of the same model config
    (the init), lr and seed, never across inits; the curve only at steps both rows validated; the
    baseline against the reference model's. Made-up rows, recomputed by hand. Then the committed
    summary rebuilds byte for byte from its command, and fidelity shows its rows."""
    import json
    import shlex
    import subprocess
    import sys

    ia = bench_module("init_ablation")

    def row(name, mode, compressed, seed, loss, curve):
        return {"status": "done", "val_loss": loss, "outer_steps": 3,
                "variant": {"name": f"{name}@seed{seed}", "mode": mode, "compressed": compressed, "seed": seed,
                            "lr": 0.001, "ratio": 8 if compressed else 1},
                "val_curve": [{"step": s, "loss": x} for s, x in curve]}

    (tmp_path / "a.json").write_text(json.dumps({"model": "20M", "card": "X", "rows": [
        row("sparseloco:lr=0.001", "sparseloco", 0, 0, 2.0, [(100, 3.0), (200, 2.0)]),
        row("pp:8:lr=0.001", "sparseloco", 8, 0, 2.4, [(100, 3.3), (200, 2.4)]),
        row("sparseloco:lr=0.001", "sparseloco", 0, 1, 2.0, [(200, 2.0)]),
        row("pp:8:lr=0.001", "sparseloco", 8, 1, 2.2, [(200, 2.2)])]}))
    (tmp_path / "b.json").write_text(json.dumps({"model": "m/emb1.json", "card": "X", "rows": [
        row("sparseloco:lr=0.001", "sparseloco", 0, 0, 2.2, [(100, 3.2), (150, 2.9), (200, 2.2)]),
        {**row("pp:8:lr=0.001", "sparseloco", 8, 0, 2.31, [(150, 3.0), (200, 2.31)]),
         "boundary_probe": [{"step": 200, "boundaries": [{"boundary": 0, "dropped": [0.0, 0.4, 0.6],
                                                          "exact": [None, 0.2, 0.1]}]}]},
        row("pp:8:lr=0.001", "sparseloco", 8, 1, 2.0, [(200, 2.0)]),  # no SparseLoCo at seed 1: left out
        row("adamw:lr=0.001", "adamw", 0, 0, 1.9, [(200, 1.9)]),
        row("adamw-pp:8:lr=0.001", "adamw", 8, 0, 2.09, [(200, 2.09)])]}))  # against AdamW, not SparseLoCo
    # Runs made before their config was committed name it where it was: the same fields count as the
    # committed file, others stay apart.
    fields = json.loads((BENCH / "models" / "20M_emb1.json").read_text())
    (tmp_path / "c.json").write_text(json.dumps({"model": "/elsewhere/20M_emb1.json", "model_config": fields, "rows": [
        row("sparseloco:lr=0.001", "sparseloco", 0, 3, 2.0, []), row("pp:8:lr=0.001", "sparseloco", 8, 3, 2.1, [])]}))
    (tmp_path / "d.json").write_text(json.dumps({"model": "/elsewhere/20M_emb1.json",
                                                 "model_config": {**fields, "initializer_range": 0.5}, "rows": [
        row("sparseloco:lr=0.001", "sparseloco", 0, 4, 2.0, []), row("pp:8:lr=0.001", "sparseloco", 8, 4, 2.1, [])]}))
    s = ia.summarize([str(tmp_path)])
    moved = {(r["model"], r["seed"]) for r in s["rows"] if r["seed"] in (3, 4)}
    assert moved == {("bench/models/20M_emb1.json", 3), ("/elsewhere/20M_emb1.json", 4)}, moved
    s["rows"] = [r for r in s["rows"] if r["seed"] not in (3, 4)]
    got = {(r["model"], r["row"].split(":")[0], r["seed"]): r for r in s["rows"]}
    assert set(got) == {("20M", "pp", 0), ("20M", "pp", 1), ("m/emb1.json", "pp", 0), ("m/emb1.json", "adamw-pp", 0)}
    assert s["cards"] == ["X"]
    assert abs(got[("20M", "pp", 0)]["penalty_pct"] - 20.0) < 1e-9 and got[("20M", "pp", 0)]["baseline_vs_reference_pct"] == 0
    e = got[("m/emb1.json", "pp", 0)]
    assert abs(e["penalty_pct"] - 5.0) < 1e-9 and abs(e["penalty_nats"] - 0.11) < 1e-9
    assert abs(e["baseline_vs_reference_pct"] - 10.0) < 1e-9 and e["base_row"] == "sparseloco:lr=0.001"
    assert [p["step"] for p in e["curve"]] == [150, 200] and abs(e["curve"][0]["penalty_pct"] - 100 * 0.1 / 2.9) < 1e-9
    (probed,) = e["boundary_probe"]  # the mean over the compressed replicas only
    assert probed["step"] == 200 and abs(probed["dropped"][0] - 0.5) < 1e-9 and abs(probed["exact"][0] - 0.15) < 1e-9
    a = got[("m/emb1.json", "adamw-pp", 0)]
    assert a["base_row"] == "adamw:lr=0.001" and abs(a["penalty_pct"] - 10.0) < 1e-9
    assert a["baseline_vs_reference_pct"] is None  # the reference model has no AdamW row
    means = {(m["model"], m["row"]): m for m in s["over_seeds"]}
    assert means[("m/emb1.json", "pp:8:lr=0.001")]["seeds"] == [0]
    m20 = means[("20M", "pp:8:lr=0.001")]
    assert m20["seeds"] == [0, 1] and abs(m20["penalty_pct_mean"] - 15.0) < 1e-9
    assert abs(m20["penalty_pct_min"] - 10.0) < 1e-9 and abs(m20["penalty_pct_max"] - 20.0) < 1e-9

    for name, cards in (("summary_20m_h200.json", ["NVIDIA H200"]), ("summary_tiny_cpu.json", ["cpu"])):
        committed = BENCH / "results" / "init_ablation" / name
        doc = json.loads(committed.read_text())
        argv = shlex.split(doc["command"])[1:]
        out = tmp_path / "rebuilt.json"
        argv[argv.index("--out") + 1] = str(out)
        subprocess.run([sys.executable] + argv, cwd=BENCH.parent, check=True, capture_output=True)
        rebuilt = json.loads(out.read_text())
        rebuilt["command"] = doc["command"]
        assert rebuilt == doc and doc["cards"] == cards, name
    tiny = doc
    committed = BENCH / "results" / "init_ablation" / "summary_20m_h200.json"
    doc = json.loads(committed.read_text())

    pr = bench_module("paper_regime")
    points = {p["size"]: p for p in pr.init_ablation_points(str(committed))}
    emb1 = next(r for r in doc["rows"] if r["model"].endswith("20M_emb1.json") and r["row"] == "pp:8:lr=0.001")
    assert points["20M, embedding N(0, 1)"]["penalty_pct"]["pp:8"] == emb1["penalty_pct"]
    assert points["20M, embedding N(0, 1)"]["d"] == 384
    every = {p["size"]: p for p in pr.init_ablation_points()}  # both summaries, the tiny rows as seed means
    mean = next(o for o in tiny["over_seeds"] if o["model"] == "bench/models/tiny_emb1.0.json" and o["row"] == "adamw-het:8")
    assert every["tiny, embedding N(0, 1)"]["penalty_pct"]["adamw-het:8"] == mean["penalty_pct_mean"]
    assert every["tiny, embedding N(0, 1)"]["seeds"]["adamw-het:8"] == mean["seeds"] and len(mean["seeds"]) > 1
    assert every["20M, embedding N(0, 1)"] == points["20M, embedding N(0, 1)"]


def test_boundary_probe_reads_what_the_link_drops_and_rebuilds(monkeypatch):
    """bench/boundary_probe.py on a Het row (M = 4 x S = 2, replicas 2-3 at ratio 4) after two inner
    steps and an outer step (T_S moved, T_perp re-split): a compressed replica's `dropped` is
    ||(I - U U^T)(X - T_perp[x])|| / ||X|| and `exact` ||T_perp[x]|| / ||X||, recomputed in float64
    from the stage's output, the codec's basis and the T_perp the receiver holds; an uncompressed one
    drops 0 and has no exact part. Installed, a validation records its step and returns the same
    losses. Breaks if the probe measured the wrong tensors, or disturbed the validation."""
    import torch
    from test_sim_sharded import _setup

    from hetloco_ds.sim.batched import BatchedSimulation
    from hetloco_ds.sim.rows import parse_variants

    probe = bench_module("boundary_probe")
    run, llama = _setup()
    variant = parse_variants(["het:4"], 4, [0])[0]
    hetloco = variant.hetloco(run.hetloco, 4)
    sim = BatchedSimulation(variant.run(run), hetloco, llama, 4, 2, torch.device("cpu"))
    g = torch.Generator().manual_seed(0)
    for _ in range(2):
        sim.train_step([[(ids, ids) for ids in torch.randint(0, 96, (run.grad_accum, 2, 16), generator=g)]
                        for _ in range(4)])
    sim.outer_step()
    val = [tuple([torch.randint(0, 96, (2, 16), generator=g)] * 2) for _ in range(3)]

    got = probe.measure(sim, val[:2])[0]
    assert got["dropped"][:2] == [0.0, 0.0] and got["exact"][:2] == [None, None]
    for m in (2, 3):
        u = sim.replicas[m].algorithms[0].codec.basis.double()
        perp = sim.perp[1][m].double()
        x2 = lost2 = exact2 = 0.0
        for ids, _ in val[:2]:
            with torch.no_grad():
                x = sim._stage_fns[0](sim.stage_tensors[0], ids.expand(4, *ids.shape))[0][m].double()
            r = x - perp[ids]
            lost = r - r @ u @ u.T
            x2, lost2, exact2 = x2 + x.pow(2).sum(), lost2 + lost.pow(2).sum(), exact2 + perp[ids].pow(2).sum()
        assert 0.05 < got["dropped"][m] < 1.0
        assert abs(got["dropped"][m] - float((lost2 / x2).sqrt())) < 1e-5, (m, got)
        assert abs(got["exact"][m] - float((exact2 / x2).sqrt())) < 1e-5, (m, got)

    monkeypatch.setattr(BatchedSimulation, "validation_losses", BatchedSimulation.validation_losses)
    plain = sim.validation_losses(val)
    rec = probe.install()
    assert sim.validation_losses(val) == plain
    curve = rec.take()
    assert [p["step"] for p in curve] == [2] and curve[0]["boundaries"][0]["dropped"] == got["dropped"]
    assert rec.take() == []
