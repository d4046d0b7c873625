"""Every bad input fails in the launching process, before any rank starts, with one exact line,
exit code 2, and nothing written.

The CLI runs in-process (`hetloco_ds.cli.main`) with `launch.spawn` replaced by a tripwire, so
"before any rank starts" is checked directly; the time bound says the checks are cheap (no
model is built, no process group formed). "Nothing written" compares a snapshot of the output
directory (names, sizes, modification times) before and after.
"""
from __future__ import annotations

import json
import os
import shutil
import socket
import struct
import time
from pathlib import Path

import deepspeed
import pytest

from hetloco_ds import cli, launch
from test_cli import save_tiny_hf_with_tokenizer, write_config, write_text_folder

CHECK_BUDGET_S = 15.0
PREFIX = "hetloco-ds train: error: "


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("bad_input")
    hf = save_tiny_hf_with_tokenizer(root / "hf")
    data = write_text_folder(root / "data")
    small = root / "small_data"
    small.mkdir()
    for i in range(3):
        (small / f"d{i}.txt").write_text("the quick brown fox jumps over the lazy dog. " * 2)
    return {"root": root, "hf": hf, "data": data, "small": small, "cache": root / "cache"}


@pytest.fixture(autouse=True)
def in_process(inputs, monkeypatch):
    """No launcher environment, the module's token cache, and a tripwire instead of spawning ranks."""
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "ACCELERATE_USE_DEEPSPEED"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("HETLOCO_CACHE", str(inputs["cache"]))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")

    def tripwire(*args, **kwargs):
        raise AssertionError("a rank was started")

    monkeypatch.setattr(launch, "spawn", tripwire)
    monkeypatch.setattr(launch, "spawn_groups", tripwire)


def snapshot(path: Path) -> dict:
    if not path.exists():
        return {}
    found = {}
    for p in sorted([path, *path.rglob("*")]):
        st = p.lstat()
        found[str(p.relative_to(path))] = (p.is_dir(), st.st_size if not p.is_dir() else 0, st.st_mtime_ns)
    return found


def fails_with(capsys, argv: list, line: str, watch: Path, code: int = 2, prefix: str = PREFIX) -> None:
    """`hetloco-ds *argv` exits `code` with exactly `line` as its only error line, within the
    check budget, leaving `watch` as it was."""
    before = snapshot(watch)
    capsys.readouterr()
    t0 = time.monotonic()
    rc = cli.main([str(a) for a in argv])
    elapsed = time.monotonic() - t0
    err = capsys.readouterr().err
    assert rc == code, err
    assert [l for l in err.splitlines() if l.startswith(prefix.split(":")[0])] == [prefix + line], err
    assert "Traceback" not in err
    assert elapsed < CHECK_BUDGET_S, elapsed
    assert snapshot(watch) == before, "the output directory changed"


def _train(inputs, cfg, out, *extra):
    return ["train", "--steps", 4, "--model", inputs["hf"], "--data", inputs["data"], "--config", cfg, "--out", out,
            *extra]


# --------------------------------------------------------------------------- config and topology

