"""HF <-> pipeline conversion on a tiny GQA LLaMA, single process, no DeepSpeed engine."""
from __future__ import annotations

import json
import logging
import re
import warnings
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from hetloco_ds import convert, hf_export
from hetloco_ds.convert import (
    ConversionError,
    export_layers,
    hf_keys_for_layer,
    load_hf_into_layers,
    materialize,
    num_pipe_layers,
    pipe_key_for_hf,
    read_hf_config,
)
from hetloco_ds.hf_export import export, export_from_state, load_hf_meta, save_hf_meta
from hetloco_ds.model import DecoderLayer, FinalNorm, LMHead, TokenEmbedding, tied_head_forward

N_LAYERS = 2
SMALL_SHARD = "20KB"  # splits the tiny model into several shards
TAG = "global_step3"


def tiny_config(tied: bool, **overrides) -> LlamaConfig:
    kwargs = dict(vocab_size=96, hidden_size=32, num_hidden_layers=N_LAYERS, num_attention_heads=4,
                  num_key_value_heads=2, intermediate_size=64, max_position_embeddings=64,
                  tie_word_embeddings=tied)
    kwargs.update(overrides)
    return LlamaConfig(**kwargs)


def random_model(config: LlamaConfig, seed: int = 0) -> LlamaForCausalLM:
    """Random weights everywhere, norms included, so that any swapped tensor shows."""
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name else 0.1 * torch.randn_like(p))
    return model


def build_layers(config: LlamaConfig, indices=None) -> dict[int, torch.nn.Module]:
    """Pipe layers on the meta device, as the lead's LayerSpecs would build them."""
    n = config.num_hidden_layers
    layers = {}
    with torch.device("meta"):
        for idx in indices if indices is not None else range(num_pipe_layers(config)):
            if idx == 0 or (idx == n + 2 and config.tie_word_embeddings):
                layers[idx] = TokenEmbedding(config)
            elif idx <= n:
                layers[idx] = DecoderLayer(config, idx - 1)
            elif idx == n + 1:
                layers[idx] = FinalNorm(config)
            else:
                layers[idx] = LMHead(config)
    return layers


def pipeline_logits(config: LlamaConfig, layers, ids: torch.Tensor) -> torch.Tensor:
    n = config.num_hidden_layers
    x = layers[0](ids)
    for idx in range(1, n + 1):
        x = layers[idx](x)
    hidden = layers[n + 1](x)
    head = layers[n + 2]
    return tied_head_forward(head, hidden) if config.tie_word_embeddings else head(hidden)


def write_fake_ckpt(ckpt_dir: Path, config, tokenizer, layer_states, tag=TAG) -> None:
    """What a DeepSpeed pipeline run leaves: one torch.save'd state dict per layer, `latest`."""
    (ckpt_dir / tag).mkdir(parents=True, exist_ok=True)
    for idx, state in layer_states.items():
        torch.save(state, ckpt_dir / tag / f"layer_{idx:02d}-model_states.pt")
    (ckpt_dir / "latest").write_text(tag)
    save_hf_meta(ckpt_dir, config, tokenizer)


@contextmanager
def transformers_messages():
    """Collect every transformers log record and Python warning emitted inside the block."""
    messages: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record):
            messages.append(record.getMessage())

    handler = Collect(level=logging.DEBUG)
    logger = logging.getLogger("transformers")
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_warning()
    logger.addHandler(handler)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            yield messages
        messages.extend(str(w.message) for w in caught)
    finally:
        logger.removeHandler(handler)
        transformers.logging.set_verbosity(verbosity)


def assert_no_key_complaints(messages: list[str]) -> None:
    bad = [m for m in messages if re.search(r"missing|unexpected|newly initiali[sz]ed|not initiali[sz]ed|load report", m, re.I)]
    assert not bad, bad


@pytest.fixture(scope="module")
def tokenizer():
    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(["the cat sat on the mat", "a dog ran to the cat"],
                            trainers.WordLevelTrainer(special_tokens=["<unk>", "<s>", "</s>"]))
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    """{(tied, sharded): (config, model, dir)} saved with save_pretrained."""
    out = {}
    for tied in (False, True):
        config = tiny_config(tied)
        model = random_model(config, seed=int(tied))
        for sharded in (False, True):
            path = tmp_path_factory.mktemp(f"hf_tied{int(tied)}_sharded{int(sharded)}")
            model.save_pretrained(path, **({"max_shard_size": SMALL_SHARD} if sharded else {}))
            out[tied, sharded] = (config, model, path)
    return out


