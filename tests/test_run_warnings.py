"""A run prints no warning its user cannot act on, and still prints the ones they can.

One real run shows the three lines every run printed (issue 58): `hetloco-ds train --nproc 3` of a
tied tiny LLaMA with `hetloco.replica_stages` [1, 2] (replica 1: two stages, so its tied weights
cross ranks), 2 steps, its WarmupCosineLR given fewer total steps than warm-up steps (a real
mistake DeepSpeed warns about). The in-process tests pin what removes each line down to the
message it removes.
"""
from __future__ import annotations

import logging

import pytest

import runs
from conftest import save_tiny_llama
from test_cli import tiny_tokenizer, write_config, write_text_folder

START = "Attempting to get learning rate from scheduler before it has started"
TOO_SHORT = "total_num_steps 2 is less than warmup_num_steps 4"


@pytest.fixture(scope="module")
def mixed_tied_run(tmp_path_factory):
    """(stdout, stderr) of that run, which must succeed."""
    root = tmp_path_factory.mktemp("run_warnings")
    save_tiny_llama(root / "hf", tied=True)
    tiny_tokenizer().save_pretrained(root / "hf")
    cfg = write_config(root / "cfg.json", {"hetloco.replica_stages": [1, 2], "scheduler.params.total_num_steps": 2,
                                           "scheduler.params.warmup_num_steps": 4})
    proc = runs.cli("train", "--nproc", 3, "--steps", 2, "--model", root / "hf", "--data",
                    write_text_folder(root / "data"), "--config", cfg, "--out", root / "out", cache=root / "cache")
    assert proc.returncode == 0, runs.explain(proc)
    return proc.stdout, proc.stderr


class Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


@pytest.fixture
def ds_log():
    """The messages DeepSpeed's logger lets through while the test runs (after its filters)."""
    from deepspeed.utils import logger

    handler = Records()
    logger.addHandler(handler)
    yield handler.messages
    logger.removeHandler(handler)


def test_a_run_does_not_warn_that_its_lr_scheduler_has_not_started(mixed_tied_run):
    """Neither the config check (launcher and ranks) nor DeepSpeed's engine (each rank) logs
    "learning rate from scheduler before it has started", while DeepSpeed's warning about the
    schedule itself still reaches the user. Breaks if the config check's probe scheduler or the
    filter on DeepSpeed's logger goes, or if the filter drops more than its one message."""
    out = "".join(mixed_tied_run)
    assert START not in out
    assert TOO_SHORT in out


def test_a_tied_model_across_stages_trains_without_the_c10d_autograd_warning(mixed_tied_run):
    """Synchronising the tied embedding and head across stages records no c10d::broadcast_ in
    autograd, so backward does not warn "an autograd kernel was not registered". Breaks if the
    adapter's `_synchronize_tied_weights` broadcasts the parameters with grad enabled."""
    assert "autograd kernel was not registered" not in "".join(mixed_tied_run)


def test_the_topology_line_of_mixed_depths_is_the_replicas_layout(mixed_tied_run):
    """With replica_stages [1, 2] the one "Using topology" line shows rank 0 as replica 0's only
    stage and ranks 1, 2 as replica 1's stages 0 and 1, not three one-stage replicas (the
    placeholder grid DeepSpeed builds before the replica's own). Breaks if the adapter hands
    DeepSpeed a topology that prints otherwise."""
    lines = [line for line in mixed_tied_run[0].splitlines() if line.startswith("Using topology:")]
    assert lines == ["Using topology: {ProcessCoord(pipe=0, data=0): 0, ProcessCoord(pipe=0, data=1): 1, "
                     "ProcessCoord(pipe=1, data=1): 2}"]


def test_the_scheduler_start_filter_drops_only_a_constructors_own_warning(ds_log):
    """DeepSpeed's warm-up schedulers ask themselves for the learning rate in their constructor:
    that warning is dropped, for each of them; asking a scheduler that has not stepped for its
    learning rate afterwards (a real mistake) still warns, and so does the constructor's warning
    about the schedule. Breaks if the filter drops the message wherever it comes from, or is gone."""
    import torch
    from deepspeed.runtime import lr_schedules

    import hetloco_ds.patches  # noqa: F401  (puts the filter on DeepSpeed's logger)

    opt = torch.optim.AdamW([torch.zeros(1, requires_grad=True)], lr=1e-3)
    cosine = lr_schedules.WarmupCosineLR(opt, total_num_steps=2, warmup_num_steps=4)
    lr_schedules.WarmupLR(opt, warmup_num_steps=4)
    lr_schedules.WarmupDecayLR(opt, total_num_steps=8, warmup_num_steps=4)
    assert ds_log == [TOO_SHORT]
    cosine.get_lr()
    assert ds_log == [TOO_SHORT, START]


@pytest.mark.parametrize("section", [
    {"type": "WarmupCosineLR", "params": {"total_num_steps": 8, "warmup_num_steps": 4}},
    {"type": "WarmupLR", "params": {"warmup_num_steps": 4}},
    {"type": "WarmupDecayLR", "params": {"total_num_steps": 8, "warmup_num_steps": 4}},
    {"type": "OneCycle", "params": {"cycle_min_lr": 1e-4, "cycle_max_lr": 1e-3}},
    {"type": "LRRangeTest", "params": {}},
], ids=lambda s: s["type"])
def test_the_config_check_builds_its_probe_scheduler_without_a_warning(section, ds_log, monkeypatch):
    """`config.check_scheduler` builds each DeepSpeed scheduler once to run its checks; on its own
    (without the adapter's filter, as `plan --config` runs it) that logs nothing: not "before it
    has started", nor OneCycle's "SGD does not support momentum". Breaks if the probe is built at
    iteration -1 or on an optimizer the run does not use."""
    from deepspeed.utils import logger

    from hetloco_ds.config import check_scheduler

    monkeypatch.setattr(logger, "filters", [])
    assert check_scheduler(section, "cfg.json") == section
    assert ds_log == []