CONFIG_CASES = {
    "ratio_not_dividing_hidden": (
        {"pipeline.stages": 1, "hetloco.subspace.ratio": 5, "hetloco.subspace.compressed_replicas": [1]},
        "{cfg}: hetloco.subspace.ratio = 5 does not divide the model's hidden_size = 32 (replica 1 is compressed)"),
    "negative_lr": (
        {"optimizer.params.lr": -0.001}, "{cfg}: optimizer.params.lr = -0.001 must be > 0"),
    "compressed_replica_missing": (
        {"pipeline.stages": 1, "hetloco.subspace.compressed_replicas": [2]},
        "{cfg}: hetloco.subspace.compressed_replicas = [2] names replica 2, but 2 ranks / pipeline.stages = 1 make "
        "replicas 0..1"),
    "replica_ratio_for_missing_replica": (
        {"pipeline.stages": 1, "hetloco.subspace.compressed_replicas": [1], "hetloco.subspace.ratio": 2,
         "hetloco.subspace.replica_ratios": {"3": 4}},
        "{cfg}: hetloco.subspace.replica_ratios = {{3: 4}} names replica 3, but 2 ranks / pipeline.stages = 1 make "
        "replicas 0..1"),
    "link_max_ctas_zero": (
        {"hetloco.pipeline.link_max_ctas": 0}, "{cfg}: hetloco.pipeline.link_max_ctas = 0: Input should be greater than or equal to 1"),
    "gemm_sm_carveout_negative": (
        {"hetloco.pipeline.gemm_sm_carveout": -2},
        '{cfg}: hetloco.pipeline.gemm_sm_carveout = -2 must be a number of SMs >= 0 or "auto"'),
    "gemm_sm_carveout_auto_without_a_cta_cap": (
        {"hetloco.pipeline.gemm_sm_carveout": "auto", "hetloco.pipeline.link_max_ctas": None},
        '{cfg}: hetloco.pipeline.gemm_sm_carveout = "auto" counts link_max_ctas CTAs per link kernel, but '
        "link_max_ctas is null (NCCL's own count); give gemm_sm_carveout a number"),
    "copy_engine_without_the_overlapped_schedule": (
        {"hetloco.pipeline.link_transport": "copy_engine", "hetloco.pipeline.schedule": "blocking"},
        '{cfg}: hetloco.pipeline.link_transport = "copy_engine" moves the overlapped schedule\'s messages, but '
        'schedule = "blocking"; set schedule to "overlapped" or "auto"'),
    "copy_engine_without_gpus": (
        {"hetloco.pipeline.link_transport": "copy_engine"},
        '{cfg}: hetloco.pipeline.link_transport = "copy_engine" moves messages between GPUs, and this machine has none'),
    "link_transport_unknown": (
        {"hetloco.pipeline.link_transport": "nvlink"},
        "{cfg}: hetloco.pipeline.link_transport = 'nvlink': Input should be 'auto', 'process_group' or 'copy_engine'"),
    "outer_state_device_unknown": (
        {"hetloco.sparseloco.outer_state_device": "host"},
        "{cfg}: hetloco.sparseloco.outer_state_device = 'host': Input should be 'gpu' or 'cpu'"),
    "topk_larger_than_chunk": (
        {"hetloco.sparseloco.topk": 5000},
        "{cfg}: hetloco.sparseloco.topk = 5000 exceeds chunk_size = 4096 (values kept per chunk)"),
    "misspelt_deepspeed_key": (
        {"train_micro_batch_size_per_gp": 4},
        "{cfg}: unknown DeepSpeed key 'train_micro_batch_size_per_gp' (DeepSpeed " + deepspeed.__version__
        + " does not read it); did you mean 'train_micro_batch_size_per_gpu'?"),
    "misspelt_scheduler_type": (
        {"scheduler.type": "WarmupCosinLR"},
        "{cfg}: scheduler.type = 'WarmupCosinLR' is not a DeepSpeed " + deepspeed.__version__ + " scheduler "
        "(LRRangeTest, OneCycle, WarmupLR, WarmupDecayLR, WarmupCosineLR); did you mean 'WarmupCosineLR'?"),
    "misspelt_scheduler_param": (
        {"scheduler.params.warmup_num_step": 3},
        "{cfg}: scheduler.params.warmup_num_step: WarmupCosineLR has no such parameter (total_num_steps, "
        "warmup_min_ratio, warmup_num_steps, cos_min_ratio, warmup_type); did you mean 'warmup_num_steps'?"),
    "scheduler_value_deepspeed_rejects": (
        {"scheduler.params.warmup_num_steps": 0},
        "{cfg}: scheduler.params: DeepSpeed's WarmupCosineLR rejects them: warmup_num_steps must be a positive "
        "integer, got 0"),
    "unknown_warmup_type": (
        {"scheduler.params.warmup_type": "cosine"}, "{cfg}: scheduler.params.warmup_type = 'cosine': one of log, linear"),
    "bf16_enabled_as_a_string": (
        {"bf16.enabled": "false"}, '{cfg}: bf16.enabled = \'false\' must be true, false or "auto"'),
    "misspelt_optimizer_type": (
        {"optimizer.type": "AdamX"},
        '{cfg}: optimizer.type = \'AdamX\': the inner optimizer is AdamW (type "AdamW", or DeepSpeed\'s "Adam", whose '
        "adam_w_mode is on by default)"),
    "unknown_key_inside_deepspeed_section": (
        {"zero_optimization": {"stage": 0, "overlap_com": True}}, "{cfg}: unknown key 'zero_optimization.overlap_com'"),
    # Strict types: each of these was once read as something else (5, True, 0.7, [1], 2, 0.001) without a word.
    "inner_steps_as_a_string": (
        {"hetloco.sparseloco.inner_steps": "5"},
        "{cfg}: hetloco.sparseloco.inner_steps = '5': Input should be a valid integer (written without quotes)"),
    "enabled_as_a_number": (
        {"hetloco.sparseloco.enabled": 1}, "{cfg}: hetloco.sparseloco.enabled = 1: Input should be a valid boolean"),
    "outer_lr_as_a_string": (
        {"hetloco.sparseloco.outer_lr": "0.7"},
        "{cfg}: hetloco.sparseloco.outer_lr = '0.7': Input should be a valid number (written without quotes)"),
    "compressed_replicas_as_strings": (
        {"pipeline.stages": 1, "hetloco.subspace.compressed_replicas": ["1"]},
        "{cfg}: hetloco.subspace.compressed_replicas = ['1'] must be a list of replica ids (whole numbers), \"all\" "
        "or \"none\""),
    "replica_ratio_as_a_string": (
        {"pipeline.stages": 1, "hetloco.subspace.compressed_replicas": [1], "hetloco.subspace.replica_ratios": {"1": "2"}},
        "{cfg}: hetloco.subspace.replica_ratios[1] = '2': Input should be a valid integer (written without quotes)"),
    "replica_ratios_key_not_a_replica_id": (
        {"pipeline.stages": 1, "hetloco.subspace.compressed_replicas": [1], "hetloco.subspace.replica_ratios": {"one": 2}},
        "{cfg}: hetloco.subspace.replica_ratios = {{'one': 2}}: key 'one' is not a replica id (a whole number >= 0)"),
    "optimizer_lr_as_a_string": (
        {"optimizer.params.lr": "1e-3"}, "{cfg}: optimizer.params.lr = '1e-3' must be a number, written without quotes"),
}


