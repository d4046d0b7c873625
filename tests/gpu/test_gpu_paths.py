"""The paths users run, on GPUs, under the defaults: what the CPU suite cannot see is where host-held
state (the outer state in pinned host memory, checkpoint staging, loaded files) meets device tensors.

Each test reads the result of its job (tests/gpu/jobs.py; all of a session's jobs run side by side)
and asserts numbers: a resumed run's losses and exported weights bitwise equal to the uninterrupted
run's, every checkpoint complete and verified, the export's loss under `transformers` equal to the
engine's validation, a user's loop saving between outer steps and at one and loading both back,
plan's memory against the measured peak, the simulators' losses against each other, an elastic
fleet healing a killed replica to the survivor's checksums.
"""
from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import torch

from gpu import jobs

pytestmark = pytest.mark.gpu

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the checks also run on a CPU job (their own smoke)
BF16_RTOL = 3e-3
"""The engine's validation (its own stage layers, DeepSpeed's inference schedule) against transformers'
forward of the export, both under bf16 autocast: the same operations, fused and ordered differently."""


def _explain(proc: dict) -> str:
    return f"{proc['cmd']}\nexit {proc['rc']}, log {proc['log']}:\n{proc['tail']}"


def _rows(out, kind: str) -> list[dict]:
    with open(Path(out) / "metrics.jsonl") as f:
        return [r for r in map(json.loads, f) if r["kind"] == kind]


def _hf_tensors(hf_dir) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out = {}
    for f in sorted(Path(hf_dir).glob("*.safetensors")):
        out.update(load_file(f))
    return out


def _hf_validation_loss(hf_dir, inputs: jobs.Inputs, result: dict, bf16: bool) -> float:
    """train.py's validation (the same held-out batches, count and mean) with transformers' model of the
    export, on the GPU, under bf16 autocast when the run trained so."""
    from transformers import AutoTokenizer, LlamaForCausalLM

    from hetloco_ds.config import load_config
    from hetloco_ds.data import load_corpus, validation_batches

    run = load_config(result["config"])
    tok = AutoTokenizer.from_pretrained(hf_dir)
    corpus = load_corpus(result["data"], tok, run.hetloco.train.seq_len, cache_dir=inputs.cache, progress=False)
    model = LlamaForCausalLM.from_pretrained(hf_dir, attn_implementation="sdpa").float().to(DEVICE).eval()
    batches = validation_batches(corpus.val, run.ds["train_micro_batch_size_per_gpu"])
    losses = []
    with torch.no_grad(), torch.autocast(DEVICE, dtype=torch.bfloat16, enabled=bf16):
        for _ in range(run.hetloco.train.eval_batches):
            ids, labels = next(batches)
            losses.append(model(input_ids=ids.to(DEVICE), labels=labels.to(DEVICE)).loss.float())
    return float(torch.stack(losses).mean())


