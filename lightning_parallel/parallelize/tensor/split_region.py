"""What runs between a region's column-wise and row-wise projections, on this rank's heads (or hidden units) only.

Between a column-split projection (q/k/v, an MLP's up projection) and the row-split one that closes the region
(o_proj, down_proj), each rank computes on its own slice: its heads, its hidden units. Modules there that keep
*replicated* parameters — per-head norms (Qwen3's and Gemma3's ``q_norm``/``k_norm`` over ``head_dim``), gates,
scales — are used on this rank's slice only, so the gradient each rank computes for them is a partial sum over
its slice: the whole gradient is the sum over the tensor-parallel group (Megatron reduces these "replicated in
the split region" parameters the same way). :class:`SplitRegionParameters` finds them by call order — a child
of the region called after a column-wise projection returned and before the row-wise one is called — and
:func:`reduce_split_region_gradients` all-reduces their gradients over the group after backward.

:func:`check_split_regions` refuses what cannot run on a slice at all, so that ``plan="auto"`` leaves those
attentions and MLPs whole (named with the reason) and an explicit plan stops with the reason:

- a norm (any child module with a parameter) whose width is a column projection's *whole* output width, unless it
  is an RMSNorm or LayerNorm by what it computes (OLMo2's ``q_norm`` over ``n_heads·head_dim``), whose statistic
  is then summed over the ranks (:mod:`~lightning_parallel.parallelize.tensor.split_norm`);
- a projection left replicated beside split ones in the same module, unless it is a latent down projection
  (multi-head latent attention's ``q_a_proj``/``kv_a_proj_with_mqa``, whose region then computes partial-sum
  gradients: :mod:`~lightning_parallel.parallelize.tensor.latent`): its output may reach each rank's heads without
  passing a split projection, so its gradient would be a partial sum that nothing reduces;
- a projection below another child of the region (not a direct child) writing a split projection's whole width,
  left replicated (Zamba2's per-depth LoRA adapters added to its shared block's q/k/v and gate|up outputs);
- a fused projection laid out in interleaved model-parallel groups (CodeGen's ``mp_num``) that the degree
  does not divide into whole groups.

No Lightning here.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from lightning_parallel import collectives
from lightning_parallel.parallelize.tensor.partial_gradients import (
    ScaleGradient,
    gradient_summed,
)
from lightning_parallel.parallelize.tensor.plan import ResolvedPlan
from lightning_parallel.parallelize.tensor.projections import features, is_projection
from lightning_parallel.parallelize.tensor.split_norm import (
    SplitWidthNorm,
    install_split_width_norms,
    recognise_norm,
)

#: Attributes of an attention module giving how many model-parallel groups its fused q/k/v rows are
#: interleaved in (CodeGen: ``mp_num`` blocks, each ``q_g | v_g | k_g`` for its heads).
INTERLEAVED_GROUP_ATTRIBUTES = ("mp_num",)

#: Styles that open a split region inside one module, and the one that closes it.
_OPENING = ("colwise", "fused_qkv", "fused_gate_up", "fused_blocks")
_CLOSING = ("rowwise",)


def _vector(param: Tensor) -> bool:
    """One value per feature, however shaped (ConvNeXt-V2's GRN keeps ``gamma`` as ``[1, 1, 1, C]``)."""
    return param.dim() >= 1 and param.numel() == max(param.shape)


def interleaved_groups(attention: nn.Module | None) -> int | None:
    """The number of model-parallel groups ``attention``'s fused q/k/v is interleaved in, or ``None``."""
    for attr in INTERLEAVED_GROUP_ATTRIBUTES:
        value = getattr(attention, attr, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 1:
            return value
    return None


def split_regions(resolved: ResolvedPlan) -> dict[str, tuple[list[str], list[str]]]:
    """``{module: (column-wise children, row-wise children)}`` for modules holding both (attention, MLP)."""
    return regions_of(resolved.styles)


def regions_of(styles: Mapping[str, str]) -> dict[str, tuple[list[str], list[str]]]:
    """:func:`split_regions` of a plan's ``{module: style}`` (before it is bound: while resolving it)."""
    regions: dict[str, tuple[list[str], list[str]]] = {}
    for fqn, style in styles.items():
        parent, _, child = fqn.rpartition(".")
        if parent and style in _OPENING + _CLOSING:
            opening, closing = regions.setdefault(parent, ([], []))
            (opening if style in _OPENING else closing).append(child)
    return {name: sides for name, sides in regions.items() if all(sides)}


def check_split_regions(module: nn.Module, resolved: ResolvedPlan, tp_size: int) -> None:
    """Refuse split regions that cannot compute on a slice (see the module docstring).

    Raises:
        ValueError: Naming the region, the module inside it and why; the fix is to leave the region replicated.
    """
    modules = dict(module.named_modules())
    regions = split_regions(resolved)
    # Also a row-wise projection's module: one left alone in a plan (its column-wise partners refused) would
    # read a replicated input as if it were split.
    split_in = {fqn.rpartition(".")[0] for fqn, style in resolved.styles.items() if style in _OPENING + _CLOSING}
    for name in sorted(split_in):
        region = modules[name]
        for child, sub in region.named_children():
            fqn = f"{name}.{child}" if name else child
            if is_projection(sub) and fqn not in resolved.styles and fqn not in resolved.latent.get(name, ()):
                split = ", ".join(c for c, s in resolved.styles.items() if c.rpartition(".")[0] == name)
                where = name or "the model"
                raise ValueError(
                    f"{fqn}: a projection left replicated inside {where}, whose {split} are split: its output can "
                    f"reach this rank's slice (heads) without passing a split projection (a rotary key shared by every "
                    f"head, as multi-head latent attention has), and its gradient would then be a partial sum. Split "
                    f"every projection of {where} or leave {where} replicated in the plan."
                )
    for name, (opening, _) in regions.items():
        # A projection below another child of the region (Zamba2's per-depth adapters beside its shared block's
        # projections) writing as many features as a split projection does is added to that projection's whole
        # output, which a rank holds a slice of.
        split_widths = {features(modules[f"{name}.{child}"])[1]: child for child in opening}
        inputs = {features(modules[f"{name}.{child}"])[0] for child in opening}
        for fqn, sub in modules[name].named_modules(prefix=name):
            # Also one split row-wise below it (a two-layer projector, tensor.projector), whose output is whole too,
            # where that width is not the region's input width (which it may be added to, as a residual).
            whole_output = fqn not in resolved.styles or (resolved.styles[fqn] == "rowwise" and features(sub)[1] not in inputs)
            if fqn.count(".") > name.count(".") + 1 - (not name) and is_projection(sub) and whole_output \
                    and features(sub)[1] in split_widths and not _within_any(fqn, resolved.styles):
                raise ValueError(
                    f"{fqn}: a projection left replicated below {name}, writing {features(sub)[1]} features as the split "
                    f"{name}.{split_widths[features(sub)[1]]} does: its whole output would meet that projection's "
                    f"slice on each rank. Leave {name} replicated in the plan."
                )
    for name, (opening, closing) in regions.items():
        inputs = {features(modules[f"{name}.{child}"])[0] for child in opening}
        outs = {child: features(modules[f"{name}.{child}"])[1] for child in closing}
        for child, out in outs.items():
            # Beside the row-wise projection that closes the region (to the model width, or to a stage's next
            # width: Hiera), another one to a narrower width is read inside the region.
            if len(outs) > 1 and out not in inputs and out < max(outs.values()):
                raise ValueError(
                    f"{name}.{child}: a row-wise projection to {out} features inside {name}, whose column-split "
                    f"projections read {'/'.join(map(str, sorted(inputs)))}: its output (summed over the ranks, so over "
                    f"every head) does not go back to the region's input width, so it is used inside {name} beside "
                    f"this rank's heads only (Doge's dt_proj, which mixes every head's values into each head's mask). "
                    f"Leave {name} replicated in the plan."
                )
    for name, (opening, _) in regions.items():
        region = modules[name]
        widths: dict[int, str] = {}
        for child in opening:
            widths.setdefault(features(modules[f"{name}.{child}"])[1], child)
        for block_owner in opening:
            for size in resolved.fused.get(f"{name}.{block_owner}", ()):
                widths.setdefault(size, block_owner)
        # A width that is also the region's input width may be a norm of the whole input (run before the split,
        # on every rank alike): only the call order tells, so SplitRegionParameters refuses that case at its call.
        inputs = {features(modules[f"{name}.{child}"])[0] for child in opening}
        for child, sub in region.named_children():
            if is_projection(sub) or f"{name}.{child}" in resolved.styles or f"{name}.{child}" in resolved.per_head:
                continue  # split itself, or sharded with the heads (per_head.find_per_head_children)
            if recognise_norm(sub) is not None:  # on meta too (recognised on a CPU copy)
                continue  # its statistic is summed over the ranks on a slice (split_norm.SplitWidthNorm)
            for pname, param in sub.named_parameters():
                if _vector(param) and param.numel() in widths and param.numel() not in inputs:
                    raise ValueError(
                        f"{name}.{child}.{pname}: its width {param.numel()} is the whole output width of the split "
                        f"{name}.{widths[param.numel()]} (a norm over all heads together, not per head): each rank "
                        f"holds 1/{tp_size} of that width, so the norm's statistic cannot be computed on a rank. "
                        f"Leave {name} replicated in the plan."
                    )
    for fqn, style in resolved.styles.items():
        parent = modules.get(fqn.rpartition(".")[0])
        groups = interleaved_groups(parent) if style in _OPENING else None
        if groups is not None and groups % tp_size:
            raise ValueError(
                f"{fqn}: its rows are interleaved in mp_num={groups} model-parallel groups, which "
                f"tensor_parallel_size={tp_size} cannot divide into whole groups per rank. Choose a "
                f"tensor_parallel_size that divides {groups}, or leave {fqn.rpartition('.')[0]} replicated in the plan."
            )


def _within_any(fqn: str, names: Mapping[str, str]) -> bool:
    """``fqn`` lies below a module the plan names (split by a style of its own: experts, a mixer)."""
    parts = fqn.split(".")
    return any(".".join(parts[:i]) in names for i in range(1, len(parts)))


class PartialSumParameters:
    """Replicated parameters whose gradient each rank of the tensor-parallel group computes as a partial sum.

    Found by :func:`reduce_split_region_gradients` under the module attribute ``_split_region_parameters``.

    Args:
        group: The tensor-parallel process group.
        name: The owning module's FQN, for messages.
        parameters: Returns the parameters, looked up when reduced (wrapping may replace them).
    """

    def __init__(self, group: dist.ProcessGroup, name: str, parameters: Callable[[], list[nn.Parameter]]) -> None:
        self.group, self.name, self._parameters = group, name, parameters

    def inside_parameters(self) -> list[nn.Parameter]:
        """The parameters whose gradients are partial sums after the last forward."""
        return self._parameters()


class SplitRegionParameters(PartialSumParameters):
    """Finds the replicated parameters a split region uses on this rank's slice, and sums their gradients.

    A child of the region that holds parameters (and is not one of the split projections) is *inside* when it is
    called after a column-wise projection of the region returned and before the row-wise one is called. Its
    parameters' gradients are then partial sums over this rank's slice; :func:`reduce_split_region_gradients`
    all-reduces them over the group once, after the last accumulated backward (as the strategy reduces the
    partial-sum gradients of sequence-parallel norms).

    A child called there on a *whole* tensor (one the region received, or one its column-wise projections read) is a
    replicated computation beside this rank's heads: SegFormer's and PVT's sequence reduction (the keys' and values'
    input made from the region's input after the queries were projected), a gate from the hidden states multiplied
    into every head. Its output reaches this rank's heads, directly or through a column-wise projection, so it is
    made a partial sum like everything else on the slice: its input's gradient is summed over the group in backward,
    and where a column-wise projection reads its output, that projection's (whole) input gradient is scaled by
    ``1/tp`` first (:mod:`~lightning_parallel.parallelize.tensor.partial_gradients`, as multi-head latent attention's
    regions do). One all-reduce more per such call in backward. The parameters are looked up on the child at reduction
    time, so wrapping that replaces them (FSDP2 over data-parallel replicas) is followed. A child called both inside
    and outside the split in one forward cannot be reduced correctly and stops with an error, as does one whose
    parameter has the whole split width (a norm over all heads together, whose statistic needs every slice).

    Args:
        mesh: The tensor-parallel mesh.
        name: The region's FQN, for messages.
    """

    def __init__(self, mesh: Any, name: str) -> None:
        super().__init__(mesh.get_group(), name, self.inside_parameters)
        self.mesh, self.tp_size = mesh, mesh.size()
        self._split = False
        self._children: dict[str, nn.Module] = {}
        self._inside: dict[str, bool] = {}
        self._seen: dict[str, bool] = {}
        self._whole: list[Tensor] = []  # this call's tensors that every rank holds whole
        self._whole_outputs: list[tuple[Tensor, Tensor | None]] = []  # (output, scaled) of whole-input calls
        self._pending: str | None = None  # the whole-input child being called

    def attach(
        self, region: nn.Module, opening: list[nn.Module], closing: list[nn.Module], candidates: Mapping[str, nn.Module]
    ) -> None:
        """Hook ``region``, its split projections and the ``candidates`` (children with parameters)."""
        region.register_forward_pre_hook(self._enter, with_kwargs=True)
        region.register_forward_hook(self._leave, always_call=True)
        for projection in opening:
            # First among the projection's hooks: it sees the tensor as the region computed it.
            projection.register_forward_pre_hook(self._projection_input, prepend=True)
            projection.register_forward_hook(self._open)
        for projection in closing:
            projection.register_forward_pre_hook(self._close)
        for child, sub in candidates.items():
            self._children[child] = sub
            sub.register_forward_pre_hook(partial(self._called, child, sub))
            sub.register_forward_hook(partial(self._returned, child))
        # Found again by reduce_split_region_gradients from the model's root (a plain attribute: no state_dict entry).
        region._split_region_parameters = self

    def inside_parameters(self) -> list[nn.Parameter]:
        """The parameters of the children the last forward called inside the split."""
        return [p for child, sub in self._children.items() if self._inside.get(child) for p in sub.parameters()]

    def _enter(self, _: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self._split, self._seen, self._whole_outputs = False, {}, []
        self._whole = [v for v in (*args, *kwargs.values()) if isinstance(v, Tensor)]

    def _projection_input(self, _: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
        if not args or not isinstance(args[0], Tensor):
            return None
        self._whole.append(args[0])
        for index, (output, scaled) in enumerate(self._whole_outputs):
            if output is args[0] and output.requires_grad:
                if scaled is None:  # once per tensor: keys and values reading it keep sharing one input
                    scaled = ScaleGradient.apply(output, 1.0 / self.tp_size)
                    self._whole_outputs[index] = (output, scaled)
                return (scaled, *args[1:])
        return None

    def _open(self, *_: Any) -> None:
        self._split = True

    def _close(self, *_: Any) -> None:
        self._split = False

    def _called(self, child: str, sub: nn.Module, _: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
        on_whole = bool(args) and any(args[0] is whole for whole in self._whole)
        split_width_norm = isinstance(getattr(sub, "forward", None), SplitWidthNorm)
        if self._split and not on_whole and not split_width_norm and args and isinstance(args[0], Tensor) and args[0].dim() >= 1:
            width = args[0].shape[-1]
            whole = [n for n, p in sub.named_parameters() if _vector(p) and p.numel() == width * self.tp_size]
            if whole:
                raise RuntimeError(
                    f"{self.name}.{child}.{whole[0]} has the whole split width {width * self.tp_size}, but is applied to "
                    f"this rank's {width} features (a norm over all heads together, not per head): its statistic "
                    f"needs every rank's slice. Leave {self.name} replicated: give TensorParallelStrategy(plan={{pattern: "
                    f"style}}) without its projections (plan='auto' cannot tell this norm from one of the input width)."
                )
        if self._seen.get(child, self._split) != self._split:
            raise RuntimeError(
                f"{self.name}.{child} is called both on the whole input and on this rank's split slice in one forward: "
                f"its gradient cannot be reduced correctly. Leave {self.name} replicated in the plan."
            )
        self._seen[child] = self._inside[child] = self._split
        # A DTensor input (sequence parallelism gathers the hidden states as one) computes as DTensor arithmetic.
        if self._split and on_whole and not isinstance(args[0], DTensor):
            self._pending = child
            return (gradient_summed(args[0], self.mesh), *args[1:])
        return None

    def _returned(self, child: str, *hook_args: Any) -> None:
        output = hook_args[-1]
        if self._pending == child and isinstance(output, Tensor):
            self._whole_outputs.append((output, None))
        self._pending = None

    def _leave(self, *_: Any) -> None:
        self._whole, self._whole_outputs = [], []


def track_split_region_parameters(modules: Mapping[str, nn.Module], resolved: ResolvedPlan, tp_mesh: Any) -> None:
    """Attach :class:`SplitRegionParameters` to every split region holding children with parameters."""
    for name, (opening, closing) in split_regions(resolved).items():
        if name in resolved.latent:
            continue  # every replicated parameter of a latent region is a partial sum (LatentRegion tracks them)
        region = modules[name]
        split = set(opening) | set(closing)
        candidates = {
            child: sub for child, sub in region.named_children()
            if child not in split and f"{name}.{child}" not in resolved.styles and f"{name}.{child}" not in resolved.per_head
            and any(True for _ in sub.parameters()) and not _planned_side_path(sub, f"{name}.{child}", resolved.styles)
        }
        if candidates:
            install_split_width_norms(region, name, candidates, tp_mesh)
        # Children whose parameters a parallel style already placed are not tracked: under sequence parallelism every
        # norm of a block is a SequenceParallel module, per-head norms inside the attention too (Qwen3's q_norm), with
        # replicated DTensor parameters whose gradients DTensor's own backward sums over the group; summing them again
        # here doubled them (tp2 with sequence_parallel=True: Qwen3, Gemma3, LFM2 q_norm gradients 2x).
        tracked = {child: sub for child, sub in candidates.items() if not all(isinstance(p, DTensor) for p in sub.parameters())}
        if tracked:
            SplitRegionParameters(tp_mesh, name).attach(
                region, [modules[f"{name}.{c}"] for c in opening], [modules[f"{name}.{c}"] for c in closing], tracked
            )


def _planned_side_path(child: nn.Module, fqn: str, styles: Mapping[str, str]) -> bool:
    """Every module holding parameters below ``child`` is in the plan, one of them split (an adapter split with the
    region, tensor.adapters): its split projection sums its input gradient over the ranks, so the replicated ones
    before it get whole gradients, not partial sums to reduce."""
    holders = [f"{fqn}.{name}" if name else fqn for name, sub in child.named_modules()
               if any(True for _ in sub.parameters(recurse=False))]
    return all(h in styles for h in holders) and any(styles[h] != "replicate" for h in holders)


@torch.no_grad()
def reduce_split_region_gradients(root: nn.Module) -> int:
    """Sum over the tensor-parallel group the gradients of the replicated parameters that split regions of
    ``root`` used on their rank's slice (one all-reduce per group and dtype); returns how many were summed.

    Call once after the last accumulated backward, before clipping and the optimizer step. A DTensor gradient
    (FSDP2's shard over data-parallel replicas) has its local part summed: every rank of the tensor-parallel
    group holds the same part of it.
    """
    buckets: dict[tuple[Any, torch.dtype, torch.device], list[Tensor]] = {}
    seen: set[int] = set()
    for sub in root.modules():
        tracker = getattr(sub, "_split_region_parameters", None)
        if not isinstance(tracker, PartialSumParameters):
            continue
        for param in tracker.inside_parameters():
            if param.grad is None or id(param) in seen:
                continue
            seen.add(id(param))
            grad = param.grad.to_local() if isinstance(param.grad, DTensor) else param.grad
            buckets.setdefault((tracker.group, grad.dtype, grad.device), []).append(grad)
    for (group, _, _), grads in buckets.items():
        flat = torch.cat([g.reshape(-1) for g in grads])
        collectives.all_reduce(flat, collectives.SUM, group)
        offset = 0
        for grad in grads:
            grad.copy_(flat[offset : offset + grad.numel()].view_as(grad))
            offset += grad.numel()
    return len(seen)
