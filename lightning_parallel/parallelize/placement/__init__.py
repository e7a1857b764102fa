"""Models bigger than one device: built on the meta device, only this rank's part materialised.

:mod:`.deferred_record` records the creations a module's ``__init__`` makes (parameters, buffers, tensors
set later), :mod:`.deferred_replay` replays them for the shards a rank holds, :mod:`.deferred_init` drives it
(and pretrained weights read slice by slice).
"""