def check_train_and_resume(result: dict, inputs: jobs.Inputs) -> None:
    """What every train-and-resume job must show (jobs.train_and_resume)."""
    from hetloco_ds.config import load_config

    assert result["ref"]["rc"] == 0, _explain(result["ref"])
    assert result["res"]["rc"] == 0, _explain(result["res"])
    ref, res, steps, h = result["ref_out"], result["res_out"], result["steps"], result["h"]
    run = load_config(result["config"])
    boundaries = list(range(h, steps + 1, h))  # a checkpoint at every outer step, the last at the end
    assert result["verified"] == {f"global_step{s}": None for s in boundaries}, result["verified"]
    assert result["latest"] == f"global_step{steps}"
    saves = _rows(ref, "checkpoint")
    assert [r["step"] for r in saves] == boundaries, saves
    assert all(r["seconds"]["blocked"] >= 0 and r["bytes"] > 0 for r in saves), saves

    # The resume from its checkpoint recomputes the later steps bit for bit, through another launcher.
    want = {(r["step"], r["replica"]): r["loss"] for r in _rows(ref, "step")}
    got = {(r["step"], r["replica"]): r["loss"] for r in _rows(res, "step")}
    assert sorted(got) == sorted(want), (sorted(got), sorted(want))
    assert all(math.isfinite(v) for v in want.values()), want
    assert got == want, [(k, want[k], got[k]) for k in sorted(want) if want[k] != got[k]]
    a, b = _hf_tensors(Path(ref) / "hf"), _hf_tensors(Path(res) / "hf")
    assert sorted(a) == sorted(b)
    assert all(torch.equal(a[k], b[k]) for k in a), [k for k in a if not torch.equal(a[k], b[k])]

    # The export is the validated model: transformers' loss of it is the engine's last validation
    # (replica 0's: through full boundaries where it is uncompressed, else close to it).
    every = run.hetloco.train.eval_interval
    val = _rows(ref, "validation")
    assert [r["step"] for r in val] == sorted({s for s in boundaries if every and s % every == 0} | {steps}), val
    expected = _hf_validation_loss(Path(ref) / "hf", inputs, result, run.bf16)
    compressed0 = run.hetloco.subspace.compressed(0, len(val[-1]["replica_losses"]))
    rtol = 0.05 if compressed0 else (BF16_RTOL if run.bf16 else 1e-5)
    assert val[-1]["replica_losses"][0] == pytest.approx(expected, rel=rtol), (val[-1], expected)
    if result["from_checkpoint"]:
        before = _hf_tensors(inputs.hf_tied if result["tied"] else inputs.hf)
        assert sorted(before) == sorted(a)
        assert not torch.equal(before["model.embed_tokens.weight"], a["model.embed_tokens.weight"])


ONE_GPU = [
    pytest.param("preset_1b", marks=pytest.mark.job("preset_1b"), id="deepspeed-then-nproc-1B-preset-deterministic"),
    pytest.param("defaults", marks=pytest.mark.job("defaults"), id="deepspeed-then-nproc-bf16-outer_on_host-untied"),
    pytest.param("compile_tied", marks=pytest.mark.job("compile_tied"), id="nproc-then-deepspeed-compile-tied"),
    pytest.param("outer_on_gpu", marks=pytest.mark.job("outer_on_gpu"), id="torchrun-then-deepspeed-outer_on_gpu"),
    pytest.param("fp32_tied", marks=pytest.mark.job("fp32_tied"), id="deepspeed-then-nproc-fp32-tied"),
    pytest.param("ac_compile_tied", marks=pytest.mark.job("ac_compile_tied"),
                 id="nproc-then-torchrun-activation-checkpointing-compile-tied"),
    pytest.param("moments_8bit_20m", marks=pytest.mark.job("moments_8bit_20m"), id="deepspeed-then-nproc-20M-8bit-moments"),
    pytest.param("moments_on_host_20m", marks=pytest.mark.job("moments_on_host_20m"),
                 id="torchrun-then-deepspeed-20M-moments-on-host"),
    pytest.param("moments_bf16_tied", marks=pytest.mark.job("moments_bf16_tied"), id="nproc-then-deepspeed-bf16-moments-tied"),
    pytest.param("unstaged_saves_8bit_20m", marks=pytest.mark.job("unstaged_saves_8bit_20m"),
                 id="torchrun-then-nproc-20M-8bit-unstaged-saves"),
    pytest.param("loss_chunked_20m", marks=pytest.mark.job("loss_chunked_20m"), id="nproc-then-torchrun-20M-chunked-loss"),
]


@pytest.mark.parametrize("name", ONE_GPU)
def test_cli_trains_saves_resumes_bitwise_and_exports_on_one_gpu(name, job_result, gpu_jobs):
    """`hetloco-ds train` on one GPU, fine-tuning the tiny GQA checkpoint: 6 steps, H = 2, a checkpoint at
    every outer step; a copy cut back to step 2 resumed to 6 through another launcher. Breaks if a save,
    a load or the export meets host-held state with device tensors (the outer state on the host is
    the default), if a resume is not bitwise the uninterrupted run, or the export is not the model
    validated. Variants: the launchers, train.compile, the outer state on the GPU, fp32, tied, and the
    1B preset at seq 1024 on the default data (with train.deterministic: its flash attention has
    several key blocks, whose backward otherwise adds in atomics)."""
    check_train_and_resume(job_result, gpu_jobs.inputs)


