"""Faithful Hugging Face round-trips: source dtype, side files, provenance, tokenizer, Hub cache.

The source checkpoint is what a user downloads: bf16 weights, a hand-written
generation_config.json, a model card and licence, and (here) its tokenizer in a directory of
its own. The model goes the way training takes it (prepare_inputs -> fp32 pipeline layers ->
DeepSpeed layer files + hf_meta -> export), without starting ranks.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from conftest import save_tiny_llama
from test_cli import SENTENCES, tiny_tokenizer, write_config, write_text_folder
from test_convert import build_layers, transformers_messages

from hetloco_ds import cli, convert, hf_export
from hetloco_ds.convert import ConversionError, export_layers, materialize
from hetloco_ds.hf_export import export
from hetloco_ds.train import TrainArgs, prepare_inputs

REPO = Path(__file__).resolve().parents[1]
TAG = "global_step5"
SHA = "0123456789abcdef0123456789abcdef01234567"
GENERATION_CONFIG = """{
    "do_sample": true,
    "temperature": 0.6,
    "top_p": 0.9,
    "bos_token_id": 0,
    "eos_token_id": 0,
    "transformers_version": "4.40.0"
}
"""
MODEL_CARD = "---\nlicense: apache-2.0\n---\n# tiny-bf16\n\nA model card nobody should rewrite.\n"


def save_bf16_source(path: Path) -> LlamaForCausalLM:
    """conftest's tiny LLaMA saved in bf16, plus side files that no re-serialisation reproduces
    byte for byte (4-space JSON, an old transformers_version, a card and a licence); no tokenizer."""
    model = save_tiny_llama(path.parent / f"{path.name}-fp32").to(torch.bfloat16)
    model.save_pretrained(path)
    (path / "generation_config.json").write_text(GENERATION_CONFIG)
    (path / "README.md").write_text(MODEL_CARD)
    (path / "LICENSE").write_text("Licence terms that travel with the weights.\n")
    return model


def save_tokenizer_dir(path: Path) -> Path:
    """test_cli's tiny tokenizer, its tokenizer_config.json rewritten as save_pretrained never writes it."""
    tiny_tokenizer().save_pretrained(path)
    config_file = path / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config["model_max_length"] = 64
    config_file.write_text(json.dumps(config, indent=4) + "\n")
    return path


@pytest.fixture(scope="module")
def bf16_run(tmp_path_factory):
    """(source dir, tokenizer dir, checkpoint dir, export dir, source model, run inputs) after the
    training path with no steps: prepare_inputs, pipeline layers, layer files, hf_meta, export."""
    root = tmp_path_factory.mktemp("bf16_run")
    source = root / "source"
    model = save_bf16_source(source)
    tok_dir = save_tokenizer_dir(root / "tokenizer")
    data = write_text_folder(root / "data")
    cfg = write_config(root / "cfg.json")
    saved = os.environ.get("HETLOCO_CACHE")
    os.environ["HETLOCO_CACHE"] = str(root / "cache")
    try:
        args = TrainArgs(config=str(cfg), model=str(source), tokenizer=str(tok_dir), data=str(data))
        _, config, tokenizer, _ = prepare_inputs(args, 2)
    finally:
        if saved is None:
            del os.environ["HETLOCO_CACHE"]
        else:
            os.environ["HETLOCO_CACHE"] = saved
    layers = materialize(build_layers(config), "cpu", source, config)  # fp32, as the pipeline holds them
    ckpt = root / "ckpt"
    (ckpt / TAG).mkdir(parents=True)
    for idx in export_layers(config):
        assert all(t.dtype == torch.float32 for t in layers[idx].state_dict().values())
        torch.save(layers[idx].state_dict(), ckpt / TAG / f"layer_{idx:02d}-model_states.pt")
    (ckpt / "latest").write_text(TAG)
    hf_export.save_hf_meta(ckpt, config, tokenizer, model_dir=args.model, tokenizer_dir=args.tokenizer)
    out = export(ckpt, root / "hf", progress=False)
    return source, tok_dir, ckpt, out, model, (cfg, data)


