"""Training data: `--data` to packed token blocks, and each replica's stream of micro-batches.

Three layers, each usable on its own:

* Sources. `--data` names local plain text (any UTF-8 file: .txt, .py, .md, ...), .json/.jsonl,
  .parquet, a folder of such files (recursive, mixed), or a dataset that `datasets.load_dataset`
  can load (from its cache, from the Hub unless HF_HUB_OFFLINE=1, or from a dataset snapshot in
  the Hugging Face hub cache). `None` means the embedded default: the `.py` sources of the
  running Python's standard library. `datasets` does all reading. A text file is one document;
  a json/parquet row is one document (column `text_field`).
* `load_corpus`. Tokenise every document, follow each with the tokenizer's EOS, concatenate, and
  cut the stream into blocks of exactly `seq_len` tokens (the tail that does not fill a block is
  dropped). A block is one sample: inputs = labels = block, the loss shifts internally. Validation
  documents are held out whole (see `_holdout_order`), so no block mixes train and val text.
* `ReplicaBatches`. Replica m's micro-batches as a pure function of a position counter, so every
  stage of a replica, and a resumed run, produce the identical sequence.

Cache layout (root: the `cache_dir` argument, else $HETLOCO_CACHE, else ~/.cache/hetloco_ds)::

    <root>/tokenizers/stdlib-py<X.Y.Z>-bpe<V>[-max<B>B]/   save_pretrained() output of the default
                                                          tokenizer + training_files.txt
    <root>/corpus/<key>.pt     {"train": int32 [N, L], "val": int32 [Nv, L], "meta": {...}},
                               key = sha256 of (files + sizes + mtimes, or dataset name + its
                               `datasets` fingerprint; tokenizer identity; seq_len; split options)

Every cache entry is written under a temporary name and `os.replace`d into place, so a reader
either sees a complete entry or none; concurrent builders (all ranks of a job on a cold cache)
waste work but never corrupt the cache. Callers that mind the waste build on one rank first.
"""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import platform
import shutil
import sysconfig
import tempfile
from typing import TYPE_CHECKING
import uuid
from bisect import bisect_right
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from tqdm.auto import tqdm
from transformers import PreTrainedTokenizerFast

from . import safe_load

if TYPE_CHECKING:  # annotations only: datasets is imported where it is used (the simulator runs without it)
    import datasets

log = logging.getLogger(__name__)

EOS_TOKEN = "<|endoftext|>"
"""End-of-document token of the default tokenizer; also its BOS."""
PAD_TOKEN = "<|pad|>"
"""Padding token of the default tokenizer (packing never pads; generation code may)."""
DEFAULT_VOCAB_SIZE = 8192
DEFAULT_VAL_FRACTION = 0.02

_CACHE_VERSION = 1  # bump when packing, holdout or the cache file format changes
_STRUCTURED = {".json": "json", ".jsonl": "json", ".parquet": "parquet"}
_TEXT_SUFFIXES = {".txt", ".md", ".py", ".rst"}  # path-like hints only; any UTF-8 file is text
_STDLIB_SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}
_SNIFF_BYTES = 8192


class DataError(ValueError):
    """Unusable `--data` or a corpus too small for the run; the message names the bad value."""


def cache_root(cache_dir: str | os.PathLike | None = None) -> Path:
    """`cache_dir`, else $HETLOCO_CACHE, else ~/.cache/hetloco_ds."""
    root = cache_dir or os.environ.get("HETLOCO_CACHE") or Path.home() / ".cache" / "hetloco_ds"
    return Path(root).expanduser()


# --------------------------------------------------------------------------- holdout


def _holdout_order(keys: Sequence[str]) -> list[int]:
    """Document indices in the order they are held out for validation: by a hash of their key.

    A key is a file's relative path (text files) or `<format>#<row>` (json/parquet rows,
    dataset rows). Hashing makes the choice deterministic, spread across the corpus, and
    stable for a file when other files come and go.
    """
    digest = [hashlib.blake2b(k.encode(), digest_size=8).digest() for k in keys]
    return sorted(range(len(keys)), key=lambda i: (digest[i], i))


def _holdout_count(n: int, val_fraction: float) -> int:
    """Documents to hold out: round(val_fraction * n), at least 1 unless val_fraction is 0."""
    if val_fraction <= 0:
        return 0
    return min(n, max(1, round(val_fraction * n)))


# --------------------------------------------------------------------------- stdlib default