@pytest.mark.parametrize("case", sorted(CONFIG_CASES))
def test_bad_config_fails_before_any_rank_with_one_line(case, inputs, tmp_path, capsys):
    """Each bad config value fails with the exact line naming key, value and file. Breaks if the
    check moves into the ranks (the tripwire fires), if a value is silently clamped or accepted
    (topk, a ratio for a replica that does not exist), if DeepSpeed keys go unchecked, or if
    anything is written first."""
    edits, line = CONFIG_CASES[case]
    cfg = write_config(tmp_path / "cfg.json", edits)
    out = tmp_path / "out"
    fails_with(capsys, _train(inputs, cfg, out, "--nproc", 2), line.format(cfg=cfg), out)
    assert not out.exists()


def test_strict_types_still_read_what_users_write():
    """Strict types refuse a value of the wrong type, not the forms a config legitimately takes:
    an int where a float goes (outer_lr 1, watchdog_timeout 60, the optimizer's lr), replica ids as
    a JSON object's string keys (replica_ratios {"1": 4}), "auto" where it is a value
    (gemm_sm_carveout, the micro batch), "all" / "none", a preset beside its own fields, and every
    config shipped with the package or used by the benchmarks. Breaks if strictness refuses any."""
    import glob

    from hetloco_ds.config import load_config, parse_config

    run = parse_config({
        "train_micro_batch_size_per_gpu": "auto", "optimizer": {"type": "AdamW", "params": {"lr": 1, "betas": [0.9, 1 / 2]}},
        "hetloco": {"sparseloco": {"preset": "templar", "topk": 16, "outer_lr": 1, "quant_bits": 4},
                    "subspace": {"ratio": 2, "compressed_replicas": [1], "replica_ratios": {"1": 4}},
                    "train": {"watchdog_timeout": 60}, "elastic": {"timeout": 5},
                    "pipeline": {"gemm_sm_carveout": "auto"}}})
    h = run.hetloco
    assert h.sparseloco.outer_lr == 1.0 and isinstance(h.sparseloco.outer_lr, float)
    assert h.subspace.replica_ratios == {1: 4} and h.subspace.ratio_for(1, 2) == 4
    assert (h.pipeline.gemm_sm_carveout, h.train.watchdog_timeout, run.optimizer.lr) == ("auto", 60.0, 1.0)
    assert parse_config({"hetloco": {"subspace": {"compressed_replicas": "all"}}}).hetloco.subspace.compressed(3, 4)
    repo = Path(__file__).resolve().parents[1]
    shipped = [p for pattern in ("configs/*.json", "hetloco_ds/configs/*.json", "examples/**/*.json")
               for p in glob.glob(str(repo / pattern), recursive=True) if "hetloco" in json.loads(Path(p).read_text())]
    assert len(shipped) >= 4, shipped
    for path in shipped:
        load_config(path)


