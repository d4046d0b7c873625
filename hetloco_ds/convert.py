"""Hugging Face LLaMA <-> pipeline stage layers, in both directions, through one key map.

The pipeline layer list (DeepSpeed layer index -> module) for n = config.num_hidden_layers:

    0        TokenEmbedding       weight (+ persistent `perp` once a subspace split exists)
    1..n     DecoderLayer(i - 1)  layer.<rest>
    n + 1    FinalNorm            norm.weight
    n + 2    LMHead               lm_head.weight
             or, tied, a TokenEmbedding replica of layer 0 (DeepSpeed TiedLayerSpec 'embed')

`KEY_MAP` below says how each state-dict key of those layers is named in a
`LlamaForCausalLM` state dict. Loading (HF -> layers) and export (DeepSpeed checkpoint ->
HF directory) both read it; nothing else in this module knows a key name.

DeepSpeed writes one `CKPT_DIR/<tag>/layer_{idx:02d}-model_states.pt` per layer and names
the newest tag in `CKPT_DIR/latest`; the training run adds `CKPT_DIR/hf_meta/` (config,
generation config, tokenizer) with `save_hf_meta`, which is all `export` needs besides the
layer files.
"""
from __future__ import annotations

import copy
import functools
import json
import os
import re
import shutil
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Iterator, Mapping

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn
from tqdm import tqdm
from transformers import GenerationConfig, LlamaConfig


HF_META = "hf_meta"
SAFE_WEIGHTS = "model.safetensors"
SAFE_INDEX = "model.safetensors.index.json"
DEFAULT_SHARD_SIZE = "2GB"


class ConversionError(ValueError):
    """A checkpoint, HF directory or config that cannot be converted; the message says why."""


# --------------------------------------------------------------------------------------------
# The key map
# --------------------------------------------------------------------------------------------


def _embed(config: LlamaConfig) -> range:
    return range(0, 1)


def _blocks(config: LlamaConfig) -> range:
    return range(1, config.num_hidden_layers + 1)


def _norm(config: LlamaConfig) -> range:
    return range(config.num_hidden_layers + 1, config.num_hidden_layers + 2)


def _head(config: LlamaConfig) -> range:
    return range(config.num_hidden_layers + 2, config.num_hidden_layers + 3)


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
    return config.num_hidden_layers + 3


def export_layers(config: LlamaConfig) -> range:
    """Pipe layer indices whose states make up the HF checkpoint (tied: not the head replica)."""
    return range(num_pipe_layers(config) - (1 if config.tie_word_embeddings else 0))


def _build_layer(config: LlamaConfig, layer_idx: int) -> nn.Module:
    """Pipe layer `layer_idx` as the pipeline builds it (one layer list: pipe.module.layer_specs)."""
    from .pipe.module import layer_specs

    specs = layer_specs(config)
    if not 0 <= layer_idx < len(specs):
        raise ConversionError(f"pipe layer index {layer_idx} is out of range 0..{len(specs) - 1}")
    return specs[layer_idx].build()


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


def read_hf_config(hf_dir: str | os.PathLike) -> LlamaConfig:
    """The LlamaConfig of a local `save_pretrained` directory."""
    path = Path(hf_dir) / "config.json"
    if not path.is_file():
        raise ConversionError(f"{path} not found: expected a directory written by save_pretrained")
    model_type = json.loads(path.read_text()).get("model_type")
    if model_type != "llama":
        raise ConversionError(f"{path}: model_type is {model_type!r}; only 'llama' models are supported")
    return LlamaConfig.from_pretrained(str(Path(hf_dir)))


def _safetensors_header(path: Path) -> dict[str, dict]:
    """Tensor name -> {"dtype", "shape", "data_offsets"} from a safetensors header, without mapping the file."""
    with open(path, "rb") as f:
        raw = f.read(8)
        size = int.from_bytes(raw, "little")
        if len(raw) < 8 or size > os.path.getsize(path) - 8:
            raise ConversionError(f"{path} is corrupt: its safetensors header claims {size} bytes in a "
                                  f"{os.path.getsize(path)}-byte file")
        try:
            header = json.loads(f.read(size))
        except (ValueError, UnicodeDecodeError) as err:
            raise ConversionError(f"{path} is corrupt: its safetensors header is not JSON ({err})") from None
    if not isinstance(header, dict):
        raise ConversionError(f"{path} is corrupt: its safetensors header is not a JSON object")
    header.pop("__metadata__", None)
    return header