def stdlib_root() -> Path:
    """The running interpreter's standard library directory."""
    return Path(sysconfig.get_paths()["stdlib"])


def _stdlib_sources() -> list[str]:
    """Relative paths of the stdlib's non-empty, UTF-8 `.py` files outside test/vendored dirs."""
    root = stdlib_root()
    found = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in _STDLIB_SKIP_DIRS and not d.startswith("."))
        for name in files:
            path = Path(folder, name)
            if name.endswith(".py") and not name.startswith("test_") and path.stat().st_size > 0:
                try:
                    path.read_bytes().decode("utf-8")
                except UnicodeDecodeError:
                    continue
                found.append(path.relative_to(root).as_posix())
    return sorted(found)


def stdlib_files(val_fraction: float = DEFAULT_VAL_FRACTION) -> tuple[list[str], list[str]]:
    """(train, val) relative paths of the default corpus, each sorted, disjoint.

    These are exactly the documents `load_corpus(None, ...)` holds out (it uses the same keys and
    hash order), so the default tokenizer, trained on `train` only, never sees validation text.
    """
    files = _stdlib_sources()
    held = set(_holdout_order(files)[: _holdout_count(len(files), val_fraction)])
    return ([f for i, f in enumerate(files) if i not in held], [files[i] for i in sorted(held)])


def _train_bpe(texts: Sequence[str], vocab_size: int, progress: bool) -> Tokenizer:
    """Byte-level BPE (GPT-2 pre-tokenisation) with `<|endoftext|>` and `<|pad|>` as ids 0 and 1.

    `tokenizers`' BPE trainer is deterministic for a given text sequence, so the same sorted
    file list gives the same tokenizer on every machine.
    """
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN, PAD_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=progress,
    )
    tok.train_from_iterator(texts, trainer, length=len(texts))
    return tok


def default_tokenizer(
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    cache_dir: str | os.PathLike | None = None,
    max_train_bytes: int | None = None,
    progress: bool = True,
) -> PreTrainedTokenizerFast:
    """The default tokenizer: byte-level BPE trained on the stdlib's training files, cached.

    Trained on every file of `stdlib_files()[0]` (about 12 MB; ~3 s on 2 cores), fed in sorted
    path order. `max_train_bytes` trains on a deterministic subset instead: training files taken
    in hash order until that many bytes, then sorted (tests use it to stay fast). EOS = BOS =
    `<|endoftext|>`, PAD = `<|pad|>`. Cached under `<root>/tokenizers/stdlib-py<ver>-bpe<V>`; the
    directory loads with `AutoTokenizer.from_pretrained`.
    """
    if vocab_size <= 258:
        raise ValueError(f"vocab_size={vocab_size}: byte-level BPE needs more than 256 bytes + 2 specials")
    name = f"stdlib-py{platform.python_version()}-bpe{vocab_size}"
    if max_train_bytes is not None:
        name += f"-max{max_train_bytes}B"
    path = cache_root(cache_dir) / "tokenizers" / name
    if not path.is_dir():  # only complete directories are ever renamed into place
        root = stdlib_root()
        train, _ = stdlib_files()
        if max_train_bytes is not None:
            chosen, total = [], 0
            for i in _holdout_order(train):
                if total >= max_train_bytes:
                    break
                chosen.append(train[i])
                total += (root / train[i]).stat().st_size
            train = sorted(chosen)
        log.info("training a %d-token BPE tokenizer on %d stdlib files", vocab_size, len(train))
        texts = [(root / f).read_text(encoding="utf-8") for f in train]
        tok = PreTrainedTokenizerFast(
            tokenizer_object=_train_bpe(texts, vocab_size, progress),
            bos_token=EOS_TOKEN,
            eos_token=EOS_TOKEN,
            pad_token=PAD_TOKEN,
        )

        def write(tmp: Path) -> None:
            tok.save_pretrained(str(tmp))
            (tmp / "training_files.txt").write_text("".join(f + "\n" for f in train))

        _publish_dir(path, write)
    return PreTrainedTokenizerFast.from_pretrained(str(path))


