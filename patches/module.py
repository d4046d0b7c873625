"""DeepSpeed's PipelineModule with its layer build and stage partition as hooks, plus the two
DeepSpeed conventions other code must follow: per-layer seeding and checkpoint file names."""
from __future__ import annotations

import functools

from deepspeed.pipe import PipelineModule
from deepspeed.runtime import utils as ds_utils
from torch import nn

from .checks import check_instance


def seed_layer(base_seed: int, layer_idx: int) -> None:
    """Seed every RNG as PipelineModule._build does before building layer `layer_idx` with
    `seed_layers=True`, so a model built without DeepSpeed (the simulator) is the same model."""
    ds_utils.set_random_seed(base_seed + layer_idx)


def layer_checkpoint_name(layer_idx: int) -> str:
    """File name of layer `layer_idx`'s state in a DeepSpeed pipeline checkpoint tag directory
    (PipelineModule.ckpt_layer_path without tensor parallelism)."""
    return f"layer_{layer_idx:02d}-model_states.pt"


class PipelineModuleAdapter(PipelineModule):
    """Subclasses implement `stage_parts`, and may replace `build_layers`."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        check_instance(self, "PipelineModule")
        # Seeding was for construction only; forward() would otherwise reseed every layer call.
        self.seed_layers = False

    # ---------------------------------------------------------- hooks
    def stage_parts(self) -> list[int]:
        """Layer-list boundaries: stage s builds layers [parts[s], parts[s + 1])."""
        raise NotImplementedError

    def build_layers(self) -> None:
        """Build this stage's layers (DeepSpeed's build by default)."""
        PipelineModule._build(self)

    # ---------------------------------------------------------- reads of DeepSpeed state
    @property
    def coord(self):
        """(pipe, data) coordinate of this rank: its stage and its replica."""
        return self._topo.get_coord(self.global_rank)

    def local_layers(self) -> dict[int, nn.Module]:
        """Layer index -> module, for the layers this stage holds (the tied head: its module)."""
        layers = {}
        for i, f in enumerate(self.forward_funcs):
            module = f.args[0] if isinstance(f, functools.partial) else f  # tied head: partial(fn, module)
            if isinstance(module, nn.Module):
                layers[self._local_start + i] = module
        return layers

    def checkpoint_layers(self) -> dict[int, nn.Module]:
        """Layer index -> module, for the layer files DeepSpeed's save_state_dict writes on this
        stage (a tied head is a function over another stage's module: no file of its own)."""
        return {self._local_start + i: f for i, f in enumerate(self.forward_funcs) if isinstance(f, nn.Module)}

    def tied_copy_owned(self, param, global_rank: int) -> bool:
        """False for a tied copy held by a stage that is not its owner (counted once in norms)."""
        for d in self.tied_comms.values():
            if global_rank != min(d["ranks"]) and any(param is p for p in d["module"].parameters()):
                return False
        return True

    # ---------------------------------------------------------- DeepSpeed's private methods
    def _build(self):
        self.build_layers()

    def _partition_layers(self, method="uniform"):
        # DeepSpeed reads `parts` elsewhere (stage_owner, to place tied layers).
        self.parts = self.stage_parts()
        stage = self.coord.pipe
        self._set_bounds(start=self.parts[stage], stop=self.parts[stage + 1])