def test_seq_len_beyond_the_models_positions_fails_before_any_rank(inputs, tmp_path, capsys):
    """A seq_len past max_position_embeddings once started every rank, wrote --out and completed no
    step for minutes."""
    cfg = write_config(tmp_path / "cfg.json", {"hetloco.train.seq_len": 65})
    out = tmp_path / "out"
    fails_with(capsys, _train(inputs, cfg, out, "--nproc", 2),
               f"{cfg}: hetloco.train.seq_len = 65 exceeds the model's max_position_embeddings = 64 (--model {inputs['hf']})",
               out)
    assert not out.exists()


def test_nproc_zero_is_refused(inputs, tmp_path, capsys):
    """`--nproc 0` once meant "the default" (4 ranks); it must be refused."""
    out = tmp_path / "out"
    fails_with(capsys, _train(inputs, write_config(tmp_path / "cfg.json"), out, "--nproc", 0),
               "--nproc 0 must be >= 1", out)


def test_bind_cores_with_fewer_cores_than_ranks_is_refused(inputs, tmp_path, capsys, monkeypatch):
    """`--bind-cores` on a launcher allowed 2 cores, for 4 ranks, names both numbers before any rank
    starts; so does `--bind-cores` with `--link`, whose ranks start in network namespaces. Breaks if
    the ranks were started unpinned (or pinned onto shared cores) instead."""
    monkeypatch.setattr(launch, "usable_cores", lambda: [0, 1])
    out = tmp_path / "out"
    cfg = write_config(tmp_path / "cfg.json")
    fails_with(capsys, _train(inputs, cfg, out, "--nproc", 4, "--bind-cores"),
               "--bind-cores: 2 usable cores cannot give each of 4 local ranks its own", out)
    fails_with(capsys, _train(inputs, cfg, out, "--nproc", 2, "--bind-cores", "--link", "stage=1G"),
               "--bind-cores is not supported with --link (the rehearsal starts its ranks in network namespaces)", out)
    assert not out.exists()


def test_too_little_data_for_the_replicas(inputs, tmp_path, capsys):
    """A corpus with fewer training blocks than replicas fails in the launcher naming --data and
    both numbers (it once failed inside every rank after a minute, leaving a half-written --out)."""
    from transformers import AutoTokenizer

    from hetloco_ds.data import load_corpus

    blocks = load_corpus(str(inputs["small"]), AutoTokenizer.from_pretrained(inputs["hf"]), 16,
                         cache_dir=inputs["cache"], progress=False).train.shape[0]
    M = blocks + 1
    cfg = write_config(tmp_path / "cfg.json", {"pipeline.stages": 1})
    out = tmp_path / "out"
    argv = ["train", "--steps", 4, "--model", inputs["hf"], "--data", inputs["small"], "--config", cfg, "--out", out,
            "--nproc", M]
    fails_with(capsys, argv, f"--data {inputs['small']}: corpus has {blocks} blocks ({blocks * 16} tokens) but {M} "
                             f"replicas need at least one block each ({M * 16} tokens at seq_len=16)", out)


def test_corrupt_safetensors_header_names_the_file(inputs, tmp_path, capsys):
    """A safetensors file whose header is not JSON: the line names the file (it once said only
    "Expecting value: line 1 column 1")."""
    bad = tmp_path / "hf_corrupt"
    shutil.copytree(inputs["hf"], bad)
    weights = bad / "model.safetensors"
    data = bytearray(weights.read_bytes())
    n = struct.unpack("<Q", data[:8])[0]
    data[8:8 + n] = b"x" * n  # right length, no JSON
    weights.write_bytes(bytes(data))
    out = tmp_path / "out"
    argv = ["train", "--steps", 4, "--model", bad, "--data", inputs["data"], "--config",
            write_config(tmp_path / "cfg.json"), "--out", out, "--nproc", 2]
    fails_with(capsys, argv, f"{weights}: not a readable safetensors file (Error while deserializing header: "
                             "invalid JSON in header: expected value at line 1 column 1)", out)


# --------------------------------------------------------------------------- elastic mode