def loaded_layers(config, hf_dir, indices=None):
    return materialize(build_layers(config, indices), "cpu", hf_dir, config)


# ------------------------------------------------------------------------------ key map


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_key_map_is_a_bijection_over_hf_keys(tied):
    """Every HF tensor has exactly one owning (pipe layer, key) and back; else export would
    drop or duplicate a weight, or load would put one into the wrong layer."""
    config = tiny_config(tied)
    hf_keys = set(LlamaForCausalLM(config).state_dict())
    if tied:
        hf_keys.discard("lm_head.weight")  # HF ties it; never stored
    forward = {}
    for idx in export_layers(config):
        for pipe_key, hf_key in hf_keys_for_layer(config, idx).items():
            assert hf_key not in forward, f"{hf_key} claimed twice"
            forward[hf_key] = (idx, pipe_key)
            assert pipe_key_for_hf(config, hf_key) == (idx, pipe_key)
    assert set(forward) == hf_keys
    for hf_key in hf_keys:
        idx, pipe_key = pipe_key_for_hf(config, hf_key)
        assert hf_keys_for_layer(config, idx)[pipe_key] == hf_key


def test_tied_head_is_a_load_only_alias_of_the_embedding():
    """Tied: the last stage's embedding replica must load HF's embed_tokens, but lm_head must
    neither be exported nor mapped back (HF would see an unexpected/duplicated tensor)."""
    tied, untied = tiny_config(True), tiny_config(False)
    n = N_LAYERS
    assert hf_keys_for_layer(tied, n + 2) == {"weight": "model.embed_tokens.weight"}
    assert pipe_key_for_hf(tied, "model.embed_tokens.weight") == (0, "weight")
    assert n + 2 not in export_layers(tied)
    with pytest.raises(ConversionError, match="lm_head.weight"):
        pipe_key_for_hf(tied, "lm_head.weight")
    assert hf_keys_for_layer(untied, n + 2) == {"lm_head.weight": "lm_head.weight"}
    with pytest.raises(ConversionError, match="model.layers.2"):
        pipe_key_for_hf(untied, "model.layers.2.mlp.up_proj.weight")  # only 2 decoder layers


# ------------------------------------------------------------------------------ HF -> layers