def _publish_dir(path: Path, write) -> None:
    """Run `write(tmp)` on a fresh temp dir next to `path`, then rename it to `path` atomically."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        write(tmp)
        os.replace(tmp, path)
    except OSError:
        if not path.is_dir():  # not a lost race with another builder: a real failure
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# --------------------------------------------------------------------------- sources


@dataclasses.dataclass
class _Source:
    """What `--data` resolved to: files grouped by reader, or an already-loaded dataset."""

    description: str
    fingerprint: dict
    root: Path | None = None
    text: list[Path] = dataclasses.field(default_factory=list)
    json: list[Path] = dataclasses.field(default_factory=list)
    parquet: list[Path] = dataclasses.field(default_factory=list)
    dataset: datasets.Dataset | None = None


def _sniff_text(path: Path) -> bool:
    """Whether a file's first bytes look like UTF-8 text (no NUL, decodes but for a cut char)."""
    with open(path, "rb") as f:
        head = f.read(_SNIFF_BYTES)
    if b"\0" in head:
        return False
    try:
        head.decode("utf-8")
    except UnicodeDecodeError as e:
        return len(head) == _SNIFF_BYTES and e.start >= len(head) - 3 and e.reason == "unexpected end of data"
    return True


def _file_fingerprint(paths: Sequence[Path]) -> list:
    return [[str(p), (s := p.stat()).st_size, s.st_mtime_ns] for p in paths]


def _local_source(path: Path, data: str) -> _Source:
    """Group the supported files at `path` (a file or a folder, searched recursively)."""
    path = path.resolve()
    if path.is_file():
        files, root = [path], path.parent
    else:
        root, files = path, []
        for folder, dirs, names in os.walk(path):  # hidden entries and __pycache__ are not data
            dirs[:] = [d for d in dirs if not d.startswith(".") and d != "__pycache__"]
            files += [Path(folder, n) for n in names if not n.startswith(".")]
        files.sort()
    src = _Source(description=str(path), fingerprint={}, root=root)
    for f in files:
        kind = _STRUCTURED.get(f.suffix.lower())
        if kind is not None:
            getattr(src, kind).append(f)
        elif path.is_file() or _sniff_text(f):
            src.text.append(f)
    if not (src.text or src.json or src.parquet):
        what = "is empty" if not files else f"has {len(files)} files but none is UTF-8 text, .json, .jsonl or .parquet"
        raise DataError(f"data folder {data!r} {what}")
    src.fingerprint = {"files": _file_fingerprint(src.text + src.json + src.parquet)}
    counts = [f"{len(v)} {k}" for k, v in (("text", src.text), ("json", src.json), ("parquet", src.parquet)) if v]
    src.description = f"{path} ({', '.join(counts)} files)"
    return src


@contextlib.contextmanager
def _local_files_only():
    """Around `datasets` reads of local files: no Hub lookups and no progress bars of its own.

    Local files need no network, so the offline flags (module constants both libraries read at
    call time) are set here to keep any lookup from turning into a retry loop (~25 s without
    internet). `datasets`' "Generating train split" / "Downloading data" bars describe copying
    files it already has; our own tokenising bar is the one a user needs. The user's
    HF_DATASETS_DISABLE_PROGRESS_BARS, if set, is left in charge.
    """
    import datasets  # lazily: the simulator and benches run where it is absent
    from huggingface_hub import constants

    saved = constants.HF_HUB_OFFLINE, datasets.config.HF_HUB_OFFLINE
    constants.HF_HUB_OFFLINE = datasets.config.HF_HUB_OFFLINE = True
    quiet = "HF_DATASETS_DISABLE_PROGRESS_BARS" not in os.environ and not datasets.are_progress_bars_disabled()
    if quiet:
        datasets.disable_progress_bars()
    try:
        yield
    finally:
        constants.HF_HUB_OFFLINE, datasets.config.HF_HUB_OFFLINE = saved
        if quiet:
            datasets.enable_progress_bars()


def hub_offline() -> bool:
    """Whether the user or the environment put Hugging Face libraries offline (HF_HUB_OFFLINE=1)."""
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def _load_named_dataset(name: str, config: str | None, split: str):
    """A dataset by Hub name: through `datasets` (its cache, or the Hub unless offline), else
    from a snapshot in the Hugging Face hub cache (`hf download --repo-type dataset NAME`)."""
    import datasets
    from huggingface_hub import snapshot_download

    try:
        return datasets.load_dataset(name, config, split=split)
    except Exception as first:  # datasets raises a zoo of types for "not cached / not found"
        try:
            snapshot = snapshot_download(name, repo_type="dataset", local_files_only=True)
        except Exception:
            raise first from None
    with _local_files_only():  # the snapshot is local files now
        return datasets.load_dataset(snapshot, config, split=split)