@pytest.mark.job("preempted")
def test_sigterm_mid_round_saves_and_the_resume_is_the_uninterrupted_run(job_result, gpu_jobs):
    """The "defaults" run, its `--nproc` launcher SIGTERMed while the rank is inside step 3 (between
    outer steps: theta_prev on the host and the weights on the GPU differ): it saves at the agreed step 3
    and exits 75; `--resume` through `deepspeed` ends with every loss and the exported weights bitwise
    the uninterrupted run's. Breaks if a mid-round save on a GPU loses the replica's own weights or
    theta at the last sync, or meets host-held state with device tensors."""
    from hetloco_ds.launch import EXIT_PREEMPTED

    r = job_result
    assert r["held_at_3"] and r["agreed"] == 3, _explain(r["held"])
    assert r["held"]["rc"] == EXIT_PREEMPTED, _explain(r["held"])
    assert r["latest"] == "global_step3" and r["verified"] is None, r
    assert r["res"]["rc"] == 0, _explain(r["res"])
    ref = gpu_jobs.result("defaults")["ref_out"]
    want = {(x["step"], x["replica"]): x["loss"] for x in _rows(ref, "step")}
    got = {(x["step"], x["replica"]): x["loss"] for x in _rows(r["out"], "step")}
    assert got == want, [(k, want.get(k), got.get(k)) for k in sorted(set(want) | set(got)) if want.get(k) != got.get(k)]
    a, b = _hf_tensors(Path(ref) / "hf"), _hf_tensors(Path(r["out"]) / "hf")
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)


def test_fp16_is_refused_in_one_line_before_any_rank_starts(tmp_path):
    """fp16 is not a training precision here (bf16 autocast over fp32 master weights per replica): the
    CLI refuses it with one line naming the key, exit 2, and writes nothing."""
    import runs

    cfg = jobs.write_config(tmp_path / "fp16.json", {"bf16.enabled": False, "fp16": {"enabled": True}})
    out = tmp_path / "out"
    proc = runs.cli("train", "--steps", 2, "--model-config", "tiny", "--config", cfg, "--out", out,
                    "--nproc", 1, cache=tmp_path / "cache", timeout=120)
    lines = runs.error_lines(proc.stderr)
    assert proc.returncode == 2 and len(lines) == 1 and "fp16.enabled" in lines[0], runs.explain(proc)
    assert not out.exists()


@pytest.mark.job("api")
def test_initialize_user_loop_saves_between_and_at_outer_steps_and_loads_both(job_result):
    """A user's script on `hetloco_ds.initialize` (tests/gpu/api_loop.py, fp32): 3 steps with H = 2, a
    save between outer steps, a step that syncs, a save at the boundary, save_pretrained; a fresh
    process loads the mid-round save and takes step 4 with the same loss and weights, bit for bit,
    then loads the boundary save; transformers' logits of the export are the engine's. Breaks if
    the API's save or load meets host-held state with device tensors, if a mid-round save loses the
    replica's own weights or theta at the last sync, or the export is not the engine's model."""
    from safetensors.torch import load_file
    from transformers import LlamaForCausalLM

    for phase in ("train", "load"):
        assert job_result[phase]["rc"] == 0, _explain(job_result[phase])
    work = Path(job_result["work"])
    train, load = (json.loads((work / f"{p}.json").read_text()) for p in ("train", "load"))
    assert train["device"].startswith(DEVICE) and train["outer_state_device"] == "cpu", train
    assert all(math.isfinite(x) for x in train["losses"]) and len(train["losses"]) == 4
    assert train["mid_synced"] is False and train["synced"] is True, train
    assert load["local_steps"] == 3 and load["synced_after_mid"] is False, load
    assert load["loss4"] == train["losses"][3], (load["loss4"], train["losses"])
    want = load_file(work / "train_params.safetensors")
    for got in ("load_params", "load_boundary_params"):
        have = load_file(work / f"{got}.safetensors")
        assert all(torch.equal(want[k], have[k]) for k in want), (got, [k for k in want if not torch.equal(want[k], have[k])])
    assert load["synced_after_boundary"] is True and load["local_steps_after_boundary"] == 4, load

    seen = load_file(work / "train_logits.safetensors")
    model = LlamaForCausalLM.from_pretrained(work / "hf_out", attn_implementation="sdpa").float().to(DEVICE).eval()
    with torch.no_grad():
        logits = model(input_ids=seen["ids"].to(DEVICE)).logits.float().cpu()
    scale = seen["logits"].abs().max().item()
    assert torch.allclose(logits, seen["logits"], rtol=0, atol=1e-4 * max(1.0, scale)), \
        (logits - seen["logits"]).abs().max().item()


