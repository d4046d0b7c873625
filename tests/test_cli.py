"""`hetloco-ds train` and `export` through the real CLI: a forked 2-rank job, and `main` in process for
the checks that must fail before any rank starts.

The tiny run inputs built here (an HF directory holding a LlamaForCausalLM and its own small
tokenizer, a text folder, a DeepSpeed JSON derived from configs/cpu_tiny.json) are shared with
test_export_training.py.
"""
from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from conftest import save_tiny_llama
import runs
from distributed import run_job

REPO = Path(__file__).resolve().parents[1]
EOS = "<|endoftext|>"
SENTENCES = [
    "the quick brown fox jumps over the lazy dog",
    "pipeline stages send activations forward and gradients back",
    "sparse top k pseudo gradients cross the slow links",
    "every replica takes a few local steps between outer syncs",
]


# ----------------------------------------------------------------------------- run inputs


def tiny_tokenizer(vocab_size: int = 64):
    """A fast tokenizer trained in-process on SENTENCES: whitespace words, BPE, < 96 tokens."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator([". ".join(SENTENCES) + "."], trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS, "<unk>"]))
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, bos_token=EOS, unk_token="<unk>")


def save_tiny_hf_with_tokenizer(path, seed: int = 0):
    """save_tiny_llama (vocab 96, hidden 32, 4 layers, untied) plus tiny_tokenizer, one directory."""
    save_tiny_llama(path, seed=seed)
    tok = tiny_tokenizer()
    assert len(tok) <= 96
    tok.save_pretrained(path)
    return path


def write_text_folder(path, docs: int = 6, repeats: int = 8):
    """`docs` text files, each SENTENCES rotated and repeated: several 16-token blocks per file."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    for i in range(docs):
        rotated = SENTENCES[i % len(SENTENCES):] + SENTENCES[: i % len(SENTENCES)]
        (path / f"doc{i}.txt").write_text(". ".join(rotated * repeats) + ".\n")
    return path


def write_config(path, edits: dict | None = None):
    """configs/cpu_tiny.json made tiny (2 stages, micro batch 2, seq_len 16, no subspace
    compression, two validation batches only at the end), then `edits` {"dotted.key": value}."""
    with open(REPO / "configs" / "cpu_tiny.json") as f:
        cfg = json.load(f)
    base = {
        "train_micro_batch_size_per_gpu": 2,
        "pipeline.stages": 2,
        "hetloco.subspace.compressed_replicas": "none",
        "hetloco.train.seq_len": 16,
        "hetloco.train.eval_interval": 0,
        "hetloco.train.eval_batches": 2,
    }
    for key, value in {**base, **(edits or {})}.items():
        *parents, leaf = key.split(".")
        node = cfg
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    Path(path).write_text(json.dumps(cfg, indent=2))
    return Path(path)


def explain(proc: subprocess.CompletedProcess) -> str:
    return f"exit {proc.returncode}\n--- stderr (tail) ---\n{proc.stderr[-4000:]}\n--- stdout (tail) ---\n{proc.stdout[-2000:]}"


def read_metrics(out) -> list[dict]:
    with open(Path(out) / "metrics.jsonl") as f:
        return [json.loads(line) for line in f]


def transformers_validation_loss(hf_dir, data_dir, config_path, cache) -> float:
    """The loss `train.py`'s validation computes, but with transformers' LlamaForCausalLM loaded
    from `hf_dir`: the same held-out blocks, micro-batches and count, averaged the same way."""
    from transformers import AutoTokenizer, LlamaForCausalLM

    from hetloco_ds.config import load_config
    from hetloco_ds.data import load_corpus
    from hetloco_ds.data import validation_batches

    run = load_config(config_path)
    tok = AutoTokenizer.from_pretrained(hf_dir)
    corpus = load_corpus(str(data_dir), tok, run.hetloco.train.seq_len, cache_dir=cache, progress=False)
    model = LlamaForCausalLM.from_pretrained(hf_dir, attn_implementation="sdpa").float().eval()
    batches = validation_batches(corpus.val, run.ds["train_micro_batch_size_per_gpu"])
    losses = []
    with torch.no_grad():
        for _ in range(run.hetloco.train.eval_batches):
            ids, labels = next(batches)
            losses.append(model(input_ids=ids, labels=labels).loss.float())
    return float(torch.stack(losses).mean())