LH = ["--lighthouse", "http://127.0.0.1:29999"]
ELASTIC_CASES = {
    "lighthouse_without_replica_id": ({}, [*LH, "--nproc", 2], "elastic mode needs both --lighthouse ADDR and --replica-id ID"),
    "fleet_size_unset": ({}, [*LH, "--replica-id", 0], "{cfg}: hetloco.elastic.max_replicas is not set: the fleet's "
                         "size N fixes the replica ids 0..N-1 and their data shards"),
    "replica_id_outside_the_fleet": ({"hetloco.elastic.max_replicas": 3}, [*LH, "--replica-id", 3],
                                     "--replica-id 3 is not in 0..2 (hetloco.elastic.max_replicas = 3 in {cfg})"),
    "replica_job_of_two_pipelines": ({"hetloco.elastic.max_replicas": 3}, [*LH, "--replica-id", 0, "--nproc", 4],
                                     "an elastic replica is one pipeline of pipeline.stages = 2 ranks; this job has 4 "
                                     "(--nproc 2, or one replica per launch)"),
    "compressed_replica_outside_the_fleet": (
        {"hetloco.elastic.max_replicas": 3, "hetloco.subspace.compressed_replicas": [4]}, [*LH, "--replica-id", 0],
        "{cfg}: hetloco.subspace.compressed_replicas = [4] names replica 4, but hetloco.elastic.max_replicas = 3 "
        "makes replicas 0..2"),
    "lighthouse_not_a_url": ({"hetloco.elastic.max_replicas": 3}, ["--lighthouse", "localhost", "--replica-id", 0],
                             "--lighthouse 'localhost' must look like http://HOST:PORT (`hetloco-ds lighthouse` prints it)"),
    "wildcard_bind_without_advertise": ({"hetloco.elastic.max_replicas": 3}, [*LH, "--replica-id", 0, "--bind", "0.0.0.0"],
                                        "--bind 0.0.0.0 listens on every interface: give --advertise, the address "
                                        "peers reach this host at"),
    "no_secret": ({"hetloco.elastic.max_replicas": 3}, [*LH, "--replica-id", 0, "--no-secret"],
                  "no fleet secret: give --secret-file or set HETLOCO_FLEET_SECRET (the secret is never read from the "
                  "command line)"),
    "secret_file_readable_by_others": ({"hetloco.elastic.max_replicas": 3}, [*LH, "--replica-id", 0, "--open-secret"],
                                       "fleet secret file {secret} is accessible by group or others (mode 644); run "
                                       "chmod 600 {secret}"),
    "elastic_nproc_not_whole_replicas": ({}, ["--elastic", "--nproc", 3], "--nproc 3 is not a multiple of "
                                         "pipeline.stages = 2 (--elastic runs --nproc / stages replicas of 2 ranks each)"),
    "elastic_more_replicas_than_the_fleet": ({"hetloco.elastic.max_replicas": 2}, ["--elastic", "--nproc", 6],
                                             "--elastic starts 3 replicas but {cfg} sets hetloco.elastic.max_replicas = 2"),
    "elastic_with_a_replica_id": ({}, ["--elastic", "--replica-id", 1], "--elastic starts its own lighthouse and "
                                  "replicas; --lighthouse / --replica-id run one replica of a fleet: pass one or the other"),
    # a fleet of mixed depths: hetloco.replica_stages names every replica's
    "mixed_fleet_against_nproc": ({"hetloco.replica_stages": [1, 2]}, ["--elastic", "--nproc", 4],
                                  "--nproc 4 does not match hetloco.replica_stages = [1, 2] in {cfg}: --elastic starts "
                                  "its 2 replicas, 3 ranks in all"),
    "mixed_fleet_against_max_replicas": (
        {"hetloco.replica_stages": [1, 2], "hetloco.elastic.max_replicas": 3}, [*LH, "--replica-id", 0],
        "{cfg}: hetloco.elastic.max_replicas = 3 but hetloco.replica_stages = [1, 2] names 2 replicas, one per "
        "replica of the fleet (leave max_replicas out)"),
    "mixed_fleet_replica_id_outside": ({"hetloco.replica_stages": [1, 2]}, [*LH, "--replica-id", 2],
                                       "--replica-id 2 is not in 0..1 (hetloco.replica_stages = [1, 2] in {cfg})"),
    "mixed_fleet_replica_of_another_depth": (
        {"hetloco.replica_stages": [1, 2]}, [*LH, "--replica-id", 0, "--nproc", 2],
        "an elastic replica is one pipeline of 1 ranks (replica 0 of hetloco.replica_stages = [1, 2]); this job has 2 "
        "(--nproc 1, or one replica per launch)"),
    "mixed_fleet_deeper_than_the_model": ({"hetloco.replica_stages": [1, 5]}, [*LH, "--replica-id", 0],
                                          "{cfg}: hetloco.replica_stages[1] = 5 exceeds the model's 4 decoder layers"),
    "mixed_fleet_of_plain_data_parallelism": (
        {"hetloco.replica_stages": [1, 2], "hetloco.sparseloco.enabled": False}, [*LH, "--replica-id", 1],
        "{cfg}: hetloco.replica_stages = [1, 2] mixes depths, which needs the outer sync "
        "(hetloco.sparseloco.enabled = false all-reduces gradients between equal stages)"),
}