@pytest.mark.job("memory")
def test_plan_predicts_the_measured_peak_on_one_gpu(job_result):
    """plan's per-stage peak (`plan.stage_memory_bytes`) against the peak a d = 1024, 6-layer model's
    training allocates on this GPU (micro 4 x 2 at seq 512, the outer state where the defaults put
    it, the engine's own cast and schedule choices), within test_plan's tolerance: below by at most
    5%, above by at most 10%. Breaks if the memory rules drift from what training holds."""
    from test_plan import MEMORY_TOLERANCE

    proc = job_result["memory"]
    assert proc["rc"] == 0, _explain(proc)
    got = json.loads((Path(job_result["work"]) / "memory.json").read_text())
    predicted = _memory_prediction(got)
    ratio = predicted / got["peak_allocated"]
    lo, hi = MEMORY_TOLERANCE
    assert 1 + lo <= ratio <= 1 + hi, (predicted / 2**30, got["peak_allocated"] / 2**30, got)


def _memory_prediction(got: dict, optimizer_state: str = "fp32") -> int:
    from hetloco_ds import plan
    from hetloco_ds.plan.shapes import ModelShape

    s = got["shape"]
    model = ModelShape(d=s["hidden_size"], n_layers=s["num_hidden_layers"], n_heads=s["num_attention_heads"],
                       n_kv_heads=s["num_key_value_heads"], ffn=s["intermediate_size"], vocab=s["vocab_size"],
                       seq_len=got["seq_len"])
    return plan.stage_memory_bytes(model, 1, micro_batch=got["micro"], n_mb=got["gas"], seq_len=got["seq_len"],
                                   schedule=got["schedule"], bf16=True, outer_state_device=got["outer_state_device"],
                                   autocast_cache=not got["step_casts"],
                                   activation_checkpoint_interval=got.get("activation_checkpoint_interval", 0),
                                   optimizer_state=optimizer_state)[0]


def _memory_beside_default(job_result, gpu_jobs) -> tuple[Path, dict, dict]:
    """(this memory job's folder, its memory.json, the default memory job's), both jobs having exited 0."""
    off_job = gpu_jobs.result("memory")
    on_proc, off_proc = job_result["memory"], off_job["memory"]
    assert on_proc["rc"] == 0, _explain(on_proc)
    assert off_proc["rc"] == 0, _explain(off_proc)
    work = Path(job_result["work"])
    return (work, json.loads((work / "memory.json").read_text()),
            json.loads((Path(off_job["work"]) / "memory.json").read_text()))