@pytest.fixture(scope="module")
def run_inputs(tmp_path_factory):
    """(hf_dir, data_dir, cache) for the tiny runs; the token cache is shared within the module."""
    root = tmp_path_factory.mktemp("cli_inputs")
    hf_dir = save_tiny_hf_with_tokenizer(root / "hf")
    data_dir = write_text_folder(root / "data")
    return hf_dir, data_dir, root / "cache"


# ----------------------------------------------------------------------------- --steps 0


def test_steps_zero_exports_the_input_checkpoint_bitwise(run_inputs, tmp_path):
    """`train --steps 0` (2 stages, 1 replica) loads the HF checkpoint into the pipeline, validates,
    checkpoints and exports it: OUT/hf must hold the very same tensors (bitwise, same dtype and
    keys), a tokenizer that tokenises as the input's does, and the step-0 validation row must
    equal transformers' loss of the input model. Breaks if the key map loses, renames or
    transposes a tensor, if a cast or the embedding split changes a bit on the way, if the export
    drops the tokenizer, or if `--steps 0` skips validation, checkpoint or export."""
    from transformers import AutoTokenizer, LlamaForCausalLM

    hf_dir, data_dir, cache = run_inputs
    # A periodic eval_interval (step 0 is a multiple of it) must not suppress the final validation.
    cfg = write_config(tmp_path / "cfg.json", {"hetloco.train.eval_interval": 50})
    out = tmp_path / "out"
    # The 2 ranks as torchrun starts them (test_launchers: the same job as --nproc 2), forked: fast.
    run_job(tmp_path / "job", 2, ["train", "--steps", 0, "--model", hf_dir, "--out", out, "--config", cfg,
                                  "--data", data_dir], runs.env(cache))

    ref = LlamaForCausalLM.from_pretrained(hf_dir).state_dict()
    got = LlamaForCausalLM.from_pretrained(out / "hf").state_dict()
    assert set(got) == set(ref)
    for key, tensor in ref.items():
        assert got[key].dtype == tensor.dtype, key
        assert torch.equal(got[key], tensor), f"{key} differs by {(got[key] - tensor).abs().max()}"

    text = SENTENCES[1] + " " + SENTENCES[3]
    tok = AutoTokenizer.from_pretrained(out / "hf")
    assert tok(text)["input_ids"] == AutoTokenizer.from_pretrained(hf_dir)(text)["input_ids"]
    assert tok.eos_token == EOS

    rows = read_metrics(out)
    assert [r["kind"] for r in rows] == ["validation", "checkpoint"]
    assert rows[0]["step"] == 0 and (rows[1]["tag"], rows[1]["step"], rows[1]["first_save"]) == ("global_step0", 0, True)
    expected = transformers_validation_loss(hf_dir, data_dir, cfg, cache)
    assert rows[0]["loss"] == pytest.approx(expected, rel=1e-5)


# ----------------------------------------------------------------------------- bad input


def _bad_bogus_key(tmp_path, hf_dir, data_dir):
    cfg = write_config(tmp_path / "bogus.json", {"hetloco.sparseloco.bogus": 1})
    return ["--config", cfg, "--model", hf_dir, "--data", data_dir], [r"bogus", re.escape("<tmp>/bogus.json")]


def _bad_stage_count(tmp_path, hf_dir, data_dir):
    cfg = write_config(tmp_path / "stages.json", {"pipeline.stages": 3})
    # Both numbers: world size 2 and 3 stages.
    return ["--config", cfg, "--model", hf_dir, "--data", data_dir], [r"stages", r"\b2\b", r"\b3\b"]


