"""The paper-table corpus: source files tokenised into int16 blocks, for bench/paper_tables.py.

The paper-regime table rows read 8 replicas x 16K tokens x 5000 steps = 655M tokens each, so the
corpus is built where much text is: on the GPU machine, from the source files its image already
holds (PyTorch, JAX, CuPy, transformers, ... and their C/CUDA headers), with a tokenizer saved
here (the default BPE-8192 of `hetloco_ds.data.default_tokenizer`):

    python -c "from hetloco_ds import data; data.default_tokenizer(vocab_size=8192).save_pretrained('.benchdata/tokenizer')"
    python bench/make_corpus.py --tokenizer .benchdata/tokenizer --out runs/corpus_seq256.pt \\
        --roots /opt/torch/.venv/lib/python3.12/site-packages /usr/local/cuda/include
    python bench/make_corpus.py --tokenizer .benchdata/tokenizer --out .benchdata/code_bpe8192_seq256.pt \\
        --suffixes .py --max-bytes 9e7       # a smaller one: this interpreter's stdlib and site-packages

Files (`--suffixes`: .py, .pyi, .h, .hpp, .cuh, .c, .cc, .cpp, .cu, .md, .rst, .txt by default;
UTF-8, 64 B .. 400 KB, test and example folders left out) are ordered by the SHA-256 of their path
relative to their root; a file whose content hash was already taken is skipped (vendored copies).
Validation documents are held out whole by `hetloco_ds.corpus`'s own hash rule (2%). Tokens go
through the Rust tokenizer's parallel batch encoding, no `datasets` needed. Output: {"train",
"val"} int16 [N, seq_len] blocks (vocab <= 32768; paper_tables widens them on load),
"vocab_size", "description".

`--cpu-smoke` is the same path with at most 1 MB of text.
"""
from __future__ import annotations

import argparse
import hashlib
import os
import sys
import time

# Its own process: the Rust tokenizer's threads on, whatever gpu.sh set for the benches (serial
# encoding took 225 of a build's 232 s on a 32-core machine).
os.environ["TOKENIZERS_PARALLELISM"] = "true"

from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from hetloco_ds import corpus, documents  # noqa: E402

SUFFIXES = {".py", ".pyi", ".h", ".hpp", ".cuh", ".c", ".cc", ".cpp", ".cu", ".md", ".rst", ".txt"}
SKIP_DIRS = {"tests", "test", "testing", "__pycache__", "examples", "benchmarks", ".git"}


def source_files(roots: list[Path], suffixes: set[str], min_bytes: int, max_bytes: int) -> list[tuple[str, Path]]:
    """(key, path) of every candidate file, in SHA-256 order of the key (root index + relative path)."""
    found = []
    for i, root in enumerate(roots):
        for folder, dirs, files in os.walk(root):
            dirs[:] = sorted(d for d in dirs if d not in SKIP_DIRS and not d.startswith("."))
            for name in files:
                path = Path(folder, name)
                if path.suffix not in suffixes or name.startswith("test_") or path.is_symlink():
                    continue
                try:
                    size = path.stat().st_size
                except OSError:
                    continue
                if min_bytes <= size <= max_bytes:
                    found.append((f"{i}/{path.relative_to(root).as_posix()}", path))
    return sorted(found, key=lambda kp: hashlib.sha256(kp[0].encode()).hexdigest())


def read_unique(files: list[tuple[str, Path]], budget_bytes: int) -> tuple[list[str], list[str]]:
    keys, texts, seen, total = [], [], set(), 0
    for key, path in files:
        if total >= budget_bytes:
            break
        try:
            raw = path.read_bytes()
            text = raw.decode("utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        digest = hashlib.sha256(raw).digest()
        if digest in seen:
            continue
        seen.add(digest)
        keys.append(key)
        texts.append(text)
        total += len(raw)
    return keys, texts


def encode(backend, texts: list[str], eos: int, batch: int = 4096) -> list[np.ndarray]:
    """Each text's ids + EOS as int16 (vocab <= 32768), encoded in parallel batches so Python
    lists of ints never hold more than one batch (hundreds of millions of them would not fit)."""
    out = []
    for i in range(0, len(texts), batch):
        for e in backend.encode_batch(texts[i:i + batch], add_special_tokens=False):
            a = np.empty(len(e.ids) + 1, np.int16)
            a[:-1] = e.ids
            a[-1] = eos
            out.append(a)
        print(f"encoded {min(i + batch, len(texts))}/{len(texts)} files", flush=True)
    return out


def pack(docs: list[np.ndarray], seq_len: int) -> torch.Tensor:
    stream = np.concatenate(docs) if docs else np.empty(0, np.int16)
    n = len(stream) // seq_len
    return torch.from_numpy(stream[: n * seq_len].reshape(n, seq_len).copy())


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokenizer", required=True, help="directory of a saved PreTrainedTokenizerFast (vocab <= 32768)")
    p.add_argument("--roots", nargs="+", default=[str(documents.stdlib_root()),
                                                  next(x for x in sys.path if x.endswith("site-packages"))])
    p.add_argument("--suffixes", default=",".join(sorted(SUFFIXES)), help="comma-separated file suffixes to read")
    p.add_argument("--max-bytes", type=float, default=6e8, help="stop adding files past this much text")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--out", required=True)
    p.add_argument("--cpu-smoke", action="store_true", help="at most 1 MB of text")
    args = p.parse_args(argv)
    if args.cpu_smoke:
        args.max_bytes = min(args.max_bytes, 1e6)
    from transformers import PreTrainedTokenizerFast

    t0 = time.time()
    tok = PreTrainedTokenizerFast.from_pretrained(args.tokenizer)
    if len(tok) > 2**15:
        sys.exit(f"vocabulary {len(tok)} does not fit int16")
    roots = [Path(r) for r in args.roots if Path(r).is_dir()]
    suffixes = {x if x.startswith(".") else "." + x for x in args.suffixes.split(",") if x}
    keys, texts = read_unique(source_files(roots, suffixes, 64, 400_000), int(args.max_bytes))
    nbytes = sum(len(t) for t in texts)
    print(f"read {len(texts)} files ({nbytes / 1e6:.0f}M characters) in {time.time() - t0:.0f} s", flush=True)
    held = set(corpus._holdout_order(keys)[: corpus._holdout_count(len(keys), corpus.DEFAULT_VAL_FRACTION)])
    ids = encode(tok.backend_tokenizer, texts, tok.eos_token_id)
    del texts
    train = pack([ids[i] for i in range(len(ids)) if i not in held], args.seq_len)
    val = pack([ids[i] for i in sorted(held)], args.seq_len)
    desc = (f"{len(keys)} source files ({nbytes / 1e6:.0f}M characters) under {', '.join(map(str, roots))}, {len(held)} held out; "
            f"{len(train)} train + {len(val)} val blocks of {args.seq_len} tokens ({train.numel() / 1e6:.1f}M train tokens)")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    torch.save({"train": train, "val": val, "vocab_size": len(tok), "description": desc}, args.out + ".tmp")
    os.replace(args.out + ".tmp", args.out)
    print(f"{desc}\nwrote {args.out} in {time.time() - t0:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
