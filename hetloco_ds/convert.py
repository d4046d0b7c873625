"""Hugging Face LLaMA <-> pipeline stage layers, in both directions, through one key map.

The pipeline layer list (`model.layer_list`, indices by `sizes.LayerLayout`) holds the token
embedding (weight, + persistent `perp` once a subspace split exists), the decoder layers
(layer.<rest>), the final norm (norm.weight) and the LM head (lm_head.weight; tied: a
TokenEmbedding replica of the embedding).

`KEY_MAP` below says how each state-dict key of those layers is named in a
`LlamaForCausalLM` state dict. Loading (HF -> layers) and export (DeepSpeed checkpoint ->
HF directory) both read it; nothing else in this module knows a key name.

DeepSpeed writes one `CKPT_DIR/<tag>/<patches.layer_checkpoint_name(idx)>` per layer and names
the newest tag in `CKPT_DIR/latest`; the training run adds `CKPT_DIR/hf_meta/` (config,
generation config, tokenizer, model card) with `save_hf_meta`, which is all `export` needs
besides the layer files. What came from the source model directory (tokenizer files,
generation_config.json, README.md and licence files) is copied byte for byte at both hops, so
an export carries the source's side files unchanged.

The exported config.json says which dtype the weights are in (the config's `dtype`: the
source checkpoint's for a fine-tune) and records where the model came from under one key,
`hetloco_ds`, that transformers keeps as an unknown attribute and otherwise ignores.
"""
from __future__ import annotations

import copy
import functools
import itertools
import json
import os
import re
import shutil
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Iterator, Mapping

import torch
from huggingface_hub import split_torch_state_dict_into_shards
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import nn
from tqdm import tqdm
from transformers import GenerationConfig, LlamaConfig

from . import safe_load
from .model import layer_list
from .patches import layer_checkpoint_name
from .sizes import LayerLayout
from .version import __version__


HF_META = "hf_meta"
SAFE_WEIGHTS = "model.safetensors"
SAFE_INDEX = "model.safetensors.index.json"
DEFAULT_SHARD_SIZE = "2GB"
PROVENANCE_KEY = "hetloco_ds"
"""config.json key of our provenance record; transformers keeps unknown keys as plain attributes."""

TOKENIZER_FILES = (
    "tokenizer_config.json", "tokenizer.json", "special_tokens_map.json", "added_tokens.json",
    "tokenizer.model", "spiece.model", "sentencepiece.bpe.model", "vocab.json", "merges.txt", "vocab.txt",
    "chat_template.jinja", "chat_template.json",
)
"""File names transformers' tokenizers read from a model directory (any one makes a tokenizer dir)."""
TOKENIZER_DIRS = ("additional_chat_templates",)
MODEL_CARD_FILES = ("README.md", "LICENSE", "LICENSE.txt", "LICENSE.md", "NOTICE", "USE_POLICY.md")
"""The model card and the licence terms a redistributed fine-tune must keep."""
GENERATION_CONFIG = "generation_config.json"
DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16,
          "float32": torch.float32, "fp32": torch.float32}


class ConversionError(ValueError):
    """A checkpoint, HF directory or config that cannot be converted; the message says why."""


# --------------------------------------------------------------------------------------------
# The key map
# --------------------------------------------------------------------------------------------


def _embed(config: LlamaConfig) -> range:
    i = LayerLayout(config.num_hidden_layers).embedding
    return range(i, i + 1)


def _blocks(config: LlamaConfig) -> range:
    return LayerLayout(config.num_hidden_layers).decoders


def _norm(config: LlamaConfig) -> range:
    i = LayerLayout(config.num_hidden_layers).norm
    return range(i, i + 1)


def _head(config: LlamaConfig) -> range:
    i = LayerLayout(config.num_hidden_layers).head
    return range(i, i + 1)


@dataclass(frozen=True)
class KeyRule:
    """One row of the key map.

    `layers(config)` is the range of pipe layer indices the rule covers. In the patterns,
    `{block}` is the position of the pipe layer within that range (the HF decoder index for
    decoder layers) and `{rest}` is any dotted suffix, the same on both sides.
    """

    layers: Callable[[LlamaConfig], range]
    pipe: str
    hf: str
    plus: str | None = None
    """Pipe key of an optional addend: HF tensor = state[pipe] + state[plus]. On load the HF
    tensor goes into `pipe` and `plus` is zeroed."""
    tied: bool | None = None
    """Only when config.tie_word_embeddings is this value (None: always)."""
    export: bool = True
    """False for a load-only alias: a replica whose HF tensor another rule already exports."""