def _bad_checkpoint_shape(tmp_path, hf_dir, data_dir):
    wrong = tmp_path / "hf_hidden48"
    shutil.copytree(hf_dir, wrong)
    config = json.loads((wrong / "config.json").read_text())
    config["hidden_size"] = 48  # the safetensors still hold hidden size 32
    (wrong / "config.json").write_text(json.dumps(config))
    cfg = write_config(tmp_path / "cfg.json")
    # A key, the shape the config implies (with 48) and the one found (with 32).
    return (["--config", cfg, "--model", wrong, "--data", data_dir],
            [r"model\.[\w.]+\.weight", r"\(\d+, 48\)|\(48, \d+\)", r"found \((\d+, 32|32, \d+)\)"])


def _bad_empty_data(tmp_path, hf_dir, data_dir):
    empty = tmp_path / "empty_data"
    empty.mkdir()
    cfg = write_config(tmp_path / "cfg.json")
    return ["--config", cfg, "--model", hf_dir, "--data", empty], [re.escape("<tmp>/empty_data")]


@pytest.fixture
def in_process(run_inputs, monkeypatch):
    """`hetloco_ds.cli.main` in this process as the launcher runs it (no launcher environment, the
    module's token cache, offline), with a tripwire instead of starting ranks (as test_bad_input.py)."""
    from hetloco_ds import launch

    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "ACCELERATE_USE_DEEPSPEED"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("HETLOCO_CACHE", str(run_inputs[2]))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")

    def tripwire(*args, **kwargs):
        raise AssertionError("a rank was started")

    monkeypatch.setattr(launch, "spawn", tripwire)
    monkeypatch.setattr(launch, "spawn_groups", tripwire)


def main_in_process(capsys, *args) -> tuple[int, str]:
    """(exit code, stderr) of `hetloco-ds ARGS` run by `hetloco_ds.cli.main` in this process."""
    from hetloco_ds import cli

    capsys.readouterr()
    rc = cli.main([str(a) for a in args])
    return rc, capsys.readouterr().err


@pytest.mark.parametrize("case", [_bad_bogus_key, _bad_stage_count, _bad_checkpoint_shape, _bad_empty_data],
                         ids=["unknown_config_key", "stages_vs_nproc", "checkpoint_shape", "empty_data_folder"])
def test_bad_input_fails_before_spawning_with_one_clear_error_and_writes_nothing(case, run_inputs, in_process, tmp_path,
                                                                                 capsys):
    """Each bad input (unknown hetloco key, stage count that does not divide --nproc, an HF
    directory whose config disagrees with its tensors, an empty data folder) must exit non-zero
    with one error line naming the bad value, no traceback, and no --out directory. Breaks if
    validation moves into the ranks (then the tripwire standing in for `launch.spawn` fails the
    test: the run would cost a spawn and every rank would print the error), if the output
    directory is created before validation, or if the message stops naming the culprit. (In
    process, as the launcher runs `main`: an escaping exception fails the test with its traceback.)"""
    hf_dir, data_dir, cache = run_inputs
    args, patterns = case(tmp_path, hf_dir, data_dir)
    out = tmp_path / "out"
    rc, err = main_in_process(capsys, "train", "--steps", 2, "--nproc", 2, "--out", out, *args)
    assert rc != 0, err
    errors = [line for line in err.splitlines() if line.startswith("hetloco-ds train: error:")]
    assert len(errors) == 1, err
    assert "Traceback" not in err, err
    message = errors[0].replace(str(tmp_path), "<tmp>")  # so a digit in the path matches nothing
    for pattern in patterns:
        assert re.search(pattern, message), (pattern, message)
    assert not out.exists()


def test_export_of_missing_checkpoint_dir_fails_clearly(tmp_path, capsys):
    """`hetloco-ds export` on a directory that does not exist must exit non-zero naming it, with
    no traceback and no output directory. Breaks if the error escapes as a traceback (in process:
    it would fail the test with it) or if the output directory is created before the input is
    checked."""
    missing, out = tmp_path / "no_such_checkpoints", tmp_path / "hf_out"
    rc, err = main_in_process(capsys, "export", missing, out)
    assert rc != 0, err
    assert "Traceback" not in err, err
    assert str(missing) in err, err
    assert not out.exists()
