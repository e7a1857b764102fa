"""What several parallelisms share: the trunk of repeated blocks (:mod:`.trunk`), activation checkpointing,
``torch.compile`` per block, gradient norms and clipping over sharded parameters, capturing a step's model call.
Nothing here knows about a particular parallelism."""