KEY_MAP: tuple[KeyRule, ...] = (
    # TE = weight + perp: the one rule that combines two pipe tensors into one HF tensor.
    KeyRule(_embed, "weight", "model.embed_tokens.weight", plus="perp"),
    KeyRule(_blocks, "layer.{rest}", "model.layers.{block}.{rest}"),
    KeyRule(_norm, "norm.weight", "model.norm.weight"),
    KeyRule(_head, "lm_head.weight", "lm_head.weight", tied=False),
    # Tied: layer n+2 is a replica of layer 0 (on the last stage). It is loaded from HF's
    # embedding but never exported: HF ties lm_head to embed_tokens and stores neither twice.
    KeyRule(_head, "weight", "model.embed_tokens.weight", plus="perp", tied=True, export=False),
)


def _active_rules(config: LlamaConfig, *, exporting: bool) -> list[KeyRule]:
    tied = bool(config.tie_word_embeddings)
    return [
        r for r in KEY_MAP
        if (r.tied is None or r.tied == tied) and (r.export or not exporting)
    ]


@functools.lru_cache(maxsize=None)
def _regex(pattern: str) -> re.Pattern:
    parts = re.split(r"(\{block\}|\{rest\})", pattern)
    groups = {"{block}": r"(?P<block>\d+)", "{rest}": r"(?P<rest>.+)"}
    return re.compile("".join(groups.get(p, re.escape(p)) for p in parts))


def _match(pattern: str, key: str) -> dict[str, str] | None:
    m = _regex(pattern).fullmatch(key)
    return None if m is None else m.groupdict()


def _pipe_to_hf(config: LlamaConfig, layer_idx: int, pipe_key: str, *, exporting: bool):
    """(hf_key, is_addend) for one pipe key, or ConversionError if no rule covers it."""
    for rule in _active_rules(config, exporting=exporting):
        span = rule.layers(config)
        if layer_idx not in span:
            continue
        for key, is_addend in ((rule.pipe, False), (rule.plus, True)):
            groups = _match(key, pipe_key) if key is not None else None
            if groups is not None:
                return rule.hf.format(block=layer_idx - span.start, **groups), is_addend
    raise ConversionError(f"no key-map rule for pipe layer {layer_idx} key {pipe_key!r}")


def pipe_key_for_hf(config: LlamaConfig, hf_key: str) -> tuple[int, str]:
    """(pipe layer index, pipe key) that owns `hf_key` (tied: the embedding, layer 0)."""
    for rule in _active_rules(config, exporting=True):
        groups = _match(rule.hf, hf_key)
        if groups is None:
            continue
        span = rule.layers(config)
        block = int(groups.pop("block", 0))
        if block >= len(span):
            raise ConversionError(f"{hf_key!r}: block {block} is out of range for {len(span)} layers")
        return span[block], rule.pipe.format(**groups)
    raise ConversionError(f"no key-map rule for HF key {hf_key!r}")


def num_pipe_layers(config: LlamaConfig) -> int:
    """Length of the pipeline layer list: embedding, n decoder layers, norm, head."""
    return LayerLayout(config.num_hidden_layers).count


def export_layers(config: LlamaConfig) -> range:
    """Pipe layer indices whose states make up the HF checkpoint (tied: not the head replica)."""
    return range(num_pipe_layers(config) - (1 if config.tie_word_embeddings else 0))


def _build_layer(config: LlamaConfig, layer_idx: int) -> nn.Module:
    """Pipe layer `layer_idx` as the pipeline builds it (the one layer list: model.layer_list)."""
    layers = layer_list(config)
    if not 0 <= layer_idx < len(layers):
        raise ConversionError(f"pipe layer index {layer_idx} is out of range 0..{len(layers) - 1}")
    return layers[layer_idx].build()


def _expected_shapes(config: LlamaConfig, layer_idx: int) -> dict[str, torch.Size]:
    """State-dict key -> shape of pipe layer `layer_idx` as `config` builds it (on meta)."""
    with torch.device("meta"):
        layer = _build_layer(config, layer_idx)
    return {k: v.shape for k, v in layer.state_dict().items()}


def hf_keys_for_layer(config: LlamaConfig, layer_idx: int) -> dict[str, str]:
    """Pipe key -> HF key for every state key of pipe layer `layer_idx`.

    The embedding's optional `perp` addend is not listed (it has no HF key of its own; see
    KEY_MAP). For the tied head replica this is its load-only alias of the embedding.
    """
    return {
        key: _pipe_to_hf(config, layer_idx, key, exporting=False)[0]
        for key in _expected_shapes(config, layer_idx)
    }


# --------------------------------------------------------------------------------------------
# HF directory -> layers
# --------------------------------------------------------------------------------------------


HUB_MODEL_FILES = ("*.json", "*.safetensors", "*.jinja", "*.model", "*.txt", "*.md", "LICENSE*", "NOTICE*",
                   "additional_chat_templates/*")
"""What `resolve_hf_dir` fetches of a model repo: weights, configs, tokenizer, card (no .bin/.pth)."""
HUB_TOKENIZER_FILES = ("config.json", *TOKENIZER_FILES, "additional_chat_templates/*")


def _one_line(err: BaseException) -> str:
    return f"{type(err).__name__}: {' '.join(str(err).split())}"


