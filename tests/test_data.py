"""Data pipeline: sources -> packed blocks -> per-replica micro-batch streams.

Most tests use a byte tokenizer (one token per UTF-8 byte, no merges) so every count below is
the number of bytes in the documents plus one EOS per document.
"""
from __future__ import annotations

import json
import os
import platform
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from hetloco_ds import data, documents
from hetloco_ds.data import DataError, ReplicaBatches, default_tokenizer, load_corpus, stdlib_files

EOS = 0


@pytest.fixture(scope="module")
def byte_tok() -> PreTrainedTokenizerFast:
    vocab = {data.EOS_TOKEN: 0, data.PAD_TOKEN: 1}
    for ch in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[ch] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=data.EOS_TOKEN, pad_token=data.PAD_TOKEN)


DOCS = {  # in corpus order: text files by sorted path, then jsonl rows, then parquet rows
    "a.txt": "alpha " * 10,  # 60 bytes
    "sub/b.md": "# beta\n" * 5,  # 35
    "sub/deeper/c.py": "x = 1\n" * 7,  # 42
    "d.jsonl#0": "gamma" * 6,  # 30
    "d.jsonl#1": "delta" * 4,  # 20
    "e.parquet#0": "epsilon" * 3,  # 21
    "e.parquet#1": "zeta" * 5,  # 20
}


@pytest.fixture
def mixed_folder(tmp_path):
    root = tmp_path / "corpus"
    (root / "sub" / "deeper").mkdir(parents=True)
    for name in ("a.txt", "sub/b.md", "sub/deeper/c.py"):
        (root / name).write_text(DOCS[name])
    with open(root / "d.jsonl", "w") as f:
        for i in range(2):
            f.write(json.dumps({"text": DOCS[f"d.jsonl#{i}"], "id": i}) + "\n")
    pq.write_table(pa.table({"text": [DOCS["e.parquet#0"], DOCS["e.parquet#1"]], "n": [0, 1]}), root / "e.parquet")
    (root / "blob.bin").write_bytes(b"\x00\x01\x02binary")  # not text: skipped
    (root / ".hidden").write_text("never read")
    return root


def _stream(tok, texts) -> torch.Tensor:
    return torch.tensor([t for x in texts for t in tok(x, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]])


def test_mixed_folder_packs_into_exact_blocks_of_documents_and_separators(byte_tok, mixed_folder, tmp_path):
    """Breaks if a format is not read, folders are not recursed, binary/hidden files leak in,
    documents are reordered, the EOS separator is missing, or blocks are padded/overlapping."""
    corpus = load_corpus(str(mixed_folder), byte_tok, seq_len=16, cache_dir=tmp_path / "c", val_fraction=0, progress=False)
    # 60+35+42+30+20+21+20 bytes + 7 EOS = 235 tokens -> 14 blocks of 16, 11 tokens dropped.
    assert corpus.train.shape == (14, 16)
    assert corpus.val.shape == (0, 16)
    expected = _stream(byte_tok, DOCS.values())
    assert len(expected) == 235
    assert torch.equal(corpus.train.flatten().long(), expected[:224])
    assert "3 text, 1 json, 1 parquet files" in corpus.description


