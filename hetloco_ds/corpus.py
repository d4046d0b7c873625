"""`--data`'s documents tokenised and packed into blocks, cached; and the tokenizers: the
embedded default (byte-level BPE trained on the standard library's training files) and one
loaded from a directory.

`load_corpus` tokenises every document `documents` reads, follows each with the tokenizer's EOS,
concatenates, and cuts the stream into blocks of exactly `seq_len` tokens (the tail that does not
fill a block is dropped). A block is one sample: inputs = labels = block, the loss shifts
internally. Validation documents are held out whole (see `_holdout_order`), so no block mixes
train and val text.

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

import dataclasses
import hashlib
import json
import logging
import os
import platform
import shutil
import tempfile
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

import numpy as np
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from tqdm.auto import tqdm
from transformers import PreTrainedTokenizerFast

from . import safe_load
from .documents import DataError, Documents, read_documents, resolve_source, stdlib_root, stdlib_sources

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


# --------------------------------------------------------------------------- tokenizers


def stdlib_files(val_fraction: float = DEFAULT_VAL_FRACTION) -> tuple[list[str], list[str]]:
    """(train, val) relative paths of the default corpus, each sorted, disjoint.

    These are exactly the documents `load_corpus(None, ...)` holds out (it uses the same keys and
    hash order), so the default tokenizer, trained on `train` only, never sees validation text.
    """
    files = stdlib_sources()
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


def load_tokenizer(directory: str):
    """AutoTokenizer of a local directory; any failure is one ConfigError naming it."""
    from transformers import AutoTokenizer

    from .config import ConfigError

    try:
        return AutoTokenizer.from_pretrained(directory)
    except Exception as err:  # transformers raises ValueError, OSError, ImportError, ... for a bad directory
        detail = " ".join(str(err).split())
        raise ConfigError(f"cannot load a tokenizer from {directory}: {type(err).__name__}: {detail}") from None


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

    def __init__(self, tokenizer, docs: Documents, sep: int, bar):
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


def _build(docs: Documents, tokenizer, sep: int, seq_len: int, val_fraction: float,
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
    src = resolve_source(data, split)
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
            docs = read_documents(src, text_field, tmp)
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
