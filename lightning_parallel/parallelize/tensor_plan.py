"""The data of a tensor-parallel plan: style names, a plan bound to a module, and each style's torch form.

:data:`STYLES` lists the names a plan may use, :class:`ResolvedPlan` is a plan bound to one module, and
:func:`parallel_style` turns one style name into the torch ``ParallelStyle`` that ``parallelize_module``
applies. Kept apart from :mod:`~lightning_parallel.parallelize.tensor` (resolving and applying plans) so
that :mod:`~lightning_parallel.parallelize.sequence` and :mod:`~lightning_parallel.parallelize.stage_tensor`
can use a plan without importing the module that uses them. No Lightning here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch.distributed.tensor import Placement
    from torch.distributed.tensor.parallel import ParallelStyle

#: Style names a plan may use, with what they do.
STYLES: dict[str, str] = {
    "colwise": "Linear split along output features (input replicated, output sharded)",
    "rowwise": "Linear split along input features (input sharded, output all-reduced)",
    "embedding_rowwise": "Embedding split over the vocabulary (output all-reduced)",
    "vocab_parallel": "another name for embedding_rowwise",
    "loss_parallel": "output head split over the vocabulary; training_step gets vocabulary-sharded logits for "
    "F.cross_entropy, computed without gathering them (torch loss_parallel); evaluation gets whole logits",
    "replicate": "kept whole on every rank (explicit no-op)",
}
#: Other names for styles; a resolved plan holds only the names they stand for.
STYLE_ALIASES: dict[str, str] = {"vocab_parallel": "embedding_rowwise"}


@dataclass(frozen=True)
class ResolvedPlan:
    """A plan bound to one module: FQN -> style, plus the attention modules whose head counts shrink."""

    styles: dict[str, str]
    head_attributes: dict[str, tuple[str, ...]]

    def describe(self) -> str:
        """One line per split module, e.g. ``blocks.0.attn.q_proj → colwise``."""
        lines = [f"{fqn} → {style}" for fqn, style in self.styles.items() if style != "replicate"]
        lines += [f"{fqn}.{attr} ÷ tp" for fqn, attrs in self.head_attributes.items() for attr in attrs]
        return "\n".join(lines) if lines else "(nothing split)"


def parallel_style(style: str, *, rowwise_output: Placement | None = None) -> ParallelStyle | None:
    """The torch ``ParallelStyle`` that splits one module by ``style``; ``None`` for ``"replicate"``.

    Args:
        style: A name from :data:`STYLES` (aliases accepted).
        rowwise_output: Layout of a ``"rowwise"`` layer's output (other styles ignore it). ``None`` keeps
            torch's default, replicated (an all-reduce); sequence parallelism passes ``Shard(sequence_dim)``
            inside the trunk (a reduce-scatter into sequence shards).

    Raises:
        ValueError: ``style`` is not a style name.
    """
    # Imported here: torch.distributed.tensor.parallel is only needed once a plan is applied.
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    style = STYLE_ALIASES.get(style, style)
    if style == "colwise":
        return ColwiseParallel()
    if style == "rowwise":
        return RowwiseParallel() if rowwise_output is None else RowwiseParallel(output_layouts=rowwise_output)
    if style == "embedding_rowwise":
        # The embedding's input (token ids) is whole on every rank, and so is its summed output.
        return RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
    if style == "loss_parallel":
        # The logits stay a vocabulary-sharded DTensor, which torch's loss_parallel needs for cross-entropy.
        return ColwiseParallel(use_local_output=False)
    if style == "replicate":
        return None
    raise ValueError(f"Style {style!r} is unknown. Choose one of: {', '.join(STYLES)}.")