def _looks_like_path(data: str) -> bool:
    p = Path(data).expanduser()
    first = Path(data).parts[0] if Path(data).parts else ""
    return (
        p.is_absolute()
        or data.startswith((".", "~"))
        or p.suffix.lower() in _STRUCTURED.keys() | _TEXT_SUFFIXES
        or (len(Path(data).parts) > 1 and Path(first).is_dir())
    )


def _resolve(data: str | datasets.Dataset | None, split: str) -> _Source:
    if not isinstance(data, (str, os.PathLike, type(None))):  # a datasets.Dataset already in memory
        return _Source(description=f"datasets.Dataset of {len(data)} rows", dataset=data,
                       fingerprint={"dataset_object": data._fingerprint})
    data = None if data is None else os.fspath(data)
    if data is None:
        root = stdlib_root()
        text = [root / f for f in _stdlib_sources()]
        return _Source(
            description=f"Python {platform.python_version()} standard library ({root}, {len(text)} .py files)",
            fingerprint={"files": _file_fingerprint(text)},
            root=root,
            text=text,
        )
    path = Path(data).expanduser()
    if path.exists():
        return _local_source(path, data)
    if _looks_like_path(data):
        raise DataError(f"data path {data!r} does not exist")
    name, _, config = data.partition(":")
    try:
        ds = _load_named_dataset(name, config or None, split)
    except Exception as e:
        where = "from the local Hugging Face caches (HF_HUB_OFFLINE is set)" if hub_offline() else \
            "from the Hugging Face caches or the Hub"
        raise DataError(
            f"data {data!r} is neither an existing path nor a dataset that datasets.load_dataset"
            f"({name!r}, {config or None!r}, split={split!r}) can load {where} "
            f"({type(e).__name__}: {' '.join(str(e).split())})"
        ) from e
    return _Source(
        description=f"dataset {data} [{split}]",
        fingerprint={"dataset": data, "split": split, "datasets_fingerprint": ds._fingerprint},
        dataset=ds,
    )


class _Documents:
    """All documents of a source as (dataset, column) groups with one key per document."""

    def __init__(self, groups: list[tuple[datasets.Dataset, str]], keys: list[str]):
        self.groups = groups
        self.keys = keys
        self.starts = np.cumsum([0] + [len(ds) for ds, _ in groups]).tolist()
        assert self.starts[-1] == len(keys)

    def __len__(self) -> int:
        return len(self.keys)

    def texts(self, indices: Sequence[int]) -> list[str | None]:
        """Texts of the given documents, in the given order."""
        out: list[str | None] = [None] * len(indices)
        by_group: dict[int, list[int]] = {}
        for pos, i in enumerate(indices):
            by_group.setdefault(bisect_right(self.starts, i) - 1, []).append(pos)
        for g, positions in by_group.items():
            ds, column = self.groups[g]
            rows = ds[[indices[p] - self.starts[g] for p in positions]][column]
            for p, text in zip(positions, rows):
                out[p] = text
        return out


def _check_column(ds: datasets.Dataset, field: str, where: str, files: dict[str, list[str]] | None = None) -> None:
    """`files`: each file's own columns, so that a missing field names the file that lacks it."""
    import datasets
    if field not in ds.column_names:
        lacking = [(f, cols) for f, cols in (files or {}).items() if field not in cols]
        where, columns = (repr(lacking[0][0]), lacking[0][1]) if lacking else (where, ds.column_names)
        raise DataError(f"{where} has no field {field!r} (fields: {', '.join(columns)}); pass --text-field FIELD "
                        "(text_field)")
    feature = ds.features[field]
    if not (isinstance(feature, datasets.Value) and feature.dtype in ("string", "large_string")):
        raise DataError(f"{where}: field {field!r} holds {feature}, not text")


def _read(src: _Source, text_field: str, tmp: str) -> _Documents:
    """Load a source's documents: plain text directly, json and parquet through `datasets` (into the
    throwaway dir `tmp`)."""
    if src.dataset is not None:
        _check_column(src.dataset, text_field, src.description)
        return _Documents([(src.dataset, text_field)], [f"row#{i}" for i in range(len(src.dataset))])
    text = []
    for f in src.text:  # a stray binary file in a folder is skipped; `datasets` would abort on it
        try:
            f.read_bytes().decode("utf-8")
            text.append(f)
        except UnicodeDecodeError as e:
            if len(src.text) == 1 and not (src.json or src.parquet):
                raise DataError(f"data file {str(f)!r} is not UTF-8 text ({e})") from e
            log.warning("skipping %s: not UTF-8 text", f)
    # Documents in order: text files (sorted paths), then json rows, then parquet rows.
    groups, keys = [], []
    if text:
        groups.append((_TextFiles(text), "text"))
        keys += [f.relative_to(src.root).as_posix() for f in text]
    if src.json or src.parquet:
        with _local_files_only():
            _read_tables(src, text_field, tmp, groups, keys)
    return _Documents(groups, keys)


