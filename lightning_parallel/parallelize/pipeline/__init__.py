"""Pipeline parallelism: the model traced and cut into stages of blocks, micro-batches through a schedule.

:mod:`.config` (:class:`PipelineConfig`), :mod:`.split` (where to cut: balanced by parameters or measured time),
:mod:`.graph` (passes over the traced graph, trace diagnostics), :mod:`.build` (tracing and building the stages),
:mod:`.schedule` (torch's schedules by name, bubble shapes), :mod:`.stage_tensor` / :mod:`.stage_views`
(tensor parallelism inside traced stages), :mod:`.stage_boundary` (values crossing stages made contiguous).
The Lightning side (running a user's step through the schedule) is in
:mod:`lightning_parallel.strategies.components.pipeline`.
"""
