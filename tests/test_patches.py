"""The DeepSpeed adapter (hetloco_ds.patches) refuses to run against a DeepSpeed whose internals moved."""
from __future__ import annotations

import subprocess
import sys

import pytest


def test_adapter_check_passes_on_the_installed_deepspeed():
    from hetloco_ds import patches

    patches.check()


def test_adapter_check_fails_when_an_overridden_name_is_gone(monkeypatch):
    """A renamed `_exec_send_grads` would leave our override silently unused: the check names it."""
    from deepspeed.runtime.pipe.engine import PipelineEngine

    from hetloco_ds import patches

    monkeypatch.delattr(PipelineEngine, "_exec_send_grads")
    with pytest.raises(patches.DeepSpeedMismatch, match=r"PipelineEngine\._exec_send_grads is gone.*0\.19\.8"):
        patches.check()


def test_adapter_check_fails_when_a_signature_changes(monkeypatch):
    from deepspeed.runtime.pipe.engine import PipelineEngine

    from hetloco_ds import patches

    monkeypatch.setattr(PipelineEngine, "_exec_recv_grads", lambda self, buffer_id, stream: None)
    with pytest.raises(patches.DeepSpeedMismatch, match=r"_exec_recv_grads takes \('self', 'buffer_id', 'stream'\)"):
        patches.check()


def test_adapter_check_fails_when_an_instance_attribute_is_gone():
    from hetloco_ds import patches

    class Engine:
        pipe_buffers = total_loss = None

    with pytest.raises(patches.DeepSpeedMismatch, match=r"no longer have \['grad_layer'\]"):
        patches.check_instance(Engine(), "PipelineEngine")


def test_importing_the_adapter_runs_the_check():
    """The check runs at import, before any engine exists: importing hetloco_ds.patches against a
    DeepSpeed without `PipelineModule._partition_layers` fails with one line naming it."""
    code = ("import deepspeed.runtime.pipe.module as m; del m.PipelineModule._partition_layers; "
            "import hetloco_ds.patches")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "DeepSpeedMismatch" in proc.stderr and "PipelineModule._partition_layers is gone" in proc.stderr