def _safetensors_keys(path: Path) -> list[str]:
    """Tensor names from a safetensors header, without mapping the file."""
    return list(_safetensors_header(path))


def _hf_weight_map(hf_dir: Path) -> dict[str, str]:
    """HF key -> file name (relative to hf_dir), from the index or the single file."""
    index = hf_dir / SAFE_INDEX
    if index.is_file():
        return json.loads(index.read_text())["weight_map"]
    single = hf_dir / SAFE_WEIGHTS
    if single.is_file():
        return {k: SAFE_WEIGHTS for k in _safetensors_keys(single)}
    hint = " (found pytorch_model.bin weights; re-save with safe_serialization)" if any(
        hf_dir.glob("pytorch_model*.bin")) else ""
    raise ConversionError(f"no {SAFE_WEIGHTS} or {SAFE_INDEX} in {hf_dir}{hint}")


def check_hf_dir(hf_dir: str | os.PathLike, config: LlamaConfig) -> None:
    """Every tensor the pipeline loads from `hf_dir` exists there with the shape `config` gives it.

    Reads only safetensors headers (no tensor data, no model built), so a launcher can reject a
    checkpoint of another shape before any rank starts. Same messages as `load_hf_into_layers`.
    """
    hf_dir = Path(hf_dir)
    weight_map = _hf_weight_map(hf_dir)
    headers: dict[str, dict[str, dict]] = {}
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
                headers[file_name] = _safetensors_header(path)
            entry = headers[file_name].get(hf_key)
            if entry is None:
                raise ConversionError(f"{hf_key} is mapped to {hf_dir / file_name} but is not in it")
            found = tuple(entry["shape"])
            if found != tuple(shape):
                raise ConversionError(
                    f"{hf_key}: expected shape {tuple(shape)} ({label}), found {found} in {hf_dir / file_name}")


def load_hf_into_layers(
    hf_dir: str | os.PathLike, config: LlamaConfig, layers: Mapping[int, nn.Module]
) -> None:
    """Copy HF weights into already materialised pipe layers {pipe index: module}.

    Reads only the tensors these layers need, opening only the shards that hold them. Every
    shape is checked before its tensor is read. A TokenEmbedding's `perp` is zeroed: HF's
    embedding goes whole into `weight` (the subspace split happens later, elsewhere).
    """
    hf_dir = Path(hf_dir)
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
            with safe_open(str(path), framework="pt", device="cpu") as f:
                for hf_key in by_file[file_name]:
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


def save_hf_meta(
    ckpt_dir: str | os.PathLike,
    config: LlamaConfig,
    tokenizer=None,
    generation_config: GenerationConfig | None = None,
) -> Path:
    """Write CKPT_DIR/hf_meta (config.json, generation_config.json, tokenizer files) atomically.

    Call it from one process only (global rank 0). Replaces an earlier hf_meta.
    """
    final = Path(ckpt_dir) / HF_META
    with _staged_dir(final, overwrite=True) as tmp:
        config.save_pretrained(tmp)
        if generation_config is None:
            generation_config = GenerationConfig.from_model_config(config)
        generation_config.save_pretrained(tmp)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
    return final