def resolve_hf_dir(name: str | os.PathLike, what: str = "--model", patterns: Iterable[str] = HUB_MODEL_FILES) -> Path:
    """A local directory for `name`: `name` itself when it is a directory, else the snapshot of
    the Hub repo `name` in the Hugging Face cache (downloaded into it first, `patterns` only,
    unless HF_HUB_OFFLINE=1). `what` names the option in errors."""
    path = Path(name).expanduser()
    if path.is_dir():
        return path
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(str(name))
    except HFValidationError:
        raise ConversionError(f"{what} {name}: not a directory (expected a save_pretrained directory or a Hub id)") from None
    offline = bool(constants.HF_HUB_OFFLINE)
    try:
        return Path(snapshot_download(str(name), allow_patterns=list(patterns), local_files_only=offline))
    except LocalEntryNotFoundError:
        how = "HF_HUB_OFFLINE is set, so nothing was downloaded" if offline else "and the Hub could not be reached"
        raise ConversionError(
            f"{what} {name}: not a directory, and not in the Hugging Face cache {constants.HF_HUB_CACHE} ({how})") from None
    except Exception as err:  # not found, gated, unauthorised, network: the hub's own words
        raise ConversionError(f"{what} {name}: not a directory, and not loadable from the Hub ({_one_line(err)})") from None


def read_hf_config(hf_dir: str | os.PathLike) -> LlamaConfig:
    """The LlamaConfig of a local `save_pretrained` directory."""
    path = Path(hf_dir) / "config.json"
    if not path.is_file():
        raise ConversionError(f"{path} not found: expected a directory written by save_pretrained")
    model_type = json.loads(path.read_text()).get("model_type")
    if model_type != "llama":
        raise ConversionError(f"{path}: model_type is {model_type!r}; only 'llama' models are supported")
    return LlamaConfig.from_pretrained(str(Path(hf_dir)))


@contextmanager
def _open_safetensors(path: Path):
    """`safe_open` on `path`; a corrupt or truncated file is a ConversionError naming it.

    safetensors' own message ("Error while deserializing header: ...") names no file, which
    leaves a user of a sharded checkpoint guessing which of its shards is broken.
    """
    try:
        handle = safe_open(str(path), framework="pt", device="cpu")
    except (SafetensorError, OSError) as err:
        raise ConversionError(f"{path}: not a readable safetensors file ({err})") from None
    with handle as f:
        yield f


def _safetensors_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape, from the header only (no tensor data is read)."""
    with _open_safetensors(path) as f:
        return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}


_SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


def _hf_weight_map(hf_dir: Path) -> dict[str, str]:
    """HF key -> file name (relative to hf_dir), from the index or the single file."""
    index = hf_dir / SAFE_INDEX
    if index.is_file():
        try:
            return json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError, TypeError) as err:
            raise ConversionError(f"{index}: not a safetensors index with a weight_map ({err!r})") from None
    single = hf_dir / SAFE_WEIGHTS
    if single.is_file():
        return {k: SAFE_WEIGHTS for k in _safetensors_shapes(single)}
    hint = " (found pytorch_model.bin weights; re-save with safe_serialization)" if any(
        hf_dir.glob("pytorch_model*.bin")) else ""
    raise ConversionError(f"no {SAFE_WEIGHTS} or {SAFE_INDEX} in {hf_dir}{hint}")


def weights_dtype(hf_dir: str | os.PathLike) -> torch.dtype | None:
    """The one floating-point dtype of a checkpoint's tensors, from the headers; None if mixed."""
    hf_dir = Path(hf_dir)
    found = set()
    for file_name in sorted(set(_hf_weight_map(hf_dir).values())):
        with _open_safetensors(hf_dir / file_name) as f:
            found |= {f.get_slice(k).get_dtype() for k in f.keys()}
    floats = {_SAFETENSORS_DTYPES[d] for d in found if d in _SAFETENSORS_DTYPES}
    return floats.pop() if len(floats) == 1 else None


def parse_dtype(value: str | torch.dtype | None) -> torch.dtype | None:
    """torch dtype from "bfloat16"/"bf16", "float16"/"fp16", "float32"/"fp32" (or a torch dtype)."""
    if value is None or isinstance(value, torch.dtype):
        return value
    try:
        return DTYPES[str(value).lower()]
    except KeyError:
        raise ConversionError(f"dtype {value!r} is not one of {', '.join(DTYPES)}") from None


