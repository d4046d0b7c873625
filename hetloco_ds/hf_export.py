"""Pipeline layer states -> a Hugging Face `save_pretrained` directory, and the run's `hf_meta`,
which is all an export needs besides the layer files. Every key name comes from `convert`'s key
map, the one loading reads too.

DeepSpeed writes one `CKPT_DIR/<tag>/<patches.layer_checkpoint_name(idx)>` per layer and names
the newest tag in `CKPT_DIR/latest`; the training run adds `CKPT_DIR/hf_meta/` (config,
generation config, tokenizer, model card) with `save_hf_meta`. What came from the source model
directory (tokenizer files, generation_config.json, README.md and licence files) is copied byte
for byte at both hops, so an export carries the source's side files unchanged.

The exported config.json says which dtype the weights are in (the config's `dtype`: the
source checkpoint's for a fine-tune) and records where the model came from under one key,
`hetloco_ds`, that transformers keeps as an unknown attribute and otherwise ignores.
"""
from __future__ import annotations

import copy
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
from safetensors.torch import save_file
from tqdm import tqdm
from transformers import GenerationConfig, LlamaConfig

from . import safe_load
from .convert import (
    DTYPES,
    SAFE_INDEX,
    TOKENIZER_DIRS,
    TOKENIZER_FILES,
    ConversionError,
    export_layers,
    hf_key_for_pipe,
    layer_shapes,
    num_pipe_layers,
    parse_dtype,
    read_hf_config,
    tokenizer_files,
)
from .patches import layer_checkpoint_name
from .version import __version__


HF_META = "hf_meta"
DEFAULT_SHARD_SIZE = "2GB"
PROVENANCE_KEY = "hetloco_ds"
"""config.json key of our provenance record; transformers keeps unknown keys as plain attributes."""
MODEL_CARD_FILES = ("README.md", "LICENSE", "LICENSE.txt", "LICENSE.md", "NOTICE", "USE_POLICY.md")
"""The model card and the licence terms a redistributed fine-tune must keep."""
GENERATION_CONFIG = "generation_config.json"


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
        for key, shape in layer_shapes(config, idx).items():
            hf_key, _ = hf_key_for_pipe(config, idx, key, exporting=True)
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
    expected = layer_shapes(config, layer_idx)
    addends = {}
    for key, tensor in state.items():
        try:
            hf_key, is_addend = hf_key_for_pipe(config, layer_idx, key, exporting=True)
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
        hf_key, _ = hf_key_for_pipe(config, layer_idx, key, exporting=True)
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
