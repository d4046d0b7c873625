"""One replica's pipeline grid in a static world whose replicas have their own depths.

DeepSpeed's PipelineParallelGrid is one M x S grid over the whole world: every replica has S
stages, and its data-parallel group (a stage's replicas) is where DeepSpeed broadcasts the
initial weights. With `hetloco.replica_stages` mixed, the replicas' stages hold different layers,
so no DeepSpeed collective may cross replicas. `ReplicaGrid` is DeepSpeed's grid object (its
methods are DeepSpeed's own) seen from one replica: a pipe x data topology of dims [S, 1] whose
ranks are the replica's global ranks, the pipe group the replica's ranks, the data-parallel and
slice groups this rank alone. The replicas meet only at the outer sync, in groups of their own
(`hetloco_ds.transport.static.block_groups`).

Group creation is collective over the whole world (torch's `new_group` without local
synchronisation): `replica_grid` creates every replica's groups, in replica order, on every
rank, and keeps its own replica's.
"""
from __future__ import annotations

from collections import namedtuple

from deepspeed.runtime.pipe.topology import PipeDataParallelTopology, PipelineParallelGrid, ProcessTopology

from .checks import check_instance

ProcessCoord = namedtuple("ProcessCoord", ("pipe", "data"))
"""As DeepSpeed's topologies print a rank's coordinate."""


class WorldTopology(PipeDataParallelTopology):
    """The valid one-stage grid over the world (pipe 1 x data W) that DeepSpeed's PipelineModule
    builds its grid from before `_partition_layers` puts the replica's own grid in its place
    (`module.PipelineModuleAdapter`). DeepSpeed's grid prints the topology it is given ("Using
    topology: ...", on rank 0), which would show every rank as stage 0 of a replica of its own;
    this one prints the world as `replica_ranks` lays it out, rank -> (pipe=stage, data=replica),
    in DeepSpeed's format, so the line agrees with `hetloco.replica_stages`."""

    def __init__(self, replica_ranks: list[list[int]]):
        super().__init__(num_pp=1, num_dp=sum(len(ranks) for ranks in replica_ranks))
        coords = {rank: ProcessCoord(pipe=s, data=m)
                  for m, ranks in enumerate(replica_ranks) for s, rank in enumerate(ranks)}
        self.layout = {coords[rank]: rank for rank in sorted(coords)}
        """(stage, replica) -> global rank, in rank order: what `__str__` prints."""

    def __str__(self):
        return str(self.layout)


class ReplicaTopology(ProcessTopology):
    """Axes pipe x data, dims [S, 1], over the replica's global `ranks` (stage order)."""

    def __init__(self, ranks: list[int]):
        super().__init__(axes=["pipe", "data"], dims=[len(ranks), 1])
        check_instance(self, "ProcessTopology")
        # Every query of ProcessTopology reads `mapping` (coordinate -> rank): global ranks throughout.
        self.mapping = {coord: ranks[local] for coord, local in self.mapping.items()}


class ReplicaGrid(PipelineParallelGrid):
    """PipelineParallelGrid of one replica (module docstring); built by `replica_grid`."""

    def __init__(self, ranks: list[int], replica: int, num_replicas: int, pipe_group, own_group,
                 tied_group=None):
        from deepspeed import comm as dist  # here: importing the adapter (the simulator does) loads no comm code

        # Not DeepSpeed's __init__, which builds an M x S grid: the attributes its methods read.
        self.global_rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self._topo = ReplicaTopology(ranks)
        self.replica_id, self.num_replicas = replica, num_replicas
        self.data_parallel_size, self.pipe_parallel_size = 1, len(ranks)
        self.model_parallel_size = self.slice_parallel_size = 1
        self.stage_id, self.data_parallel_id = ranks.index(self.global_rank), 0
        self.ds_model_proc_group, self.ds_model_world_size, self.ds_model_rank = pipe_group, len(ranks), self.stage_id
        self.dp_group, self.dp_groups, self.dp_proc_group = [self.global_rank], [[self.global_rank]], own_group
        self.is_first_stage = self.stage_id == 0
        self.is_last_stage = self.stage_id == len(ranks) - 1
        self.p2p_groups = [[r, ranks[(i + 1) % len(ranks)]] for i, r in enumerate(ranks)]
        self.pp_group, self.pp_proc_group = list(ranks), pipe_group
        self.slice_group, self.slice_proc_group = [self.global_rank], own_group
        self.tied_group = tied_group
        """The group of the replica's first and last stage (a tied model with S > 1), else None."""


def replica_grid(replica_ranks: list[list[int]], tied: bool, own_group) -> ReplicaGrid:
    """This rank's ReplicaGrid; `replica_ranks[m]`: replica m's global ranks by stage (the same
    list on every rank); `own_group`: a group of this rank alone. Collective: every rank creates,
    in this order, each replica's pipe group and, with `tied`, each multi-stage replica's
    first-last group."""
    from deepspeed import comm as dist

    me = dist.get_rank()
    pipes = [dist.new_group(ranks=ranks) for ranks in replica_ranks]
    tied_groups = [dist.new_group(ranks=[ranks[0], ranks[-1]]) if tied and len(ranks) > 1 else None
                   for ranks in replica_ranks]
    m = next(i for i, ranks in enumerate(replica_ranks) if me in ranks)
    return ReplicaGrid(replica_ranks[m], m, len(replica_ranks), pipes[m], own_group, tied_groups[m])