def check_hf_dir(hf_dir: str | os.PathLike, config: LlamaConfig) -> None:
    """Every tensor the pipeline loads from `hf_dir` exists there with the shape `config` gives it.

    Reads only safetensors headers (no tensor data, no model built), so a launcher can reject a
    checkpoint of another shape before any rank starts. Same messages as `load_hf_into_layers`.
    """
    hf_dir = Path(hf_dir)
    weight_map = _hf_weight_map(hf_dir)
    headers: dict[str, dict[str, tuple[int, ...]]] = {}
    for idx in range(num_pipe_layers(config)):
        for pipe_key, shape in _expected_shapes(config, idx).items():
            hf_key, is_addend = _pipe_to_hf(config, idx, pipe_key, exporting=False)
            if is_addend:
                continue
            label = f"pipe layer {idx} {pipe_key!r}"
            if hf_key not in weight_map:
                raise ConversionError(f"{hf_dir} lacks 1 needed tensor(s): {hf_key} (for {label})")
            file_name = weight_map[hf_key]
            if file_name not in headers:
                path = hf_dir / file_name
                if not path.is_file():
                    raise ConversionError(f"{path} is named by {hf_dir / SAFE_INDEX} but does not exist")
                headers[file_name] = _safetensors_shapes(path)
            found = headers[file_name].get(hf_key)
            if found is None:
                raise ConversionError(f"{hf_key} is mapped to {hf_dir / file_name} but is not in it")
            if found != tuple(shape):
                raise ConversionError(
                    f"{hf_key}: expected shape {tuple(shape)} ({label}), found {found} in {hf_dir / file_name}")


def _load_targets(config: LlamaConfig, layers: Mapping[int, nn.Module]):
    """HF key -> [(label, pipe tensor)] of every tensor `layers` load, and the addends to zero."""
    targets: dict[str, list[tuple[str, torch.Tensor]]] = {}
    addends: list[torch.Tensor] = []
    for idx, module in sorted(layers.items()):
        for pipe_key, tensor in module.state_dict(keep_vars=True).items():
            if tensor.is_meta:
                raise ConversionError(
                    f"pipe layer {idx} key {pipe_key!r} is on the meta device; call materialize()")
            hf_key, is_addend = _pipe_to_hf(config, idx, pipe_key, exporting=False)
            if is_addend:
                addends.append(tensor)
            else:
                targets.setdefault(hf_key, []).append((f"pipe layer {idx} {pipe_key!r}", tensor))
    return targets, addends


def load_state_into_layers(state: Mapping[str, torch.Tensor], config: LlamaConfig,
                           layers: Mapping[int, nn.Module]) -> None:
    """As `load_hf_into_layers`, from an in-memory `LlamaForCausalLM` state dict (HF key names)."""
    targets, addends = _load_targets(config, layers)
    missing = [k for k in targets if k not in state]
    if missing:
        raise ConversionError(f"the model's state dict lacks {len(missing)} needed tensor(s): {missing[:4]}")
    with torch.no_grad():
        for tensor in addends:
            tensor.zero_()
        for hf_key, wanted in targets.items():
            value = state[hf_key]
            for label, target in wanted:
                if tuple(target.shape) != tuple(value.shape):
                    raise ConversionError(f"{hf_key}: expected shape {tuple(target.shape)} ({label}), "
                                          f"found {tuple(value.shape)} in the model")
                target.copy_(value.detach())


def load_hf_into_layers(
    hf_dir: str | os.PathLike, config: LlamaConfig, layers: Mapping[int, nn.Module]
) -> None:
    """Copy HF weights into already materialised pipe layers {pipe index: module}.

    Reads only the tensors these layers need, opening only the shards that hold them. Every
    shape is checked before its tensor is read. A TokenEmbedding's `perp` is zeroed: HF's
    embedding goes whole into `weight` (the subspace split happens later, elsewhere).
    """
    hf_dir = Path(hf_dir)
    targets, addends = _load_targets(config, layers)
    weight_map = _hf_weight_map(hf_dir)
    missing = [k for k in targets if k not in weight_map]
    if missing:
        needed_by = "; ".join(f"{k} (for {targets[k][0][0]})" for k in missing)
        raise ConversionError(f"{hf_dir} lacks {len(missing)} needed tensor(s): {needed_by}")

    by_file: dict[str, list[str]] = {}
    for hf_key in targets:
        by_file.setdefault(weight_map[hf_key], []).append(hf_key)

    with torch.no_grad():
        for tensor in addends:
            tensor.zero_()
        for file_name in sorted(by_file):
            path = hf_dir / file_name
            if not path.is_file():
                raise ConversionError(f"{path} is named by {hf_dir / SAFE_INDEX} but does not exist")
            with _open_safetensors(path) as f:
                present = set(f.keys())
                for hf_key in by_file[file_name]:
                    if hf_key not in present:
                        raise ConversionError(f"{hf_key} is mapped to {path} but is not in it")
                    found = tuple(f.get_slice(hf_key).get_shape())
                    for label, target in targets[hf_key]:
                        if tuple(target.shape) != found:
                            raise ConversionError(
                                f"{hf_key}: expected shape {tuple(target.shape)} ({label}), "
                                f"found {found} in {path}")
                    value = f.get_tensor(hf_key)
                    for _, target in targets[hf_key]:
                        target.copy_(value)