class _TextFiles:
    """Plain-text files as the rows of one "text" column, each file one document, read as
    `datasets`' text builder reads them with sample_by="document" (the whole file, universal
    newlines, UTF-8), on demand and without `datasets`, which plain text does not need."""

    def __init__(self, files: list[Path]):
        self.files = files

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, rows: list[int]) -> dict[str, list[str]]:
        out = []
        for i in rows:
            with open(self.files[i], encoding="utf-8") as f:
                out.append(f.read())
        return {"text": out}


def _read_tables(src: _Source, text_field: str, tmp: str, groups: list, keys: list[str]) -> None:
    """Append the json rows, then the parquet rows, of a source (through `datasets`)."""
    import datasets
    load = dict(split="train", cache_dir=tmp, keep_in_memory=True)
    for kind in ("json", "parquet"):
        files = getattr(src, kind)
        if not files:
            continue
        try:
            ds = datasets.load_dataset(kind, data_files=[str(f) for f in files], **load)
        except Exception as e:
            raise DataError(f"cannot read {kind} files {[str(f) for f in files]}: {type(e).__name__}: {e}") from e
        columns = {str(f): _file_columns(kind, f, load) for f in files} if text_field not in ds.column_names else None
        _check_column(ds, text_field, f"{kind} data under {str(src.root)!r}", columns)
        groups.append((ds, text_field))
        keys += [f"{kind}#{i}" for i in range(len(ds))]


def _file_columns(kind: str, path: Path, load: dict) -> list[str]:
    """One json or parquet file's columns (read only to name the file a field is missing from)."""
    import datasets
    if kind == "parquet":
        import pyarrow.parquet as pq

        return pq.read_schema(path).names
    return datasets.load_dataset(kind, data_files=[str(path)], **load).column_names


# --------------------------------------------------------------------------- tokenise + pack


def _tokenizer_fingerprint(tokenizer) -> str:
    """Identity of a tokenizer's mapping: its full serialisation for fast tokenizers."""
    h = hashlib.sha256(type(tokenizer).__name__.encode())
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        h.update(backend.to_str().encode())
    else:
        h.update(str(getattr(tokenizer, "name_or_path", "")).encode())
        h.update(json.dumps(sorted(tokenizer.get_vocab().items())).encode())
    return h.hexdigest()


class _Tokenised:
    """Memo of tokenised documents (ids + separator) behind one progress bar."""

    def __init__(self, tokenizer, docs: _Documents, sep: int, bar):
        self.tokenizer, self.docs, self.sep, self.bar = tokenizer, docs, sep, bar
        self.done: dict[int, np.ndarray] = {}

    def run(self, indices: Sequence[int], stop_after_tokens: float = float("inf")) -> int:
        """Tokenise `indices` in order until `stop_after_tokens` of them are done; return count done.

        Batches grow from 8 to 256 documents so a small token budget does not tokenise a large
        first batch, while long runs still give the Rust tokenizer big parallel batches.
        """
        pos, tokens, batch = 0, 0, 8
        while pos < len(indices) and tokens < stop_after_tokens:
            chunk = [i for i in indices[pos : pos + batch] if i not in self.done]
            texts = self.docs.texts(chunk)
            nonempty = [j for j, t in enumerate(texts) if t]
            ids = []
            if nonempty:
                batch_texts = [texts[j] for j in nonempty]
                ids = self.tokenizer(batch_texts, add_special_tokens=False, verbose=False)["input_ids"]
            for i in chunk:
                self.done[i] = np.empty(0, np.int32)
            for j, row in zip(nonempty, ids):
                arr = np.empty(len(row) + 1, np.int32)
                arr[:-1] = row
                arr[-1] = self.sep
                self.done[chunk[j]] = arr
            self.bar.update(len(chunk))
            tokens += sum(len(self.done[i]) for i in indices[pos : pos + batch])
            pos += batch
            batch = min(2 * batch, 256)
        return pos

    def stream(self, indices: Sequence[int]) -> np.ndarray:
        parts = [self.done[i] for i in indices if i in self.done]
        return np.concatenate(parts) if parts else np.empty(0, np.int32)


