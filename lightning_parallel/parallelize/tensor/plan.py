"""The data of a tensor-parallel plan: style names, a plan bound to a module, and each style's torch form.

:data:`STYLES` lists the names a plan may use, :class:`ResolvedPlan` is a plan bound to one module, and
:func:`parallel_style` turns one style name into the torch ``ParallelStyle`` that ``parallelize_module``
applies. Kept apart from :mod:`~lightning_parallel.parallelize.tensor.apply` (resolving and applying plans) so
that :mod:`~lightning_parallel.parallelize.tensor.sequence` and :mod:`~lightning_parallel.parallelize.pipeline.stage_tensor`
can use a plan without importing the module that uses them. No Lightning here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cache, partial
from typing import TYPE_CHECKING

from torch import nn

from lightning_parallel.parallelize.tensor.wrapped import WrappedProjection, wrapped_styles

if TYPE_CHECKING:
    from torch.distributed.tensor import Placement
    from torch.distributed.tensor.parallel import ParallelStyle

#: Style names a plan may use, with what they do.
STYLES: dict[str, str] = {
    "colwise": "Linear split along output features (input replicated, output sharded)",
    "colwise_gather_output": "Linear split along output features, output gathered whole (e.g. an output head, tied or not)",
    "fused_qkv": "fused q|k|v projection: each block split by whole heads (k/v may have fewer heads: GQA)",
    "fused_gate_up": "fused gate|up projection: each half split along output features",
    "fused_blocks": "fused projection of equal blocks, each as wide as the input of the row-wise projection closing "
    "its region (a short convolution's B|C|x): each block split along output features",
    "channelwise": "depthwise convolution (groups = channels) inside a split region: weight and bias split over the "
    "channels with the projections around it, its channel counts divided",
    "colwise_gather_input": "Linear split along output features (per head) reading every head's values: an input "
    "arriving as this rank's slice is all-gathered first (Doge's dt_proj)",
    "rowwise": "Linear split along input features (input sharded, output all-reduced)",
    "embedding_rowwise": "Embedding split over the vocabulary (output all-reduced)",
    "vocab_parallel": "another name for embedding_rowwise",
    "loss_parallel": "output head split over the vocabulary; training_step gets vocabulary-sharded logits for "
    "F.cross_entropy, computed without gathering them (torch loss_parallel); evaluation gets whole logits",
    "experts": "a MoE block's grouped experts (3-D gate_up_proj/down_proj): every expert's hidden units split, "
    "gate|up column-wise in blocks, down row-wise, output all-reduced (routing stays replicated)",
    "state_space": "a Mamba-1/Mamba-2 mixer (set on the mixer): its inner channels / heads split, in_proj by blocks, "
    "the convolution channelwise, per-channel parameters on dim 0, x_proj and out_proj row-wise (tensor.state_space)",
    "replicate": "kept whole on every rank (explicit no-op)",
}
#: Other names for styles; a resolved plan holds only the names they stand for.
STYLE_ALIASES: dict[str, str] = {"vocab_parallel": "embedding_rowwise"}


@dataclass(frozen=True)
class ResolvedPlan:
    """A plan bound to one module: FQN -> style, plus the attention modules whose head counts shrink.

    Attributes:
        styles: Module name -> style.
        head_attributes: Attention module name -> attributes divided by the TP degree (``config.x``: on a
            copy of the module's config).
        fused: Fused projection name -> sizes of its blocks along the output features.
        sources: Module name -> where its entry came from (``"inferred"``, ``"model's tp_plan"``, ``"plan"``).
        conv1d: Split modules that are transformers' ``Conv1D`` (weight stored ``[in, out]``).
        heads: Fused q/k/v projection name -> ``(query heads, key/value heads)``: each rank gets whole heads
            of both, so both must divide by the TP degree.
        kept_whole: Module name -> why the automatic plan leaves it whole at this TP degree (printed).
        per_head: Split attention module name -> its own parameters holding one entry per head along dim 0
            (attention sinks, per-head gate biases): sharded on dim 0 like the heads.
        latent: Split attention module name -> its latent down projections left replicated (multi-head latent
            attention's ``q_a_proj``, ``kv_a_proj_with_mqa``): the region computes partial-sum gradients
            (:mod:`~lightning_parallel.parallelize.tensor.latent`).
        multi_query: Fused q|k|v projections with one key/value head: queries split by heads, the k/v head's
            features split and gathered whole after the projection (:mod:`~lightning_parallel.parallelize.tensor.multi_query`).
        wrapped: Split projection name -> how it is wrapped with adapters (peft's LoRA layers): ``styles`` name the
            projections as before wrapping; the base layer splits so, its adapters with it
            (:mod:`~lightning_parallel.parallelize.tensor.wrapped`).
    """

    styles: dict[str, str]
    head_attributes: dict[str, tuple[str, ...]]
    fused: dict[str, tuple[int, ...]] = field(default_factory=dict)
    sources: dict[str, str] = field(default_factory=dict)
    conv1d: frozenset[str] = frozenset()
    heads: dict[str, tuple[int, int]] = field(default_factory=dict)
    kept_whole: dict[str, str] = field(default_factory=dict)
    per_head: dict[str, tuple[str, ...]] = field(default_factory=dict)
    latent: dict[str, tuple[str, ...]] = field(default_factory=dict)
    multi_query: frozenset[str] = frozenset()
    wrapped: dict[str, WrappedProjection] = field(default_factory=dict)

    def module_styles(self) -> dict[str, str]:
        """``styles`` by the names of the modules that split in the model as it is (a wrapped projection's base layer
        and adapters in place of the projection)."""
        return wrapped_styles(self.styles, self.wrapped)

    def describe(self) -> str:
        """One line per split module, e.g. ``blocks.0.attn.q_proj → colwise  (inferred)``, then what stays whole and why."""
        lines = []
        for fqn, style in self.styles.items():
            if style == "replicate":
                continue
            blocks = f" blocks {'|'.join(map(str, self.fused[fqn]))}" if fqn in self.fused else ""
            blocks += " (one k/v head, gathered)" if fqn in self.multi_query else ""
            source = f"  ({self.sources[fqn]})" if fqn in self.sources else ""
            lines.append(f"{fqn} → {style}{blocks}{source}")
        lines += [f"{fqn} is wrapped with adapters: {', '.join(f'{name[len(fqn) + 1:]} → {style}' for name, style in found.styles(fqn, self.styles[fqn]).items())}"
                  for fqn, found in self.wrapped.items()]
        lines += [f"{fqn}.{attr} ÷ tp" for fqn, attrs in self.head_attributes.items() for attr in attrs]
        lines += [f"{fqn}.{name} → per head (dim 0)" for fqn, names in self.per_head.items() for name in names]
        lines += [f"{fqn} stays replicated: latent projection, gradients summed over tp"
                  for names in self.latent.values() for fqn in names]
        if not lines:
            lines.append("(nothing split)")
        lines += [f"{fqn} stays whole: {why}" for fqn, why in self.kept_whole.items()]
        return "\n".join(lines)


def parallel_style(style: str, *, rowwise_output: Placement | None = None, conv1d: bool = False) -> ParallelStyle | None:
    """The torch ``ParallelStyle`` that splits one module by ``style``; ``None`` for ``"replicate"``, ``"experts"``,
    ``"channelwise"`` and ``"state_space"``.

    Args:
        style: A name from :data:`STYLES` (aliases accepted).
        rowwise_output: Layout of a ``"rowwise"`` layer's output (other styles ignore it). ``None`` keeps
            torch's default, replicated (an all-reduce); sequence parallelism passes ``Shard(sequence_dim)``
            inside the trunk (a reduce-scatter into sequence shards).
        conv1d: The module is transformers' ``Conv1D`` (weight stored ``[in, out]``), not ``nn.Linear``.

    Raises:
        ValueError: ``style`` is not a style name.
    """
    # Imported here: torch.distributed.tensor.parallel is only needed once a plan is applied.
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    style = STYLE_ALIASES.get(style, style)
    colwise, rowwise = _conv1d_styles() if conv1d else (ColwiseParallel, RowwiseParallel)
    if style in ("colwise", "fused_qkv", "fused_gate_up", "fused_blocks", "colwise_gather_input"):
        # Fused projections are reordered rank-major first (fused.py): a plain column split then gives
        # each rank its part of every block.
        return colwise()
    if style == "colwise_gather_output":
        return colwise(output_layouts=Replicate())
    if style == "rowwise":
        return rowwise() if rowwise_output is None else rowwise(output_layouts=rowwise_output)
    if style == "embedding_rowwise":
        # The embedding's input (token ids) is whole on every rank, and so is its summed output.
        return RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
    if style == "loss_parallel":
        # The logits stay a vocabulary-sharded DTensor, which torch's loss_parallel needs for cross-entropy.
        return ColwiseParallel(use_local_output=False)
    if style in ("replicate", "experts", "channelwise", "state_space"):
        # experts are split by parallelize.tensor.experts, depthwise convolutions by parallelize.tensor.channels,
        # state-space mixers by parallelize.tensor.state_space, not by a torch ParallelStyle
        return None
    raise ValueError(f"Style {style!r} is unknown. Choose one of: {', '.join(STYLES)}.")


def _conv1d_partition(weight_placement: Placement, bias_placement: Placement, name: str, module: nn.Module, mesh) -> None:
    from torch.distributed.tensor import distribute_tensor

    for param_name, param in list(module.named_parameters(recurse=False)):
        placement = weight_placement if param_name == "weight" else bias_placement
        placed = distribute_tensor(param, mesh, [placement], src_data_rank=None)
        module.register_parameter(param_name, nn.Parameter(placed, requires_grad=param.requires_grad))


def _conv1d_style(base: type, weight_placement: Placement, bias_placement: Placement, input_layout: Placement) -> type:
    """A torch ``ParallelStyle`` for transformers' ``Conv1D`` (``x @ W + b`` with ``W: [in, out]``).

    torch's styles accept only ``nn.Linear``; ``Conv1D`` is the same map with the weight transposed, so
    the weight is split along the other dimension. Its forward runs on DTensors (``addmm``, ``view`` with
    whole sizes) between the style's input and output conversions.
    """
    from torch.distributed.tensor import distribute_module

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        self.desired_input_layouts = (input_layout,)
        return distribute_module(
            module,
            device_mesh,
            partial(_conv1d_partition, weight_placement, bias_placement),
            partial(self._prepare_input_fn, self.input_layouts, self.desired_input_layouts),
            partial(self._prepare_output_fn, self.output_layouts, self.use_local_output),
        )

    return type(f"Conv1D{base.__name__}", (base,), {"_apply": _apply, "__doc__": _conv1d_style.__doc__})


@cache
def _conv1d_styles() -> tuple[type, type]:
    """Column- and row-wise styles for ``Conv1D``, built once (on first use: torch's parallel styles are heavy)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return (
        _conv1d_style(ColwiseParallel, Shard(1), Shard(0), Replicate()),
        _conv1d_style(RowwiseParallel, Shard(0), Replicate(), Shard(-1)),
    )