def materialize(
    layers: Mapping[int, nn.Module],
    device: torch.device | str,
    hf_dir: str | os.PathLike | None = None,
    config: LlamaConfig | None = None,
) -> Mapping[int, nn.Module]:
    """Allocate meta-built layers on `device`, rebuild non-persistent buffers, then load.

    Without `hf_dir` parameters are left uninitialised, for a caller that loads them itself
    (e.g. from a DeepSpeed checkpoint). `config` defaults to hf_dir's config.json. A module
    listed under several indices (a tied replica on the same stage) is allocated once.
    """
    seen: set[int] = set()
    for idx, module in layers.items():
        if id(module) in seen:
            continue
        seen.add(id(module))
        resets = [m for m in module.modules() if hasattr(m, "reset_nonpersistent_buffers")]
        if not resets and any(m._non_persistent_buffers_set for m in module.modules()):
            raise ConversionError(
                f"pipe layer {idx} ({type(module).__name__}) has non-persistent buffers but no "
                "reset_nonpersistent_buffers(); to_empty would leave them uninitialised")
        module.to_empty(device=device)
        for m in resets:
            m.reset_nonpersistent_buffers()
    if hf_dir is not None:
        load_hf_into_layers(hf_dir, config if config is not None else read_hf_config(hf_dir), layers)
    return layers


# --------------------------------------------------------------------------------------------
# hf_meta: what export needs besides the layer files
# --------------------------------------------------------------------------------------------


@contextmanager
def _staged_dir(final: Path, *, overwrite: bool) -> Iterator[Path]:
    """Yield a temporary sibling of `final`; on success it replaces `final` by rename.

    On any exception the temporary directory is removed and `final` is left as it was.
    """
    final = Path(os.path.abspath(final))
    if final.exists() and not overwrite and (not final.is_dir() or any(final.iterdir())):
        raise ConversionError(f"{final} already exists and is not empty; pass overwrite=True to replace it")
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.parent / f".{final.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)  # a leftover of an earlier process with our pid
    tmp.mkdir()
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    old = None
    if final.exists():
        old = final.parent / f".{final.name}.old-{os.getpid()}"
        os.rename(final, old)
    try:
        os.rename(tmp, final)
    except BaseException:
        if old is not None:
            os.rename(old, final)
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if old is not None:
        shutil.rmtree(old) if old.is_dir() else old.unlink()


@dataclass
class HFMeta:
    """Contents of CKPT_DIR/hf_meta."""

    path: Path
    config: LlamaConfig
    generation_config: GenerationConfig
    tokenizer: object | None
    """The tokenizer saved there (AutoTokenizer), or None when none was saved."""


def tokenizer_files(directory: str | os.PathLike) -> list[str]:
    """Names of the tokenizer files (and chat-template folder) present in `directory`."""
    directory = Path(directory)
    return [n for n in TOKENIZER_FILES + TOKENIZER_DIRS if (directory / n).exists()]


def _copy_side_files(src: Path, dst: Path, names: Iterable[str]) -> None:
    """Copy those of `names` that exist in `src` into `dst`, byte for byte."""
    for name in names:
        path = Path(src) / name
        if path.is_dir():
            shutil.copytree(path, dst / name, dirs_exist_ok=True)
        elif path.is_file():
            shutil.copy2(path, dst / name)


def save_hf_meta(
    ckpt_dir: str | os.PathLike,
    config: LlamaConfig,
    tokenizer=None,
    generation_config: GenerationConfig | None = None,
    *,
    model_dir: str | os.PathLike | None = None,
    tokenizer_dir: str | os.PathLike | None = None,
) -> Path:
    """Write CKPT_DIR/hf_meta (config.json, generation config, model card, tokenizer) atomically.

    `model_dir` (the source checkpoint) gives generation_config.json, README.md and licence
    files, `tokenizer_dir` the tokenizer files, all copied unchanged; `generation_config` /
    `tokenizer` objects are saved only where no such file was copied (a generation config from
    `config` when there is neither). Call it from one process only (global rank 0). Replaces an
    earlier hf_meta.
    """
    final = Path(ckpt_dir) / HF_META
    with _staged_dir(final, overwrite=True) as tmp:
        config.save_pretrained(tmp)
        if model_dir is not None:
            _copy_side_files(Path(model_dir), tmp, (GENERATION_CONFIG, *MODEL_CARD_FILES))
        if not (tmp / GENERATION_CONFIG).exists():
            (generation_config or GenerationConfig.from_model_config(config)).save_pretrained(tmp)
        if tokenizer_dir is not None:
            _copy_side_files(Path(tokenizer_dir), tmp, TOKENIZER_FILES + TOKENIZER_DIRS)
        if tokenizer is not None and not tokenizer_files(tmp):
            tokenizer.save_pretrained(tmp)
    return final


def load_hf_meta(ckpt_dir: str | os.PathLike) -> HFMeta:
    path = Path(ckpt_dir) / HF_META
    if not path.is_dir():
        raise ConversionError(f"{path} not found: the training run writes it with save_hf_meta()")
    config = read_hf_config(path)
    if (path / GENERATION_CONFIG).is_file():
        generation_config = GenerationConfig.from_pretrained(str(path))
    else:
        generation_config = GenerationConfig.from_model_config(config)
    tokenizer = None
    if tokenizer_files(path):
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(path))
    return HFMeta(path, config, generation_config, tokenizer)


