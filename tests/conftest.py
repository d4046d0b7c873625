"""Shared fixtures: tiny LLaMA checkpoints saved the way users have them (save_pretrained)."""
from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def tiny_llama_config(tied: bool = False, layers: int = 4, vocab: int = 96):
    from transformers import LlamaConfig

    cfg = LlamaConfig(
        vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        tie_word_embeddings=tied, rms_norm_eps=1e-5,
    )
    cfg._attn_implementation = "sdpa"
    return cfg


def save_tiny_llama(path, tied: bool = False, layers: int = 4, seed: int = 0, vocab: int = 96):
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(tiny_llama_config(tied, layers, vocab)).float()
    # Non-trivial norm weights so a dropped or misplaced norm shows up in the comparison.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    model.save_pretrained(path)
    return model


@pytest.fixture(scope="session")
def hf_untied(tmp_path_factory):
    path = tmp_path_factory.mktemp("hf_untied")
    save_tiny_llama(path, tied=False)
    return str(path)


@pytest.fixture(scope="session")
def hf_tied(tmp_path_factory):
    path = tmp_path_factory.mktemp("hf_tied")
    save_tiny_llama(path, tied=True)
    return str(path)


@pytest.fixture(scope="session")
def tiny_jobs(tmp_path_factory):
    """tests/runs.py's job: `.inputs(layout)` (model, data, config, token cache) and
    `.reference(layout)` -> (inputs, directory of one uninterrupted 2-rank run: what faulted,
    resumed and otherwise launched runs must reproduce), run on first use of each layout."""
    import runs
    from distributed import run_job
    from test_cli import save_tiny_hf_with_tokenizer, write_config, write_text_folder

    root = tmp_path_factory.mktemp("tiny_jobs")
    hf, data = save_tiny_hf_with_tokenizer(root / "hf"), write_text_folder(root / "data")
    done: dict = {}

    class Jobs:
        @staticmethod
        def inputs(layout: str) -> dict:
            return {"hf": hf, "data": data, "config": write_config(root / f"{layout}.json", runs.LAYOUTS[layout]),
                    "cache": root / "cache", "layout": layout}

        @staticmethod
        def reference(layout: str):
            if layout not in done:
                inputs, out = Jobs.inputs(layout), root / f"reference_{layout}"
                # As torchrun starts it (test_launchers: the same job as --nproc 2), forked: fast.
                run_job(root / f"reference_{layout}.log", 2, runs.train_args(inputs, out), runs.env(inputs["cache"]))
                done[layout] = (inputs, out)
            return done[layout]

    return Jobs