def _blocks(stream: np.ndarray, seq_len: int, max_tokens: int | None = None) -> torch.Tensor:
    if max_tokens is not None:
        stream = stream[:max_tokens]
    n = len(stream) // seq_len
    return torch.from_numpy(np.ascontiguousarray(stream[: n * seq_len]).reshape(n, seq_len))


def _build(docs: _Documents, tokenizer, sep: int, seq_len: int, val_fraction: float,
           max_train_tokens: int | None, progress: bool, description: str) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """Tokenise and pack. Val = whole documents in hash order (at least one block's worth).

    Only when no whole-document split can give validation a full block while leaving a training
    document (e.g. the corpus is one file) is the val set the final blocks of the token stream.
    """
    n = len(docs)
    order = _holdout_order(docs.keys)
    k = _holdout_count(n, val_fraction)
    if n > 1:
        k = min(k, n - 1)  # a whole-document split keeps at least one training document
    with tqdm(total=n, desc=f"tokenising {description}", unit="doc", delay=1.0, disable=not progress) as bar:
        tok = _Tokenised(tokenizer, docs, sep, bar)
        if k and n > 1:
            tok.run(order[:k])
            # Grow the held-out set along the hash order until it fills one block.
            while len(tok.stream(order[:k])) < seq_len and k < n - 1:
                k += 1
                tok.run(order[k - 1 : k])
        val_docs = set(order[:k])
        if k == 0 or (n > 1 and len(tok.stream(order[:k])) >= seq_len):
            train_idx = [i for i in range(n) if i not in val_docs]
            budget = float("inf") if max_train_tokens is None else max_train_tokens
            train_idx = train_idx[: tok.run(train_idx, budget)]
            val = _blocks(tok.stream(sorted(val_docs)), seq_len)
            train = _blocks(tok.stream(train_idx), seq_len, max_train_tokens)
            held = f"{k} held out for validation"
        else:
            tok.run(list(range(n)))
            everything = _blocks(tok.stream(range(n)), seq_len)
            nv = min(len(everything), max(1, round(val_fraction * len(everything))))
            val, train = everything[len(everything) - nv :], everything[: len(everything) - nv]
            if max_train_tokens is not None:
                train = train[: max_train_tokens // seq_len]
            held = f"too few documents to hold out whole ones, so validation is the last {nv} blocks"
    total = sum(len(a) for a in tok.done.values())
    if len(train) == 0 or (val_fraction > 0 and len(val) == 0):
        need = seq_len * (2 if val_fraction > 0 else 1)
        raise DataError(
            f"data {description} has {total} tokens in {n} documents; seq_len={seq_len} needs at "
            f"least {need} (one training block{' and one validation block' if val_fraction > 0 else ''})"
        )
    meta = {"documents": n, "held_out": held, "tokens_seen": total}
    return train.clone(), val.clone(), meta


@dataclasses.dataclass(frozen=True)
class Corpus:
    """Packed token blocks of one `--data` value."""

    train: torch.Tensor
    """int32 [N, seq_len] training blocks, in corpus order (ReplicaBatches shuffles)."""
    val: torch.Tensor
    """int32 [Nv, seq_len] blocks of the held-out documents ([0, seq_len] if val_fraction=0)."""
    description: str
    """One line for logs: source, documents, held-out rule, block counts."""
    cache_path: Path
    """The cache file the blocks came from."""


def load_corpus(
    data: str | os.PathLike | datasets.Dataset | None,
    tokenizer,
    seq_len: int,
    cache_dir: str | os.PathLike | None = None,
    text_field: str = "text",
    val_fraction: float = DEFAULT_VAL_FRACTION,
    max_train_tokens: int | None = None,
    split: str = "train",
    progress: bool = True,
) -> Corpus:
    """Tokenise, split and pack `data` (see the module docstring), or load it from the cache.

    `data`: a path, `name[:config]` of a Hub dataset (split `split`; the module docstring says
    where it is looked up), a `datasets.Dataset` (its `text_field` column), or None for the
    stdlib default. `max_train_tokens` keeps only the
    first that many training tokens (whole blocks, corpus order) and stops tokenising there.
    Raises `DataError` for a missing path, a folder without supported files, an unknown
    dataset, a missing `text_field`, or a corpus smaller than one training plus one validation
    block.
    """
    if seq_len < 1:
        raise DataError(f"seq_len={seq_len} must be positive")
    if not 0 <= val_fraction < 1:
        raise DataError(f"val_fraction={val_fraction} must be in [0, 1)")
    sep = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else tokenizer.sep_token_id
    if sep is None:
        raise DataError(f"tokenizer {getattr(tokenizer, 'name_or_path', tokenizer)!r} has no EOS or SEP token to separate documents")
    src = _resolve(data, split)
    key = {
        "version": _CACHE_VERSION,
        "source": src.fingerprint,
        "tokenizer": _tokenizer_fingerprint(tokenizer),
        "separator": sep,
        "seq_len": seq_len,
        "text_field": text_field,
        "val_fraction": val_fraction,
        "max_train_tokens": max_train_tokens,
    }
    root = cache_root(cache_dir)
    path = root / "corpus" / (hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:32] + ".pt")
    if path.exists():
        log.info("corpus cache hit: %s", path)
        try:
            saved = safe_load.load(path, None, what="token cache")
        except safe_load.UnreadableFile as err:
            raise DataError(f"{err}; delete it to rebuild it") from None
    else:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=path.parent, prefix=".datasets-") as tmp:
            docs = _read(src, text_field, tmp)
            train, val, meta = _build(docs, tokenizer, sep, seq_len, val_fraction, max_train_tokens, progress, src.description)
        meta["description"] = (
            f"{src.description}: {meta['documents']} documents, {meta['held_out']}; "
            f"{len(train)} train + {len(val)} val blocks of {seq_len} tokens"
        )
        saved = {"train": train, "val": val, "meta": meta}
        tmp_path = path.with_name(f".{path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        try:
            torch.save(saved, tmp_path)
            os.replace(tmp_path, path)  # atomic: readers see the whole file or none
        finally:
            tmp_path.unlink(missing_ok=True)
    return Corpus(saved["train"], saved["val"], saved["meta"]["description"], path)


# --------------------------------------------------------------------------- replica streams


def _epoch_seed(seed: int, epoch: int) -> int:
    digest = hashlib.blake2b(f"{seed}/{epoch}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


class ReplicaBatches:
    """Endless `(inputs, labels)` micro-batches of replica `replica` of `num_replicas`.

    Epoch e permutes all N blocks with a generator seeded by (seed, e); replica m owns slots
    [m*S, (m+1)*S) of that permutation, S = N // num_replicas, so replicas are disjoint within an
    epoch (the N % num_replicas leftover blocks sit out that epoch; different ones each epoch).
    Item j of the replica's stream is slot m*S + j % S of epoch j // S, and micro-batch p is items
    p*b .. p*b+b-1 (a batch may straddle an epoch boundary). So batch p depends on nothing but
    (blocks, replica, num_replicas, b, seed, p): every pipeline stage of a replica builds its own
    iterator and sees the same sequence, and one constructed at `position=p` continues exactly
    where an uninterrupted run would be after p micro-batches.

    `blocks`: int [N, seq_len] token blocks; ids and labels are then separate int64 [b, seq_len]
    copies of the same blocks. Or any map-style dataset (`len`, `[i]`) of N samples, whose b
    samples `collate_fn` merges into a batch (default: torch's `default_collate`, as DeepSpeed's
    loader); `pipeline_batch` reads (inputs, labels) from that batch.
    """

    def __init__(self, blocks, replica: int, num_replicas: int, micro_batch_size: int,
                 seed: int = 0, position: int = 0, collate_fn=None):
        if isinstance(blocks, torch.Tensor) and blocks.dim() != 2:
            raise ValueError(f"blocks must be [N, seq_len], got shape {tuple(blocks.shape)}")
        if not 0 <= replica < num_replicas:
            raise ValueError(f"replica={replica} is not in [0, num_replicas={num_replicas})")
        if micro_batch_size < 1 or position < 0:
            raise ValueError(f"micro_batch_size={micro_batch_size} must be >= 1 and position={position} >= 0")
        n = len(blocks)
        if n < num_replicas:
            if not isinstance(blocks, torch.Tensor):
                raise DataError(f"the dataset has {n} samples but {num_replicas} replicas need at least one each")
            seq_len = blocks.shape[1]
            raise DataError(
                f"corpus has {n} blocks ({n * seq_len} tokens) but {num_replicas} replicas need at "
                f"least one block each ({num_replicas * seq_len} tokens at seq_len={seq_len})"
            )
        self.blocks, self.collate_fn = blocks, collate_fn
        self.replica, self.num_replicas, self.micro_batch_size, self.seed = replica, num_replicas, micro_batch_size, seed
        self.shard_size = n // num_replicas
        self._position = position
        self._perm: tuple[int, torch.Tensor] | None = None

    @property
    def position(self) -> int:
        """Micro-batches consumed so far; the next one yielded is `batch(position)`."""
        return self._position

    @property
    def epoch(self) -> int:
        """Epoch of the next item this replica reads."""
        return self._position * self.micro_batch_size // self.shard_size

    def _shard(self, epoch: int) -> torch.Tensor:
        if self._perm is None or self._perm[0] != epoch:
            g = torch.Generator().manual_seed(_epoch_seed(self.seed, epoch))
            perm = torch.randperm(len(self.blocks), generator=g)
            start = self.replica * self.shard_size
            self._perm = (epoch, perm[start : start + self.shard_size])
        return self._perm[1]

    def block_indices(self, position: int) -> torch.Tensor:
        """Row indices into `blocks` of micro-batch `position`."""
        first = position * self.micro_batch_size
        return torch.stack([
            self._shard(j // self.shard_size)[j % self.shard_size]
            for j in range(first, first + self.micro_batch_size)
        ])

    def batch(self, position: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Micro-batch `position` as (inputs, labels); does not move `.position`."""
        rows = self.block_indices(position)
        if isinstance(self.blocks, torch.Tensor) and self.collate_fn is None:
            ids = self.blocks[rows].long()
            return ids, ids.clone()
        from torch.utils.data import default_collate

        return pipeline_batch((self.collate_fn or default_collate)([self.blocks[int(i)] for i in rows]))

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        out = self.batch(self._position)
        self._position += 1
        return out

    def state_dict(self) -> dict:
        """What a checkpoint stores to resume this stream."""
        return {"position": self._position, "seed": self.seed, "replica": self.replica,
                "num_replicas": self.num_replicas, "micro_batch_size": self.micro_batch_size}

    def load_state_dict(self, state: dict) -> None:
        """Resume at `state["position"]`; the other fields must match (a position means nothing else)."""
        for name in ("seed", "replica", "num_replicas", "micro_batch_size"):
            if state[name] != getattr(self, name):
                raise ValueError(f"data state was saved with {name}={state[name]}, this run has {getattr(self, name)}")
        self._position = int(state["position"])


def validation_batches(blocks: torch.Tensor, micro: int):
    """The held-out blocks in order, `micro` at a time, cycling: the same batches at every validation."""
    n = blocks.shape[0]
    start = 0
    while True:
        idx = torch.arange(start, start + micro) % n
        ids = blocks[idx].long()
        yield ids, ids.clone()
        start = (start + micro) % n


def pipeline_batch(batch) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, labels) as the pipeline reads them, from a collated batch: an (inputs, labels)
    pair, as DeepSpeed's pipeline takes it; a tensor of token blocks or a mapping with
    `input_ids` (and optionally `labels`), whose labels are the ids (the loss shifts them)."""
    if isinstance(batch, torch.Tensor):
        ids = batch.long()
        return ids, ids.clone()
    if isinstance(batch, dict) and "input_ids" in batch:
        ids = torch.as_tensor(batch["input_ids"]).long()
        labels = batch.get("labels")
        return ids, ids.clone() if labels is None else torch.as_tensor(labels).long()
    if isinstance(batch, (tuple, list)) and len(batch) == 2:
        return tuple(batch)
    kind = f"a mapping with keys {sorted(batch)}" if isinstance(batch, dict) else type(batch).__name__
    raise DataError(f"a collated micro-batch is {kind}; the pipeline needs (inputs, labels), a tensor of token "
                    "blocks or a mapping with input_ids")


def load_tokenizer(directory: str):
    """AutoTokenizer of a local directory; any failure is one ConfigError naming it."""
    from transformers import AutoTokenizer

    from .config import ConfigError

    try:
        return AutoTokenizer.from_pretrained(directory)
    except Exception as err:  # transformers raises ValueError, OSError, ImportError, ... for a bad directory
        detail = " ".join(str(err).split())
        raise ConfigError(f"cannot load a tokenizer from {directory}: {type(err).__name__}: {detail}") from None