# --------------------------------------------------------------------------------------------
# Layer states -> HF directory
# --------------------------------------------------------------------------------------------


_SIZE_UNITS = {"TB": 10**12, "GB": 10**9, "MB": 10**6, "KB": 10**3,
               "TIB": 2**40, "GIB": 2**30, "MIB": 2**20, "KIB": 2**10}


def _parse_size(size: int | str) -> int:
    """Bytes from an int or a string like "2GB" (decimal, as transformers) or "2GiB"."""
    if isinstance(size, int):
        return size
    m = re.fullmatch(r"\s*([0-9.]+)\s*([KMGT]I?B)\s*", size.upper())
    if m is None:
        raise ConversionError(f"cannot parse shard size {size!r}; use bytes or e.g. '2GB'")
    return int(float(m.group(1)) * _SIZE_UNITS[m.group(2)])


def _save_shard(tensors: dict[str, torch.Tensor], path: Path) -> None:
    save_file(tensors, str(path), metadata={"format": "pt"})


def _own_storage(t: torch.Tensor) -> torch.Tensor:
    """A contiguous CPU tensor that owns its storage (safetensors refuses shared storage)."""
    t = t.detach().to("cpu").contiguous()
    if t.untyped_storage().nbytes() != t.numel() * t.element_size():
        t = t.clone()
    return t


