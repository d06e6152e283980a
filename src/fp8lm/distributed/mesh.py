"""`ParallelDims`: how a run's ranks split into pipeline stages, data-parallel replicas and shards,
and tensor-parallel groups, and the one ``DeviceMesh`` built from it (as torchtitan's
``ParallelDims``).

The mesh's dimensions, outermost first: ``pp`` (pipeline stages), ``dp_replicate`` (data-parallel
replicas, each holding the whole model state of its stage: FP8 data parallelism or DDP),
``dp_shard`` (data-parallel ranks that shard the model state: FSDP2 or FP8 ZeRO) and ``tp``
(tensor + sequence parallel ranks, consecutive so that they share a node). Every dimension is in
the mesh, size 1 included, so code asks ``mesh["tp"]`` without knowing the layout.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

__all__ = ["ParallelDims", "ParallelMesh", "MESH_DIMS"]

MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "tp")


@dataclass(frozen=True)
class ParallelDims:
    """Sizes of the mesh's dimensions; their product is the world size."""

    pp: int = 1
    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1

    def __post_init__(self) -> None:
        for name in MESH_DIMS:
            size = getattr(self, name)
            if not (isinstance(size, int) and size >= 1):
                raise ValueError(f"ParallelDims.{name} must be an integer >= 1, got {size!r}")

    @classmethod
    def for_world(cls, world: int, *, tp: int = 1, pp: int = 1, shard: bool = False) -> ParallelDims:
        """The dims of ``world`` ranks split into ``pp`` stages of ``tp`` ranks each, the rest
        data-parallel: sharding the state (``shard``: FSDP2, FP8 ZeRO) or replicating it."""
        if world % (tp * pp):
            raise ValueError(
                f"{world} ranks cannot be split into model replicas of tp {tp} x pp {pp} = {tp * pp} ranks: launch "
                f"a multiple of {tp * pp} ranks (world size = dp x tp x pp)"
            )
        dp = world // (tp * pp)
        return cls(pp=pp, dp_replicate=1 if shard else dp, dp_shard=dp if shard else 1, tp=tp)

    @property
    def world(self) -> int:
        return math.prod(getattr(self, name) for name in MESH_DIMS)

    @property
    def dp(self) -> int:
        """Data-parallel degree: the number of different batches a step sees."""
        return self.dp_replicate * self.dp_shard

    def coordinates(self, rank: int) -> dict[str, int]:
        """``rank``'s index along each dimension (row-major over `MESH_DIMS`, as the mesh)."""
        out = {}
        for name in reversed(MESH_DIMS):
            size = getattr(self, name)
            out[name] = rank % size
            rank //= size
        return {name: out[name] for name in MESH_DIMS}

    def dp_rank(self, rank: int) -> int:
        """``rank``'s data-parallel index: which batches it draws (the ranks of one model replica
        draw the same)."""
        c = self.coordinates(rank)
        return c["dp_replicate"] * self.dp_shard + c["dp_shard"]

    def build_mesh(self, device_type: str) -> ParallelMesh:
        """The run's mesh; every rank calls it once (it creates the process groups)."""
        return ParallelMesh.build(self, device_type)

    def describe(self) -> str:
        """One line for the run's output: the dimensions larger than 1."""
        parts = [f"{name} {getattr(self, name)}" for name in MESH_DIMS if getattr(self, name) > 1]
        return " x ".join(parts) or "one process"


@dataclass(frozen=True)
class ParallelMesh:
    """The run's ``DeviceMesh`` over `MESH_DIMS` (``mesh["tp"]``, ``mesh["pp"]``, ...) with two
    flattened views kept beside it: ``dp`` (replicate x shard: every data-parallel rank of a model
    part) and ``model`` (pp x dp_shard x tp: the ranks that together hold one copy of the model
    state, over which a gradient norm is summed)."""

    dims: ParallelDims
    root: DeviceMesh
    dp: DeviceMesh
    model: DeviceMesh

    @classmethod
    def build(cls, dims: ParallelDims, device_type: str) -> ParallelMesh:
        root = init_device_mesh(device_type, tuple(getattr(dims, n) for n in MESH_DIMS), mesh_dim_names=MESH_DIMS)
        dp = root["dp_replicate", "dp_shard"]._flatten("dp")
        model = root["pp", "dp_shard", "tp"]._flatten("model")
        return cls(dims, root, dp, model)

    def __getitem__(self, name: str) -> DeviceMesh:
        return self.root[name]

    def mesh(self, name: str) -> DeviceMesh:
        """The 1-D mesh of dimension ``name``, or of the flattened ``dp`` / ``model``."""
        return self.dp if name == "dp" else self.model if name == "model" else self.root[name]

    def group(self, name: str):
        """The process group of `mesh` ``name``."""
        return self.mesh(name).get_group()

    def expert_groups(self, ep: int, over: str = "dp") -> tuple:
        """Expert parallelism over the data-parallel ranks of each pipeline stage and tensor-parallel
        rank (dimension ``over``: ``dp``, or the one of ``dp_replicate`` / ``dp_shard`` larger than 1):
        the group of this rank's ``ep`` consecutive data-parallel ranks at its stage and ``tp``
        place, which exchange tokens, and the group of its experts' replicas (the ranks at its place
        in the other such groups; None when there is one group)."""
        dp = self.dims.dp
        if ep == dp:
            return self.group(over), None
        shape = (self.dims.pp, dp // ep, ep, self.dims.tp)
        names = ("ep_pp", "ep_replicate", "ep", "ep_tp")
        experts = init_device_mesh(self.root.device_type, shape, mesh_dim_names=names)
        return experts.get_group("ep"), experts.get_group("ep_replicate")

    def expert_model_group(self, ep: int):
        """Under expert parallelism without sharding (dp_shard = 1), the ranks that together hold
        one copy of the model: at this rank's place among the expert groups, every stage's ``ep``
        ranks of every ``tp`` place (the group over which a gradient norm adds up; each rank holds
        its experts and 1/tp of the tensor-parallel weights)."""
        pp, dp, tp = self.dims.pp, self.dims.dp, self.dims.tp
        ranks = torch.arange(self.dims.world).reshape(pp, dp // ep, ep, tp).transpose(0, 1)
        names = ("ep_replicate", "ep_pp", "ep", "ep_tp")
        mesh = DeviceMesh(self.root.device_type, ranks, mesh_dim_names=names)
        return mesh["ep_pp", "ep", "ep_tp"]._flatten("ep_model").get_group()

    def clip_options(self) -> dict:
        """`fp8lm.clip_grad_norm_`'s ``group`` and ``stage_size`` for gradients laid out on this mesh."""
        return {"group": self.model.get_group(), "stage_size": self.dims.dp_shard * self.dims.tp}