@pytest.mark.parametrize("case", sorted(ELASTIC_CASES))
def test_bad_elastic_input_fails_before_any_rank_with_one_line(case, inputs, tmp_path, capsys, monkeypatch):
    """Each impossible elastic invocation (a replica id outside the fleet, a fleet without a size, a replica
    job holding two pipelines, an unusable address, a missing or exposed secret, an --elastic launch that
    does not divide into replicas) fails in the launching process with one line, writing nothing. Breaks
    if any of them reached a rank, a lighthouse or the disk first."""
    edits, extra, line = ELASTIC_CASES[case]
    cfg = write_config(tmp_path / "cfg.json", edits)
    secret = tmp_path / "secret"
    secret.write_text("a-fleet-secret-0123456789abcdef\n")
    secret.chmod(0o644 if "--open-secret" in extra else 0o600)
    monkeypatch.delenv("HETLOCO_FLEET_SECRET", raising=False)
    if "--no-secret" not in extra and "--open-secret" not in extra:
        monkeypatch.setenv("HETLOCO_FLEET_SECRET", "a-fleet-secret-0123456789abcdef")
    extra = [a for a in extra if a not in ("--no-secret", "--open-secret")]
    if "--open-secret" in ELASTIC_CASES[case][1]:
        extra += ["--secret-file", secret]
    out = tmp_path / "out"
    fails_with(capsys, _train(inputs, cfg, out, *extra), line.format(cfg=cfg, secret=secret), out)
    assert not out.exists()


def test_lighthouse_with_nothing_there_fails_in_bounded_time_with_one_line(inputs, tmp_path, capsys, monkeypatch):
    """--lighthouse at an address where nothing listens once started every rank, which after 26 s
    printed 63 lines of torchft's C++ frames; now the launcher asks once (bounded) and says what it
    tried to reach. The port is bound but not listening, so nothing can answer there."""
    cfg = write_config(tmp_path / "cfg.json", {"hetloco.elastic.max_replicas": 3})
    monkeypatch.setenv("HETLOCO_FLEET_SECRET", "a-fleet-secret-0123456789abcdef")
    out = tmp_path / "out"
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        port = held.getsockname()[1]
        fails_with(capsys, _train(inputs, cfg, out, "--lighthouse", f"http://127.0.0.1:{port}", "--replica-id", 0),
                   f"--lighthouse http://127.0.0.1:{port}: nothing answers at 127.0.0.1:{port} (Connection refused "
                   "within 5 s); start `hetloco-ds lighthouse` there first, or pass the address it printed", out)
    assert not out.exists()


# --------------------------------------------------------------------------- the run directory


@pytest.fixture
def recorded_run(inputs, tmp_path):
    """A run directory as a run leaves it once checks passed and it started: the record and
    hf_meta (no checkpoint yet), for a 2-rank, 1-stage job; plus a file of the user's."""
    from hetloco_ds.train import TrainArgs, own_run, plan_run

    cfg = write_config(tmp_path / "run.json", {"pipeline.stages": 1})
    out = tmp_path / "run"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    plan = plan_run(TrainArgs(config=str(cfg), model=str(inputs["hf"]), data=str(inputs["data"]), out=str(out),
                              steps=4), 2, owned=True)
    own_run(plan).release()
    return out, cfg


def test_used_out_without_resume_is_refused(inputs, recorded_run, tmp_path, capsys):
    """A second run into a used --out (once it silently replaced hf/ and the record and rewound
    `latest`) is refused; the user's own files do not count as a run."""
    out, cfg = recorded_run
    fails_with(capsys, _train(inputs, cfg, out, "--nproc", 2),
               f"--out {out} already holds a run (run_config.json, checkpoints, .hetloco); pass --resume to continue "
               "it or --overwrite to replace it", out)
    only_mine = tmp_path / "logs_only"
    only_mine.mkdir()
    (only_mine / "job.log").write_text("x")
    from hetloco_ds.config import ConfigError
    from hetloco_ds.train import TrainArgs, plan_run

    plan_run(TrainArgs(config=str(cfg), model=str(inputs["hf"]), data=str(inputs["data"]), out=str(only_mine)), 2)
    with pytest.raises(ConfigError):
        plan_run(TrainArgs(config=str(cfg), model=str(inputs["hf"]), data=str(inputs["data"]), out=str(out)), 2)


