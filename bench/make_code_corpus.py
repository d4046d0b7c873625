"""A larger real corpus for the paper-table runs: Python sources of this machine's interpreter.

The embedded default corpus (the standard library, 3.2M tokens) is repeated about 8 times by a
1500-step table row of M = 8 replicas x 8 x 256 tokens, so the longer runs would measure
memorisation. This script packs the standard library plus a deterministic sample of the
installed packages' sources (torch, transformers, numpy, ... as found in site-packages; test
folders left out) with the default BPE-8192 tokenizer into one tensor file the GPU machine can
read without `datasets`:

    python bench/make_code_corpus.py --train-tokens 26000000 --out .benchdata/code_bpe8192_seq256.pt

Files are taken in the order of the SHA-256 of their path relative to site-packages (a fixed,
package-mixed order) until the byte budget is reached; the held-out documents are chosen by
`hetloco_ds.data.load_corpus`'s own hash rule. Tokens are stored as int16 (vocab 8192) to fit
the device tool's 64 MiB carry limit; `bench/paper_tables.py` widens them on load.
"""
from __future__ import annotations

import argparse
import hashlib
import os
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from hetloco_ds import data  # noqa: E402

SKIP_DIRS = {"tests", "test", "testing", "__pycache__", "examples", "benchmarks"}


def site_sources(root: Path, max_file_bytes: int) -> list[Path]:
    """UTF-8 `.py` files under `root`, test/example folders and huge generated files left out."""
    found = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in SKIP_DIRS and not d.startswith("."))
        for name in files:
            path = Path(folder, name)
            if not name.endswith(".py") or name.startswith("test_"):
                continue
            size = path.stat().st_size
            if 0 < size <= max_file_bytes:
                found.append(path)
    return found


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--train-tokens", type=int, default=26_000_000, help="stop adding files past about this many tokens")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--max-file-bytes", type=int, default=400_000)
    p.add_argument("--out", default=".benchdata/code_bpe8192_seq256.pt")
    args = p.parse_args()

    tokenizer = data.default_tokenizer(vocab_size=8192)
    stdlib = data.stdlib_root()
    site = Path(next(p for p in sys.path if p.endswith("site-packages")))
    std_files = [stdlib / f for f in data._stdlib_sources()]
    std_bytes = sum(f.stat().st_size for f in std_files)
    # Bytes per token of this tokenizer on code, from a sample of the stdlib, sets the byte budget.
    sample = "".join(f.read_text() for f in std_files[:200])
    bytes_per_token = len(sample.encode()) / len(tokenizer(sample)["input_ids"])
    budget = int(args.train_tokens * bytes_per_token) - std_bytes
    chosen, total = [], 0
    for f in sorted(site_sources(site, args.max_file_bytes),
                    key=lambda f: hashlib.sha256(f.relative_to(site).as_posix().encode()).hexdigest()):
        if total >= budget:
            break
        try:
            f.read_bytes().decode("utf-8")
        except UnicodeDecodeError:
            continue
        chosen.append(f)
        total += f.stat().st_size
    print(f"{bytes_per_token:.2f} bytes/token; stdlib {len(std_files)} files {std_bytes / 1e6:.1f} MB + "
          f"site-packages {len(chosen)} files {total / 1e6:.1f} MB", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp, "code")
        for prefix, root, files in (("stdlib", stdlib, std_files), ("site", site, chosen)):
            for f in files:
                link = folder / prefix / f.relative_to(root)
                link.parent.mkdir(parents=True, exist_ok=True)
                link.symlink_to(f)
        corpus = data.load_corpus(str(folder), tokenizer, args.seq_len, cache_dir=Path(tmp, "cache"))
    desc = corpus.description.replace(str(folder), f"Python {sys.version.split()[0]} stdlib + sampled site-packages sources")
    blob = {"train": corpus.train.to(torch.int16), "val": corpus.val.to(torch.int16), "vocab_size": len(tokenizer),
            "description": desc}
    assert int(corpus.train.max()) < 2**15 and len(tokenizer) <= 2**15
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    tmp_out = args.out + ".tmp"
    torch.save(blob, tmp_out)
    os.replace(tmp_out, args.out)
    print(f"{desc}\nwrote {args.out} ({os.path.getsize(args.out) / 2**20:.1f} MiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
