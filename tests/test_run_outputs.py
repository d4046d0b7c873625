"""What one CPU training run prints and leaves behind, through the real CLI with a user's
environment (no HETLOCO_QUIET, no DS_ACCELERATOR, a cold token cache): stderr, OUT/hf,
metrics.jsonl's throughput fields and `hetloco-ds plot`.

One run (2 ranks: 1 stage x 2 replicas, SparseLoCo H = 2, 2 steps) from a bf16 checkpoint
whose tokenizer lives in a directory of its own (`--tokenizer`); the tests read its outputs.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from test_cli import explain, read_metrics, write_config, write_text_folder
from test_hf_roundtrip import save_bf16_source, save_tokenizer_dir

from hetloco_ds import cli, convert, plot
from hetloco_ds.metrics import PEAK_BF16_FLOPS, RunFacts, peak_flops_for, training_flops_per_token

STEPS, REPLICAS = 2, 2


@pytest.fixture(scope="module")
def cpu_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("cpu_run")
    source = root / "source"
    save_bf16_source(source)
    tok_dir = save_tokenizer_dir(root / "tokenizer")
    data = write_text_folder(root / "data")
    cfg = write_config(root / "cfg.json", {"pipeline.stages": 1, "hetloco.sparseloco.inner_steps": 2})
    out = root / "out"
    env = {k: v for k, v in os.environ.items() if k not in ("HETLOCO_QUIET", "TQDM_DISABLE", "DS_ACCELERATOR")}
    env.update(HETLOCO_CACHE=str(root / "cache"), HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    proc = subprocess.run(
        [sys.executable, "-m", "hetloco_ds.cli", "train", "--model", str(source), "--tokenizer", str(tok_dir),
         "--data", str(data), "--config", str(cfg), "--out", str(out), "--nproc", str(REPLICAS), "--steps", str(STEPS)],
        capture_output=True, text=True, env=env, timeout=240)
    assert proc.returncode == 0, explain(proc)
    return source, tok_dir, out, proc


def test_cpu_run_stderr_has_no_datasets_bars_or_accelerator_warning(cpu_run):
    """A CPU run on local files with a cold cache shows our own bars and none of `datasets`'
    ("Generating train split", "Downloading data") nor DeepSpeed's "Setting accelerator to CPU"
    warning (DeepSpeed logs to stdout), in the launcher and both ranks. Breaks if local reads
    stop silencing `datasets`' bars or DS_ACCELERATOR stops being set before DeepSpeed is
    imported."""
    *_, proc = cpu_run
    assert "train:" in proc.stderr, explain(proc)  # progress bars are on, so their absence below means something
    for noise in ("Generating train split", "Downloading data", "Setting accelerator", "unable to detect"):
        assert noise not in proc.stderr + proc.stdout, (noise, explain(proc))


def test_bf16_source_trains_and_exports_bf16_with_its_side_files(cpu_run):
    """Fine-tuning a bf16 checkpoint exports bf16 (config.json says so) with the model card,
    licence, generation config and --tokenizer's files unchanged and the provenance key.
    Breaks if the CLI drops --tokenizer or --model's dtype on the way to the ranks' export."""
    source, tok_dir, out, _ = cpu_run
    config = json.loads((out / "hf" / "config.json").read_text())
    assert config["dtype"] == "bfloat16"
    assert config["hetloco_ds"]["source_model"] == str(source)
    assert config["hetloco_ds"]["tag"] == f"global_step{STEPS}"
    assert {t.dtype for t in load_file(out / "hf" / "model.safetensors").values()} == {torch.bfloat16}
    for name in ("generation_config.json", "README.md", "LICENSE"):
        assert (out / "hf" / name).read_bytes() == (source / name).read_bytes(), name
    for name in convert.tokenizer_files(tok_dir):
        assert (out / "hf" / name).read_bytes() == (tok_dir / name).read_bytes(), name


def test_step_rows_carry_global_tokens_per_s_and_peak_memory_but_no_mfu_on_cpu(cpu_run):
    """Each step row has global_tokens_per_s = replicas x tokens / seconds and the writer's peak
    memory (resident set on CPU: tens of MB at least with torch loaded), and no mfu (no GPU
    peak to divide by). Breaks if a field is dropped or renamed, if the global rate forgets the
    other replicas, or if a CPU row claims an MFU."""
    *_, out, _ = cpu_run
    steps = [r for r in read_metrics(out) if r["kind"] == "step"]
    assert sorted((r["step"], r["replica"]) for r in steps) == [(s, m) for s in range(1, STEPS + 1) for m in range(REPLICAS)]
    for r in steps:
        assert r["global_tokens_per_s"] == pytest.approx(REPLICAS * r["tokens"] / r["seconds"], rel=1e-9), r
        assert r["peak_memory_bytes"] > 50e6, r
        assert "mfu" not in r, r


def test_plot_writes_loss_and_bytes_pngs(cpu_run, tmp_path):
    """`hetloco-ds plot RUN_DIR` writes loss.png and bytes.png (PNG files matplotlib reads back)
    from series that sum the replicas' outer-sync bytes; a directory without metrics is one
    error line. Breaks if a PNG is not written, if the series mis-sum, or if the command
    goes missing from the CLI."""
    *_, out, _ = cpu_run
    assert cli.main(["plot", str(out), "--out", str(tmp_path / "plots")]) == 0
    import matplotlib.image

    for name in (plot.LOSS_PNG, plot.BYTES_PNG):
        path = tmp_path / "plots" / name
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
        height, width, _ = matplotlib.image.imread(path).shape
        assert height > 100 and width > 100, name
    rows = read_metrics(out)
    data = plot.series(rows)
    sync = sum(r["bytes"]["outer_sync"]["sent"] for r in rows if r["kind"] == "step")
    assert sync > 0 and data["sent"]["outer_sync"][1][-1] == sync
    assert sorted(data["train"]) == list(range(REPLICAS)) and data["validation"][0] == [STEPS]
    assert cli.main(["plot", str(tmp_path / "nothing")]) == 2


def test_flops_per_token_is_6n_plus_attention_by_hand():
    """The FLOP convention the README states (bench/'s), counted by hand for conftest's tiny LLaMA
    (d 32, 4 layers, 4 heads of 8, 2 KV heads, MLP 64, vocab 96): N is every parameter, a tied
    table once. Breaks if a table is dropped or counted twice, or the attention term changes."""
    from conftest import tiny_llama_config

    d, layers, heads, head_dim, kv, ff, vocab, seq = 32, 4, 4, 8, 2, 64, 96, 16
    per_layer = d * heads * head_dim + 2 * d * kv * head_dim + heads * head_dim * d + 3 * d * ff + 2 * d
    tied_n = vocab * d + layers * per_layer + d  # embedding (= LM head), layers, final norm
    attention = 12 * layers * heads * head_dim * seq
    assert training_flops_per_token(tiny_llama_config(tied=True), seq) == 6 * tied_n + attention
    assert training_flops_per_token(tiny_llama_config(tied=False), seq) == 6 * (tied_n + vocab * d) + attention

    facts = RunFacts(num_replicas=2, num_stages=4, flops_per_token=1e9, peak_flops=1e15)
    assert facts.rates(tokens=4000, seconds=2.0) == {"global_tokens_per_s": 4000.0, "mfu": 1e9 * 2000 / 4 / 1e15}


@pytest.mark.parametrize("name, tflops", [("NVIDIA H100 80GB HBM3", 989), ("NVIDIA H100 PCIe", 756), ("NVIDIA H100 NVL", 835),
                                          ("NVIDIA H200", 989), ("NVIDIA A100-SXM4-80GB", 312), ("NVIDIA L40S", 362),
                                          ("NVIDIA L4", 121), ("Tesla T4", None)])
def test_peak_lookup_by_device_name(name, tflops):
    """Device names as torch reports them map to their dense bf16 peak; variants before the
    family (an H100 PCIe is not an SXM, an L40S is not an L4); unknown GPUs get no MFU."""
    assert peak_flops_for(name) == (None if tflops is None else tflops * 1e12)
    assert len({key for key, _ in PEAK_BF16_FLOPS}) == len(PEAK_BF16_FLOPS)


def test_a_heads_width_is_the_configs_own_where_it_names_one():
    """`model.head_dim`, which MFU's attention term and the engine's step-cast check both read: a
    config's own head_dim (transformers sizes q, k and v by it) over hidden / heads. Breaks if
    either goes back to hidden / heads alone."""
    from conftest import tiny_llama_config

    from hetloco_ds.model import head_dim

    config = tiny_llama_config(tied=False)
    assert head_dim(config) == 32 // 4
    config.head_dim = 16
    assert head_dim(config) == 16
    assert training_flops_per_token(config, 16) - training_flops_per_token(tiny_llama_config(tied=False), 16) \
        >= 12 * 4 * 4 * (16 - 8) * 16