@pytest.mark.parametrize("sharded", [False, True], ids=["single", "sharded"])
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_materialize_loads_hf_weights_bitwise(hf_dirs, tied, sharded):
    """Meta-built layers, materialised from an HF dir, hold HF's exact tensors and a correct
    rotary table; a wrong key, a lost cast or a garbage inv_freq after to_empty would show."""
    config, model, path = hf_dirs[tied, sharded]
    layers = loaded_layers(config, path)
    hf_state = model.state_dict()
    for idx, layer in layers.items():
        for pipe_key, tensor in layer.state_dict().items():
            assert not tensor.is_meta
            assert torch.equal(tensor, hf_state[hf_keys_for_layer(config, idx)[pipe_key]]), (idx, pipe_key)
    fresh = DecoderLayer(config, 0).rotary.inv_freq
    for idx in range(1, N_LAYERS + 1):
        assert torch.equal(layers[idx].rotary.inv_freq, fresh)
        assert torch.equal(layers[idx].rotary.original_inv_freq, fresh)


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_loaded_pipeline_layers_compute_hf_logits(hf_dirs, tied):
    """The stage layers in sequence reproduce LlamaForCausalLM's logits: the map is right in
    meaning (e.g. q/k not swapped), not only in names."""
    config, model, path = hf_dirs[tied, True]
    layers = loaded_layers(config, path)
    ids = torch.randint(0, config.vocab_size, (2, 11), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(pipeline_logits(config, layers, ids), model(ids).logits, rtol=1e-5, atol=1e-5)


def test_tied_replica_in_one_stage_is_allocated_once(hf_dirs):
    """On a single stage DeepSpeed lists the same tied module under indices 0 and n+2; it must
    stay one module with the HF embedding, not be reallocated into two."""
    config, model, path = hf_dirs[True, False]
    layers = build_layers(config, [0])
    layers[N_LAYERS + 2] = embedding = layers[0]
    calls = []
    real_to_empty = embedding.to_empty
    embedding.to_empty = lambda **kw: calls.append(kw) or real_to_empty(**kw)
    materialize(layers, "cpu", path, config)
    assert len(calls) == 1 and layers[N_LAYERS + 2] is layers[0]
    assert torch.equal(layers[0].weight, model.model.embed_tokens.weight)


def test_perp_is_zeroed_on_load(hf_dirs):
    """With a subspace split (perp buffer present), HF's embedding goes whole into `weight`
    and perp is zero, so TE = weight + perp still equals HF's table."""
    config, model, path = hf_dirs[False, False]
    layers = build_layers(config, [0])
    with torch.device("meta"):
        layers[0].register_buffer("perp", torch.empty(config.vocab_size, config.hidden_size))
    materialize(layers, "cpu", path, config)
    assert torch.equal(layers[0].weight, model.model.embed_tokens.weight)
    assert torch.count_nonzero(layers[0].perp) == 0


def test_load_opens_only_the_shards_it_needs(hf_dirs, monkeypatch):
    """A stage must read its own layers only; opening every shard would read the whole model
    on every rank."""
    config, _, path = hf_dirs[False, True]
    weight_map = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(set(weight_map.values())) > 2
    opened = []
    real = convert.safe_open

    def counting_safe_open(filename, *args, **kwargs):
        opened.append(Path(filename).name)
        return real(filename, *args, **kwargs)

    monkeypatch.setattr(convert, "safe_open", counting_safe_open)
    n = N_LAYERS
    loaded_layers(config, path, [n + 1])
    assert opened == [weight_map["model.norm.weight"]]
    opened.clear()
    loaded_layers(config, path, [2])
    assert sorted(opened) == sorted({f for k, f in weight_map.items() if k.startswith("model.layers.1.")})


def test_load_shape_mismatch_names_key_shapes_and_file(hf_dirs):
    """A config that disagrees with the checkpoint must fail with the key, both shapes and the
    file, not with a bare copy_ broadcast error (or worse, a silent broadcast)."""
    _, _, path = hf_dirs[False, True]
    wrong = tiny_config(False, intermediate_size=48)
    with pytest.raises(ConversionError) as err:
        loaded_layers(wrong, path, [1])
    msg = str(err.value)
    assert re.search(r"model\.layers\.0\.mlp\.\w+_proj\.weight", msg), msg
    assert re.search(r"expected shape \((48, 32|32, 48)\).*found \((64, 32|32, 64)\)", msg), msg
    assert re.search(r"model-\d{5}-of-\d{5}\.safetensors", msg), msg


def test_load_missing_key_is_named(hf_dirs, tmp_path):
    """A checkpoint lacking a tensor must say which one, before anything is read."""
    config, _, path = hf_dirs[False, False]
    state = load_file(path / "model.safetensors")
    del state["model.norm.weight"]
    save_file(state, tmp_path / "model.safetensors", metadata={"format": "pt"})
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    with pytest.raises(ConversionError, match=r"model\.norm\.weight"):
        loaded_layers(read_hf_config(tmp_path), tmp_path, [N_LAYERS + 1])


def test_load_into_unmaterialised_layers_says_so(hf_dirs):
    """Copying into meta tensors is a silent no-op; loading must refuse and point at materialize."""
    config, _, path = hf_dirs[False, False]
    with pytest.raises(ConversionError, match="materialize"):
        load_hf_into_layers(path, config, build_layers(config, [N_LAYERS + 1]))


def test_untied_config_on_tied_checkpoint_names_lm_head(hf_dirs):
    """Loading a tied checkpoint as untied must say lm_head.weight is missing."""
    _, _, path = hf_dirs[True, False]
    with pytest.raises(ConversionError, match=r"lm_head\.weight"):
        loaded_layers(tiny_config(False), path, [N_LAYERS + 2])


def test_read_hf_config_rejects_missing_or_non_llama(hf_dirs, tmp_path):
    """A wrong directory must fail with a message saying what is wrong with it."""
    with pytest.raises(ConversionError, match="config.json"):
        read_hf_config(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(ConversionError, match="gpt2"):
        read_hf_config(tmp_path)
    config, _, path = hf_dirs[True, False]
    read = read_hf_config(path)
    assert isinstance(read, LlamaConfig) and read.tie_word_embeddings and read.num_key_value_heads == 2


# ------------------------------------------------------------------------------ layers -> HF


def ckpt_from_hf(hf_dirs, tied, tmp_path, tokenizer, tag=TAG):
    config, model, path = hf_dirs[tied, False]
    layers = loaded_layers(config, path)
    states = {idx: layers[idx].state_dict() for idx in export_layers(config)}
    ckpt = tmp_path / "ckpt"
    write_fake_ckpt(ckpt, config, tokenizer, states, tag)
    return config, model, ckpt


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_export_round_trips_through_from_pretrained(hf_dirs, tied, tmp_path, tokenizer):
    """DeepSpeed layer files -> export -> from_pretrained gives HF's exact tensors and logits
    with no missing/unexpected-key report; tied exports no lm_head and loads tied."""
    config, model, ckpt = ckpt_from_hf(hf_dirs, tied, tmp_path, tokenizer)
    out = export(ckpt, tmp_path / "out", progress=False)
    assert (out / "model.safetensors").is_file() and not (out / "model.safetensors.index.json").exists()
    assert ("lm_head.weight" in load_file(out / "model.safetensors")) is not tied

    with transformers_messages() as messages:
        loaded, info = LlamaForCausalLM.from_pretrained(out, output_loading_info=True)
        loaded_tok = AutoTokenizer.from_pretrained(out)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    assert_no_key_complaints(messages)

    expected = model.state_dict()
    for key, tensor in loaded.state_dict().items():
        assert torch.equal(tensor, expected[key]), key
    if tied:
        assert loaded.lm_head.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr()
    ids = torch.randint(0, config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(loaded.eval()(ids).logits, model(ids).logits)
    assert loaded_tok("the cat sat")["input_ids"] == tokenizer("the cat sat")["input_ids"]
    assert (out / "generation_config.json").is_file()


@pytest.mark.parametrize("shard_size", [SMALL_SHARD, "10KB", "2GB"], ids=["sharded", "oversize-tensors", "single"])
def test_export_shards_like_save_pretrained(hf_dirs, tmp_path, shard_size, tokenizer):
    """The shard files and index equal what save_pretrained writes for the same model and
    size limit, so HF tooling that expects its layout works on ours."""
    config, model, _ = hf_dirs[False, False]
    reference = tmp_path / "reference"
    model.save_pretrained(reference, max_shard_size=shard_size)
    states = {idx: layer.state_dict() for idx, layer in loaded_layers(config, hf_dirs[False, False][2]).items()}
    out = export_from_state(states, config, tokenizer, tmp_path / "out", max_shard_size=shard_size)
    weight_files = lambda d: sorted(p.name for p in d.iterdir() if p.name.startswith("model"))
    assert weight_files(out) == weight_files(reference)
    index = "model.safetensors.index.json"
    if (reference / index).exists():
        assert json.loads((out / index).read_text()) == json.loads((reference / index).read_text())
    for name in weight_files(out):
        if name.endswith(".safetensors"):
            ours, theirs = load_file(out / name), load_file(reference / name)
            assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)


def test_perp_is_added_into_embed_tokens_on_export(hf_dirs, tmp_path, tokenizer):
    """After a subspace split TE = weight + perp; exporting only `weight` would ship a model
    missing the high-rank part of its embedding."""
    config, model, path = hf_dirs[False, False]
    states = {idx: layer.state_dict() for idx, layer in loaded_layers(config, path).items()}
    table = states[0]["weight"]
    perp = torch.randn_like(table)
    states[0] = {"weight": table - perp, "perp": perp}
    out = export_from_state(states, config, tokenizer, tmp_path / "out")
    exported = load_file(out / "model.safetensors")["model.embed_tokens.weight"]
    assert torch.equal(exported, (table - perp) + perp)
    torch.testing.assert_close(exported, table)


def test_interrupted_export_leaves_nothing_that_looks_complete(hf_dirs, tmp_path, tokenizer, monkeypatch):
    """A crash midway must leave neither out_dir nor a staging dir, and must not touch an
    existing out_dir that overwrite=True was going to replace."""
    config, _, ckpt = ckpt_from_hf(hf_dirs, False, tmp_path, tokenizer)
    real = hf_export._save_shard
    calls = []

    def failing_save_shard(tensors, path):
        calls.append(path)
        if len(calls) == 3:
            raise OSError("disk full")
        real(tensors, path)

    monkeypatch.setattr(hf_export, "_save_shard", failing_save_shard)
    out = tmp_path / "out"
    with pytest.raises(OSError, match="disk full"):
        export(ckpt, out, progress=False, max_shard_size=SMALL_SHARD)
    assert len(calls) == 3
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]

    out.mkdir()
    (out / "previous.txt").write_text("keep me")
    calls.clear()
    with pytest.raises(OSError, match="disk full"):
        export(ckpt, out, progress=False, max_shard_size=SMALL_SHARD, overwrite=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "out"]
    assert [p.name for p in out.iterdir()] == ["previous.txt"]


def test_export_refuses_non_empty_out_dir_unless_overwrite(hf_dirs, tmp_path, tokenizer):
    """An export must not silently clobber a directory; with overwrite=True it replaces it
    whole (no stale shard of the old model survives)."""
    _, _, ckpt = ckpt_from_hf(hf_dirs, False, tmp_path, tokenizer)
    out = tmp_path / "out"
    out.mkdir()
    (out / "model-00001-of-00009.safetensors").write_text("stale")
    with pytest.raises(ConversionError, match=re.escape(str(out))):
        export(ckpt, out, progress=False)
    export(ckpt, out, progress=False, overwrite=True)
    assert not (out / "model-00001-of-00009.safetensors").exists()
    assert (out / "model.safetensors").is_file()
    empty = tmp_path / "empty"
    empty.mkdir()
    export(ckpt, empty, progress=False)  # an empty directory is fine
    assert (empty / "config.json").is_file()


def test_export_uses_latest_tag_unless_told(hf_dirs, tmp_path, tokenizer):
    """`latest` picks the tag; an explicit tag wins. Exporting the wrong step is silent
    otherwise."""
    config, _, ckpt = ckpt_from_hf(hf_dirs, False, tmp_path, tokenizer, tag="global_step1")
    states = {idx: torch.load(ckpt / "global_step1" / f"layer_{idx:02d}-model_states.pt")
              for idx in export_layers(config)}
    states[N_LAYERS + 1] = {"norm.weight": torch.full((config.hidden_size,), 7.0)}
    write_fake_ckpt(ckpt, config, tokenizer, states, tag=TAG)
    norm = lambda d: load_file(d / "model.safetensors")["model.norm.weight"]
    assert torch.all(norm(export(ckpt, tmp_path / "latest", progress=False)) == 7)
    assert not torch.all(norm(export(ckpt, tmp_path / "step1", tag="global_step1", progress=False)) == 7)


def test_export_errors_name_what_is_missing_or_wrong(hf_dirs, tmp_path, tokenizer):
    """Each way a checkpoint can be unusable fails before writing, naming the culprit."""
    config, _, ckpt = ckpt_from_hf(hf_dirs, False, tmp_path, tokenizer)
    out = tmp_path / "out"
    with pytest.raises(ConversionError, match="does not exist"):
        export(tmp_path / "nope", out, progress=False)
    with pytest.raises(ConversionError, match="global_step9"):
        export(ckpt, out, tag="global_step9", progress=False)

    layer_file = ckpt / TAG / "layer_02-model_states.pt"
    state = torch.load(layer_file)
    layer_file.unlink()
    with pytest.raises(ConversionError, match="layer_02-model_states.pt"):
        export(ckpt, out, progress=False)

    state["layer.self_attn.k_proj.weight"] = torch.zeros(32, 32)
    torch.save(state, layer_file)
    with pytest.raises(ConversionError) as err:
        export(ckpt, out, progress=False)
    assert "layer.self_attn.k_proj.weight" in str(err.value)
    assert "(32, 32)" in str(err.value) and "(16, 32)" in str(err.value)

    del state["layer.self_attn.k_proj.weight"]
    torch.save(state, layer_file)
    with pytest.raises(ConversionError, match="missing key 'layer.self_attn.k_proj.weight'"):
        export(ckpt, out, progress=False)

    (ckpt / "latest").unlink()
    with pytest.raises(ConversionError, match="latest"):
        export(ckpt, out, progress=False)
    assert not out.exists()


def test_hf_meta_round_trips_and_replaces_atomically(tmp_path, tokenizer):
    """export depends on hf_meta for config and tokenizer; rewriting it must leave one
    complete copy and no staging directory."""
    config = tiny_config(True)
    save_hf_meta(tmp_path, config, tokenizer)
    save_hf_meta(tmp_path, config, tokenizer)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf_meta"]
    meta = load_hf_meta(tmp_path)
    assert meta.config.tie_word_embeddings and meta.config.num_key_value_heads == 2
    assert meta.tokenizer("the cat")["input_ids"] == tokenizer("the cat")["input_ids"]
    with pytest.raises(ConversionError, match="hf_meta"):
        load_hf_meta(tmp_path / "elsewhere")
