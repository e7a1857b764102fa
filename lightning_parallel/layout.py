"""How ranks are arranged: data × tensor × pipeline parallel sizes, validated against the world size.

The mesh dimension order is fixed as ``(pp, dp, tp)``: tensor-parallel peers get adjacent ranks (so TP
stays inside a node, where the fast links are), data-parallel replicas come next, pipeline stages are
outermost (their point-to-point traffic is the lightest). No Lightning here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

#: Mesh dimension names, outermost first.
MESH_DIM_NAMES: tuple[str, str, str] = ("pp", "dp", "tp")

_FIELD_BY_DIM = {"pp": "pipeline_parallel_size", "dp": "data_parallel_size", "tp": "tensor_parallel_size"}


class RankCoordinates(NamedTuple):
    """Where one global rank sits in the mesh."""

    pp: int
    dp: int
    tp: int


@dataclass(frozen=True)
class ParallelLayout:
    """Sizes of the three parallel dimensions.

    Exactly one size may be ``-1``, meaning "all remaining ranks"; :meth:`resolve` fills it in once the
    world size is known. A size of 1 switches that kind of parallelism off.

    Args:
        data_parallel_size: Number of model replicas that see different data.
        tensor_parallel_size: Number of ranks that split each layer's weights.
        pipeline_parallel_size: Number of pipeline stages.

    Example:
        >>> ParallelLayout(data_parallel_size=-1, tensor_parallel_size=2).resolve(8)
        ParallelLayout(data_parallel_size=4, tensor_parallel_size=2, pipeline_parallel_size=1)
    """

    data_parallel_size: int = -1
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{f.name} must be an int, got {value!r} ({type(value).__name__}).")
            if value == 0 or value < -1:
                raise ValueError(f"{f.name}={value} is invalid: use a positive size, or -1 to fill the remaining ranks.")
        filled = [f.name for f in fields(self) if getattr(self, f.name) == -1]
        if len(filled) > 1:
            raise ValueError(
                f"Only one size may be -1 (fill the remaining ranks), but {' and '.join(filled)} both are. "
                f"Give all but one of them an explicit size."
            )

    @property
    def is_resolved(self) -> bool:
        """Whether every size is known (no ``-1`` left)."""
        return -1 not in self.sizes

    @property
    def sizes(self) -> tuple[int, int, int]:
        """Sizes in mesh order ``(pp, dp, tp)``."""
        return (self.pipeline_parallel_size, self.data_parallel_size, self.tensor_parallel_size)

    @property
    def world_size(self) -> int:
        """Number of ranks this layout occupies."""
        self._require_resolved("world_size")
        return math.prod(self.sizes)

    def describe(self) -> str:
        """Short human-readable form, e.g. ``dp=2 × tp=2 × pp=1``."""
        return " × ".join(f"{dim}={getattr(self, _FIELD_BY_DIM[dim])}" for dim in ("dp", "tp", "pp"))

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
        fixed = math.prod(size for size in self.sizes if size != -1)
        # Sizes of 1 multiply nothing: leave them out of the message.
        terms = [f"{_FIELD_BY_DIM[dim]}={size}" for dim, size in zip(MESH_DIM_NAMES, self.sizes) if size not in (-1, 1)]
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
        if world_size % fixed != 0:
            missing = next(f.name for f in fields(self) if getattr(self, f.name) == -1)
            raise ValueError(
                f"{missing}=-1 cannot be filled: the world size {where} is not divisible by {product} = {fixed}. "
                f"Use a world size that is a multiple of {fixed}."
            )
        filled = {f.name: (world_size // fixed if getattr(self, f.name) == -1 else getattr(self, f.name)) for f in fields(self)}
        return ParallelLayout(**filled)

    def coordinates(self, rank: int) -> RankCoordinates:
        """Mesh coordinates of a global rank (row-major over ``(pp, dp, tp)``, as DeviceMesh lays them out)."""
        self._require_resolved("coordinates")
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank={rank} is outside the layout's {self.world_size} ranks.")
        pp, rest = divmod(rank, self.data_parallel_size * self.tensor_parallel_size)
        dp, tp = divmod(rest, self.tensor_parallel_size)
        return RankCoordinates(pp=pp, dp=dp, tp=tp)

    def group_ranks(self, dim: str, rank: int) -> list[int]:
        """Global ranks that share ``rank``'s coordinates in every dimension except ``dim``."""
        if dim not in MESH_DIM_NAMES:
            raise ValueError(f"dim={dim!r} is not a mesh dimension; choose one of {MESH_DIM_NAMES}.")
        coords = self.coordinates(rank)._asdict()
        ranks = []
        for index in range(getattr(self, _FIELD_BY_DIM[dim])):
            coords[dim] = index
            ranks.append((coords["pp"] * self.data_parallel_size + coords["dp"]) * self.tensor_parallel_size + coords["tp"])
        return ranks

    def build_mesh(self, device_type: str, data_parallel_shard_size: int = 1) -> DeviceMesh:
        """Create the DeviceMesh; the default process group must already exist.

        Its dimensions are ``(pp, dp_replicate, dp_shard, tp)``, with ``dp`` the two data-parallel
        dimensions (``dp_replicate × dp_shard = data_parallel_size``, shard ranks adjacent) also available
        flattened through :func:`data_parallel_mesh`; ``mesh["dp_replicate", "dp_shard"]`` is what hybrid
        sharding (HSDP) replicates and shards over.

        Raises:
            ValueError: ``data_parallel_shard_size`` does not divide ``data_parallel_size``.
        """
        from torch.distributed.device_mesh import init_device_mesh

        self._require_resolved("build_mesh")
        if data_parallel_shard_size < 1 or self.data_parallel_size % data_parallel_shard_size != 0:
            raise ValueError(
                f"data_parallel_shard_size={data_parallel_shard_size} must divide data_parallel_size="
                f"{self.data_parallel_size} (replicas × shards = data-parallel ranks)."
            )
        shape = (
            self.pipeline_parallel_size,
            self.data_parallel_size // data_parallel_shard_size,
            data_parallel_shard_size,
            self.tensor_parallel_size,
        )
        mesh = init_device_mesh(device_type, shape, mesh_dim_names=("pp", "dp_replicate", "dp_shard", "tp"))
        data_parallel_mesh(mesh)  # creates its process group now, while every rank is here
        return mesh


    def _require_resolved(self, what: str) -> None:
        if not self.is_resolved:
            raise RuntimeError(f"ParallelLayout.{what} needs resolved sizes; call resolve(world_size) first ({self}).")


def data_parallel_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The 1-D mesh of all data-parallel ranks (``dp_replicate × dp_shard`` flattened; created once, then cached)."""
    return mesh["dp_replicate", "dp_shard"]._flatten("dp")