def test_bf16_checkpoint_exports_bf16_bitwise_with_identical_logits(bf16_run):
    """A bf16 checkpoint trained in fp32 master weights exports bf16 by default: config.json says
    bfloat16, every tensor is the source's bit for bit, from_pretrained reports no missing or
    unexpected key and gives the source's logits exactly. Breaks if the export falls back to the
    stored fp32 (twice the size, config says float32), or if prepare_inputs stops recording the
    source dtype."""
    source, _, _, out, _, _ = bf16_run
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    ours, theirs = load_file(out / "model.safetensors"), load_file(source / "model.safetensors")
    assert ours.keys() == theirs.keys()
    for key, tensor in theirs.items():
        assert tensor.dtype == torch.bfloat16 and ours[key].dtype == torch.bfloat16, key
        assert torch.equal(ours[key], tensor), key
    with transformers_messages():
        loaded, info = LlamaForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    reference = LlamaForCausalLM.from_pretrained(source)
    assert loaded.dtype == reference.dtype == torch.bfloat16
    ids = torch.randint(0, reference.config.vocab_size, (2, 11), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert torch.equal(loaded.eval()(ids).logits, reference.eval()(ids).logits)


def test_side_files_are_copied_byte_for_byte(bf16_run):
    """generation_config.json, README.md and LICENSE of the model directory and the tokenizer
    files of --tokenizer's directory reach the export unchanged. Breaks if any hop re-saves them
    (GenerationConfig / tokenizer save_pretrained rewrite the JSON) or drops the card."""
    source, tok_dir, _, out, _, _ = bf16_run
    for name in ("generation_config.json", "README.md", "LICENSE"):
        assert (out / name).read_bytes() == (source / name).read_bytes(), name
    names = convert.tokenizer_files(tok_dir)
    assert "tokenizer.json" in names and "tokenizer_config.json" in names
    for name in names:
        assert (out / name).read_bytes() == (tok_dir / name).read_bytes(), name
    text = " ".join(SENTENCES[:2])
    assert AutoTokenizer.from_pretrained(out)(text)["input_ids"] == AutoTokenizer.from_pretrained(tok_dir)(text)["input_ids"]


def test_provenance_is_one_key_transformers_keeps_and_ignores(bf16_run, tmp_path):
    """config.json records the source and checkpoint tag under "hetloco_ds" only: every other
    key equals the source's config.json, and transformers' LlamaConfig loads and re-saves the
    key unchanged and without a word. Breaks if provenance lands in a key transformers
    interprets or complains about, if the export alters another config field, or if the
    record goes missing."""
    source, _, _, out, _, _ = bf16_run
    written = json.loads((out / "config.json").read_text())
    assert written["hetloco_ds"]["source_model"] == str(source)
    assert written["hetloco_ds"]["tag"] == TAG
    with transformers_messages() as messages:
        LlamaConfig.from_pretrained(out).save_pretrained(tmp_path / "again")
    assert not [m for m in messages if "hetloco" in m.lower() or "unused" in m.lower()], messages
    again = json.loads((tmp_path / "again" / "config.json").read_text())
    assert again["hetloco_ds"] == written["hetloco_ds"]
    original = json.loads((source / "config.json").read_text())
    assert {k: v for k, v in written.items() if k != "hetloco_ds"} == original


def test_export_from_state_copies_side_files_unless_given_objects(bf16_run, tmp_path):
    """The in-memory export (what a script's save_pretrained calls) copies the side files of
    `side_files_from` unchanged and keeps the config's bf16; a tokenizer passed explicitly
    is the one saved. Breaks if side_files_from is ignored or its tokenizer wins over the argument."""
    source, tok_dir, _, _, _, _ = bf16_run
    config = convert.read_hf_config(source)
    layers = materialize(build_layers(config), "cpu", source, config)
    states = {idx: layers[idx].state_dict() for idx in export_layers(config)}
    out = hf_export.export_from_state(states, config, None, tmp_path / "copied", side_files_from=source)
    for name in ("generation_config.json", "README.md", "LICENSE"):
        assert (out / name).read_bytes() == (source / name).read_bytes(), name
    assert {t.dtype for t in load_file(out / "model.safetensors").values()} == {torch.bfloat16}
    tokenizer = AutoTokenizer.from_pretrained(tok_dir)
    out = hf_export.export_from_state(states, config, tokenizer, tmp_path / "given", side_files_from=tok_dir)
    assert (out / "tokenizer_config.json").read_bytes() != (tok_dir / "tokenizer_config.json").read_bytes()
    assert AutoTokenizer.from_pretrained(out)("the lazy dog")["input_ids"] == tokenizer("the lazy dog")["input_ids"]


def test_export_dtype_option_overrides_the_source_dtype(bf16_run, tmp_path):
    """`hetloco-ds export --dtype float32` writes float32 weights (the bf16 values upcast, so
    exact) and says so in config.json. Breaks if --dtype is not passed through or ignored."""
    source, _, ckpt, _, _, _ = bf16_run
    out = tmp_path / "fp32"
    assert cli.main(["export", str(ckpt), str(out), "--dtype", "float32"]) == 0
    assert json.loads((out / "config.json").read_text())["dtype"] == "float32"
    ours, theirs = load_file(out / "model.safetensors"), load_file(source / "model.safetensors")
    for key, tensor in theirs.items():
        assert ours[key].dtype == torch.float32 and torch.equal(ours[key], tensor.float()), key


def test_export_dtype_is_the_weights_dtype_unless_train_dtype_says_otherwise(bf16_run, tmp_path, monkeypatch):
    """prepare_inputs sets the export dtype (the config's `dtype`) from the source's weights even
    when its config.json does not say, and `--dtype` overrides it. Breaks if a silent config
    makes a bf16 fine-tune export fp32, or if train's --dtype is ignored."""
    source, tok_dir, _, _, _, (cfg, data) = bf16_run
    silent = tmp_path / "silent"
    silent.mkdir()
    for name in ("model.safetensors", "generation_config.json"):
        (silent / name).write_bytes((source / name).read_bytes())
    config = json.loads((source / "config.json").read_text())
    del config["dtype"]
    (silent / "config.json").write_text(json.dumps(config))
    assert convert.read_hf_config(silent).dtype in (None, torch.float32)  # transformers alone would not know
    monkeypatch.setenv("HETLOCO_CACHE", str(tmp_path / "cache"))
    for dtype, expected in ((None, torch.bfloat16), ("float16", torch.float16)):
        args = TrainArgs(config=str(cfg), model=str(silent), tokenizer=str(tok_dir), data=str(data), dtype=dtype)
        assert prepare_inputs(args, 2)[1].dtype == expected


def test_model_without_tokenizer_is_one_line_naming_the_option(bf16_run, tmp_path, capsys):
    """A model directory without tokenizer files fails before any rank starts with one error
    line naming the directory and --tokenizer, not transformers' advice to install
    sentencepiece or tiktoken, and writes nothing. Breaks if the check goes and AutoTokenizer's
    error (or a traceback) reaches the user."""
    source, _, _, _, _, (cfg, data) = bf16_run
    out = tmp_path / "out"
    rc = cli.main(["train", "--model", str(source), "--config", str(cfg), "--data", str(data),
                   "--out", str(out), "--nproc", "2", "--steps", "1"])
    err = capsys.readouterr().err
    assert rc == 2, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("hetloco-ds train: error:"), err
    assert str(source) in lines[0] and "--tokenizer" in lines[0], lines[0]
    assert "sentencepiece" not in err and "Traceback" not in err
    assert not out.exists()


def test_corrupt_safetensors_header_error_names_the_file(tmp_path):
    """A shard whose header is not valid JSON fails with the shard's path in the message, from
    the header-only shape check and from loading alike. Breaks if safetensors' own error (which
    names no file) escapes."""
    model = save_tiny_llama(tmp_path / "fp32")
    hf = tmp_path / "sharded"
    model.save_pretrained(hf, max_shard_size="20KB")
    shards = sorted(hf.glob("model-*.safetensors"))
    assert len(shards) > 2
    broken = shards[1]
    data = bytearray(broken.read_bytes())
    data[8:16] = b"{garbage"
    broken.write_bytes(bytes(data))
    config = convert.read_hf_config(hf)
    with pytest.raises(ConversionError, match=str(broken)):
        convert.check_hf_dir(hf, config)
    with pytest.raises(ConversionError, match=str(broken)):
        materialize(build_layers(config), "cpu", hf, config)
    single = tmp_path / "single"
    model.save_pretrained(single)
    (single / "model.safetensors").write_bytes(b"\xff" * 64)
    with pytest.raises(ConversionError, match=str(single / "model.safetensors")):
        convert.check_hf_dir(single, config)


# ----------------------------------------------------------------------------- Hugging Face cache


def fake_hub_snapshot(hf_home: Path, repo_type: str, repo_id: str, files: dict[str, bytes]) -> Path:
    """The layout `snapshot_download` leaves in HF_HOME/hub: refs/main names a commit whose
    snapshot folder holds the files."""
    repo = hf_home / "hub" / f"{repo_type}s--{repo_id.replace('/', '--')}"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(SHA)
    snapshot = repo / "snapshots" / SHA
    for name, content in files.items():
        (snapshot / name).parent.mkdir(parents=True, exist_ok=True)
        (snapshot / name).write_bytes(content)
    return snapshot


RESOLVE = """
import json, sys
from hetloco_ds.train import TrainArgs, prepare_inputs
out = {}
args = TrainArgs(config=sys.argv[1], model="tiny-org/tiny-llama", data="tiny-org/tiny-text")
_, config, tokenizer, corpus = prepare_inputs(args, 2)
out.update(model=args.model, tokenizer=args.tokenizer, provenance=config.hetloco_ds, corpus=corpus.description,
           blocks=len(corpus.train) + len(corpus.val))
try:
    prepare_inputs(TrainArgs(config=sys.argv[1], model="tiny-org/not-downloaded"), 2)
except ValueError as err:
    out["missing"] = str(err)
print("RESULT " + json.dumps(out))
"""


def test_hub_ids_resolve_from_a_local_hugging_face_cache(tmp_path):
    """With HF_HOME holding a model snapshot and a dataset snapshot (as `hf download` leaves
    them) and HF_HUB_OFFLINE=1, `--model org/name` trains from the snapshot directory (its
    commit recorded as provenance) and `--data org/name` reads the dataset's rows; an id that
    is not cached is one error naming the cache and why nothing was fetched. Breaks if Hub ids
    are refused as "not a directory" again, or if a dataset snapshot is not found offline."""
    hf_home = tmp_path / "hf_home"
    source = tmp_path / "source"
    save_tiny_llama(source)
    tiny_tokenizer().save_pretrained(source)
    snapshot = fake_hub_snapshot(hf_home, "model", "tiny-org/tiny-llama",
                                 {p.name: p.read_bytes() for p in source.iterdir()})
    rows = [json.dumps({"text": ". ".join(SENTENCES[i:] + SENTENCES[:i]) * 4}) for i in range(4)] * 3
    fake_hub_snapshot(hf_home, "dataset", "tiny-org/tiny-text", {"data/train.jsonl": ("\n".join(rows) + "\n").encode()})
    cfg = write_config(tmp_path / "cfg.json")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE"))}
    env.update(HF_HOME=str(hf_home), HF_HUB_OFFLINE="1", HETLOCO_CACHE=str(tmp_path / "cache"),
               PYTHONPATH=str(REPO), TOKENIZERS_PARALLELISM="false")
    proc = subprocess.run([sys.executable, "-c", RESOLVE, str(cfg)], capture_output=True, text=True, env=env,
                          timeout=180)
    result = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and result, proc.stderr[-3000:]
    got = json.loads(result[0][len("RESULT "):])
    assert Path(got["model"]) == snapshot and Path(got["tokenizer"]) == snapshot
    assert got["provenance"] == {"source_model": "tiny-org/tiny-llama", "source_revision": SHA}
    assert "tiny-org/tiny-text" in got["corpus"] and "12 documents" in got["corpus"], got["corpus"]
    assert got["blocks"] > 0
    assert "tiny-org/not-downloaded" in got["missing"] and str(hf_home / "hub") in got["missing"]
    assert "HF_HUB_OFFLINE" in got["missing"] and "\n" not in got["missing"]
