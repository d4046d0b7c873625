"""Every bench script on the CPU, each checked on numbers a reader of its results relies on, against
a reference the bench did not compute (transformers' parameter count, the per-replica simulator, the
payload a real outer step made, the analytic link bytes). Most run their `--cpu-smoke` mode; the
shaped-link benches (root and minutes) replay their committed results through their own code; the
4-rank gpu_four.py and the elastic gpu_elastic.py (each over a minute of CPU) are checked through
their verdict and summary code on hand-made inputs."""
from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
import time

import pytest

from test_bench_tables import BENCH, bench_module

REPO = BENCH.parent
RESULTS = BENCH / "results"


def _env(**extra) -> dict:
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", HETLOCO_QUIET="1", TQDM_DISABLE="1",
               TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_PORT", "OUT"):
        env.pop(k, None)
    return {**env, **extra}


def _run(argv: list[str], timeout: float, **env) -> subprocess.CompletedProcess:
    proc = subprocess.run(argv, cwd=REPO, env=_env(**env), capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{argv} exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


def _hf_params(preset: str, vocab: int) -> int:
    """transformers' own count for the preset: the reference every bench's n_params must equal."""
    import torch
    from transformers import LlamaForCausalLM

    from hetloco_ds.presets import model_config_for

    with torch.device("meta"):
        return LlamaForCausalLM(model_config_for(preset, vocab)).num_parameters()


def test_gpu_sh_runs_gpu_throughput_on_the_cpu_and_every_system_trains_the_same_model(tmp_path):
    """Breaks if bench/gpu.sh stops running a bench (its --cpu path, the environment record, the log,
    the exit status), or if the three systems of gpu_throughput.py stop training the same model or
    report tokens/s that are not their tokens over their step time."""
    out = tmp_path / "out"
    _run(["bash", "bench/gpu.sh", "--cpu", "gpu_throughput.py", "--cpu-smoke", "--profile-shapes", "",
          "--out", str(out / "tp.json")], timeout=600, OUT=str(out))
    assert "torch" in (out / "env.txt").read_text() and "[bench] wrote" in (out / "gpu_throughput.log").read_text()
    report = json.loads((out / "tp.json").read_text())
    rows = {r["system"]: r for r in report["results"]}
    assert sorted(rows) == ["ds", "hf", "ours"]
    for r in rows.values():
        assert r["n_params"] == _hf_params("tiny", 1024)
        assert r["tokens_per_step"] == 2 * 64
        assert r["tokens_per_s"] == pytest.approx(r["tokens_per_step"] / r["step_s_median"])
        assert abs(r["last_loss"] - math.log(1024)) < 1.0  # a fresh model on random tokens


def test_gpu_sh_stops_before_the_bench_without_the_gpus_it_asks_for(tmp_path):
    """Breaks if bench/gpu.sh starts a bench on a machine with fewer GPUs than --gpus says."""
    proc = subprocess.run(["bash", "bench/gpu.sh", "--gpus", "2", "plan_figures.py", "--out", str(tmp_path / "pf")],
                          cwd=REPO, env=_env(OUT=str(tmp_path)), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and "need 2 GPUs, found 0" in proc.stdout
    assert not (tmp_path / "pf").exists()


def test_gpu_sh_packs_every_result_into_one_whole_archive(tmp_path):
    """BENCH_PACK=1: $OUT's files, three folders down included, end up in $OUT/bench.tgz as they
    are at the end (the log whole), with no part file left, though packs run every 0.1 s while
    the bench writes. Breaks if a pack cut off at the end could leave or corrupt the archive, or if
    a pack that found a file changing (the growing log; tar's exit status 1) were thrown away."""
    import tarfile

    out = tmp_path / "out"
    out.mkdir()
    # 24 MB that gzip cannot shrink: each pack takes long enough that one is under way at the end
    (out / "big.bin").write_bytes(os.urandom(24 << 20))
    _run(["bash", "bench/gpu.sh", "--cpu", "plan_figures.py", "--out", str(out / "a" / "b" / "c" / "pf")],
         timeout=300, OUT=str(out), BENCH_PACK="1", BENCH_PACK_EVERY="0.1")
    kept = {str(p.relative_to(out)): p.read_bytes() for p in out.rglob("*") if p.is_file() and p.name != "bench.tgz"}
    assert "a/b/c/pf/plan_figures.json" in kept and "plan_figures.log" in kept
    assert not [k for k in kept if k.startswith(".bench.tgz")]
    with tarfile.open(out / "bench.tgz") as tar:
        packed = {m.name.removeprefix("./"): tar.extractfile(m).read() for m in tar.getmembers() if m.isfile()}
    assert packed == kept


def test_outer_step_payload_is_what_the_size_rule_says(tmp_path):
    """Breaks if outer_step.py's byte and parameter counts stop being the real ones."""
    os_ = bench_module("outer_step")
    assert os_.main(["--cpu-smoke", "--out", str(tmp_path / "os.json")]) == 0
    r = json.loads((tmp_path / "os.json").read_text())
    assert r["n_params"] == _hf_params("tiny", 1024)
    assert r["payload_bytes_made"] == [r["payload_bytes"]]
    assert r["outer_M1_ms"] > 0 and r["bandwidth_floor"]["prepare_floor_ms"] > 0


def test_sim_check_batched_simulator_equals_the_per_replica_one(tmp_path):
    """Breaks if sim_check.py stops comparing the two simulators (or they part)."""
    sc = bench_module("sim_check")
    assert sc.main(["--cpu-smoke", "--out", str(tmp_path / "sc.json")]) == 0
    r = json.loads((tmp_path / "sc.json").read_text())["results"]
    assert r["batched"]["max_rel_vs_per_replica"] <= 1e-5 and len(r["per_replica"]["losses"]) == 2
    assert r["batched"]["outer"] == {"outer_step": 1, "excluded": []}


def test_sim_throughput_simulators_agree_at_the_outer_step(tmp_path):
    """Breaks if sim_throughput.py's simulators stop running the same model and outer step as the engine."""
    _run([sys.executable, "bench/sim_throughput.py", "--cpu-smoke", "--replicas", "2", "--steps", "1", "--profile",
          "--out", str(tmp_path / "st.json")], timeout=600)
    rows = {r["system"]: r for r in json.loads((tmp_path / "st.json").read_text())["results"]}
    assert sorted(rows) == ["engine", "sim_batched", "sim_per_replica"]
    # one profiled step each: batching the 2 replicas takes fewer ops than running them one by one
    assert 0 < rows["sim_batched"]["profile"]["aten_ops"] < rows["sim_per_replica"]["profile"]["aten_ops"]
    assert {r["n_params"] for r in rows.values()} == {_hf_params("tiny", 1024)}
    a, b = rows["sim_batched"]["last_outer_diagnostics"], rows["sim_per_replica"]["last_outer_diagnostics"]
    assert a["excluded"] == b["excluded"] == [] and a["outer_step"] == b["outer_step"] == 2
    assert a["replicas_per_selected"] == pytest.approx(b["replicas_per_selected"], rel=1e-5)


def test_sim_throughput_times_an_adamw_row_without_an_outer_step(tmp_path):
    """Breaks if sim_throughput.py again asks a plain data-parallel row for the outer step it has
    not (on a GPU that failed the 105M AdamW measurement after its steps were timed)."""
    st = bench_module("sim_throughput")
    assert st.main(["--cpu-smoke", "--replicas", "2", "--steps", "1", "--variant", "adamw", "--systems", "sim_batched",
                    "--outer-repeats", "2", "--out", str(tmp_path / "st.json")]) == 0
    (row,) = json.loads((tmp_path / "st.json").read_text())["results"]
    assert "error" not in row and row["step_s_median"] > 0 and row["variant"] == "adamw@seed0"
    assert "outer_step_s_median" not in row


def test_tied_embeddings_rows_start_from_the_same_model_and_part_after_it(tmp_path):
    """Breaks if tied_embeddings.py's rows stop being like for like (same start, same data) or stop
    differing in what they compare (how the two copies are tied)."""
    te = bench_module("tied_embeddings")
    te.main(["--cpu-smoke", "--out", str(tmp_path)])
    r = json.loads((tmp_path / "tied_embeddings.json").read_text())
    rows = {x["row"]: x for x in r["results"]}
    assert rows["every_step"]["train_losses"][0] == rows["outer_step"]["train_losses"][0]
    assert rows["every_step"]["train_losses"][1:] != rows["outer_step"]["train_losses"][1:]
    got = r["summary"]["outer_step"]["val_vs_every_step_pct"][0]
    want = 100 * (rows["outer_step"]["val_loss"] / rows["every_step"]["val_loss"] - 1)
    assert got == pytest.approx(want, abs=1e-3)


def test_corpus_then_paper_tables_then_summary(tmp_path, capfd):
    """make_corpus.py -> paper_tables.py -> summarize_tables.py, as the tables are made. Breaks if the
    corpus stops decoding to its source text, a table row stops training on it, the FLOP count's
    parameter rule drifts from transformers', or the summary loses a row."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    src = tmp_path / "src"
    (src / "pkg").mkdir(parents=True)
    text = "def f(x):\n    return x * 2  # doubles\n" * 400
    for i in range(12):
        (src / "pkg" / f"m{i}.py").write_text(f"# module {i}\n" + text)
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([text], trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>", "<unk>"]))
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>").save_pretrained(tmp_path / "tok")
    corpus = tmp_path / "corpus.pt"
    assert bench_module("make_corpus").main(["--tokenizer", str(tmp_path / "tok"), "--roots", str(src),
                                             "--seq-len", "32", "--out", str(corpus), "--cpu-smoke"]) == 0
    import torch

    blob = torch.load(corpus)
    assert blob["train"].dtype == torch.int16 and blob["train"].shape[1] == 32 and len(blob["val"]) > 0
    back = PreTrainedTokenizerFast.from_pretrained(tmp_path / "tok").decode(blob["train"][:4].flatten().tolist())
    assert "return x * 2  # doubles" in back

    out = tmp_path / "tables"
    with pytest.raises(SystemExit, match="--val-every 3 must be a multiple of --inner-steps 2"):
        bench_module("paper_tables").main(["--data", str(corpus), "--cpu-smoke", "--inner-steps", "2",
                                           "--val-every", "3", "--out", str(out)])
    # --passes sets the steps from the corpus: 3.5 steps' tokens (2 x 2 x 32 a step) are 3 whole
    # steps, where the smoke's own default is 2
    passes = 3.5 * 128 / blob["train"].numel()
    assert bench_module("paper_tables").main(["--data", str(corpus), "--cpu-smoke", "--val-every", "1",
                                              "--passes", repr(passes), "--probe-boundaries", "--out", str(out)]) == 0
    run = json.loads((out / "paper_tables_smoke_g0p0.json").read_text())
    # a row judged (--s-per-step) not to finish within the budget is not started; with no --state-dir
    # nothing is saved either, and the call ends at once (size_sweep.py run --whole-rows)
    late = tmp_path / "late"
    t0 = time.time()
    assert bench_module("paper_tables").main(["--data", str(corpus), "--cpu-smoke", "--s-per-step", "100",
                                              "--budget-s", "200", "--out", str(late)]) == 0
    assert time.time() - t0 < 60 and not list(late.glob("*.json"))
    assert re.search(r"sparseloco@seed0 +not started: \d+ s at 100\.000 s a step", capfd.readouterr().out)
    # --resume-only (a chain's later calls): continues what an earlier call saved and starts nothing;
    # where nothing is saved (a machine lent afresh) it ends before any worker starts
    state, chain = tmp_path / "state", tmp_path / "chain"
    with pytest.raises(SystemExit, match="--resume-only needs --state-dir"):
        bench_module("paper_tables").main(["--data", str(corpus), "--cpu-smoke", "--resume-only", "--out", str(chain)])
    resume = ["--data", str(corpus), "--cpu-smoke", "--state-dir", str(state), "--resume-only", "--out", str(chain)]
    assert bench_module("paper_tables").main(resume) == 0 and not chain.exists()
    assert "no row of --rows is saved under" in capfd.readouterr().out
    # a budget inside the saving margin: the first row saved at its first boundary, the second never started
    assert bench_module("paper_tables").main(["--data", str(corpus), "--cpu-smoke", "--state-dir", str(state),
                                              "--budget-s", "30", "--tag", "c1", "--out", str(chain)]) == 0
    first = json.loads((chain / "paper_tables_c1_g0p0.json").read_text())
    assert first["rows"] == [] and [(u["row"], u["status"], u["step"]) for u in first["unfinished"]] == \
        [("sparseloco@seed0", "saved", 1)]
    assert bench_module("paper_tables").resumable(str(state)) == {"sparseloco@seed0"}
    assert bench_module("paper_tables").main(resume + ["--tag", "c2"]) == 0
    second = json.loads((chain / "paper_tables_c2_g0p0.json").read_text())
    assert [r["variant"]["name"] for r in second["rows"]] == ["sparseloco@seed0"] and not second["unfinished"]
    assert second["rows"][0]["steps"] == 2 and math.isfinite(second["rows"][0]["val_loss"])
    assert "resuming sparseloco@seed0" in capfd.readouterr().out
    assert bench_module("paper_tables").resumable(str(state)) == set()  # finished: its state removed
    if not torch.cuda.is_available():  # a GPU run on a machine without one: refused, naming the device
        with pytest.raises(SystemExit, match="--device cuda: no CUDA device visible"):
            bench_module("paper_tables").main(["--data", str(corpus), "--cpu-smoke", "--device", "cuda",
                                               "--out", str(late)])
    assert run["val_every"] == 1 and run["steps"] == 3 and run["tokens_per_row"] <= passes * blob["train"].numel()
    for r in run["rows"]:  # the worker process got --val-every: a point a step, the last the final one
        assert r["train_losses_every"] == 10 and len(r["train_losses"]) == 1  # step 1 of 3
        assert [p["step"] for p in r["val_curve"]] == [1, 2, 3] and r["val_curve"][-1]["loss"] == r["val_loss"]
        # and --probe-boundaries: each validation's boundary shares, in the row's own record
        assert [p["step"] for p in r["boundary_probe"]] == [1, 2, 3]
        (b,) = r["boundary_probe"][-1]["boundaries"]  # M = 2 x S = 2: one boundary, the second replica compressed
        if r["variant"]["compressed"]:
            assert b["dropped"][0] == 0.0 and 0.0 < b["dropped"][1] < 1.0 and b["exact"][0] is None and b["exact"][1] > 0
        else:
            assert b["dropped"] == [0.0, 0.0] and b["exact"] == [None, None]
    assert run["n_params"] == _hf_params("tiny", blob["vocab_size"])
    rows = {r["variant"]["name"].split("@")[0]: r for r in run["rows"]}
    assert sorted(rows) == ["het:8", "sparseloco"] and all(math.isfinite(r["val_loss"]) for r in rows.values())
    st = bench_module("summarize_tables")
    summary = {s["row"]: s for s in st.summarize(*st.load_rows([str(out)])[:2])}
    assert summary["het:8"]["compressed_replicas"] == 1 and summary["sparseloco"]["compressed_replicas"] == 0
    het, sl = rows["het:8"]["val_loss"], rows["sparseloco"]["val_loss"]
    assert summary["het:8"]["delta_pct_mean"] == pytest.approx(100 * (het - sl) / sl)


def test_robust_outer_counts_the_screens_decisions_from_the_rows_outer_steps(tmp_path):
    """bench/robust_outer.py --cpu-smoke (tiny, M = 4 x S = 2, 3 outer steps): the reference row's last
    replica is absent from every outer step; the x100 attacker is screened at the 2 x 2 stage decisions of outer steps 2 and 3
    (at the first, the warmup's lr 0 left every pseudo-gradient zero, x100 too: nothing to judge) with
    no honest replica dropped, and not at all without the screen; each delta is 100 (val - reference) /
    reference of the rows' own losses; the outer-step timing has both finishes. Breaks if the bench
    miscounted decisions, mixed up the attacker, or a row ran other settings than it says."""
    out = tmp_path / "robust.json"
    _run([sys.executable, "bench/robust_outer.py", "--cpu-smoke", "--out", str(out)], timeout=900,
         HETLOCO_CACHE=str(tmp_path / "cache"))
    report = json.loads(out.read_text())
    rows = report["rows"]
    assert report["status"] == "done" and list(rows) == ["honest_alone", "clean_screen", "scale_screen", "scale"]
    assert all(r["replicas"] == 4 for r in rows.values()) and rows["honest_alone"]["attack"] == "absent"
    assert rows["scale_screen"]["attacker"] == rows["scale"]["attacker"] == 3
    assert (rows["scale_screen"]["stage_decisions"], rows["scale_screen"]["attacker_screened"],
            rows["scale_screen"]["false_positives"]) == (6, 4, 0)
    assert rows["scale_screen"]["honest_max_norm_ratio"] < 3
    trace = rows["scale_screen"]["screen_trace"]  # [outer step, stage, median, screened, agreement, norm ratio]
    assert [t[:2] for t in trace] == [[k, s] for k in (1, 2, 3) for s in (0, 1)]
    assert [t[3] for t in trace] == [[], [], [3], [3], [3], [3]] and all(t[5][3] > 50 for t in trace[2:])
    assert rows["clean_screen"]["false_positives"] == 0 and "stage_decisions" not in rows["scale"]
    ref = rows["honest_alone"]["val_loss"]
    for r in rows.values():
        assert r["delta_pct_vs_honest_alone"] == pytest.approx(100 * (r["val_loss"] - ref) / ref)
    assert report["verdict"]["scale_contained"] == (abs(rows["scale_screen"]["delta_pct_vs_honest_alone"]) <= 1)
    timing = report["outer_step_seconds"]
    assert timing["finish_screen_none"] > 0 and timing["finish_screen_agreement"] > 0 and timing["prepare"] > 0


def test_plan_figures_reproduces_its_committed_results(tmp_path):
    """Breaks if the cost model or plan_figures.py drift from bench/results/plan_figures.json."""
    pf = bench_module("plan_figures")
    assert pf.main(["--out", str(tmp_path)]) == 0
    got, want = (json.loads(p.read_text()) for p in (tmp_path / "plan_figures.json", RESULTS / "plan_figures.json"))
    assert _close(got, want)
    assert (tmp_path / "plan_fig2.png").stat().st_size > 0


def _close(a, b, path="") -> bool:
    if isinstance(b, dict):
        assert sorted(a) == sorted(b), path
        return all(_close(a[k], b[k], f"{path}.{k}") for k in b)
    if isinstance(b, list):
        assert len(a) == len(b), path
        return all(_close(x, y, f"{path}[{i}]") for i, (x, y) in enumerate(zip(a, b)))
    if isinstance(b, float):
        assert a == pytest.approx(b, rel=1e-9), path
        return True
    assert a == b, path
    return True


def test_overlap_links_committed_predictions_are_the_plans(tmp_path):
    """Breaks if overlap_links.py's prediction or pass criteria, or the cost model under them, no longer
    give what bench/results/overlap_links.json recorded (the shaped runs themselves need root and
    minutes; tests/test_netlab.py runs the engine on a shaped link with shaped_links.py's method)."""
    ol = bench_module("overlap_links")
    sl = bench_module("shaped_links")
    result = json.loads((RESULTS / "overlap_links.json").read_text())
    for p in result["points"]:
        bw = min(p["stage_bw_bps"] or sl.UNLIMITED, 1e15)
        pred = ol.predict(p["stages"], p["ratio"], bw, p["schedule"], p["compute_seconds_per_microbatch_busiest"])
        assert pred.total_time == pytest.approx(p["predicted"]["step_seconds"], rel=1e-9)
    assert ol.agreement(result["points"]) == result["agreement"]
    shaped = json.loads((RESULTS / "shaped_links.json").read_text())
    assert sl.agreement(shaped["points"]) == shaped["agreement"]


def test_gpu_links_committed_predictions_are_the_plans():
    """Breaks if gpu_links.py's predictions, its calibration or its agreement, or the cost model under
    them, no longer give what bench/results/gpu_links_h200x2.json recorded from the 2 x H200 run (the
    run needs two GPUs and root; its CPU stand-in, `--cpu-smoke`, takes about 2 minutes)."""
    gl = bench_module("gpu_links")
    result = json.loads((RESULTS / "gpu_links_h200x2.json").read_text())
    setup = gl.Setup.of(result)
    cal = result["calibration"]
    assert setup.calibrate(96, "blocking", cal["unshaped_rate_bps"], cal["t_unshaped_step"]) == pytest.approx(
        cal["tflops"], rel=1e-9)
    assert setup.predict(96, cal["unshaped_rate_bps"], "blocking", cal["tflops"]).total_time == pytest.approx(
        cal["t_unshaped_step"], rel=1e-6)
    stage = [p for p in result["points"] if p["part"] == "a"]
    assert len(stage) == 3 * 2 * 4 and {p["ratio"] for p in stage} == {96, 8, 1}
    for p in stage:
        pred = setup.predict(p["ratio"], p["predicted"]["rate_bps"], p["schedule"], cal["tflops"])
        assert pred.total_time == pytest.approx(p["predicted"]["step_seconds"], rel=1e-9)
        assert pred.stage_link_bytes_per_step == p["stage_link_payload_bytes_per_step"]  # the engine sent what plan counts
    for p in (p for p in result["points"] if p["part"] == "b" and p["replica_bw_bps"]):
        pred = setup.predict_replica(p["replica_bw_bps"])
        assert pred.outer_sync_time == pytest.approx(p["predicted"]["outer_sync_seconds"], rel=1e-9)
        assert pred.outer_payload_bytes[0] == p["payload_bytes"]
    assert gl.agreement(result["points"]) == result["agreement"]
    assert gl.hidden_transfers(result["points"], result["settings"]["n_mb"]) == result["hidden_transfers"]


def test_gpu_two_counts_the_stage_link_bytes_it_sends(tmp_path):
    """Breaks if gpu_two.py's measured stage-link bytes (two real ranks) stop equalling the analytic count."""
    _run([sys.executable, "bench/gpu_two.py", "--cpu-smoke", "--configs", "a_ours_r8", "--out", str(tmp_path / "g2.json")],
         timeout=600)
    (two,) = json.loads((tmp_path / "g2.json").read_text())["results"]
    link = two["stage_link"]
    assert link["match"] and link["ratio"] == 8 and link["k"] == 128 // 8
    assert link["activation_grad_sent"] == 2 * 2 * 64 * link["k"] * (2 if two["ds_config"]["bf16"]["enabled"] else 4)


def test_gpu_four_judges_the_replicas_hashes():
    """gpu_four.py's verdict on its per-stage parameter hashes, on hand-made ones (its --cpu-smoke runs
    4 DeepSpeed ranks: over a minute of CPU, run by hand). Breaks if replicas that differ are called
    identical, or a missing hash passes."""
    g4 = bench_module("gpu_four")

    def entry(stage, replica, **hashes):
        return {"stage": stage, "replica": replica, "hashes": {k: {"sha256": v, "step": 1} for k, v in hashes.items()}}

    table = g4.compare_hashes([entry(0, 0, init="a", inner="b", after_outer="c"),
                               entry(0, 1, init="a", inner="x", after_outer="c"),
                               entry(1, 0, init="d", inner="e", after_outer="f"),
                               entry(1, 1, init="d", inner="y", after_outer=None)])
    assert table["identical_init"] == {"stage0": True, "stage1": True}
    assert table["identical_inner"] == {"stage0": False, "stage1": False}
    assert table["identical_after_outer"] == {"stage0": True, "stage1": False}
    with pytest.raises(SystemExit):
        g4.parse_args(["--cpu-smoke", "--warmup", "3"])  # H = 3: the outer step would not be timed


def test_resident_link_times_every_condition(tmp_path):
    """Breaks if resident_link.py stops timing its GEMMs in each condition it lists."""
    _run([sys.executable, "bench/resident_link.py", "--cpu-smoke", "--out", str(tmp_path / "rl.json")], timeout=600)
    r = json.loads((tmp_path / "rl.json").read_text())
    want = {f"{b}/carveout{c}/{res}" for b, c, res in bench_module("resident_link").conditions(False, 0)}
    assert set(r["results"]) == want and len(want) == 4
    assert all(x["ms_median"] > 0 for x in r["results"].values())
    assert r["results"]["cpu/carveout0/none"]["vs_same_blas_alone"] == 1.0


def test_gpu_elastic_summary_reads_the_phases_from_the_metrics_rows():
    """gpu_elastic.py's summary on hand-made metrics rows with known answers (its --cpu-smoke starts
    three training processes, five with --replica-stages 1,2, and a lighthouse: minutes on 2 cores,
    run by hand). Breaks if a phase takes the wrong rows (the fault's outer step, the heal, the
    rejoin), if the killed replica's rows from before its restart are lost, or if checksums compared
    at no common step counted as equal."""
    ge = bench_module("gpu_elastic")

    def step(s, t, secs=1.0):
        return {"kind": "step", "step": s, "time": t, "tokens": 100, "seconds": secs}

    def outer(s, t, members, secs, quorum, healed=False, sums=None):
        return {"kind": "outer", "step": s, "time": t, "members": members, "seconds": secs, "quorum_seconds": quorum,
                "payload_bytes": 64, "healed": healed, "params_checksum": [s],
                "block_checksums": sums or [f"{s:x}", f"{s + 1:x}"]}

    # H = 2, replica stages [1, 2]; replica 1 killed at t = 6.5, restarted at t = 10.5, healed at step 12
    # (t = 12, not contributing), both members again from step 14.
    args = ge.parse_args(["--cpu-smoke", "--replica-stages", "1,2"])
    assert ge.roles(args.depths) == (0, 1) and ge.roles([2, 1]) == (1, 0) and ge.roles([1, 1]) == (0, 1)
    assert ge.gpus(args.depths, 1) == ["1", "2"] and ge.gpus(args.depths, 1, "4,5,6,7") == ["5", "6"]
    r0 = [step(s, float(s)) for s in range(1, 17)]
    r0 += [outer(2, 2.0, [0, 1], 0.9, 0.5), outer(4, 4.0, [0, 1], 0.1, 0.05), outer(6, 6.0, [0, 1], 0.3, 0.1),
           outer(8, 8.0, [0], 3.2, 3.0), outer(10, 10.0, [0], 0.2, 0.1), outer(12, 12.0, [0], 0.6, 0.4),
           outer(14, 14.0, [0, 1], 0.4, 0.3), outer(16, 16.0, [0, 1], 0.2, 0.1)]
    before = [step(s, float(s), 2.0) for s in range(1, 7)]
    before += [outer(2, 2.0, [0, 1], 0.9, 0.5), outer(4, 4.0, [0, 1], 0.1, 0.05), outer(6, 6.0, [0, 1], 0.3, 0.1)]
    after = [step(s, 11.0 + s / 10) for s in (11, 12)] + [step(s, float(s), 0.5) for s in (13, 14, 15, 16)]
    after += [outer(12, 12.0, [0], 0.6, 0.4, healed=True), outer(14, 14.0, [0, 1], 0.4, 0.3),
              outer(16, 16.0, [0, 1], 0.2, 0.1)]
    s = ge.summarize(r0, before, after, 0, 1, 6.5, 10.5, args)
    survivor, killed = s["replicas"]["0"], s["replicas"]["1"]
    assert (survivor["stages"], survivor["role"], killed["stages"], killed["role"]) == (1, "survivor", 2, "killed")
    assert survivor["fault_cost_s"]["first_outer_step_alone_quorum_s"] == 3.0
    assert survivor["outer_step_s"]["two_members"] == {"median": 0.2, "n": 3, "quorum_median": 0.1}  # 4, 6, 16
    assert survivor["outer_step_s"]["one_member"] == {"median": 0.4, "n": 2, "quorum_median": 0.25}  # 10, 12
    assert killed["outer_step_s"]["two_members"] == {"median": 0.2, "n": 3, "quorum_median": 0.1}  # 4, 6, 16
    assert killed["recovery_s"]["healed_step"] == 12
    assert killed["recovery_s"]["restart_to_first_step"] == pytest.approx(11.0 + 1.1 - 10.5)
    assert killed["recovery_s"]["restart_to_two_members_again"] == pytest.approx(14.0 - 10.5)
    assert survivor["tokens_per_s"]["alone"]["steps"] == 5  # steps 9 to 13: between t 8 and t 14
    assert killed["tokens_per_s"]["together"] == {"steps": 4, "inner_tokens_per_s": 50.0, "tokens_per_s": 50.0}
    assert killed["tokens_per_s"]["together_again"]["steps"] == 2  # steps 15, 16
    c = s["checksums"]
    assert c["field"] == "block_checksums" and c["equal_before_kill"] and c["steps_before_kill"] == [2, 4, 6]
    assert c["equal_after_heal"] and c["steps_after_heal"] == [12, 14, 16]
    assert c["at_last_step_compared"] == {"step": 16, "0": ["10", "11"], "1": ["10", "11"]}
    after[-1]["block_checksums"] = ["10", "12"]
    assert not ge.summarize(r0, before, after, 0, 1, 6.5, 10.5, args)["checksums"]["equal_after_heal"]
    lost = [r for r in after if r["kind"] == "step" or r["step"] == 12]  # no common step after the heal but 12
    assert ge.summarize(r0, before, lost, 0, 1, 6.5, 10.5, args)["checksums"]["steps_after_heal"] == [12]
    assert ge._checksums([outer(2, 2.0, [0], 1, 1)], [], "block_checksums") == ([], False)


def test_stock_pipe_reports_its_own_step_times_and_profiles_deepspeeds_instructions(tmp_path):
    """Breaks if the stock-DeepSpeed baseline (bench/stock_pipe.py) stops training the shape it names
    (transformers' parameter count), reports a rate that is not its tokens over its median steady
    step, or its profile loses DeepSpeed's instructions (the timeline the 1B comparison reads)."""
    import statistics

    import torch
    from transformers import LlamaForCausalLM

    out = tmp_path / "stock.json"
    _run([sys.executable, "bench/stock_pipe.py", "--cpu-smoke", "--out-json", str(out)], timeout=600)
    r = json.loads(out.read_text())
    stock = bench_module("stock_pipe")
    with torch.device("meta"):
        assert r["nparams"] == LlamaForCausalLM(stock.llama_shape("tiny", 256)).num_parameters()
    steady = [t for i, t in enumerate(r["step_seconds"], 1) if i > r["warmup"] and i != 3]
    assert r["median_step_seconds"] == statistics.median(steady)
    assert math.isclose(r["global_tokens_per_s"], 2 * 2 * 32 * r["replicas"] / r["median_step_seconds"])
    assert len(r["peak_allocated_gib_by_rank"]) == 2
    for rank, first in ((0, "exec_load_micro_batch"), (1, "exec_recv_activations")):
        timeline = json.loads((tmp_path / "profile" / f"rank{rank}.json").read_text())["timeline"]
        names = [row[0] for row in timeline]
        assert names[0] == first and names.count("exec_forward_pass") == 2 and names.count("exec_backward_pass") == 2
        assert names[-1] == "exec_optimizer_step"


def test_scale_steady_rule_leaves_out_warmup_outer_and_profiled_steps(tmp_path):
    """The rule ANCHORS.md states for our rate: no step before 6, none at or right after an outer
    step, not the profiled one; breaks if scale.py medians over the wrong steps."""
    scale = bench_module("scale")
    path = tmp_path / "metrics.jsonl"
    rows = [{"kind": "step", "step": s, "loss": 9.0 - s / 10, "global_tokens_per_s": 1000.0 * s, "peak_memory_bytes": 2**30 * s,
             "peak_memory_bytes_by_stage": [2**31 * (13 - s), 2**30 * s]}
            for s in range(1, 13)] + [{"kind": "outer", "step": 4, "seconds": 0.5}]
    path.write_text("".join(json.dumps(r, sort_keys=True) + "\n" for r in rows))
    got = scale.steady_rates(str(path), inner_steps=4, profiled=7)
    assert got["steady_steps"] == 3 and got["global_tokens_per_s"] == 10000.0  # steps 6, 10, 11
    assert got["outer_step_seconds"] == [0.5] and got["peak_memory_gib_writers"] == 12 and got["final_loss"] == 9.0 - 1.2
    assert got["peak_memory_gib_by_stage"] == [24, 12]  # each stage's own high-water mark, whichever step set it
    assert scale.step_rows(str(path)) == 12
    # a run's fullest GPU: stock's ranks, ours' stages, a profiled step's ranks beside the writers', the writers'
    assert scale.gpu_peak_gib({"peak_allocated_gib_by_rank": [3.0, 5.0]}) == 5.0
    assert scale.gpu_peak_gib(dict(got, profile={"rank0": {"peak_allocated_gib": 99.0}})) == 24
    assert scale.gpu_peak_gib({"peak_memory_gib_writers": 12, "profile": {"rank0": {"peak_allocated_gib": 16.6},
                                                                          "rank2": {"peak_allocated_gib": 13.5}}}) == 16.6
    assert scale.gpu_peak_gib({"peak_memory_gib_writers": 12, "profile": {}}) == 12


def test_scale_checkpoint_facts_time_the_steps_trained_while_each_checkpoint_was_written(tmp_path):
    """scale.py's checkpoint columns: every commit row, the steps whose rows ended between its
    save's end (commit time - to_commit + blocked) and its commit, their median seconds, and the
    median of the other steps (the first 5 left out); the newest checkpoint's bytes on disk.
    Breaks if a window is off by its blocked seconds or steps inside a write count as otherwise."""
    scale = bench_module("scale")
    run = tmp_path / "run"
    (run / "checkpoints" / "global_step8").mkdir(parents=True)
    (run / "checkpoints" / "global_step8" / "manifest.json").write_text(json.dumps({"step": 8, "files": {"a": {}}}))
    (run / "checkpoints" / "global_step8" / "a.pt").write_bytes(b"x" * 1000)
    (run / "checkpoints" / "latest").write_text("global_step8")
    rows = [{"kind": "step", "step": s, "seconds": 2.0 if 5 <= s <= 6 else 1.0, "time": 100.0 + s} for s in range(1, 13)]
    # saved at t = 104 (blocked 0.5 s), committed at 106.5: steps ending at 105 and 106 trained while written
    rows.append({"kind": "checkpoint", "tag": "global_step4", "step": 4, "first_save": True, "bytes": 1000,
                 "seconds": {"blocked": 0.5, "written": 2.0, "to_commit": 2.5}, "time": 106.5})
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    got = scale.checkpoint_facts(str(run / "metrics.jsonl"), str(run))
    assert got["bytes"] == 1000 + len(json.dumps({"step": 8, "files": {"a": {}}})) and got["step"] == 8
    (c,) = got["commits"]
    assert c["steps_while_written"] == 2 and c["median_step_seconds_while_written"] == 2.0 and c["first_save"]
    assert got["median_step_seconds_otherwise"] == 1.0  # steps 8-12 (7 ends within a second of the commit)


def test_scale_replica_rates_split_the_rows_by_replica(tmp_path):
    """Mixed depths (scale.py --parts mixed): each replica's own steady tokens/s, bytes sent by link
    class summed over its rows, and its outer steps; breaks if replicas' rows mix or bytes are dropped."""
    scale = bench_module("scale")
    path = tmp_path / "metrics.jsonl"
    rows = []
    for m, (tokens, act) in enumerate(((512, 0), (1024, 300))):
        for s in range(1, 13):
            sync = 100 * (m + 1) if s % 4 == 0 else 0
            rows.append({"kind": "step", "replica": m, "step": s, "tokens": tokens, "seconds": 0.5 if s != 10 else 1.0,
                         "bytes": {"activation": {"sent": act, "recv": act}, "outer_sync": {"sent": sync, "recv": sync}}})
        rows += [{"kind": "outer", "replica": m, "step": s, "seconds": 0.25 * (m + 1)} for s in (4, 8, 12)]
    path.write_text("".join(json.dumps(r, sort_keys=True) + "\n" for r in rows))
    got = scale.replica_rates(str(path), inner_steps=4)
    assert set(got) == {"0", "1"}
    assert got["0"]["steady_steps"] == 4 and got["0"]["tokens_per_s"] == 1024.0  # steps 6, 7, 10 (slow), 11
    assert got["1"]["tokens_per_s"] == 2048.0 and got["1"]["outer_step_seconds"] == [0.5, 0.5, 0.5]
    assert got["1"]["sent_bytes"] == {"activation": 3600, "outer_sync": 600} and got["0"]["sent_bytes"]["outer_sync"] == 300
    assert got["0"]["outer_steps"] == 3 and got["1"]["sent_bytes_per_step"]["activation"] == 300


def test_scale_largest_part_runs_every_row_on_the_cpu_with_plans_prediction_and_stocks_outcome(tmp_path):
    """bench/scale.py --cpu-smoke --parts largest (issue 59, item 3; tiny shapes, 8 steps, 7 kept; three runs):
    stock DeepSpeed checkpointing its decoder layers, then ours with 8-bit and host AdamW moments on
    the 8B row's shape and on the 70B stage's, every ours run at S = 1 with every decoder layer
    recomputed, its model from the LlamaConfig JSON the part wrote (transformers' parameter count is
    the row's), each row with finite tokens/s, plan's prediction for its own optimizer state, and
    its outcome; stock's out-of-memory outcome, read from a log, does not fail the part. Breaks if
    the part stops running a row, passing its options, or recording what the later GPU run checks."""
    import torch
    from transformers import LlamaForCausalLM

    from hetloco_ds.presets import model_config_for

    out, work = tmp_path / "out", tmp_path / "work"
    # Three of its five runs (the suite's time): stock, and each shape with one of the two options.
    _run([sys.executable, "bench/scale.py", "--cpu-smoke", "--parts", "largest", "--out", str(out), "--work", str(work),
          "--only", "stock_8b,ours_8b_s1_8bit,ours_70b_stage_s1_cpu_offload"], timeout=900)
    data = json.loads((out / "scale.json").read_text())
    rows = {r["name"]: r for r in data["rows"]}
    assert data["card"] == "cpu" and list(rows) == ["stock_8b_s1_ckpt1", "ours_8b_s1_8bit", "ours_70b_stage_s1_cpu_offload"]
    for r in rows.values():
        assert r["part"] == "largest" and r["rc"] == 0 and r["outcome"] == "ok" and r["last_error_line"] is None
        assert math.isfinite(r["global_tokens_per_s"]) and r["global_tokens_per_s"] > 0
        assert math.isfinite(r["plan_peak_gib"]) and r["plan_peak_gib"] > 0
    stock = rows["stock_8b_s1_ckpt1"]
    assert stock["activation_checkpoint_interval"] == 1 and stock["may_run_out_of_memory"] is True
    assert stock["plan_inputs"]["optimizer_state"] == "fp32" and stock["plan_inputs"]["sparseloco"] is False
    for name, r in rows.items():
        if r["system"] != "ours":
            continue
        cfg, opt = r["config"], name.split("_s1_")[1]
        assert cfg["hetloco"]["train"]["optimizer_state"] == opt == r["plan_inputs"]["optimizer_state"]
        assert cfg["pipeline"] == {"stages": 1, "activation_checkpoint_interval": 1}
        assert r["plan_inputs"]["activation_checkpoint_interval"] == 1 and r["steady_steps"] >= 2
        assert r["model"].endswith(".json") and json.loads(open(r["model"]).read()) == r["model_fields"]
        with torch.device("meta"):
            assert r["params"] == LlamaForCausalLM(model_config_for(r["model"], 8192)).num_parameters()
    stage = rows["ours_70b_stage_s1_cpu_offload"]
    assert stage["model_fields"]["num_hidden_layers"] == 2
    by_stage = stage["plan_peak_gib_70b_s8_by_stage"]
    assert all(len(v) == 8 for v in by_stage.values())
    # the moments on the host leave every stage's predicted peak lower than 8-bit moments on the device
    assert all(h < e for h, e in zip(by_stage["cpu_offload"], by_stage["8bit"])), by_stage
    # what the GPU run's stock row will likely record: its last error line, and the part still passes
    scale = bench_module("scale")
    log = tmp_path / "oom.log"
    log.write_text("python -m torch.distributed.run ...\n  File \"engine.py\", line 1\n"
                   "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 3.91 GiB.\n"
                   "E1129 torch.distributed.elastic.multiprocessing.api: failed (exitcode: 1)\n"
                   "torch.distributed.elastic.multiprocessing.errors.ChildFailedError:\n")
    got = scale.run_outcome(1, str(log))
    assert got["outcome"] == "out_of_memory" and got["last_error_line"].endswith("ChildFailedError:")
    assert got["out_of_memory_line"].startswith("torch.OutOfMemoryError: CUDA out of memory")
    assert scale.row_ok(dict(stock, rc=1, **got)) and not scale.row_ok(dict(rows["ours_8b_s1_8bit"], rc=1, **got))


def test_scale_summary_replays_the_committed_1b_and_178m_comparison():
    """The committed summary is what --summarize makes of the committed runs: each system's median
    over its repeats and its ratio to stock's median (bench/README quotes these)."""
    scale = bench_module("scale")
    d = RESULTS / "scale_h100x4"
    files = [str(d / f) for f in ("speed_pinned_loads_r0_r1.json", "speed_r2_memory_s178.json", "s178_r1_r2.json")]
    got = scale.summarize(files)
    assert got == json.loads((d / "summary.json").read_text())
    speed = got["systems"]
    assert len(speed["speed/ours_1b_default"]["global_tokens_per_s"]) == 3
    assert speed["speed/ours_1b_default"]["median"] == sorted(speed["speed/ours_1b_default"]["global_tokens_per_s"])[1]
    assert math.isclose(speed["speed/ours_1b_default"]["vs_stock_median"],
                        speed["speed/ours_1b_default"]["median"] / speed["speed/stock_1b_s2"]["median"])
    # the fullest GPU: the profiled repeat's stage 0 (27.85 GiB, overlapped then), not the writers' last stage
    assert speed["speed/ours_1b_default"]["peak_allocated_gib_fullest_gpu"] == 27.852
    # the same comparison under the defaults since (blocking inside a host, the outer state on the host)
    new = scale.summarize([str(d / "speed_outer_cpu_r0_r1_r2.json")])
    assert new == json.loads((d / "summary_outer_cpu.json").read_text())
    ours, stock = new["systems"]["speed/ours_1b_default"], new["systems"]["speed/stock_1b_s2"]
    assert ours["median"] == sorted(ours["global_tokens_per_s"])[1] and ours["vs_stock_median"] > 1
    assert (ours["peak_allocated_gib_fullest_gpu"], stock["peak_allocated_gib_fullest_gpu"]) == (16.599, 13.440485954284668)


def test_penalty_rows_train_on_the_cpu_under_issue_57s_method(tmp_path):
    """size_sweep.py run --set penalty --cpu-smoke: 20M's penalty rows (issue 57, item 2) by name, at
    SparseLoCo's tuned lr of the micro-batch-8 regime, train end to end on the CPU (random tokens,
    paper_tables' tiny schedule, the model's own width, so k = 4 at 1/96), each under the method as
    it stands (no per-step projection, weight decay on the whole table). Breaks if the recipe's rows
    stop parsing, fitting the width or running, or run the old method by default."""
    _run([sys.executable, "bench/size_sweep.py", "run", "--set", "penalty", "--one-pass", "--micro", "8",
          "--model", "20M", "--seeds", "0", "--cpu-smoke", "--out", str(tmp_path)], timeout=900)
    (run,) = [json.loads(p.read_text()) for p in (tmp_path / "one_pass" / "micro8" / "20M").glob("paper_tables_*.json")]
    assert run["model_config"]["hidden_size"] == 384
    got = {r["variant"]["name"]: r for r in run["rows"]}
    assert sorted(got) == sorted(f"{r}:lr=0.001@seed0" for r in ("pp:8", "het:8", "pp:96", "het:96"))
    for r in got.values():
        assert r["variant"]["project_embedding_every_step"] is False and r["variant"]["embedding_weight_decay"] == "table"
        assert math.isfinite(r["val_loss"]) and r["val_curve"][-1]["loss"] == r["val_loss"]
    assert got["pp:96:lr=0.001@seed0"]["variant"]["ratio"] == 96 and got["het:8:lr=0.001@seed0"]["variant"]["compressed"] == 1


def test_paper_regime_row_saves_its_curve_at_the_budget_and_resumes_on_the_cpu(tmp_path):
    """paper_regime.py run --cpu-smoke: a row of the 178M recipe's chain on the CPU (tiny model):
    the first call, its budget inside the saving margin, saves the row at its first boundary and its
    JSON carries the validation curve reached so far (the state itself never leaves the machine);
    --resume-only finishes it with the whole curve; on a machine with nothing saved it ends at once."""
    common = [sys.executable, "bench/paper_regime.py", "run", "--row", "het:8", "--cpu-smoke",
              "--out", str(tmp_path), "--state-dir", str(tmp_path / "state")]
    _run(common + ["--budget-s", "30", "--tag", "c1"], timeout=600)
    first = json.loads((tmp_path / "178M" / "paper_tables_c1_g0p0.json").read_text())
    (u,) = first["unfinished"]
    assert first["rows"] == [] and (u["status"], u["step"]) == ("saved", 1) and [p["step"] for p in u["val_curve"]] == [1]
    assert first["warmup_steps"] == 1 and first["val_every"] == 1
    _run(common + ["--resume-only", "--tag", "c2"], timeout=600)
    (row,) = json.loads((tmp_path / "178M" / "paper_tables_c2_g0p0.json").read_text())["rows"]
    assert row["variant"]["name"] == "het:8:lr=0.001@seed0" and [p["step"] for p in row["val_curve"]] == [1, 2, 3]
    assert row["val_curve"][0] == u["val_curve"][0]
    done = _run(common + ["--resume-only", "--tag", "c3"], timeout=120)
    assert "nothing to resume" in done.stdout and not (tmp_path / "178M" / "paper_tables_c3_g0p0.json").exists()


def test_optimizer_state_rows_differ_only_in_the_option_and_resume_keeps_them(tmp_path):
    """bench/optimizer_state.py --cpu-smoke (tiny, M = 2 x S = 2, 4 steps) with fp32 and cpu_offload,
    then --resume adding bf16 when torchao is installed: every row trains on the same tokens (the
    same outer steps), cpu_offload's loss is fp32's exactly (on the CPU it is fp32's arithmetic),
    each delta is 100 (val - fp32's) / fp32's of the rows' own losses, the bytes per parameter are
    `sizes`'s, and the resumed call keeps the first call's rows without training them again.
    Breaks if a row ran with another option or schedule than it says, or --resume retrains."""
    from hetloco_ds import sizes

    out = tmp_path / "os.json"
    env = {"HETLOCO_CACHE": str(tmp_path / "cache")}
    _run([sys.executable, "bench/optimizer_state.py", "--cpu-smoke", "--options", "fp32,cpu_offload", "--out", str(out)],
         timeout=600, **env)
    first = json.loads(out.read_text())
    rows = first["rows"]
    assert first["status"] == "done" and list(rows) == ["tiny:fp32", "tiny:cpu_offload"]
    assert rows["tiny:cpu_offload"]["val_loss"] == rows["tiny:fp32"]["val_loss"]
    assert rows["tiny:cpu_offload"]["delta_pct_vs_fp32"] == 0 and rows["tiny:fp32"]["delta_pct_vs_fp32"] is None
    assert (rows["tiny:cpu_offload"]["device_bytes_per_param"], rows["tiny:cpu_offload"]["host_bytes_per_param"]) == (0, 16)
    assert "optimizer_state.py" in first["command"] and first["card"].startswith("cpu")
    try:
        import torchao  # noqa: F401
    except ImportError:
        return
    proc = _run([sys.executable, "bench/optimizer_state.py", "--cpu-smoke", "--options", "fp32,cpu_offload,bf16",
                 "--resume", "--out", str(out)], timeout=600, **env)
    assert "tiny:fp32: kept" in proc.stdout and "tiny:cpu_offload: kept" in proc.stdout
    rows = json.loads(out.read_text())["rows"]
    assert {k: rows[k] for k in first["rows"]} == first["rows"]
    bf16 = rows["tiny:bf16"]
    assert bf16["outer_steps"] == rows["tiny:fp32"]["outer_steps"] == 2
    assert bf16["delta_pct_vs_fp32"] == pytest.approx(100 * (bf16["val_loss"] - rows["tiny:fp32"]["val_loss"])
                                                       / rows["tiny:fp32"]["val_loss"])
    assert bf16["device_bytes_per_param"] == sizes.optimizer_state_bytes_per_param("bf16") == 4


def test_loss_chunk_rows_name_each_way_and_ours_is_the_whole_logits_loss(tmp_path):
    """bench/loss_chunk.py --cpu-smoke (the tiny head, 64 tokens, bf16 autocast): a row per way this
    machine has (the whole logits, ours at 16 tokens a chunk, torch's chunked linear_cross_entropy
    where this torch has it), each with its median seconds and its loss and gradients beside the
    whole logits'; ours within bf16's rounding of a logit. Breaks if a way fails or drifts."""
    import torch
    import torch.nn.functional as F

    out = tmp_path / "loss_chunk.json"
    _run([sys.executable, "bench/loss_chunk.py", "--cpu-smoke", "--out", str(out)], timeout=300)
    doc = json.loads(out.read_text())
    rows = {r["way"]: r for r in doc["rows"]}
    expected = {"whole", "ours:16"} | ({"torch:16"} if hasattr(F, "linear_cross_entropy") else set())
    assert expected <= set(rows) and doc["card"] == "cpu" and doc["torch"] == torch.__version__
    for way in expected:
        assert rows[way]["error"] is None and len(rows[way]["seconds"]) == 2, rows[way]
    assert rows["ours:16"]["loss_rel_diff"] < 1e-5 and rows["ours:16"]["grad_rel_diff"] < 2e-2, rows["ours:16"]
