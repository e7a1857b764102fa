"""Data parallelism: every replica trains on its own rows and gradients are averaged.

:mod:`.replicated` (DDP and :class:`DataParallelConfig`), :mod:`.sharded` (FSDP2 / HSDP), :mod:`.periodic_sync`
(local SGD / DiLoCo-style synchronisation), :mod:`.grad_sync` (gradient sums over a process group, used by
pipelines too), :mod:`.batchnorm` (batch statistics across replicas: SyncBatchNorm, and the refusals).
"""
