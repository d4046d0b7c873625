"""Training data: `--data` to packed token blocks, and each replica's stream of micro-batches.

The public face of three layers, each a module of its own and usable on its own:

* `documents`: what `--data` names (local files, a `datasets` dataset, the Hub or its cache;
  `None`, the running Python's standard library), resolved and read as documents.
* `corpus`: the documents tokenised, validation documents held out whole, packed into blocks of
  `seq_len` tokens and cached (`load_corpus`); the default tokenizer and a directory's tokenizer.
* `batches`: replica m's micro-batches as a pure function of a position counter
  (`ReplicaBatches`), the held-out batches, a collated batch as the pipeline takes it.

The package's own modules import from those; this module keeps `hetloco_ds.data.<name>` working
for the scripts, benches and tests that use it.
"""
from __future__ import annotations

from .batches import ReplicaBatches, pipeline_batch, validation_batches
from .corpus import (
    DEFAULT_VAL_FRACTION,
    DEFAULT_VOCAB_SIZE,
    EOS_TOKEN,
    PAD_TOKEN,
    Corpus,
    cache_root,
    default_tokenizer,
    load_corpus,
    load_tokenizer,
    stdlib_files,
)
from .documents import DataError, hub_offline, stdlib_root

__all__ = [
    "DEFAULT_VAL_FRACTION", "DEFAULT_VOCAB_SIZE", "EOS_TOKEN", "PAD_TOKEN", "Corpus", "DataError", "ReplicaBatches",
    "cache_root", "default_tokenizer", "hub_offline", "load_corpus", "load_tokenizer", "pipeline_batch",
    "stdlib_files", "stdlib_root", "validation_batches",
]