class _ShardWriter:
    """Writes safetensors shards as `save_pretrained` splits them, while tensors stream in.

    The split is planned up front by huggingface_hub's `split_torch_state_dict_into_shards`
    (which `save_pretrained` uses) over meta tensors of the final keys, shapes and dtype, so
    no data is needed to plan. A shard is written as soon as its last tensor arrives; only
    the tensors of shards still incomplete are held, which is at most one shard plus one
    oversize tensor, since the plan follows the order in which tensors arrive.
    """

    def __init__(self, directory: Path, plan: Mapping[str, torch.Tensor], max_shard_size: int):
        self.directory = directory
        self.split = split_torch_state_dict_into_shards(dict(plan), max_shard_size=max_shard_size)
        self.total_parameters = sum(t.numel() for t in plan.values())
        self.pending: dict[str, dict[str, torch.Tensor]] = {}

    def add(self, key: str, tensor: torch.Tensor) -> None:
        name = self.split.tensor_to_filename.get(key)
        if name is None:
            raise ConversionError(f"tensor {key!r} is not in the export plan")
        shard = self.pending.setdefault(name, {})
        shard[key] = _own_storage(tensor)
        if len(shard) == len(self.split.filename_to_tensors[name]):
            _save_shard(self.pending.pop(name), self.directory / name)

    def finish(self) -> None:
        missing = sorted(k for name, keys in self.split.filename_to_tensors.items()
                         if not (self.directory / name).exists() for k in keys if k not in self.pending.get(name, {}))
        if missing:  # only a broken layer stream gets here: _layer_to_hf checks every layer's keys
            raise ConversionError(f"export got no tensor for {missing}")
        if self.split.is_sharded:
            index = {
                "metadata": {"total_parameters": self.total_parameters, **self.split.metadata},
                "weight_map": self.split.tensor_to_filename,
            }
            (self.directory / SAFE_INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")


def _export_plan(config: LlamaConfig, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """HF key -> meta tensor of its final shape and dtype, in the order `_layer_to_hf` yields them."""
    plan = {}
    for idx in export_layers(config):
        for key, shape in _expected_shapes(config, idx).items():
            hf_key, _ = _pipe_to_hf(config, idx, key, exporting=True)
            plan[hf_key] = torch.empty(shape, dtype=dtype, device="meta")
    return plan


def _provenance(config: LlamaConfig, **fields) -> dict:
    """What goes under config.json's PROVENANCE_KEY: ours, on top of what training recorded."""
    recorded = getattr(config, PROVENANCE_KEY, None)
    return {**(recorded if isinstance(recorded, dict) else {}), "version": __version__,
            **{k: v for k, v in fields.items() if v is not None}}


def _layer_to_hf(
    config: LlamaConfig, layer_idx: int, state: Mapping[str, torch.Tensor], source: str,
    dtype: torch.dtype | None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """HF (key, tensor) pairs of one layer state, in module order, shapes checked."""
    expected = _expected_shapes(config, layer_idx)
    addends = {}
    for key, tensor in state.items():
        try:
            hf_key, is_addend = _pipe_to_hf(config, layer_idx, key, exporting=True)
        except ConversionError:
            is_addend = False
        if is_addend:
            addends[hf_key] = (key, tensor)
        elif key not in expected:
            raise ConversionError(
                f"{source}: unexpected key {key!r} for pipe layer {layer_idx} (expected {sorted(expected)})")
    for key, shape in expected.items():
        if key not in state:
            raise ConversionError(f"{source}: missing key {key!r} of pipe layer {layer_idx}")
        tensor = state[key]
        if tensor.shape != shape:
            raise ConversionError(
                f"{source}: key {key!r} has shape {tuple(tensor.shape)}, the config expects {tuple(shape)}")
        hf_key, _ = _pipe_to_hf(config, layer_idx, key, exporting=True)
        if hf_key in addends:
            plus_key, plus = addends.pop(hf_key)
            if plus.shape != shape:
                raise ConversionError(
                    f"{source}: key {plus_key!r} has shape {tuple(plus.shape)}, the config expects {tuple(shape)}")
            tensor = (tensor + plus).to(tensor.dtype)
        yield hf_key, tensor if dtype is None else tensor.to(dtype)
    if addends:
        raise ConversionError(f"{source}: addend(s) {sorted(k for k, _ in addends.values())} without their base key")


def _export_dtype(dtype, config: LlamaConfig, first_state: Mapping[str, torch.Tensor]) -> torch.dtype:
    """`dtype` if given, else the config's (a fine-tune's source dtype), else the first stored tensor's."""
    chosen = parse_dtype(dtype)
    if chosen is None:
        declared = getattr(config, "dtype", None)
        if isinstance(declared, str):
            declared = DTYPES.get(declared.lower())
        if isinstance(declared, torch.dtype) and declared.is_floating_point:
            chosen = declared
    if chosen is None:
        chosen = next((t.dtype for t in first_state.values() if t.is_floating_point()), torch.float32)
    return chosen


def _write_hf_dir(
    out_dir: str | os.PathLike,
    config: LlamaConfig,
    layer_states: Iterable[tuple[int, Mapping[str, torch.Tensor], str]],
    write_side_files: Callable[[Path, LlamaConfig], None],
    *,
    overwrite: bool,
    max_shard_size: int | str,
    progress: bool,
    dtype: torch.dtype | str | None,
    provenance: dict,
) -> Path:
    """The one writer: weights, config.json, then side files, staged and renamed into place.

    Every tensor is written in one dtype (`_export_dtype`), which config.json then declares.
    """
    limit = _parse_size(max_shard_size)
    config = copy.deepcopy(config)
    layer_states = iter(layer_states)
    first = next(layer_states, None)
    if first is None:
        raise ConversionError("no layer states to export")
    dtype = _export_dtype(dtype, config, first[1])
    final = Path(out_dir)
    with _staged_dir(final, overwrite=overwrite) as tmp:
        writer = _ShardWriter(tmp, _export_plan(config, dtype), limit)
        # Closed on an error too, ending its line: the error's line is then one of its own.
        with tqdm(itertools.chain([first], layer_states), total=len(export_layers(config)), desc="export",
                  unit="layer", disable=not progress) as bar:
            first = None  # the chain holds it now; let it go once written
            for idx, state, source in bar:
                for hf_key, tensor in _layer_to_hf(config, idx, state, source, dtype):
                    writer.add(hf_key, tensor)
                del state
        writer.finish()
        config.dtype = dtype
        setattr(config, PROVENANCE_KEY, provenance)
        if not config.architectures:
            config.architectures = ["LlamaForCausalLM"]
        config.save_pretrained(tmp)
        write_side_files(tmp, config)
    return Path(os.path.abspath(final))


def _read_latest(ckpt_dir: Path) -> str:
    latest = ckpt_dir / "latest"
    if not latest.is_file():
        tags = sorted(p.name for p in ckpt_dir.iterdir() if p.is_dir() and any(p.glob("layer_*model_states.pt")))
        raise ConversionError(f"{latest} not found; pass tag= (checkpoint tags here: {tags or 'none'})")
    tag = latest.read_text().strip()
    if not tag:
        raise ConversionError(f"{latest} is empty")
    return tag


def _layer_file(tag_dir: Path, idx: int) -> Path:
    path = tag_dir / layer_checkpoint_name(idx)
    if path.is_file():
        return path
    found = sorted(tag_dir.glob(f"layer_{idx:02d}-*model_states.pt"))
    if len(found) == 1:
        return found[0]
    if found:
        raise ConversionError(
            f"pipe layer {idx} has {len(found)} files in {tag_dir} ({[p.name for p in found]}); "
            "tensor-parallel layer shards are not supported")
    raise ConversionError(f"missing layer file {path}")


def _check_export_target(source: Path, target: Path) -> None:
    """The export never writes into, or (with overwrite) deletes, what it reads from: the
    checkpoint directory, anything inside it, or a directory containing it (the run directory)."""
    src, dst = os.path.realpath(source), os.path.realpath(target)
    if dst == src or dst.startswith(src.rstrip(os.sep) + os.sep):
        raise ConversionError(f"export target {target} is inside the checkpoint directory {source} it reads from")
    if src.startswith(dst.rstrip(os.sep) + os.sep):
        raise ConversionError(f"export target {target} contains the checkpoint directory {source} it reads from; "
                              "choose a directory outside it")


def export(
    ckpt_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    tag: str | None = None,
    progress: bool = True,
    *,
    overwrite: bool = False,
    max_shard_size: int | str = DEFAULT_SHARD_SIZE,
    dtype: torch.dtype | str | None = None,
) -> Path:
    """DeepSpeed pipeline checkpoint -> HF `save_pretrained`-style directory; returns out_dir.

    Reads `ckpt_dir/<tag>/layer_XX-model_states.pt` (tag defaults to `latest`) one layer at a
    time and `ckpt_dir/hf_meta`, whose side files (tokenizer, generation config, model card)
    are copied unchanged. Everything is written under `.<out_dir>.tmp-<pid>` and renamed to
    `out_dir` last, so a directory named out_dir is always complete. `dtype` ("bfloat16",
    "float16", "float32" or a torch dtype) casts the weights; by default they are written in
    hf_meta's config dtype (a fine-tune's source dtype), else as stored.
    """
    ckpt_dir = Path(ckpt_dir)
    if not ckpt_dir.is_dir():
        raise ConversionError(f"checkpoint directory {ckpt_dir} does not exist")
    _check_export_target(ckpt_dir, Path(out_dir))
    tag = tag if tag is not None else _read_latest(ckpt_dir)
    tag_dir = ckpt_dir / tag
    if not tag_dir.is_dir():
        raise ConversionError(f"checkpoint tag directory {tag_dir} does not exist")
    meta_dir = ckpt_dir / HF_META
    if not meta_dir.is_dir():
        raise ConversionError(f"{meta_dir} not found: the training run writes it with save_hf_meta()")
    config = read_hf_config(meta_dir)
    files = {idx: _layer_file(tag_dir, idx) for idx in export_layers(config)}  # all, before writing

    def states():
        for idx, path in files.items():
            try:
                state = safe_load.load(path, "cpu", what="layer file")
            except safe_load.UnreadableFile as err:
                raise ConversionError(str(err)) from None
            yield idx, state, str(path)

    def side_files(tmp: Path, written_config: LlamaConfig) -> None:
        for src in meta_dir.iterdir():
            if src.name == "config.json":
                continue
            (shutil.copytree if src.is_dir() else shutil.copy2)(src, tmp / src.name)
        if not (tmp / GENERATION_CONFIG).exists():
            GenerationConfig.from_model_config(written_config).save_pretrained(tmp)

    return _write_hf_dir(out_dir, config, states(), side_files, overwrite=overwrite,
                         max_shard_size=max_shard_size, progress=progress, dtype=dtype,
                         provenance=_provenance(config, tag=tag))


def export_from_state(
    layer_states: Mapping[int, Mapping[str, torch.Tensor]],
    config: LlamaConfig,
    tokenizer,
    out_dir: str | os.PathLike,
    *,
    generation_config: GenerationConfig | None = None,
    overwrite: bool = False,
    max_shard_size: int | str = DEFAULT_SHARD_SIZE,
    progress: bool = False,
    dtype: torch.dtype | str | None = None,
    side_files_from: str | os.PathLike | None = None,
) -> Path:
    """In-memory layer states {pipe index: state dict} -> HF directory, as `export` writes it.

    The tied head replica's state, if given, is ignored (layer 0 holds the embedding).
    `side_files_from` (a run's hf_meta or the source model directory) gives tokenizer files,
    generation_config.json and model card, copied unchanged; a `tokenizer` or
    `generation_config` passed here replaces the copied one. Without either there are no
    tokenizer files, and the generation config is derived from `config`. `dtype` as `export`.
    """
    wanted = export_layers(config)
    missing = [i for i in wanted if i not in layer_states]
    if missing:
        raise ConversionError(f"layer_states lacks pipe layer(s) {missing}")
    extra = [i for i in layer_states if i not in wanted and i not in range(num_pipe_layers(config))]
    if extra:
        raise ConversionError(f"layer_states has pipe layer(s) {extra} beyond the {num_pipe_layers(config)} layers")

    def states():
        for idx in wanted:
            yield idx, layer_states[idx], f"layer_states[{idx}]"

    def side_files(tmp: Path, written_config: LlamaConfig) -> None:
        if side_files_from is not None:
            own_tokenizer = () if tokenizer is not None else TOKENIZER_FILES + TOKENIZER_DIRS
            _copy_side_files(Path(side_files_from), tmp, (GENERATION_CONFIG, *MODEL_CARD_FILES, *own_tokenizer))
        if generation_config is not None:
            generation_config.save_pretrained(tmp)
        elif not (tmp / GENERATION_CONFIG).exists():
            GenerationConfig.from_model_config(written_config).save_pretrained(tmp)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)

    return _write_hf_dir(out_dir, config, states(), side_files, overwrite=overwrite,
                         max_shard_size=max_shard_size, progress=progress, dtype=dtype,
                         provenance=_provenance(config))
