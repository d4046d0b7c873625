"""The last stage's loss at a large vocabulary: seconds and peak memory of one micro-batch's forward
and backward through the LM head and the cross-entropy (issue 59, item 2), each way side by side:

    whole        `model.causal_lm_loss` of `F.linear(hidden, weight)`: the [tokens, vocab] logits
    ours:N       `model.chunked_lm_loss`, N tokens a chunk (`hetloco.train.loss_chunk_tokens`)
    torch:N      torch's `F.linear_cross_entropy` with `LinearCrossEntropyOptions(batch_chunk_size=N)`
                 (its chunked path; where this torch has it)
    liger        Liger's `LigerFusedLinearCrossEntropyLoss` (where liger_kernel imports and a GPU runs it)

    OUT=$OUT bash bench/gpu.sh --timeout 300 loss_chunk.py --out $OUT/loss_chunk.json       # GPU
    python bench/loss_chunk.py --cpu-smoke --out /tmp/loss_chunk.json                        # tiny, CPU

Shapes (--shapes): Llama-3-8B's head (d 4096, vocab 128256) and Llama-3.2-1B's (d 2048, same
vocabulary), 8192 tokens, bf16 autocast over fp32 weights as the engine trains. Each way runs
--repeats times after one warm-up, interleaved way by way so drift hits all alike; a row has the
median seconds, the peak allocated bytes above what the inputs hold (torch.cuda.max_memory_allocated
after reset), the loss and its relative difference from `whole`'s, and the gradients' largest
relative difference from `whole`'s. A way that fails (missing, out of memory) records its error.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from hetloco_ds.model import (HeadInput, causal_lm_loss, chunked_lm_loss, head_dtype,  # noqa: E402
                              next_token_targets)

SHAPES = {"8B": (4096, 128256), "1B": (2048, 128256), "tiny": (64, 512)}


def ways(chunks: list[int]) -> dict:
    """name -> loss(hidden [1, T, d], weight [V, d], labels [1, T]) for every way this machine has."""
    out = {"whole": lambda h, w, y: causal_lm_loss(F.linear(h, w), y)}
    for n in chunks:
        out[f"ours:{n}"] = lambda h, w, y, n=n: chunked_lm_loss(HeadInput(h, w), y, n)
    options = getattr(torch.nn, "LinearCrossEntropyOptions", None) or getattr(F, "LinearCrossEntropyOptions", None)
    if hasattr(F, "linear_cross_entropy") and options is not None:
        for n in chunks:
            out[f"torch:{n}"] = _on_flat(lambda h, w, t, n=n: F.linear_cross_entropy(
                h, w, t, ignore_index=-100, options=options(batch_chunk_size=n)))
    try:
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

        liger = LigerFusedLinearCrossEntropyLoss()
        out["liger"] = _on_flat(lambda h, w, t: liger(w, h, t))
    except Exception:  # not installed, or no GPU for its kernels: the row says it is missing
        pass
    return out


def _on_flat(loss):
    """A library's fused head + loss(hidden [T, d], weight [V, d], targets [T]) as a way: the flat
    hidden states and the weight in the head's dtype (`model.head_dtype`), the next-token targets
    (`model.next_token_targets`), autocast off inside."""
    def way(h, w, y):
        dtype = head_dtype(h, w)
        with torch.autocast(h.device.type, enabled=False):
            return loss(h.reshape(-1, h.shape[-1]).to(dtype), w.to(dtype), next_token_targets(y))
    return way


def run_once(fn, h, w, y, device: str, bf16: bool) -> tuple[float, int, float, tuple]:
    """(seconds, peak bytes above the inputs, loss, (grad hidden, grad weight)) of one forward and backward."""
    h.grad = w.grad = None
    cuda = device == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    t0 = time.perf_counter()
    with torch.autocast(device, dtype=torch.bfloat16, enabled=bf16):
        loss = fn(h, w, y)
    loss.backward()
    if cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    peak = torch.cuda.max_memory_allocated() - base if cuda else 0
    return seconds, peak, loss.item(), (h.grad.float(), w.grad.float())


def measure(shape: str, tokens: int, chunks: list[int], repeats: int, device: str, bf16: bool) -> list[dict]:
    d, vocab = SHAPES[shape]
    g = torch.Generator().manual_seed(0)
    h = torch.randn(1, tokens, d, generator=g).to(device).requires_grad_()
    w = (torch.randn(vocab, d, generator=g) * d ** -0.5).to(device).requires_grad_()
    y = torch.randint(0, vocab, (1, tokens), generator=g).to(device)
    fns = ways(chunks)
    rows = {name: {"shape": shape, "d": d, "vocab": vocab, "tokens": tokens, "way": name, "seconds": [],
                   "peak_bytes": 0, "error": None} for name in fns}
    ref = None
    for i in range(repeats + 1):  # the first round warms up
        for name, fn in fns.items():
            row = rows[name]
            if row["error"]:
                continue
            try:
                s, peak, loss, grads = run_once(fn, h, w, y, device, bf16)
            except Exception as err:  # out of memory, a kernel missing: the row says so
                row["error"] = f"{type(err).__name__}: {str(err).splitlines()[0][:300]}"
                if device == "cuda":
                    torch.cuda.empty_cache()
                continue
            if name == "whole" and ref is None:
                ref = (loss, grads)
            if i:
                row["seconds"].append(s)
            row["peak_bytes"] = max(row["peak_bytes"], peak)
            row["loss"] = loss
            if ref is not None:
                row["loss_rel_diff"] = abs(loss - ref[0]) / abs(ref[0])
                row["grad_rel_diff"] = max(((a - b).abs().max() / b.abs().max()).item() for a, b in zip(grads, ref[1]))
            del grads
    out = []
    for row in rows.values():
        if row["seconds"]:
            row["median_s"] = statistics.median(row["seconds"])
            row["peak_gib"] = row["peak_bytes"] / 2**30
        out.append(row)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", default="8B,1B")
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--chunks", default="1024,2048,4096")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--cpu-smoke", action="store_true", help="the tiny shape, 64 tokens, 2 repeats, on this CPU")
    p.add_argument("--out", required=True)
    a = p.parse_args()
    device = "cpu" if a.cpu_smoke else "cuda"
    if a.cpu_smoke:
        a.shapes, a.tokens, a.chunks, a.repeats = "tiny", 64, "16", 2
    card = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    rows = []
    for shape in a.shapes.split(","):
        rows += measure(shape, a.tokens, [int(c) for c in a.chunks.split(",")], a.repeats, device, bf16=True)
    doc = {"card": card, "torch": torch.__version__, "command": " ".join(sys.argv), "rows": rows}
    tmp = a.out + ".tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=1)
    os.replace(tmp, a.out)
    for r in rows:
        print(f"{r['shape']:>4} {r['way']:<12} " + (f"{1e3 * r['median_s']:8.2f} ms  {r['peak_gib']:6.2f} GiB  "
                                                  f"loss diff {r.get('loss_rel_diff', 0):.1e}  grad diff "
                                                  f"{r.get('grad_rel_diff', 0):.1e}" if r.get("median_s") else
                                                  f"failed: {r['error']}"), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
