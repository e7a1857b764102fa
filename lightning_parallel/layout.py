"""How ranks are arranged: one layout of named mesh axes, validated against the world size. No Lightning here.

The axes, outermost first, are ``(pp, dp_replicate, dp_shard, cp, tp)``: tensor-parallel peers get adjacent
ranks (so TP stays inside a node, where the fast links are), context-parallel peers come next (also inside a
node: ring attention passes keys and values every layer), then the data-parallel ranks (those sharding one
replica adjacent), and pipeline stages outermost (their point-to-point traffic is the lightest).
``dp`` names ``dp_replicate × dp_shard`` flattened: every rank holding a different slice of the batch.

A new dimension is one more axis here (its size field, its place in :data:`AXES`) plus the component that
uses it; everything that walks the axes (coordinates, groups, the mesh, checkpoint metadata) follows.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

#: Mesh axes, outermost first (row-major rank order, as DeviceMesh lays them out).
AXES: tuple[str, ...] = ("pp", "dp_replicate", "dp_shard", "cp", "tp")

#: Names that address several axes at once, flattened in mesh order. ``dp_cp``: every rank holding a replica
#: of the same parameters (context-parallel peers hold the same weights and see other parts of one sequence);
#: ``dp_shard_cp``: the ranks that shard one replica's state under context parallelism.
FLATTENED_AXES: dict[str, tuple[str, ...]] = {
    "dp": ("dp_replicate", "dp_shard"),
    "dp_cp": ("dp_replicate", "dp_shard", "cp"),
    "dp_shard_cp": ("dp_shard", "cp"),
}

#: The user-facing size of each dimension (``dp`` is split in replicate × shard by the data-parallel mode).
SIZE_FIELDS: dict[str, str] = {
    "pp": "pipeline_parallel_size",
    "dp": "data_parallel_size",
    "cp": "context_parallel_size",
    "tp": "tensor_parallel_size",
}

#: Kept for callers of the three-axis layout: the dimensions a rank has a coordinate in.
MESH_DIM_NAMES: tuple[str, ...] = ("pp", "dp", "cp", "tp")


class RankCoordinates(NamedTuple):
    """Where one global rank sits: its index along each dimension (``dp`` flattened over replicate × shard)."""

    pp: int
    dp: int
    cp: int
    tp: int


@dataclass(frozen=True)
class ParallelLayout:
    """Sizes of the parallel dimensions.

    Exactly one of the four sizes may be ``-1``, meaning "all remaining ranks"; :meth:`resolve` fills it
    in once the world size is known. A size of 1 switches that kind of parallelism off.

    Args:
        data_parallel_size: Ranks that see different data (model replicas, or shards of one).
        tensor_parallel_size: Ranks that split each layer's weights.
        pipeline_parallel_size: Pipeline ranks.
        context_parallel_size: Ranks that split each sequence (context parallelism: ring attention).
        data_parallel_shard_size: Of the data-parallel ranks, how many shard one replica's state (1:
            replicate; ``data_parallel_size``: fully sharded; in between: hybrid sharding). Must divide
            ``data_parallel_size``; the data-parallel mode sets it.
        expert_parallel_size: Of the data-parallel ranks, how many divide a Mixture-of-Experts layer's experts
            among them (expert parallelism borrows its ranks from data parallelism: the world size does not
            change). Must divide ``data_parallel_size``; adjacent data-parallel ranks form one group.

    Example:
        >>> ParallelLayout(data_parallel_size=-1, tensor_parallel_size=2).resolve(8).describe()
        'dp=4 × tp=2 × pp=1'
    """

    data_parallel_size: int = -1
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    context_parallel_size: int = 1
    data_parallel_shard_size: int = 1
    expert_parallel_size: int = 1

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{f.name} must be an int, got {value!r} ({type(value).__name__}).")
            if value == 0 or value < -1 or (value == -1 and f.name in ("data_parallel_shard_size", "expert_parallel_size")):
                raise ValueError(f"{f.name}={value} is invalid: use a positive size, or -1 to fill the remaining ranks.")
        filled = [name for name in SIZE_FIELDS.values() if getattr(self, name) == -1]
        if len(filled) > 1:
            raise ValueError(
                f"Only one size may be -1 (fill the remaining ranks), but {' and '.join(filled)} both are. "
                f"Give all but one of them an explicit size."
            )
        dp, shard = self.data_parallel_size, self.data_parallel_shard_size
        if dp != -1 and dp % shard != 0:
            raise ValueError(
                f"data_parallel_shard_size={shard} must divide data_parallel_size={dp} (replicas × shards = "
                "data-parallel ranks)."
            )
        ep = self.expert_parallel_size
        if dp != -1 and dp % ep != 0:
            raise ValueError(
                f"expert_parallel_size={ep} must divide data_parallel_size={dp}: expert parallelism borrows its ranks "
                f"from data parallelism. Use an expert_parallel_size that divides {dp}, or more data-parallel ranks."
            )

    # ------------------------------------------------------------------ sizes

    @property
    def is_resolved(self) -> bool:
        """Whether every size is known (no ``-1`` left)."""
        return all(getattr(self, name) != -1 for name in SIZE_FIELDS.values())

    def size(self, axis: str) -> int:
        """The size of a mesh axis (:data:`AXES`) or of a flattened one (``dp``)."""
        if axis in SIZE_FIELDS:
            return getattr(self, SIZE_FIELDS[axis])
        if axis == "dp_shard":
            return self.data_parallel_shard_size
        if axis == "dp_replicate":
            self._require_resolved("size('dp_replicate')")
            return self.data_parallel_size // self.data_parallel_shard_size
        raise ValueError(f"axis={axis!r} is not a mesh axis; choose one of {', '.join((*AXES, *FLATTENED_AXES))}.")

    @property
    def axis_sizes(self) -> dict[str, int]:
        """Every mesh axis's size, outermost first."""
        return {axis: self.size(axis) for axis in AXES}

    @property
    def sizes(self) -> tuple[int, ...]:
        """Sizes in rank order ``(pp, dp, cp, tp)`` (``dp`` flattened)."""
        return tuple(self.size(dim) for dim in MESH_DIM_NAMES)

    @property
    def world_size(self) -> int:
        """Number of ranks this layout occupies."""
        self._require_resolved("world_size")
        return math.prod(self.sizes)

    def describe(self) -> str:
        """Short human-readable form, e.g. ``dp=2 × tp=2 × pp=1`` (``cp`` shown when used)."""
        dims = ["dp", "cp", "tp", "pp"] if self.context_parallel_size != 1 else ["dp", "tp", "pp"]
        text = " × ".join(f"{dim}={self.size(dim)}" for dim in dims)
        return text if self.expert_parallel_size == 1 else f"{text} (ep={self.expert_parallel_size} of dp)"

    def with_data_parallel_shard_size(self, shard_size: int) -> ParallelLayout:
        """This layout with ``shard_size`` of its data-parallel ranks sharding each replica."""
        return replace(self, data_parallel_shard_size=shard_size)

    def resolve(self, world_size: int, world_description: str | None = None) -> ParallelLayout:
        """Fill a ``-1`` size and check that the layout uses exactly ``world_size`` ranks.

        Args:
            world_size: Number of processes in the job.
            world_description: How the world size came about (e.g. ``"devices=2 × num_nodes=1"``), quoted in
                errors so the user knows which setting to change.

        Raises:
            ValueError: If the sizes cannot fill ``world_size`` ranks exactly.
        """
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}.")
        where = f"{world_size} ({world_description})" if world_description else str(world_size)
        sizes = {name: getattr(self, name) for name in SIZE_FIELDS.values()}
        fixed = math.prod(size for size in sizes.values() if size != -1)
        # Sizes of 1 multiply nothing: leave them out of the message.
        terms = [f"{name}={size}" for name, size in sizes.items() if size not in (-1, 1)]
        product = " × ".join(terms) or "all sizes 1"
        if fixed > world_size:
            raise ValueError(
                f"The layout needs at least {product} = {fixed} ranks, but the world size is {where}. "
                f"Launch {fixed} processes (e.g. trainer.devices={fixed}) or lower the parallel sizes."
            )
        if self.is_resolved:
            if fixed != world_size:
                raise ValueError(
                    f"The layout {product} = {fixed} ranks does not match the world size {where}. "
                    f"Make the product equal the world size, or set data_parallel_size=-1 to use the remaining ranks."
                )
            return self
        missing = next(name for name, size in sizes.items() if size == -1)
        if world_size % fixed != 0:
            raise ValueError(
                f"{missing}=-1 cannot be filled: the world size {where} is not divisible by {product} = {fixed}. "
                f"Use a world size that is a multiple of {fixed}."
            )
        return replace(self, **{missing: world_size // fixed})  # __post_init__ checks the filled sizes again

    # ------------------------------------------------------------------ ranks

    def axis_coordinates(self, rank: int) -> dict[str, int]:
        """A global rank's index along every mesh axis (row-major over :data:`AXES`)."""
        self._require_resolved("coordinates")
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank={rank} is outside the layout's {self.world_size} ranks.")
        coordinates: dict[str, int] = {}
        for axis in reversed(AXES):
            rank, coordinates[axis] = divmod(rank, self.size(axis))
        return {axis: coordinates[axis] for axis in AXES}

    def coordinates(self, rank: int) -> RankCoordinates:
        """A global rank's ``(pp, dp, cp, tp)`` coordinates (``dp`` over replicate × shard, shard fastest)."""
        axes = self.axis_coordinates(rank)
        dp = axes["dp_replicate"] * self.data_parallel_shard_size + axes["dp_shard"]
        return RankCoordinates(pp=axes["pp"], dp=dp, cp=axes["cp"], tp=axes["tp"])

    def group_ranks(self, axis: str, rank: int) -> list[int]:
        """Global ranks that share ``rank``'s coordinates on every axis except ``axis`` (or a flattened one)."""
        varying = FLATTENED_AXES.get(axis, (axis,))
        if any(name not in AXES for name in varying):
            raise ValueError(f"axis={axis!r} is not a mesh axis; choose one of {', '.join((*AXES, *FLATTENED_AXES))}.")
        coordinates = self.axis_coordinates(rank)
        groups = [dict(coordinates)]
        for name in varying:  # outer axis first: ranks come out in increasing order
            groups = [{**c, name: index} for c in groups for index in range(self.size(name))]
        return [self.rank_of(c) for c in groups]

    def rank_of(self, coordinates: Mapping[str, int]) -> int:
        """The global rank at ``coordinates`` (an index along every axis of :data:`AXES`)."""
        rank = 0
        for axis in AXES:
            rank = rank * self.size(axis) + coordinates[axis]
        return rank

    def build_mesh(self, device_type: str) -> DeviceMesh:
        """Create the DeviceMesh over :data:`AXES` (the default process group must already exist).

        ``dp`` (replicate × shard flattened) is created too, while every rank is here: see
        :func:`data_parallel_mesh`. ``mesh["dp_replicate", "dp_shard"]`` is what hybrid sharding (HSDP)
        replicates and shards over. With context parallelism, ``dp_cp`` and ``dp_shard_cp`` too (see
        :func:`replica_mesh`).
        """
        from torch.distributed.device_mesh import init_device_mesh

        self._require_resolved("build_mesh")
        mesh = init_device_mesh(device_type, tuple(self.axis_sizes.values()), mesh_dim_names=AXES)
        data_parallel_mesh(mesh)
        if self.context_parallel_size > 1:
            for name in ("dp_cp", "dp_shard_cp"):
                mesh[FLATTENED_AXES[name]]._flatten(name)
        return mesh

    # ------------------------------------------------------------------ (de)serialisation

    def to_dict(self) -> dict[str, int]:
        """The sizes by dimension name, as checkpoint metadata and the planner record them."""
        return {"pp": self.pipeline_parallel_size, "dp": self.data_parallel_size, "cp": self.context_parallel_size,
                "tp": self.tensor_parallel_size, "dp_shard": self.data_parallel_shard_size,
                "ep": self.expert_parallel_size}

    @classmethod
    def from_dict(cls, sizes: Mapping[str, Any]) -> ParallelLayout:
        """The layout :meth:`to_dict` wrote (older checkpoints' ``{pp, dp, tp}`` too: unsharded, no cp)."""
        return cls(
            data_parallel_size=int(sizes.get("dp", 1)),
            tensor_parallel_size=int(sizes.get("tp", 1)),
            pipeline_parallel_size=int(sizes.get("pp", 1)),
            context_parallel_size=int(sizes.get("cp", 1)),
            data_parallel_shard_size=int(sizes.get("dp_shard", 1)),
            expert_parallel_size=int(sizes.get("ep", 1)),
        )

    def _require_resolved(self, what: str) -> None:
        if not self.is_resolved:
            raise RuntimeError(f"ParallelLayout.{what} needs resolved sizes; call resolve(world_size) first ({self}).")


def data_parallel_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The 1-D mesh of all data-parallel ranks (``dp_replicate × dp_shard`` flattened; created once, then cached)."""
    return mesh["dp_replicate", "dp_shard"]._flatten("dp")


def expert_meshes(mesh: DeviceMesh, expert_parallel_size: int) -> tuple[DeviceMesh, DeviceMesh]:
    """``(ep, replicas)``: the 1-D meshes of the ranks dividing one set of experts (adjacent data-parallel ranks)
    and of the ranks holding the same experts (every ``expert_parallel_size``-th data-parallel rank).

    The data-parallel mesh is unflattened into ``(dp / ep, ep)`` (created once, then cached by torch).
    """
    dp_mesh = data_parallel_mesh(mesh)
    # DeviceMesh._unflatten is private (checked against torch 2.13); torchtitan builds its expert meshes the same way.
    split = dp_mesh._unflatten(0, (dp_mesh.size() // expert_parallel_size, expert_parallel_size), ("ep_replicas", "ep"))
    return split["ep"], split["ep_replicas"]


def replica_mesh(mesh: DeviceMesh, sharded: bool = False) -> DeviceMesh:
    """The ranks that hold replicas of the same parameters and average their gradients.

    Data-parallel ranks, and context-parallel peers too (same weights, other parts of each sequence: their
    gradients are partial sums, see :mod:`lightning_parallel.parallelize.context.splitter`). ``sharded``: the 2-D
    ``(dp_replicate, dp_shard[×cp])`` mesh FSDP2 replicates and shards over (context-parallel peers shard one
    replica's state, as torchtitan does); otherwise the 1-D mesh of them all (DDP's group).
    """
    context_parallel = "cp" in (mesh.mesh_dim_names or ()) and mesh["cp"].size() > 1
    if sharded:
        return mesh["dp_replicate", "dp_shard_cp" if context_parallel else "dp_shard"]
    return mesh["dp_cp"] if context_parallel else data_parallel_mesh(mesh)
