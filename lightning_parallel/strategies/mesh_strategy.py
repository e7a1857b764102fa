"""A Lightning strategy that launches the processes and builds the DeviceMesh of a ParallelLayout.

It knows nothing of the parallelisms themselves: :class:`~lightning_parallel.strategies.engine.ParallelEngineStrategy`
builds on it and says how many data-parallel ranks shard one replica, what a layout must satisfy, and
which process-group backends its options allow.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.utilities.distributed import (
    _get_default_process_group_backend_for_device,
    _init_dist_connection,
)
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.accelerators import Accelerator
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_only
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch.distributed.device_mesh import DeviceMesh
from typing_extensions import override

from lightning_parallel.checkpoint.io import ParallelCheckpointIO
from lightning_parallel.layout import (
    ParallelLayout,
    RankCoordinates,
    data_parallel_mesh,
    replica_mesh,
)
from lightning_parallel.strategies.collectives import GroupCollectivesMixin
from lightning_parallel.strategies.launch import (
    START_METHODS,
    StartMethod,
    as_timedelta,
    elastic_restart_store,
    make_launcher,
)

#: Process-group timeout when none is given: long enough for slow first steps, short enough to not hang a job.
DEFAULT_TIMEOUT_S = 1800.0


class MeshStrategy(GroupCollectivesMixin, ParallelStrategy):
    """Processes, the process group and the layout's DeviceMesh; collectives over the data-parallel group.

    Args:
        layout: Parallel sizes; ``-1`` in one of them fills the remaining ranks.
        start_method: ``"popen"``, ``"spawn"`` or ``"fork"`` (see :func:`~lightning_parallel.strategies.launch.make_launcher`).
        process_group_backend: ``None`` picks nccl on CUDA and gloo on CPU.
        timeout: Seconds (or a ``timedelta``) a collective may wait before the job fails instead of hanging.
        accelerator, parallel_devices, cluster_environment, checkpoint_io, precision_plugin: As for
            Lightning's strategies (``checkpoint_io`` defaults to ``ParallelCheckpointIO``: atomic files).
    """

    def __init__(
        self,
        layout: ParallelLayout | None = None,
        *,
        start_method: StartMethod = "popen",
        process_group_backend: str | None = None,
        timeout: float | timedelta = DEFAULT_TIMEOUT_S,
        accelerator: Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
    ) -> None:
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io if checkpoint_io is not None else ParallelCheckpointIO(),
            precision_plugin=precision_plugin,
        )
        if start_method not in START_METHODS:
            raise ValueError(f"start_method={start_method!r} is unknown; choose one of {', '.join(START_METHODS)}.")
        layout = layout if layout is not None else ParallelLayout()
        if not isinstance(layout, ParallelLayout):
            raise TypeError(f"layout must be a ParallelLayout, got {type(layout).__name__}.")
        self._timeout = as_timedelta(timeout)
        self._requested_layout = layout
        self._layout: ParallelLayout | None = None
        self._start_method = start_method
        self._process_group_backend = process_group_backend
        self._num_nodes = 1
        self._mesh: DeviceMesh | None = None
        self._data_parallel_group: dist.ProcessGroup | None = None

    # ------------------------------------------------------------------ what subclasses decide

    def _data_parallel_shard_size(self, layout: ParallelLayout, devices_per_node: int) -> int:
        """Of the layout's data-parallel ranks, how many shard one replica (1: replicate)."""
        return 1

    def _validate(self, layout: ParallelLayout) -> None:
        """Refuse, in the launching process, what this layout cannot run."""

    def _check_backend(self, backend: str) -> None:
        """Refuse a process-group backend the strategy's options cannot use."""

    # ------------------------------------------------------------------ properties

    @property
    @override
    def root_device(self) -> torch.device:
        if not self.parallel_devices:
            raise RuntimeError("The strategy has no devices yet; it is connected to them by the Trainer.")
        return self.parallel_devices[self.local_rank]

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._num_nodes = num_nodes

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def is_distributed(self) -> bool:
        """Whether more than one process takes part."""
        return self.num_nodes * self.num_processes > 1

    @property
    def process_group_backend(self) -> str | None:
        return self._process_group_backend

    @property
    def layout(self) -> ParallelLayout:
        """The resolved layout (known once the Trainer has connected the devices)."""
        if self._layout is None:
            raise RuntimeError("The layout is resolved when the Trainer is created; pass this strategy to a Trainer first.")
        return self._layout

    @property
    def coordinates(self) -> RankCoordinates:
        """This rank's ``(pp, dp, cp, tp)`` coordinates."""
        return self.layout.coordinates(self.global_rank)

    @property
    def device_mesh(self) -> DeviceMesh:
        """The DeviceMesh over the layout's axes (exists after the process group is set up)."""
        if self._mesh is None:
            raise RuntimeError("The device mesh is created in setup_environment(); it is not available yet.")
        return self._mesh

    @property
    def process_group_timeout(self) -> timedelta:
        """How long a collective may wait before the job fails instead of hanging."""
        return self._timeout

    @property
    def data_parallel_group(self) -> dist.ProcessGroup | None:
        """Process group of this rank's data-parallel replicas (``None`` before the mesh exists)."""
        if self._mesh is None:
            return None
        if self._data_parallel_group is None:
            # Once: flattening the mesh reads its rank table on the host, and this is asked for every logged value.
            self._data_parallel_group = data_parallel_mesh(self._mesh).get_group()
        return self._data_parallel_group

    @property
    def tensor_parallel_group(self) -> dist.ProcessGroup | None:
        """Process group of the ranks that split each layer (``None`` before the mesh exists)."""
        return self._mesh["tp"].get_group() if self._mesh is not None else None

    @property
    def context_parallel_group(self) -> dist.ProcessGroup | None:
        """Process group of the ranks that split each sequence (``None`` before the mesh exists)."""
        return self._mesh["cp"].get_group() if self._mesh is not None else None

    @property
    def replica_group(self) -> dist.ProcessGroup | None:
        """Process group of the ranks holding replicas of the same parameters, which average gradients: the
        data-parallel replicas and, under context parallelism, their cp peers (``None`` before the mesh exists)."""
        return replica_mesh(self._mesh).get_group() if self._mesh is not None else None

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # Replicas see different data; tensor-, context- and pipeline-parallel peers must see the same batch.
        return {"num_replicas": self.layout.data_parallel_size, "rank": self.coordinates.dp}

    def layout_for(self, world_size: int, devices_per_node: int, world_description: str | None = None) -> ParallelLayout:
        """The layout this strategy runs over ``world_size`` ranks, its data-parallel ranks split into replicas
        and shards as the data-parallel mode says (no process group needed: the planner asks too).

        Raises:
            ValueError: The sizes do not fit ``world_size``, or the shard size does not divide the replicas.
        """
        layout = self._requested_layout.resolve(world_size, world_description=world_description)
        return layout.with_data_parallel_shard_size(self._data_parallel_shard_size(layout, devices_per_node))

    # ------------------------------------------------------------------ launch and process groups

    @override
    def _configure_launcher(self) -> None:
        if self.cluster_environment is None:
            raise RuntimeError("The Trainer must connect a cluster environment before the launcher is configured.")
        # Validate here, in the launching process, so a bad layout fails once and before any process starts.
        world = self.num_nodes * self.num_processes
        self._layout = self.layout_for(world, self.num_processes, f"trainer devices={self.num_processes} × num_nodes={self.num_nodes}")
        self._validate(self._layout)
        self._launcher = make_launcher(self, self._start_method, self.cluster_environment)

    @override
    def setup_environment(self) -> None:
        self._prepare_process()
        self._init_process_group()
        self._build_mesh()

    def _prepare_process(self) -> None:
        """Before any process group: the device, the seed, this process's rank and the backend to use."""
        super().setup_environment()
        reset_seed()
        self.set_world_ranks()
        self._process_group_backend = self._process_group_backend or _get_default_process_group_backend_for_device(
            self.root_device
        )
        self._check_backend(self._process_group_backend)

    def _init_process_group(self) -> None:
        """Join the default process group (every rank of the job)."""
        device_id = self.root_device if self.root_device.type != "cpu" else None
        store = elastic_restart_store(self.cluster_environment.world_size(), self._timeout)
        _init_dist_connection(
            self.cluster_environment, self._process_group_backend, timeout=self._timeout, device_id=device_id,
            **({"store": store} if store is not None else {}),
        )

    def _build_mesh(self) -> None:
        """Resolve the layout over the process group's ranks and build its DeviceMesh."""
        layout = self._layout = self.layout_for(dist.get_world_size(), self.num_processes, "processes in the default process group")
        self._mesh = layout.build_mesh(self.root_device.type)
        self._data_parallel_group = None
        expected = layout.axis_coordinates(self.global_rank)
        found = {axis: self._mesh[axis].get_local_rank() for axis in expected}
        if found != expected:
            # The sampler and the collectives rely on the layout's rank arithmetic matching the mesh.
            raise RuntimeError(
                f"Rank {self.global_rank}: mesh coordinates {found} differ from the layout's {expected}; the "
                "process group's ranks are not numbered as the launcher assigned them."
            )
        rank_zero_info(f"lightning_parallel: layout {layout.describe()} on {self._process_group_backend}")

    def set_world_ranks(self) -> None:
        """Tell the cluster environment this process's global rank and the world size."""
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank

    @classmethod
    def register_as(cls, registry: Any, name: str, description: str, **init_params: Any) -> None:
        """Register ``cls`` under ``name`` in a Lightning strategy registry, once."""
        if name not in registry:
            registry.register(name, cls, description=description, **init_params)
