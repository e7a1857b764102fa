"""The pipeline in Lightning: the component (:mod:`.component`), the runner that drives a user's step methods
through the schedule (:mod:`.runner`), and micro-batch cutting, padding and combining (:mod:`.microbatches`)."""

from lightning_parallel.strategies.components.pipeline.component import PipelineComponent

__all__ = ["PipelineComponent"]