def test_validation_holds_out_whole_documents_deterministically(byte_tok, mixed_folder, tmp_path):
    """Breaks if val is cut by block (mixing a document into both splits), depends on anything
    but the document keys, or is empty: 2% of 7 documents rounds up to exactly 1."""
    corpora = [load_corpus(str(mixed_folder), byte_tok, seq_len=16, cache_dir=tmp_path / f"c{i}", progress=False) for i in range(2)]
    assert torch.equal(corpora[0].val, corpora[1].val) and torch.equal(corpora[0].train, corpora[1].train)
    corpus = corpora[0]
    held = [k for k, text in DOCS.items() if torch.equal(corpus.val.flatten().long(), _stream(byte_tok, [text])[: corpus.val.numel()])]
    assert len(held) == 1
    assert corpus.val.shape == ((len(DOCS[held[0]]) + 1) // 16, 16)
    rest = _stream(byte_tok, [t for k, t in DOCS.items() if k != held[0]])
    assert corpus.train.shape == (len(rest) // 16, 16)
    assert torch.equal(corpus.train.flatten().long(), rest[: corpus.train.numel()])
    assert "1 held out for validation" in corpus.description


def test_single_document_validation_is_the_tail_of_its_blocks(byte_tok, tmp_path):
    """Breaks if a one-file corpus (e.g. one big .txt) errors or trains on its val blocks."""
    (tmp_path / "one.txt").write_text("0123456789" * 20)  # 200 bytes + EOS = 201 -> 12 blocks
    corpus = load_corpus(str(tmp_path / "one.txt"), byte_tok, seq_len=16, cache_dir=tmp_path / "c", val_fraction=0.1, progress=False)
    stream = _stream(byte_tok, ["0123456789" * 20])
    assert corpus.train.shape == (11, 16) and corpus.val.shape == (1, 16)  # round(0.1 * 12) = 1
    assert torch.equal(torch.cat([corpus.train, corpus.val]).flatten().long(), stream[:192])


def test_cache_hit_does_not_retokenise_and_a_changed_file_does(byte_tok, mixed_folder, tmp_path, monkeypatch):
    """Breaks if the cache key misses the tokenizer call path (re-tokenising every run) or
    ignores file changes (serving stale blocks), or if temp files are left in the cache."""
    calls = []
    real_call = type(byte_tok).__call__

    def counting(self, *args, **kwargs):
        calls.append(1)
        return real_call(self, *args, **kwargs)

    monkeypatch.setattr(type(byte_tok), "__call__", counting)
    cache = tmp_path / "c"
    first = load_corpus(str(mixed_folder), byte_tok, seq_len=16, cache_dir=cache, val_fraction=0, progress=False)
    assert len(calls) > 0
    calls.clear()
    second = load_corpus(str(mixed_folder), byte_tok, seq_len=16, cache_dir=cache, val_fraction=0, progress=False)
    assert calls == []
    assert torch.equal(first.train, second.train) and second.cache_path == first.cache_path
    assert sorted(p.name for p in (cache / "corpus").iterdir()) == [first.cache_path.name]

    (mixed_folder / "a.txt").write_text(DOCS["a.txt"] * 2)  # +60 bytes -> 295 tokens -> 18 blocks
    third = load_corpus(str(mixed_folder), byte_tok, seq_len=16, cache_dir=cache, val_fraction=0, progress=False)
    assert len(calls) > 0 and third.train.shape == (18, 16)
    calls.clear()
    load_corpus(str(mixed_folder), byte_tok, seq_len=32, cache_dir=cache, val_fraction=0, progress=False)
    assert len(calls) > 0  # seq_len is part of the key
    assert not [p for p in (cache / "corpus").iterdir() if p.name.startswith(".")]



def test_a_crafted_token_cache_is_refused_in_one_line_and_runs_nothing(byte_tok, mixed_folder, tmp_path):
    """The token cache is a torch file a run reads back; one rewritten to run code when unpickled
    is refused naming it (delete it to rebuild), and its code never runs. Breaks if the cache is
    read other than through safe_load (weights-only), or its error is torch's multi-line one."""
    from test_crafted_files import _Touch

    cache, marker = tmp_path / "c", tmp_path / "MARKER"
    path = load_corpus(str(mixed_folder), byte_tok, seq_len=16, cache_dir=cache, val_fraction=0,
                       progress=False).cache_path
    torch.save({"train": _Touch(marker)}, path)
    with pytest.raises(DataError) as err:
        load_corpus(str(mixed_folder), byte_tok, seq_len=16, cache_dir=cache, val_fraction=0, progress=False)
    assert str(err.value) == (f"token cache {path} is refused: loading it would call getattr; only tensors and "
                              "plain data are read from a file, and nothing in this one was run; delete it to rebuild it")
    assert not marker.exists()

def _ids(batch) -> list[int]:
    """Block numbers of a batch drawn from blocks = arange(N * L).view(N, L)."""
    ids, labels = batch
    assert ids.dtype == labels.dtype == torch.int64 and torch.equal(ids, labels)
    assert ids.data_ptr() != labels.data_ptr()
    return (ids[:, 0] // ids.shape[1]).tolist()


def test_replica_shards_are_disjoint_and_deterministic():
    """Breaks if replicas train on the same blocks within an epoch, if two iterators built
    independently (two stages of one replica) disagree, or if every epoch repeats one order."""
    blocks = torch.arange(20 * 4, dtype=torch.int32).view(20, 4)  # S = 20 // 3 = 6 per replica
    epoch0 = []
    for m in range(3):
        a = ReplicaBatches(blocks, m, 3, micro_batch_size=2, seed=7)
        b = ReplicaBatches(blocks, m, 3, micro_batch_size=2, seed=7)
        seq = [_ids(next(a)) for _ in range(6)]  # two epochs of 3 batches
        assert seq == [_ids(next(b)) for _ in range(6)]
        assert a.position == 6 and a.epoch == 2
        first, second = sum(seq[:3], []), sum(seq[3:], [])
        assert len(set(first)) == 6 and len(set(second)) == 6
        assert first != second  # a fresh permutation each epoch
        epoch0.append(set(first))
    assert len(epoch0[0] | epoch0[1] | epoch0[2]) == 18  # disjoint: 3 x 6 distinct blocks
    other_seed = ReplicaBatches(blocks, 0, 3, micro_batch_size=2, seed=8)
    assert [_ids(next(other_seed)) for _ in range(3)] != [_ids(b) for b in map(ReplicaBatches(blocks, 0, 3, 2, seed=7).batch, range(3))]


def test_resume_at_position_continues_exactly():
    """Breaks if the stream has hidden state beyond its position, so a resumed run (here across
    an epoch boundary that splits a micro-batch: S = 5, b = 3) diverges from an unbroken one."""
    blocks = torch.arange(10 * 2).view(10, 2)
    straight = ReplicaBatches(blocks, 1, 2, micro_batch_size=3, seed=3)
    reference = [_ids(next(straight)) for _ in range(10)]
    resumed = ReplicaBatches(blocks, 1, 2, micro_batch_size=3, seed=3, position=4)
    assert [_ids(next(resumed)) for _ in range(6)] == reference[4:]
    restored = ReplicaBatches(blocks, 1, 2, micro_batch_size=3, seed=3)
    restored.load_state_dict({**straight.state_dict(), "position": 7})
    assert restored.position == 7 and _ids(next(restored)) == reference[7]
    with pytest.raises(ValueError, match="num_replicas=2, this run has 4"):
        ReplicaBatches(blocks, 1, 4, 3, seed=3).load_state_dict(straight.state_dict())


def test_missing_path_raises_data_error_naming_it(byte_tok, tmp_path):
    """Breaks if a typo in --data falls through to a confusing hub lookup or a traceback."""
    missing = str(tmp_path / "nope" / "train.jsonl")
    with pytest.raises(DataError, match=f"data path '{missing}' does not exist"):
        load_corpus(missing, byte_tok, seq_len=16, cache_dir=tmp_path / "c")


def test_empty_or_unsupported_folder_raises_data_error_naming_it(byte_tok, tmp_path):
    """Breaks if an empty folder (or one of binaries) yields an empty corpus instead of an error."""
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(DataError, match=f"data folder '{empty}' is empty"):
        load_corpus(str(empty), byte_tok, seq_len=16, cache_dir=tmp_path / "c")
    (empty / "x.bin").write_bytes(b"\x00" * 10)
    with pytest.raises(DataError, match="has 1 files but none is UTF-8 text"):
        load_corpus(str(empty), byte_tok, seq_len=16, cache_dir=tmp_path / "c")


def test_unknown_dataset_name_raises_quickly_naming_it(byte_tok, tmp_path):
    """Breaks if an uncached dataset name hangs in network retries or errors without the name."""
    with pytest.raises(DataError, match="'no-such-org-xyz/no-such-set' is neither an existing path nor a dataset"):
        load_corpus("no-such-org-xyz/no-such-set", byte_tok, seq_len=16, cache_dir=tmp_path / "c")


def test_missing_text_field_raises_naming_field(byte_tok, tmp_path):
    """Breaks if json rows without the configured field silently become an empty corpus."""
    (tmp_path / "d.jsonl").write_text(json.dumps({"content": "hello"}) + "\n")
    with pytest.raises(DataError, match="no field 'text' \\(fields: content\\)"):
        load_corpus(str(tmp_path / "d.jsonl"), byte_tok, seq_len=4, cache_dir=tmp_path / "c")
    corpus = load_corpus(str(tmp_path / "d.jsonl"), byte_tok, seq_len=3, cache_dir=tmp_path / "c",
                         text_field="content", val_fraction=0, progress=False)
    assert corpus.train.shape == (2, 3)  # "hello" + EOS


def test_missing_parquet_field_names_the_file_and_the_flag(byte_tok, tmp_path):
    """A folder of parquet files, one of which lacks the text column: the error once named the
    folder and `text_field` (no such flag); it names the file and --text-field."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder = tmp_path / "shards"
    folder.mkdir()
    pq.write_table(pa.table({"content": ["hello world"] * 4}), folder / "a.parquet")
    pq.write_table(pa.table({"content": ["hello there"] * 4}), folder / "b.parquet")
    with pytest.raises(DataError) as err:
        load_corpus(str(folder), byte_tok, seq_len=4, cache_dir=tmp_path / "c", progress=False)
    assert str(err.value) == (f"{str(folder / 'a.parquet')!r} has no field 'text' (fields: content); "
                              "pass --text-field FIELD (text_field)")


def test_too_small_corpus_raises_with_token_counts(byte_tok, tmp_path):
    """Breaks if a corpus shorter than one block per split / per replica trains on nothing."""
    (tmp_path / "tiny.txt").write_text("hi")
    with pytest.raises(DataError, match="has 3 tokens in 1 documents; seq_len=16 needs at least 32"):
        load_corpus(str(tmp_path / "tiny.txt"), byte_tok, seq_len=16, cache_dir=tmp_path / "c")
    with pytest.raises(DataError, match=r"2 blocks \(32 tokens\) but 3 replicas need .* \(48 tokens"):
        ReplicaBatches(torch.zeros(2, 16, dtype=torch.int32), 0, 3, micro_batch_size=1)


def test_cache_root_precedence(tmp_path, monkeypatch):
    """Breaks if HETLOCO_CACHE or the explicit argument stop redirecting the cache."""
    monkeypatch.setenv("HETLOCO_CACHE", str(tmp_path / "env"))
    assert data.cache_root() == tmp_path / "env"
    assert data.cache_root(tmp_path / "arg") == tmp_path / "arg"
    monkeypatch.delenv("HETLOCO_CACHE")
    assert data.cache_root() == Path.home() / ".cache" / "hetloco_ds"


def test_stdlib_split_is_deterministic_and_disjoint():
    """Breaks if test code or vendored packages leak into the default corpus, or if the val
    files overlap train or change between calls."""
    train, val = stdlib_files()
    assert (train, val) == stdlib_files()
    assert not set(train) & set(val)
    assert len(val) == round(0.02 * (len(train) + len(val))) >= 1
    everything = train + val
    assert "os.py" in train + val and "json/decoder.py" in everything
    assert not [f for f in everything if "site-packages/" in f or "/test/" in f or f.startswith(("test/", "idlelib/idle_test"))]


def test_default_tokenizer_trains_caches_and_reloads(tmp_path, monkeypatch):
    """Breaks if the stdlib tokenizer loses its special tokens, trains on val files, is not
    cached (retrained per run), or cannot be reloaded by AutoTokenizer; and if the default
    corpus does not hold out exactly the stdlib val files."""
    tok = default_tokenizer(vocab_size=300, cache_dir=tmp_path, max_train_bytes=100_000, progress=False)
    path = tmp_path / "tokenizers" / f"stdlib-py{platform.python_version()}-bpe300-max100000B"
    assert len(tok) == 300
    assert (tok.eos_token, tok.bos_token, tok.pad_token) == (data.EOS_TOKEN, data.EOS_TOKEN, data.PAD_TOKEN)
    assert (tok.eos_token_id, tok.pad_token_id) == (0, 1)
    trained_on = (path / "training_files.txt").read_text().split()
    train, val = stdlib_files()
    assert trained_on == sorted(trained_on) and set(trained_on) <= set(train)
    assert sum(os.path.getsize(data.stdlib_root() / f) for f in trained_on) >= 100_000

    def no_training(*args, **kwargs):
        raise AssertionError("retrained despite a cached tokenizer")

    monkeypatch.setattr("hetloco_ds.corpus._train_bpe", no_training)
    again = default_tokenizer(vocab_size=300, cache_dir=tmp_path, max_train_bytes=100_000, progress=False)
    reloaded = AutoTokenizer.from_pretrained(str(path))
    sample = "def f(x):\n    return x  # é\n"
    ids = tok(sample, add_special_tokens=False)["input_ids"]
    assert again(sample, add_special_tokens=False)["input_ids"] == ids == reloaded(sample, add_special_tokens=False)["input_ids"]
    assert reloaded.decode(ids) == sample

    corpus = load_corpus(None, tok, seq_len=64, cache_dir=tmp_path, max_train_tokens=20 * 64, progress=False)
    assert corpus.train.shape == (20, 64)
    root = data.stdlib_root()
    val_stream = _stream(tok, [(root / f).read_text() for f in val])
    assert corpus.val.shape == (len(val_stream) // 64, 64)
    assert torch.equal(corpus.val.flatten().long(), val_stream[: corpus.val.numel()])
    first_train = _stream(tok, [(root / f).read_text() for f in train[:12]])
    assert torch.equal(corpus.train.flatten().long(), first_train[: 20 * 64])
    assert "standard library" in corpus.description and f"{len(val)} held out" in corpus.description


def test_plain_text_reads_as_the_datasets_text_builder_does_without_importing_it(tmp_path):
    """Plain-text files are read without `datasets` (the GPU image and the simulator lack it), to the same
    documents its text builder gives with sample_by="document": the whole file, "\\r\\n" and "\\r" read as
    "\\n", UTF-8. The reference is `datasets` itself. Breaks if a newline, a byte order or a document
    boundary differed, which would change every token of a user's corpus between versions."""
    import subprocess
    import sys

    import datasets

    root = tmp_path / "t"
    root.mkdir()
    files = [root / "a.txt", root / "b.txt"]
    files[0].write_bytes("one\r\ntwo\rthree\n\n  é ∑ 🙂\t\n".encode())
    files[1].write_bytes(b"no final newline\r\n\r\nx")
    want = datasets.load_dataset("text", data_files=[str(f) for f in files], sample_by="document", split="train",
                                 cache_dir=str(tmp_path / "c"), keep_in_memory=True)["text"]
    docs = documents.read_documents(documents.resolve_source(str(root), "train"), "text", str(tmp_path / "tmp"))
    assert docs.texts([0, 1]) == want and docs.keys == ["a.txt", "b.txt"]
    # Reading a text corpus does not import `datasets` at all.
    code = ("import sys; from hetloco_ds import data, documents; "
            f"d = documents.read_documents(documents.resolve_source({str(root)!r}, 'train'), 'text', "
            f"{str(tmp_path / 'tmp2')!r}); "
            "print(len(d.texts([0, 1])), 'datasets' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["2", "False"]