@pytest.mark.job("memory_ac")
def test_recomputed_decoder_layers_lower_the_measured_peak_on_one_gpu(job_result, gpu_jobs):
    """The memory job's model and batch with every decoder layer recomputed in the backward
    (pipeline.activation_checkpoint_interval 1): its first loss is the job's without (the same
    forward) and its measured peak lies below that job's. plan's predictions beside both peaks go to
    plan_vs_peak.json next to the job's log, with the allocator's account of the peak (memory.json's
    peak_breakdown): at this size (77M parameters, 2048 tokens a micro-batch) the kept activations are
    small enough that the outer step sets the peak. plan's prediction lies within test_plan's
    tolerance of both peaks. Breaks if the interval is not applied on the GPU, recomputing changes
    the forward, or plan's outer-step phase or cuBLAS workspaces drift from what the GPU holds."""
    from test_plan import MEMORY_TOLERANCE

    work, on, off = _memory_beside_default(job_result, gpu_jobs)
    assert on["activation_checkpoint_interval"] == 1 and off["activation_checkpoint_interval"] == 0
    (work / "plan_vs_peak.json").write_text(json.dumps({
        "with": {"predicted": _memory_prediction(on), "measured": on["peak_allocated"]},
        "without": {"predicted": _memory_prediction(off), "measured": off["peak_allocated"]},
        "breakdown_with": on.get("peak_breakdown"), "breakdown_without": off.get("peak_breakdown")}, indent=1))
    assert on["losses"][0] == pytest.approx(off["losses"][0], rel=1e-5), (on["losses"], off["losses"])
    assert on["peak_allocated"] < off["peak_allocated"], (on["peak_allocated"] / 2**30, off["peak_allocated"] / 2**30)
    lo, hi = MEMORY_TOLERANCE
    for got in (on, off):
        assert 1 + lo <= _memory_prediction(got) / got["peak_allocated"] <= 1 + hi, (
            _memory_prediction(got) / 2**30, got["peak_allocated"] / 2**30)


@pytest.mark.job("memory_8bit")
def test_eight_bit_moments_lower_the_measured_peak_on_one_gpu(job_result, gpu_jobs):
    """The memory job's model and batch with AdamW's moments in 8 bits (torchao's AdamW8bit): the first
    loss is the job's without (the moments act only from the first step on), the next three stay
    within 2% of fp32's, and the peak falls by at least half of what plan says the moments save
    (8 - 2.03 B a parameter of 77M). plan's prediction beside the peak goes to plan_vs_peak.json and
    lies within test_plan's tolerance. Breaks if the option does not reach the GPU, its moments are
    not the smaller ones, or plan's account of them drifts from what the GPU holds."""
    from test_plan import MEMORY_TOLERANCE

    from hetloco_ds import sizes
    from hetloco_ds.plan.shapes import ModelShape

    work, on, off = _memory_beside_default(job_result, gpu_jobs)
    (work / "plan_vs_peak.json").write_text(json.dumps({
        "predicted": _memory_prediction(on, "8bit"), "measured": on["peak_allocated"],
        "breakdown": on.get("peak_breakdown")}, indent=1))
    assert on["losses"][0] == pytest.approx(off["losses"][0], rel=1e-5), (on["losses"], off["losses"])
    assert on["losses"] == pytest.approx(off["losses"], rel=0.02), (on["losses"], off["losses"])
    sh = on["shape"]
    params = ModelShape(d=sh["hidden_size"], n_layers=sh["num_hidden_layers"], n_heads=sh["num_attention_heads"],
                        n_kv_heads=sh["num_key_value_heads"], ffn=sh["intermediate_size"], vocab=sh["vocab_size"],
                        seq_len=on["seq_len"]).n_params()
    saving = params * (sizes.optimizer_state_bytes_per_param("fp32") - sizes.optimizer_state_bytes_per_param("8bit"))
    assert off["peak_allocated"] - on["peak_allocated"] >= saving / 2, (
        off["peak_allocated"] / 2**30, on["peak_allocated"] / 2**30, saving / 2**30)
    lo, hi = MEMORY_TOLERANCE
    ratio = _memory_prediction(on, "8bit") / on["peak_allocated"]
    assert 1 + lo <= ratio <= 1 + hi, (ratio, on["peak_allocated"] / 2**30)