def load_hf_meta(ckpt_dir: str | os.PathLike) -> HFMeta:
    path = Path(ckpt_dir) / HF_META
    if not path.is_dir():
        raise ConversionError(f"{path} not found: the training run writes it with save_hf_meta()")
    config = read_hf_config(path)
    if (path / "generation_config.json").is_file():
        generation_config = GenerationConfig.from_pretrained(str(path))
    else:
        generation_config = GenerationConfig.from_model_config(config)
    tokenizer = None
    if (path / "tokenizer_config.json").is_file() or (path / "tokenizer.json").is_file():
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
    """Streams tensors into safetensors shards, split as `save_pretrained` splits them.

    In order, a tensor joins the current shard unless that would pass `max_shard_size`
    (then the current shard is written first); a tensor larger than the limit gets a shard
    of its own. Shards are numbered in the order they are written, which is the order
    huggingface_hub's `split_torch_state_dict_into_shards` gives them; names are final only
    in `finish`, once the count is known.
    """

    def __init__(self, directory: Path, max_shard_size: int):
        self.directory, self.max_shard_size = directory, max_shard_size
        self.current: dict[str, torch.Tensor] = {}
        self.current_size = 0
        self.written: list[tuple[Path, list[str]]] = []
        self.total_size = 0
        self.total_parameters = 0
        self.dtypes: set[torch.dtype] = set()

    def add(self, key: str, tensor: torch.Tensor) -> None:
        tensor = _own_storage(tensor)
        size = tensor.numel() * tensor.element_size()
        self.total_size += size
        self.total_parameters += tensor.numel()
        self.dtypes.add(tensor.dtype)
        if size > self.max_shard_size:
            self._write({key: tensor})
            return
        if self.current_size + size > self.max_shard_size:
            self._write(self.current)
            self.current, self.current_size = {}, 0
        self.current[key] = tensor
        self.current_size += size

    def _write(self, tensors: dict[str, torch.Tensor]) -> None:
        path = self.directory / f"model-{len(self.written) + 1:05d}.partial.safetensors"
        _save_shard(tensors, path)
        self.written.append((path, list(tensors)))

    def finish(self) -> None:
        if self.current:
            self._write(self.current)
            self.current = {}
        if not self.written:
            raise ConversionError("no tensors to write")
        if len(self.written) == 1:
            os.rename(self.written[0][0], self.directory / SAFE_WEIGHTS)
            return
        n = len(self.written)
        weight_map = {}
        for i, (path, keys) in enumerate(self.written, start=1):
            name = f"model-{i:05d}-of-{n:05d}.safetensors"
            os.rename(path, self.directory / name)
            weight_map.update({k: name for k in keys})
        index = {
            "metadata": {"total_parameters": self.total_parameters, "total_size": self.total_size},
            "weight_map": weight_map,
        }
        (self.directory / SAFE_INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")


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


def _write_hf_dir(
    out_dir: str | os.PathLike,
    config: LlamaConfig,
    layer_states: Iterable[tuple[int, Mapping[str, torch.Tensor], str]],
    write_side_files: Callable[[Path, LlamaConfig], None],
    *,
    overwrite: bool,
    max_shard_size: int | str,
    progress: bool,
    dtype: torch.dtype | None,
) -> Path:
    """The one writer: weights, config.json, then side files, staged and renamed into place."""
    limit = _parse_size(max_shard_size)
    config = copy.deepcopy(config)
    final = Path(out_dir)
    with _staged_dir(final, overwrite=overwrite) as tmp:
        writer = _ShardWriter(tmp, limit)
        bar = tqdm(layer_states, total=len(export_layers(config)), desc="export", unit="layer",
                   disable=not progress)
        for idx, state, source in bar:
            for hf_key, tensor in _layer_to_hf(config, idx, state, source, dtype):
                writer.add(hf_key, tensor)
            del state
        writer.finish()
        if len(writer.dtypes) == 1:
            config.dtype = next(iter(writer.dtypes))
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
    path = tag_dir / f"layer_{idx:02d}-model_states.pt"
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
    dtype: torch.dtype | None = None,
) -> Path:
    """DeepSpeed pipeline checkpoint -> HF `save_pretrained`-style directory; returns out_dir.

    Reads `ckpt_dir/<tag>/layer_XX-model_states.pt` (tag defaults to `latest`) one layer at a
    time and `ckpt_dir/hf_meta`. Everything is written under `.<out_dir>.tmp-<pid>` and
    renamed to `out_dir` last, so a directory named out_dir is always complete. `dtype`
    casts the weights (default: as stored).
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
            yield idx, torch.load(path, map_location="cpu", weights_only=True, mmap=True), str(path)

    def side_files(tmp: Path, written_config: LlamaConfig) -> None:
        for src in meta_dir.iterdir():
            if src.name == "config.json":
                continue
            (shutil.copytree if src.is_dir() else shutil.copy2)(src, tmp / src.name)
        if not (tmp / "generation_config.json").exists():
            GenerationConfig.from_model_config(written_config).save_pretrained(tmp)

    return _write_hf_dir(out_dir, config, states(), side_files, overwrite=overwrite,
                         max_shard_size=max_shard_size, progress=progress, dtype=dtype)


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
    dtype: torch.dtype | None = None,
) -> Path:
    """In-memory layer states {pipe index: state dict} -> HF directory, as `export` writes it.

    The tied head replica's state, if given, is ignored (layer 0 holds the embedding).
    `tokenizer` may be None (then the directory has no tokenizer files).
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
        (generation_config or GenerationConfig.from_model_config(written_config)).save_pretrained(tmp)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)

    return _write_hf_dir(out_dir, config, states(), side_files, overwrite=overwrite,
                         max_shard_size=max_shard_size, progress=progress, dtype=dtype)
