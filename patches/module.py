"""DeepSpeed's PipelineModule with its layer build and stage partition as hooks, plus the two
DeepSpeed conventions other code must follow: per-layer seeding and checkpoint file names."""
from __future__ import annotations

import functools
import os

import torch
from deepspeed.pipe import PipelineModule, TiedLayerSpec
from deepspeed.runtime import utils as ds_utils
from torch import nn

from .checks import check_instance
from .grid import WorldTopology, replica_grid


def seed_layer(base_seed: int, layer_idx: int) -> None:
    """Seed every RNG as PipelineModule._build does before building layer `layer_idx` with
    `seed_layers=True`, so a model built without DeepSpeed (the simulator) is the same model."""
    ds_utils.set_random_seed(base_seed + layer_idx)


def layer_checkpoint_name(layer_idx: int) -> str:
    """File name of layer `layer_idx`'s state in a DeepSpeed pipeline checkpoint tag directory
    (PipelineModule.ckpt_layer_path without tensor parallelism)."""
    return f"layer_{layer_idx:02d}-model_states.pt"


class PipelineModuleAdapter(PipelineModule):
    """Subclasses implement `stage_parts`, and may replace `build_layers` and `sync_local_copies`.

    `replica_ranks` (each replica's global ranks by stage, the same list on every rank): the
    replicas have their own depths, and the module runs on its replica's `grid.ReplicaGrid`
    instead of DeepSpeed's M x S grid (`topology` is then ignored)."""

    def __init__(self, *args, replica_ranks: list[list[int]] | None = None, **kwargs):
        self._replica_ranks = replica_ranks
        if replica_ranks is not None:
            # DeepSpeed's __init__ builds a grid from `topology` before it partitions: a valid
            # one-stage grid over the world (its groups are made on every rank alike, then unused);
            # `_partition_layers`, called next, puts the replica's own grid in its place.
            kwargs["topology"] = WorldTopology(replica_ranks)
        super().__init__(*args, **kwargs)
        check_instance(self, "PipelineModule")
        if replica_ranks is not None:
            check_instance(self, "PipelineModule with a replica grid")
        # Seeding was for construction only; forward() would otherwise reseed every layer call.
        self.seed_layers = False

    # ---------------------------------------------------------- hooks
    def stage_parts(self) -> list[int]:
        """Layer-list boundaries: stage s builds layers [parts[s], parts[s + 1])."""
        raise NotImplementedError

    def build_layers(self) -> None:
        """Build this stage's layers (DeepSpeed's build by default)."""
        PipelineModule._build(self)

    def sync_local_copies(self) -> None:
        """After DeepSpeed synchronised the tied weights across stages (at build and after a
        load): make copies this stage holds twice equal (nothing by default)."""

    # ---------------------------------------------------------- reads of DeepSpeed state
    @property
    def replica(self) -> tuple[int, int]:
        """(this rank's replica, the number of replicas in the world)."""
        if self._replica_ranks is not None:
            return self._grid.replica_id, self._grid.num_replicas
        return self._grid.data_parallel_id, self._grid.data_parallel_size

    def replica_ranks(self) -> list[list[int]]:
        """Every replica of the world, as its global ranks by stage."""
        if self._replica_ranks is not None:
            return [list(r) for r in self._replica_ranks]
        return [[self._grid.stage_to_global(s, data=m) for s in range(self.num_stages)]
                for m in range(self._grid.data_parallel_size)]

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

    def load_layer_files(self, directory: str, read) -> None:
        """This stage's layers from their files in `directory`, each read by `read(path)`, then the
        tied weights synchronised: what DeepSpeed's `load_state_dir` does, whose checkpoint engine
        unpickles with weights_only=False (any function a file names is called) and reads every
        file twice."""
        for idx, layer in self.checkpoint_layers().items():
            layer.load_state_dict(read(os.path.join(directory, layer_checkpoint_name(idx))), strict=True)
        self._synchronize_tied_weights()

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
        if self._replica_ranks is not None:
            tied = any(isinstance(s, TiedLayerSpec) for s in self._layer_specs)
            # The one-stage grid DeepSpeed just built gives each rank a group of its own (its slice group).
            self._grid = replica_grid(self._replica_ranks, tied, self._grid.get_slice_parallel_group())
            self._topo = self._grid.topology()
            self.num_stages, self.stage_id = self._grid.pipe_parallel_size, self._grid.stage_id
        # DeepSpeed reads `parts` elsewhere (stage_owner, to place tied layers).
        self.parts = self.stage_parts()
        stage = self.coord.pipe
        self._set_bounds(start=self.parts[stage], stop=self.parts[stage + 1])

    def _index_tied_modules(self):
        if self._replica_ranks is None:
            return PipelineModule._index_tied_modules(self)
        # The replica's grid made the first-last group of every replica (collectively); DeepSpeed's
        # indexing would make groups only for its own. The tied layers sit on the replica's first
        # and last stage (the embedding and its head replica); S = 1 holds both itself.
        group, ranks = self._grid.tied_group, [self._grid.pp_group[0], self._grid.pp_group[-1]]
        if group is None or self.global_rank not in ranks:  # a middle stage holds no tied module
            return {}
        keys = sorted(set(s.key for s in self._layer_specs if isinstance(s, TiedLayerSpec)))
        assert len(keys) == 1, f"one tied module expected across a replica's stages, got {keys}"
        comms = {keys[0]: {"ranks": ranks, "group": group, "weight_attr": self.tied_weight_attrs[keys[0]],
                           "module": self.tied_modules[keys[0]]}}
        if self.global_rank != ranks[0]:  # as DeepSpeed: the owner counts the tied module once
            for p in self.tied_modules[keys[0]].parameters():
                p.ds_pipe_replicated = True
        return comms

    def _synchronize_tied_weights(self):
        # Without grad: DeepSpeed broadcasts the tied parameters themselves (not their `.data`), an
        # in-place c10d::broadcast_ on tensors that require grad, which torch's autograd fallback
        # records; every later backward through the tied weight then warned "c10d::broadcast_: an
        # autograd kernel was not registered to the Autograd key(s)". Copying a weight from its
        # owner stage is set-up, not something to differentiate.
        with torch.no_grad():
            PipelineModule._synchronize_tied_weights(self)
            self.sync_local_copies()
