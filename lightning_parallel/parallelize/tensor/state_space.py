"""State-space (Mamba-1 and Mamba-2) mixers split over their inner channels and heads.

A Mamba mixer projects the model width ``d`` to an inner width ``c`` (and more), runs a depthwise convolution and a
selective scan that keep channels (Mamba-1) or heads (Mamba-2) apart, and projects ``c`` back to ``d``. Like an
attention's heads, the channels split over the tensor-parallel ranks, found by structure on the unmodified module
(not by class name), style ``state_space`` on the mixer itself:

- **Mamba-1** (transformers' ``MambaMixer``, ``FalconMambaMixer``, Jamba's): ``in_proj`` ``d → x | z`` (two blocks of
  ``c``), a depthwise convolution of ``c`` channels, ``x_proj`` ``c → dt_rank + 2·d_state`` (``dt | B | C``),
  ``dt_proj`` ``dt_rank → c``, ``A_log`` ``[c, d_state]``, ``D`` ``[c]``, ``out_proj`` ``c → d``. Rank ``r`` holds its
  part of both blocks of ``in_proj``, of the convolution, of ``dt_proj`` (output rows), ``A_log`` and ``D``; ``x_proj``
  and ``out_proj`` split over their input (row-wise). ``x_proj``'s output is a sum over every channel: its partial sums
  are all-reduced in forward, and, as each rank uses ``dt``, ``B`` and ``C`` only for its own channels, its gradient
  is all-reduced in backward too. Norms of those whole values (Jamba's ``dt/b/c_layernorm``) stay replicated, their
  gradients (partial sums) reduced after backward with the other split regions' replicated parameters.
- **Mamba-2** (``Mamba2Mixer`` and the hybrids' copies: Bamba, Falcon-H1, Nemotron-H, GraniteMoE-hybrid, Zamba2):
  ``in_proj`` ``d → z | x | B | C | dt`` (``c``, ``c``, ``G·N``, ``G·N``, ``H`` heads), a depthwise convolution over
  ``x | B | C``, ``A_log``/``D``/``dt_bias`` one per head, a gated RMSNorm over ``c``, ``out_proj`` ``c → d``. Rank
  ``r`` holds whole heads (its part of ``z``, ``x``, ``dt`` and the per-head parameters). ``B`` and ``C`` are shared
  by the heads of a group: with ``G`` divisible by the TP degree each rank holds its heads' groups; with one group
  they are needed whole on every rank, so each rank *stores* ``1/tp`` of their rows (of ``in_proj`` and of the
  convolution) and gathers them in forward; the gather's backward reduce-scatters their gradients (each rank's is a
  partial sum over its heads), so every parameter is stored once and its gradient is whole. The gated norm is
  recognised by running its own forward (gate before or after the norm, ``G`` groups); over a group split between
  ranks its sum of squares is all-reduced (its gradient too). Buffers over ``in_proj``'s outputs (Falcon-H1's
  ``mup_vector``) are read in the same local order.

The mixer's own Python forward then runs on this rank's parts: its parameters are ``Shard`` DTensors (checkpoints
and optimizers see the whole parameters, in the module's own order, :mod:`~lightning_parallel.parallelize.tensor.fused`),
their local slices are put in the modules' ``__dict__`` while the mixer runs (as
:mod:`~lightning_parallel.parallelize.tensor.per_head` does), and the widths it reshapes by (``intermediate_size``,
``num_heads``, ``n_groups``, ``conv_dim``, the convolution's channel counts) are divided. The mixer's input gradient
is all-reduced in backward and ``out_proj``'s partial sums in forward. A mixer that does not call ``x_proj``/
``out_proj`` as modules (a fused CUDA kernel taking every weight at once) stops with an error instead of computing
a wrong sum. Anything not matching these layouts is left whole with the reason (:func:`find_state_space`).
Sequence parallelism keeps the mixers whole (the plan says so). No Lightning here.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from lightning_parallel.parallelize.tensor import fused as fused_layout
from lightning_parallel.parallelize.tensor.channels import depthwise_channels
from lightning_parallel.parallelize.tensor.partial_gradients import gradient_summed
from lightning_parallel.parallelize.tensor.projections import features, is_projection
from lightning_parallel.parallelize.tensor.split_region import PartialSumParameters
from lightning_parallel.parallelize.tensor.split_norm import norm_eps

#: Attribute names a mixer keeps its widths under, by what they count; divided on the mixer once it is split.
INNER_ATTRIBUTES = ("intermediate_size", "d_inner", "mamba_d_inner")
HEAD_ATTRIBUTES = ("num_heads", "nheads", "n_heads")
GROUP_ATTRIBUTES = ("n_groups", "ngroups")
CONV_ATTRIBUTES = ("conv_dim",)
GROUP_STATE_ATTRIBUTES = ("groups_time_state_size",)


@dataclass(frozen=True)
class StateSpaceLayout:
    """Where a mixer's parts are and how wide they are.

    Attributes:
        kind: ``"mamba1"`` or ``"mamba2"``.
        in_proj, out_proj, conv: Child names of the opening projection, the closing one and the depthwise convolution.
        x_proj, dt_proj: Mamba-1's projections of the convolved channels (``dt | B | C``) and of ``dt`` (else ``None``).
        norm: Mamba-2's gated norm over the inner width (``None``: none with parameters).
        in_blocks: Blocks of ``in_proj``'s outputs (Mamba-1 ``x, z``; Mamba-2 ``z, x, B, C, dt``).
        conv_blocks: Blocks of the convolution's channels (Mamba-1 ``x``; Mamba-2 ``x, B, C``).
        shared: Indices into ``in_blocks`` of the blocks every head reads (Mamba-2's ``B``, ``C``), else empty.
        groups: Mamba-2's ``n_groups`` (1 for Mamba-1).
        per_channel: The mixer's own parameters split on dim 0 with the channels or heads (``A_log``, ``D``, ...).
        side_norms: Mamba-1's children normalising ``x_proj``'s whole outputs (replicated, gradients summed).
        buffers: The mixer's own buffers over ``in_proj``'s outputs (last dim), read in the local order.
        norm_before_gate: Mamba-2's norm scales by ``silu(gate)`` after normalising (else before).
    """

    kind: str
    in_proj: str
    out_proj: str
    conv: str
    x_proj: str | None
    dt_proj: str | None
    norm: str | None
    in_blocks: tuple[int, ...]
    conv_blocks: tuple[int, ...]
    shared: tuple[int, ...]
    groups: int
    per_channel: tuple[str, ...]
    side_norms: tuple[str, ...] = ()
    buffers: tuple[str, ...] = ()
    norm_before_gate: bool = False

    @property
    def inner(self) -> int:
        """The inner width ``c`` (``out_proj``'s input)."""
        return self.conv_blocks[0]


def _int_attribute(module: nn.Module, names: tuple[str, ...]) -> tuple[str, int] | None:
    for name in names:
        value = vars(module).get(name)
        if isinstance(value, int) and not isinstance(value, bool):
            return name, value
    return None


def find_state_space(module: nn.Module) -> dict[str, StateSpaceLayout | str]:
    """Every Mamba-1/Mamba-2 mixer under ``module``: its layout, or why it stays whole (a string)."""
    found: dict[str, StateSpaceLayout | str] = {}
    for fqn, sub in module.named_modules():
        if any(fqn.startswith(f"{done}.") for done in found):
            continue
        layout = state_space_layout(sub)
        if layout is not None:
            found[fqn] = layout
    return found


def state_space_layout(sub: nn.Module) -> StateSpaceLayout | str | None:
    """``sub``'s layout if it is a state-space mixer (a reason string if it looks like one but cannot be split),
    ``None`` if it is not one: a depthwise convolution between projections beside parameters of its own."""
    own = dict(sub.named_parameters(recurse=False))
    convs = {name: child for name, child in sub.named_children() if depthwise_channels(child) is not None}
    if not own or len(convs) != 1:
        return None
    projections = {name: child for name, child in sub.named_children() if is_projection(child)}
    (conv, conv_module), = convs.items()
    channels = depthwise_channels(conv_module)
    widths = sorted(features(m) for m in projections.values())
    if any(p.dim() > 2 for p in own.values()):
        # Zamba's per-head x_proj/dt_proj weights ([heads, ...] parameters of the mixer) beside d→2c and c→d
        # projections: a Mamba-1 mixer of a layout of its own. Anything else with such parameters is no mixer.
        opening = [f for f in widths if f[1] == 2 * channels]
        closing = [f for f in widths if f[0] == channels]
        if len(widths) != 2 or len(opening) != 1 or len(closing) != 1 or closing[0][1] != opening[0][0]:
            return None
        return ("its projections are parameters of the mixer itself, one per mixer head (3-D), a layout this split "
                "does not know")
    if len(projections) == 4:
        return _mamba1(sub, projections, conv, channels, own)
    if len(projections) == 2:
        return _mamba2(sub, projections, conv, channels, own)
    return None


def _mamba1(
    sub: nn.Module, projections: Mapping[str, nn.Module], conv: str, c: int, own: Mapping[str, Tensor]
) -> StateSpaceLayout | str | None:
    widths = {name: features(m) for name, m in projections.items()}
    opening = [n for n, (_, out) in widths.items() if out == 2 * c]
    state = [n for n, p in own.items() if p.dim() == 2 and p.shape[0] == c]
    skips = [n for n, p in own.items() if p.dim() == 1 and p.shape[0] == c]
    if len(opening) != 1 or len(state) != 1 or len(skips) != 1 or len(own) != 2:
        return None
    d_model = widths[opening[0]][0]
    d_state = own[state[0]].shape[1]
    dt = [n for n, (i, out) in widths.items() if out == c and i < c]
    if len(dt) != 1:
        return None
    rank = widths[dt[0]][0]
    x_proj = [n for n, (i, out) in widths.items() if i == c and out == rank + 2 * d_state]
    closing = [n for n, (i, out) in widths.items() if i == c and out == d_model and n not in x_proj]
    if len(x_proj) != 1 or len(closing) != 1:
        return "its projections of the inner width to dt|B|C and to the model width cannot be told apart by their widths"
    if projections[x_proj[0]].bias is not None:
        return f"{x_proj[0]} has a bias, which a sum over the ranks' channels would add once per rank"
    side: list[str] = []
    taken = {*projections, conv}
    for name, child in sub.named_children():
        params = list(child.parameters())
        if name in taken or not params:
            continue
        if any(p.dim() != 1 or p.shape[0] not in (rank, d_state) or p.shape[0] == c for p in params):
            return f"its child {name} holds parameters that are not vectors over dt or B/C (the replicated side)"
        side.append(name)
    return StateSpaceLayout(
        kind="mamba1", in_proj=opening[0], out_proj=closing[0], conv=conv, x_proj=x_proj[0], dt_proj=dt[0], norm=None,
        in_blocks=(c, c), conv_blocks=(c,), shared=(), groups=1, per_channel=(state[0], skips[0]),
        side_norms=tuple(side),
    )


def _mamba2(
    sub: nn.Module, projections: Mapping[str, nn.Module], conv: str, conv_dim: int, own: Mapping[str, Tensor]
) -> StateSpaceLayout | str | None:
    if any(p.dim() != 1 for p in own.values()) or len({p.shape[0] for p in own.values()}) != 1:
        return None
    heads = next(iter(own.values())).shape[0]
    widths = {name: features(m) for name, m in projections.items()}
    for closing, (c, d_model) in widths.items():
        (opening, (d_in, width)), = ((n, f) for n, f in widths.items() if n != closing)
        if d_in == d_model and width == c + conv_dim + heads and conv_dim > c:
            break
    else:
        return None
    shared = conv_dim - c
    groups = _int_attribute(sub, GROUP_ATTRIBUTES)
    if shared % 2 or groups is None or (shared // 2) % groups[1] or c % heads:
        return "its B|C width or group count (n_groups) cannot be read from the module"
    norm, before = None, False
    buffers = tuple(n for n, b in sub.named_buffers(recurse=False) if b.shape[-1] == width and b.numel() == width)
    if len(buffers) != len(list(sub.named_buffers(recurse=False))):
        return "it holds buffers other than one value per output of its input projection"
    for name, child in sub.named_children():
        params = dict(child.named_parameters())
        if name in (opening, closing, conv) or not params:
            continue
        if norm is not None or set(params) != {"weight"} or params["weight"].shape != (c,):
            return f"its child {name} holds parameters other than a gated norm's weight over the inner width"
        recognised = recognise_gated_norm(child, groups[1])
        if recognised is None:
            return f"its norm {name} is not a gated RMSNorm over {groups[1]} group(s) (checked on a random input)"
        norm, before = name, recognised
    return StateSpaceLayout(
        kind="mamba2", in_proj=opening, out_proj=closing, conv=conv, x_proj=None, dt_proj=None, norm=norm,
        in_blocks=(c, c, shared // 2, shared // 2, heads), conv_blocks=(c, shared // 2, shared // 2), shared=(2, 3),
        groups=groups[1], per_channel=tuple(own), buffers=buffers, norm_before_gate=before,
    )


def _gated_norm(hidden: Tensor, gate: Tensor | None, weight: Tensor, eps: float, groups: int, width: int,
                before: bool, summed: Any) -> Tensor:
    """A gated RMSNorm of ``hidden`` (``groups`` groups here, each of ``width`` features whole, its sum of squares
    completed by ``summed``), in float32 as transformers' gated norms compute it."""
    dtype = hidden.dtype
    x = hidden.to(torch.float32)
    if gate is not None and not before:
        x = x * nn.functional.silu(gate.to(torch.float32))
    grouped = x.view(*x.shape[:-1], groups, x.shape[-1] // groups)
    grouped = grouped * torch.rsqrt(summed(grouped.pow(2).sum(-1, keepdim=True)) / width + eps)
    x = grouped.view(*x.shape)
    if gate is not None and before:
        return (weight * x * nn.functional.silu(gate.to(torch.float32))).to(dtype)
    return weight * x.to(dtype)


def recognise_gated_norm(norm: nn.Module, groups: int) -> bool | None:
    """Whether ``norm`` normalises before gating (``True``) or after (``False``), found by running its own forward on
    a random input of its width with a gate; ``None`` if it is neither gated RMSNorm over ``groups`` groups.

    Run on a CPU copy with random weights (as the MLP probe does), so that a module still on the meta device (deferred
    initialisation) is recognised too, and a weight of ones cannot hide how it is applied."""
    import copy

    eps = norm_eps(norm)
    if eps is None or any(True for _ in norm.buffers()):
        return None
    width = norm.weight.shape[0]
    generator = torch.Generator().manual_seed(0)
    probe = copy.deepcopy(norm).to_empty(device="cpu").to(torch.float64)
    sample = torch.randn(2, 3, width, generator=generator, dtype=torch.float64) * 3 + 0.5
    gate = torch.randn(2, 3, width, generator=generator, dtype=torch.float64)
    with torch.no_grad():
        probe.weight.copy_(torch.rand(width, generator=generator, dtype=torch.float64) + 0.5)
        try:
            expected = type(probe).forward(probe, sample, gate)
        except Exception:  # noqa: BLE001  (a module of another signature is simply not this norm)
            return None
        if not isinstance(expected, Tensor) or expected.shape != sample.shape:
            return None
        scale = expected.abs().max().clamp_min(1e-30)
        for before in (False, True):
            got = _gated_norm(sample, gate, probe.weight, eps, groups, width // groups, before, lambda t: t)
            if float((got - expected).abs().max() / scale) < 1e-5:
                return before
    return None


def check_state_space(fqn: str, module: nn.Module, tp_size: int) -> StateSpaceLayout:
    """``module``'s layout, checked to split ``tp_size`` ways.

    Raises:
        TypeError: ``module`` is not a Mamba-1/Mamba-2 mixer this split knows (the reason is named).
        ValueError: Its channels, heads, B/C rows or groups do not divide by ``tp_size``.
    """
    layout = state_space_layout(module)
    if not isinstance(layout, StateSpaceLayout):
        why = layout or "no depthwise convolution between an input and an output projection beside parameters of its own"
        raise TypeError(
            f"{fqn}: style 'state_space' splits a Mamba-1 or Mamba-2 mixer, but {type(module).__name__} is not one this "
            f"split knows: {why}. Leave {fqn} replicated in the plan."
        )
    sizes = {"inner channels": layout.inner}
    if layout.kind == "mamba2":
        sizes.update({"heads": layout.in_blocks[-1], "B/C rows": layout.in_blocks[2]})
    for what, size in sizes.items():
        if size % tp_size:
            raise ValueError(
                f"{fqn}: its {size} {what} are not divisible by tensor_parallel_size={tp_size}. Choose a "
                f"tensor_parallel_size that divides {size}, or leave {fqn} replicated in the plan."
            )
    if layout.kind == "mamba2" and layout.groups > 1 and layout.groups % tp_size:
        raise ValueError(
            f"{fqn}: its n_groups={layout.groups} groups of B/C are shared by the heads of a group; "
            f"tensor_parallel_size={tp_size} divides neither them nor leaves one group (which every rank could gather). "
            f"Choose a tensor_parallel_size that divides {layout.groups}, or leave {fqn} replicated in the plan."
        )
    return layout


def split_state_space(
    fqn: str, module: nn.Module, layout: StateSpaceLayout, tp_mesh: Any
) -> dict[str, dict[str, fused_layout.FusedLayout]]:
    """Shard ``module``'s parameters, divide its widths and install the hooks that run its forward on this rank's
    parts; returns the fused layouts (by module FQN) whose checkpoints are converted to the module's own order."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    tp = tp_mesh.size()
    children = dict(module.named_children())
    layouts: dict[str, dict[str, fused_layout.FusedLayout]] = {}

    def place(owner: nn.Module, name: str, placement: Any) -> None:
        param = owner._parameters[name]
        placed = distribute_tensor(param.detach(), tp_mesh, [placement], src_data_rank=None)
        owner.register_parameter(name, nn.Parameter(placed, requires_grad=param.requires_grad))

    def fused(child: str, blocks: tuple[int, ...]) -> None:
        owner = children[child]
        layouts[f"{fqn}.{child}"] = {}
        for name, param in list(owner.named_parameters(recurse=False)):
            block_layout = fused_layout.FusedLayout(0, blocks, tp)
            fused_layout.rank_major_rows(param, block_layout)
            place(owner, name, Shard(0))
            layouts[f"{fqn}.{child}"][name] = block_layout

    fused(layout.in_proj, layout.in_blocks)
    fused(layout.conv, layout.conv_blocks)
    for name in layout.per_channel:
        place(module, name, Shard(0))
    closing = children[layout.out_proj]
    place(closing, "weight", Shard(1))
    if closing.bias is not None:
        place(closing, "bias", Replicate())
    if layout.dt_proj is not None:
        for name, _ in list(children[layout.dt_proj].named_parameters(recurse=False)):
            place(children[layout.dt_proj], name, Shard(0))
    if layout.x_proj is not None:
        place(children[layout.x_proj], "weight", Shard(1))
    if layout.norm is not None:
        place(children[layout.norm], "weight", Shard(0))
    gather = layout.kind == "mamba2" and layout.groups % tp != 0  # one group: B and C whole on every rank
    _divide_widths(module, children[layout.conv], layout, tp, gather)
    region = _StateSpaceRegion(fqn, module, layout, tp_mesh, gather)
    module.register_forward_pre_hook(region.enter, with_kwargs=True)
    module.register_forward_hook(region.leave, always_call=True)
    children[layout.out_proj].register_forward_hook(region.closed)
    if layout.x_proj is not None:
        children[layout.x_proj].register_forward_hook(region.projected)
    if layout.side_norms:
        module._split_region_parameters = PartialSumParameters(
            tp_mesh.get_group(), fqn, lambda: [p for n in layout.side_norms for p in children[n].parameters()])
    return layouts


def _divide_widths(module: nn.Module, conv: nn.Module, layout: StateSpaceLayout, tp: int, gather: bool) -> None:
    """The widths the mixer's forward reshapes by, as this rank holds them."""
    inner = layout.inner // tp
    if layout.kind == "mamba1":
        local = {INNER_ATTRIBUTES: inner}
        channels = inner
    else:
        shared = layout.in_blocks[2] if gather else layout.in_blocks[2] // tp
        groups = layout.groups if gather else layout.groups // tp
        channels = inner + 2 * shared
        local = {INNER_ATTRIBUTES: inner, HEAD_ATTRIBUTES: layout.in_blocks[-1] // tp, GROUP_ATTRIBUTES: groups,
                 CONV_ATTRIBUTES: channels, GROUP_STATE_ATTRIBUTES: shared}
    for names, value in local.items():
        for name in names:
            if isinstance(vars(module).get(name), int):
                setattr(module, name, value)
    for name in ("in_channels", "out_channels", "groups"):
        setattr(conv, name, channels)


class _StateSpaceRegion:
    """The hooks around one split mixer's forward (see the module docstring)."""

    def __init__(self, fqn: str, module: nn.Module, layout: StateSpaceLayout, mesh: Any, gather: bool) -> None:
        self.fqn, self.layout, self.mesh, self.gather = fqn, layout, mesh, gather
        self.children = dict(module.named_children())
        self.tp, self.rank = mesh.size(), mesh.get_local_rank()
        self.calls: set[str] = set()
        self.buffer_index = self._local_order(layout.in_blocks)

    def _local_order(self, blocks: tuple[int, ...]) -> Tensor:
        """Indices (module order) of ``in_proj``'s outputs this rank's forward reads, in its order."""
        parts, start = [], 0
        for index, size in enumerate(blocks):
            part = size // self.tp
            if self.gather and index in self.layout.shared:
                parts.append(torch.arange(start, start + size))
            else:
                parts.append(torch.arange(start + self.rank * part, start + (self.rank + 1) * part))
            start += size
        return torch.cat(parts)

    def _local_rows(self, param: Tensor, blocks: tuple[int, ...], shared: tuple[int, ...]) -> Tensor:
        """This rank's rows of a rank-major ``Shard(0)`` parameter, the shared blocks gathered whole if needed."""
        local = param.to_local()
        if not self.gather:
            return local
        from torch.distributed.tensor import DTensor, Partial, Shard

        pieces = list(local.split([size // self.tp for size in blocks], dim=0))
        for index in shared:
            # Each rank stores 1/tp of the rows and uses all of them for its heads: the gradient of the whole rows is
            # a partial sum on each rank, reduce-scattered back into the shards by the gather's backward.
            pieces[index] = DTensor.from_local(pieces[index], self.mesh, [Shard(0)], run_check=False).full_tensor(
                grad_placements=[Partial()])
        return torch.cat(pieces, dim=0)

    def enter(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        layout, children = self.layout, self.children
        self.calls = set()
        opening = children[layout.in_proj]
        for name in [n for n, p in opening._parameters.items() if p is not None]:
            opening.__dict__[name] = self._local_rows(opening._parameters[name], layout.in_blocks, layout.shared)
        conv_shared = tuple(i - 1 for i in layout.shared)  # the convolution's blocks start at x
        conv = children[layout.conv]
        for name in [n for n, p in conv._parameters.items() if p is not None]:
            conv.__dict__[name] = self._local_rows(conv._parameters[name], layout.conv_blocks, conv_shared)
        for name in layout.per_channel:
            module.__dict__[name] = module._parameters[name].to_local()
        for child in (layout.dt_proj, layout.x_proj, layout.out_proj):
            if child is not None:
                owner = children[child]
                for name, param in owner._parameters.items():
                    if param is not None:
                        owner.__dict__[name] = param.to_local()
        closing = children[layout.out_proj]
        if closing._parameters.get("bias") is not None:
            # Every rank's partial sum would add the bias: each adds 1/tp of it (its gradient summed back to whole).
            closing.__dict__["bias"] = gradient_summed(closing._parameters["bias"].to_local(), self.mesh) / self.tp
        for name in layout.buffers:
            whole = module._buffers[name]
            module.__dict__[name] = whole.index_select(-1, self.buffer_index.to(whole.device))
        if layout.norm is not None:
            norm = children[layout.norm]
            norm.__dict__["forward"] = self._norm_forward(norm)
        return tuple(gradient_summed(a, self.mesh) for a in args), {k: gradient_summed(v, self.mesh) for k, v in kwargs.items()}

    def _norm_forward(self, norm: nn.Module) -> Any:
        layout = self.layout
        weight = norm._parameters["weight"].to_local()
        eps = norm_eps(norm)
        width = layout.inner // layout.groups  # one group's features, whole
        groups = 1 if self.gather else layout.groups // self.tp

        def summed(partial: Tensor) -> Tensor:
            if not self.gather:
                return partial
            from lightning_parallel.parallelize.common.meta_run import summed_with_gradient

            # The statistic's gradient is a partial sum on each rank too: this all-reduce sums it in backward.
            return summed_with_gradient(partial, self.mesh.get_group())

        def forward(hidden_states: Tensor, gate: Tensor | None = None) -> Tensor:
            return _gated_norm(hidden_states, gate, weight, eps, groups, width, layout.norm_before_gate, summed)

        return forward

    def projected(self, _: nn.Module, __: Any, output: Tensor) -> Tensor:
        """``x_proj``'s partial sums all-reduced; its gradient (used on this rank's channels only) summed too."""
        self.calls.add("x_proj")
        return gradient_summed(_all_reduced(output, self.mesh), self.mesh)

    def closed(self, _: nn.Module, __: Any, output: Tensor) -> Tensor:
        """``out_proj``'s partial sums all-reduced (its gradient, whole on every rank, passed through)."""
        self.calls.add("out_proj")
        return _all_reduced(output, self.mesh)

    def leave(self, module: nn.Module, _: Any, output: Any) -> Any:
        layout = self.layout
        for name in (*layout.per_channel, *layout.buffers):
            module.__dict__.pop(name, None)
        for child in (layout.in_proj, layout.conv, layout.dt_proj, layout.x_proj, layout.out_proj, layout.norm):
            for name in ("weight", "bias", "forward") if child else ():
                self.children[child].__dict__.pop(name, None)
        needed = {"out_proj"} | ({"x_proj"} if layout.x_proj else set())
        if not needed <= self.calls:
            raise RuntimeError(
                f"{self.fqn}: its forward did not call {', '.join(sorted(needed - self.calls))} as a module (a fused kernel "
                f"taking every weight at once?), so this rank's partial sums were never added up. Run the mixer's Python "
                f"path (no mamba_ssm/causal_conv1d kernels), or leave {self.fqn} replicated in the plan."
            )
        return output


def _all_reduced(partial: Tensor, mesh: Any) -> Tensor:
    """Every rank's partial sum, summed (forward); the replicated gradient passed through (backward)."""
    from torch.distributed.tensor import DTensor, Partial, Replicate

    return DTensor.from_local(partial, mesh, [Partial()], run_check=False).redistribute(placements=[Replicate()]).to_local()