def test_resume_with_another_config_is_refused_naming_the_difference(inputs, recorded_run, tmp_path, capsys):
    """--resume with a config that changes training (topk) is refused naming key and both values,
    and the run's record is not rewritten (a failed --resume once rewrote it first)."""
    out, _ = recorded_run
    cfg2 = write_config(tmp_path / "other.json", {"pipeline.stages": 1, "hetloco.sparseloco.topk": 16})
    fails_with(capsys, ["train", "--steps", 4, "--out", out, "--resume", "--config", cfg2],
               f"--resume: {cfg2} differs from the run's config: hetloco.sparseloco.topk = 16 (the run has 32)", out)


def test_only_changes_that_alter_training_count_as_differences_on_resume():
    """What --resume compares: a changed topk or ratio is a difference; how stage links are driven
    (schedule, CTAs, the GEMM carveout, the transport: timing, the same bits arrive), where the outer
    state waits between outer steps (the same bits) and how often to validate or checkpoint are not.
    Breaks if a timing knob blocked a resume, or if the pipeline exemption swallowed a training key
    beside it."""
    from hetloco_ds.config import parse_config
    from hetloco_ds.rundir import config_differences

    base = {"pipeline": {"stages": 2}, "hetloco": {"sparseloco": {"topk": 32}}}
    then = parse_config(base)
    timing = parse_config({**base, "hetloco": {"sparseloco": {"topk": 32, "outer_state_device": "cpu"},
                                               "train": {"eval_interval": 7},
                                               "pipeline": {"schedule": "overlapped", "link_max_ctas": 4,
                                                            "gemm_sm_carveout": "auto",
                                                            "link_transport": "copy_engine"}}})
    assert config_differences(timing, then) == []
    training = parse_config({**base, "hetloco": {"sparseloco": {"topk": 16}, "subspace": {"ratio": 2},
                                                 "pipeline": {"schedule": "blocking"}}})
    assert config_differences(training, then) == [
        "hetloco.sparseloco.topk = 16 (the run has 32)", "hetloco.subspace.ratio = 2 (the run has 1)"]


def test_resume_with_another_model_is_refused(inputs, recorded_run, tmp_path, capsys):
    out, _ = recorded_run
    other = tmp_path / "other_hf"
    shutil.copytree(inputs["hf"], other)
    fails_with(capsys, ["train", "--steps", 4, "--out", out, "--resume", "--model", other],
               f"--resume: --model {other} is not the run's ({inputs['hf']}; {out}/run_config.json)", out)


def test_resume_without_a_complete_checkpoint_is_refused(recorded_run, capsys):
    """A bare --resume reads config, model and data from the run's record; with nothing
    committed yet it says so (and never starts over silently)."""
    out, _ = recorded_run
    fails_with(capsys, ["train", "--steps", 4, "--out", out, "--resume"],
               f"--resume: {out}/checkpoints holds no complete checkpoint to resume from", out)


def test_resume_with_another_world_size_is_refused(recorded_run, capsys):
    out, _ = recorded_run
    fails_with(capsys, ["train", "--steps", 4, "--out", out, "--resume", "--nproc", 4],
               "--resume: the run has 2 ranks (2 replicas x pipeline.stages = 1); this launch has 4", out)


def test_resume_and_overwrite_together_are_refused(recorded_run, capsys):
    out, _ = recorded_run
    fails_with(capsys, ["train", "--steps", 4, "--out", out, "--resume", "--overwrite"],
               "--resume continues the run in --out and --overwrite replaces it; pass one", out)


def test_out_in_use_by_a_running_job_is_refused(inputs, recorded_run, tmp_path, capsys):
    """While a job holds --out (its lock), a second one into it is refused naming the holder
    (two runs once both "succeeded" into one --out with every metrics row doubled)."""
    from hetloco_ds import checkpoint, rundir

    out, cfg = recorded_run
    # A committed checkpoint, so that only the lock stands in the way of this --resume.
    tag_dir = out / "checkpoints" / "global_step2"
    tag_dir.mkdir()
    (tag_dir / "manifest.json").write_text(json.dumps({"files": {}, "world_size": 2}))
    held = rundir.RunLock(str(out))
    try:
        holder = (out / ".hetloco" / "lock").read_text().strip()
        assert holder.startswith(f"pid {os.getpid()} on {socket.gethostname()} since ")
        fails_with(capsys, ["train", "--steps", 4, "--out", out, "--resume"],
                   f"--out {out} is in use by another run ({holder})", out)
    finally:
        held.release()
    assert checkpoint.pick(str(out / "checkpoints"), 2).tag == "global_step2"


