"""Pure module transforms ``(module, mesh or group, options) -> module``; no Lightning, no Hydra.

One subpackage per parallelism, each owning its transforms and nothing else:

* :mod:`.data` — data parallelism: DDP (replicated), FSDP2 / HSDP (sharded), periodic synchronisation,
  gradient sums over a group, batch statistics (SyncBatchNorm, refusals).
* :mod:`.tensor` — tensor parallelism: plans (data, inference from the model, published ``_tp_plan``),
  applying them with DTensor, fused projections, sequence parallelism, DTensor rules for CPU attention.
* :mod:`.expert` — expert parallelism: a Mixture-of-Experts layer's routed experts divided by expert index over
  the ``ep`` ranks (borrowed from data parallelism), tokens dispatched and combined by all-to-all.
* :mod:`.context` — context parallelism: the sequence split at the model call, ring attention, ops along
  the sequence made global or refused.
* :mod:`.pipeline` — pipeline parallelism: the split into stages, tracing and building them, schedules,
  tensor parallelism inside traced stages, values crossing stage boundaries.
* :mod:`.placement` — models bigger than one device: meta-device construction recorded and replayed per
  rank, only this rank's shards materialised.
* :mod:`.common` — what several parallelisms share: the trunk of blocks, activation checkpointing,
  ``torch.compile`` per block, gradient norms over shards, capturing a step's model call.

Subpackages depend only on those listed before them (``common`` first, then data, tensor, expert, context,
pipeline, placement); ``tests/unit/test_import_layers.py`` enforces it.
"""
