"""Hugging Face LLaMA <-> pipeline stage layers: the key map both directions read, and loading
(an HF directory or state dict into the layers). Writing the other way is `hf_export`'s.

The pipeline layer list (`model.layer_list`, indices by `sizes.LayerLayout`) holds the token
embedding (weight, + persistent `perp` once a subspace split exists), the decoder layers
(layer.<rest>), the final norm (norm.weight) and the LM head (lm_head.weight; tied: a
TokenEmbedding replica of the embedding).

`KEY_MAP` below says how each state-dict key of those layers is named in a
`LlamaForCausalLM` state dict. Loading (HF -> layers, here) and export (DeepSpeed checkpoint ->
HF directory, `hf_export`) both read it, through `hf_key_for_pipe`, `pipe_key_for_hf` and
`layer_shapes`; nothing else knows a key name.
"""
from __future__ import annotations

import functools
import json
import os
import re
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Mapping

import torch
from safetensors import SafetensorError, safe_open
from torch import nn
from transformers import LlamaConfig

from .model import layer_list
from .sizes import LayerLayout


SAFE_WEIGHTS = "model.safetensors"
SAFE_INDEX = "model.safetensors.index.json"
TOKENIZER_FILES = (
    "tokenizer_config.json", "tokenizer.json", "special_tokens_map.json", "added_tokens.json",
    "tokenizer.model", "spiece.model", "sentencepiece.bpe.model", "vocab.json", "merges.txt", "vocab.txt",
    "chat_template.jinja", "chat_template.json",
)
"""File names transformers' tokenizers read from a model directory (any one makes a tokenizer dir)."""
TOKENIZER_DIRS = ("additional_chat_templates",)
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


def hf_key_for_pipe(config: LlamaConfig, layer_idx: int, pipe_key: str, *, exporting: bool):
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


def layer_shapes(config: LlamaConfig, layer_idx: int) -> dict[str, torch.Size]:
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
        key: hf_key_for_pipe(config, layer_idx, key, exporting=False)[0]
        for key in layer_shapes(config, layer_idx)
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


def tokenizer_files(directory: str | os.PathLike) -> list[str]:
    """Names of the tokenizer files (and chat-template folder) present in `directory`."""
    directory = Path(directory)
    return [n for n in TOKENIZER_FILES + TOKENIZER_DIRS if (directory / n).exists()]


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
        for pipe_key, shape in layer_shapes(config, idx).items():
            hf_key, is_addend = hf_key_for_pipe(config, idx, pipe_key, exporting=False)
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
            hf_key, is_addend = hf_key_for_pipe(config, idx, pipe_key, exporting=False)
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