@pytest.mark.parametrize("where", ["run_dir", "inside_checkpoints"])
def test_export_never_writes_into_or_deletes_its_source(recorded_run, where, capsys):
    """`export CKPT OUT --overwrite` with OUT the run directory once deleted every checkpoint and
    metrics.jsonl and exited 0; into the checkpoint directory it would write into its source."""
    out, _ = recorded_run
    ckpt = out / "checkpoints"
    target, why = {"run_dir": (out, f"contains the checkpoint directory {ckpt} it reads from; choose a directory "
                                    "outside it"),
                   "inside_checkpoints": (ckpt / "hf", f"is inside the checkpoint directory {ckpt} it reads from")}[where]
    fails_with(capsys, ["export", ckpt, target, "--overwrite"], f"export target {target} {why}", out,
               prefix="hetloco-ds export: error: ")


MIXED_CASES = {
    "replica_stages_against_the_world": (
        {"hetloco.replica_stages": [1, 2]}, ["--nproc", 2],
        "{cfg}: world size 2 does not match hetloco.replica_stages = [1, 2], which needs 3 ranks (one per stage of "
        "every replica)"),
    "replica_stages_deeper_than_the_model": (
        {"hetloco.replica_stages": [1, 5]}, ["--nproc", 6],
        "{cfg}: hetloco.replica_stages[1] = 5 exceeds the model's 4 decoder layers"),
}


@pytest.mark.parametrize("case", sorted(MIXED_CASES))
def test_bad_mixed_depths_fail_before_any_rank_with_one_line(case, inputs, tmp_path, capsys):
    """hetloco.replica_stages whose ranks are not the world, or a replica deeper than the model: one
    line, before any rank starts (elastic fleets of mixed depths: ELASTIC_CASES). Breaks if the check moves into
    the ranks (where every rank would fail alike, after building groups)."""
    edits, extra, line = MIXED_CASES[case]
    cfg = write_config(tmp_path / "cfg.json", edits)
    out = tmp_path / "out"
    fails_with(capsys, _train(inputs, cfg, out, *extra), line.format(cfg=cfg), out)
    assert not out.exists()


@pytest.mark.parametrize("staging", ["auto", "host"])
def test_a_run_that_needs_more_host_memory_than_the_host_has_is_refused_naming_both(inputs, tmp_path, monkeypatch,
                                                                                   staging):
    """Before any rank starts: the ranks' host bytes (`sizes.host_state_bytes`: here, on the CPU, the
    training state of 2 replicas of the tiny model, and a checkpoint's copy where
    `train.checkpoint_staging` is "host"; "auto" counts none, as it stages only where the host holds
    the copy) against MemAvailable; one line naming both, and the same run is accepted with enough
    memory. Breaks if the check is dropped, counts another model's parameters, or counts a copy "auto"
    would not make."""
    import transformers

    from hetloco_ds import runplan, sizes, train
    from hetloco_ds.config import ConfigError

    cfg = write_config(tmp_path / "run.json", {"pipeline.stages": 1, "hetloco.train.checkpoint_staging": staging})
    args = train.TrainArgs(config=str(cfg), model=str(inputs["hf"]), data=str(inputs["data"]), out=str(tmp_path / "r"))
    params = transformers.LlamaForCausalLM.from_pretrained(str(inputs["hf"])).num_parameters()
    copies = staging == "host"
    need = sizes.host_state_bytes(2 * params, on_gpu=False, outer_on_host=True, bf16=False, checkpoint_copy=copies)
    assert need < sizes.host_state_bytes(2 * params, on_gpu=False, outer_on_host=True, bf16=False) or copies
    monkeypatch.setattr(runplan, "mem_available", lambda: need - 1)
    with pytest.raises(ConfigError) as err:
        train.plan_run(args, 2)
    held = "checkpoint copies, the training state" if copies else "the training state"
    hint = '; hetloco.train.checkpoint_staging "none" saves without a host copy' if copies else ""
    assert str(err.value) == (f"{cfg}: the 2 rank(s) on this host need about {need / 1e9:.1f} GB of host memory "
                              f"({params / 1e9:.2f}B parameters, 2 replica(s): {held}) and "
                              f"{(need - 1) / 1e9:.1f} GB is available{hint}")
    monkeypatch.setattr(runplan, "mem_available", lambda: need)
    assert train.plan_run(args, 2).replicas == 2
