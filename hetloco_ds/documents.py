"""What `--data` names, resolved and read as documents (the first of the data layers; `corpus`
tokenises what this reads, `batches` serves the blocks, `data` is their public face).

`--data` names local plain text (any UTF-8 file: .txt, .py, .md, ...), .json/.jsonl, .parquet, a
folder of such files (recursive, mixed), or a dataset that `datasets.load_dataset` can load (from
its cache, from the Hub unless HF_HUB_OFFLINE=1, or from a dataset snapshot in the Hugging Face
hub cache). `None` means the embedded default: the `.py` sources of the running Python's standard
library. A text file is one document, read here without `datasets` (the simulator and the GPU
image run without it); a json/parquet row is one document (column `text_field`), read through
`datasets`.

No torch here: reading documents needs none, and the batches that import `DataError` from this
module stay free of the tokenizer libraries.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import platform
import sysconfig
from bisect import bisect_right
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

import numpy as np

if TYPE_CHECKING:  # annotations only: datasets is imported where it is used (the simulator runs without it)
    import datasets

log = logging.getLogger(__name__)

_STRUCTURED = {".json": "json", ".jsonl": "json", ".parquet": "parquet"}
_TEXT_SUFFIXES = {".txt", ".md", ".py", ".rst"}  # path-like hints only; any UTF-8 file is text
_STDLIB_SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}
_SNIFF_BYTES = 8192


class DataError(ValueError):
    """Unusable `--data` or a corpus too small for the run; the message names the bad value."""


# --------------------------------------------------------------------------- stdlib default


def stdlib_root() -> Path:
    """The running interpreter's standard library directory."""
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_sources() -> list[str]:
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


def resolve_source(data: str | datasets.Dataset | None, split: str) -> _Source:
    if not isinstance(data, (str, os.PathLike, type(None))):  # a datasets.Dataset already in memory
        return _Source(description=f"datasets.Dataset of {len(data)} rows", dataset=data,
                       fingerprint={"dataset_object": data._fingerprint})
    data = None if data is None else os.fspath(data)
    if data is None:
        root = stdlib_root()
        text = [root / f for f in stdlib_sources()]
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


class Documents:
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


def read_documents(src: _Source, text_field: str, tmp: str) -> Documents:
    """Load a source's documents: plain text directly, json and parquet through `datasets` (into the
    throwaway dir `tmp`)."""
    if src.dataset is not None:
        _check_column(src.dataset, text_field, src.description)
        return Documents([(src.dataset, text_field)], [f"row#{i}" for i in range(len(src.dataset))])
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
    return Documents(groups, keys)


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