@pytest.mark.job("simulators")
def test_simulators_agree_on_the_gpu_with_the_outer_state_on_the_host(job_result):
    """bench/sim_check.py on the GPU under the defaults: the per-replica simulator and the batched
    one (eager and compiled), M = 2 x S = 2 with one replica compressed, bf16, losses within its rtol,
    every replica finite and contributing at the outer step (which resyncs the embedding split).
    Breaks if the simulators' outer step meets host-held state with device tensors, or if they part."""
    assert job_result["rc"] == 0, _explain(job_result)
    report = job_result["json"]
    assert report["ok"] is True and report["card"] != "cpu", report
    for kind in ("per_replica", "batched", "compiled"):
        r = report["results"][kind]
        assert "error" not in r, (kind, r)
        assert r["outer"]["excluded"] == [], (kind, r)


def _check_elastic(result: dict) -> None:
    assert result["rc"] == 0, _explain(result)
    report = result["json"]
    assert report is not None and "error" not in report, report
    sums = report["checksums"]
    assert sums["equal_before_kill"] and sums["equal_after_heal"], sums
    for m, found in report["checkpoints"].items():
        assert found["latest"] is not None and found["problem"] is None, (m, found)


@pytest.mark.job("elastic")
def test_elastic_replicas_sharing_a_gpu_save_and_heal_a_killed_one(job_result):
    """bench/gpu_elastic.py: two one-stage replicas, each a job of its own on the same GPU, a lighthouse,
    a checkpoint at every outer step; one replica SIGKILLed mid-round and restarted, healed from the
    survivor. Breaks if the elastic state transfer or heal meets host-held state with device tensors,
    if the healed replica's weights differ from the survivor's, or a replica's checkpoint is incomplete."""
    _check_elastic(job_result)


MANY_GPUS = [
    pytest.param("s2", marks=[pytest.mark.gpus(2), pytest.mark.job("s2")], id="S2-compressed"),
    pytest.param("m2", marks=[pytest.mark.gpus(2), pytest.mark.job("m2")], id="M2"),
    pytest.param("m2s2", marks=[pytest.mark.gpus(4), pytest.mark.job("m2s2")], id="M2xS2-replica1-compressed"),
    pytest.param("mixed_1_2", marks=[pytest.mark.gpus(3), pytest.mark.job("mixed_1_2")], id="replica_stages-1-2"),
    pytest.param("mixed_1_1_2", marks=[pytest.mark.gpus(4), pytest.mark.job("mixed_1_1_2")], id="replica_stages-1-1-2"),
]


@pytest.mark.parametrize("name", MANY_GPUS)
def test_cli_trains_saves_resumes_bitwise_and_exports_on_several_gpus(name, job_result, gpu_jobs):
    """As the one-GPU test, one rank per GPU: pipelines with compressed boundaries (the embedding split
    resynced at every outer step), replicas meeting in outer syncs, replicas of their own depths
    exchanging by block. Breaks where those paths meet host-held state with device tensors."""
    check_train_and_resume(job_result, gpu_jobs.inputs)


@pytest.mark.gpus(3)
@pytest.mark.job("elastic_1_2")
def test_elastic_two_stage_replica_killed_and_rejoined(job_result):
    """bench/gpu_elastic.py --replica-stages 1,2 (one GPU per rank): the two-stage replica loses a rank
    mid-round and rejoins, healed block by block from the one-stage survivor."""
    _check_elastic(job_result)


def test_the_record_names_the_commit_it_ran_at():
    """The record of the previous run (tests/gpu/last_run.json) is well formed: a 40-hex commit, the card,
    the versions and an outcome per test (the current run's is written when the session ends)."""
    path = Path(__file__).with_name("last_run.json")
    if not path.exists():
        pytest.skip("no record yet")
    record = json.loads(path.read_text())
    assert re.fullmatch(r"[0-9a-f]{40}", record["commit"]), record["commit"]
    assert record["cards"] and record["versions"]["torch"] and record["tests"]
    assert all(v["outcome"] in ("passed", "failed", "skipped") for v in record["tests"].values())
