"""Cut a module into pipeline stages and keep this rank's: torch's tracing frontend, or ``nn.Sequential`` slicing.

Tracing (``torch.distributed.pipelining.pipeline``, a stage beginning where each split point is called)
handles any ``forward`` torch.export can capture: loops over ``nn.ModuleList``, residuals, embeddings and
heads, tied weights (replicated onto each stage that uses them). Export bakes train/eval behaviour
(dropout, batch norm, ``if self.training``) into the graph, so the module is traced twice, once per mode,
and both graphs share this rank's parameter objects. A module export cannot capture is split without
tracing if it is an ``nn.Sequential``; anything else gets an error saying what to change.

After the build the original module is *rebound*: its parameters on this rank's stages are the stages'
own objects (so an optimizer over ``module.parameters()`` trains them), the ones that live on other ranks
are ``None`` (their memory is freed). No Lightning here.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Collection, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from itertools import pairwise
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed import ProcessGroup
from torch.distributed.pipelining import PipelineStage, pipe_split, pipeline
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.export.unflatten import InterpreterModule
from torch.utils._pytree import tree_map

from lightning_parallel.parallelize.pipeline.graph import (
    bind_subgraphs,
    check_chain,
    check_stage_inputs,
    clean_graph,
    root_cause,
    where_trace_stopped,
)
from lightning_parallel.parallelize.pipeline.opaque_blocks import restore_forward
from lightning_parallel.parallelize.pipeline.opaque_experts import (
    mark_routed_experts,
    opaque_routed_experts,
)
from lightning_parallel.parallelize.pipeline.opaque_functions import (
    opaque_autograd_functions,
)
from lightning_parallel.parallelize.pipeline.schedule import stages_on
from lightning_parallel.parallelize.pipeline.stage_boundary import (
    contiguous_boundaries,
    contiguous_module_boundaries,
)
from lightning_parallel.parallelize.pipeline.stage_tensor import StageTensorParallel


@dataclass(frozen=True)
class TiedParameter:
    """A parameter replicated on several pipeline ranks (tied weights): gradients must be summed over them.

    Attributes:
        name: Its name in the pipelined module.
        pp_ranks: Pipeline ranks holding a copy.
        owner_pp_rank: The rank whose copy counts in global quantities (gradient norm).
    """

    name: str
    pp_ranks: tuple[int, ...]
    owner_pp_rank: int


@dataclass
class LocalPipeline:
    """This rank's part of the pipeline.

    Attributes:
        frontend: ``"trace"`` or ``"sequential"``.
        stage_indices: Stage indices held here, increasing.
        train_stages: Stages for training (and their graphs in train mode).
        eval_stages: Stages for validation/test/predict (eval-mode graphs, same parameters).
        replaced: ``id(original parameter) -> local parameter`` (``None``: it lives on another rank).
        tied: Every parameter replicated over pipeline ranks (all of them, also those not held here).
        note: Why the fallback frontend was chosen (empty when traced).
        skeleton: A copy of the whole module on the meta device (no memory), traced again for evaluation
            inputs of another shape (``None`` for the sequential frontend, whose stages take any shape).
        local_tensors: This rank's stage tensors by name (what a new trace's stages are bound to).
        constants: Tensors the first trace lifted out of ``forward`` (not parameters or buffers) by name, in
            this rank's stages: a trace of the meta skeleton has only their shapes.
    """

    frontend: str
    stage_indices: list[int]
    train_stages: list[Any]
    eval_stages: list[Any]
    replaced: dict[int, nn.Parameter | None] = field(default_factory=dict)
    tied: list[TiedParameter] = field(default_factory=list)
    note: str = ""
    skeleton: nn.Module | None = None
    local_tensors: dict[str, Tensor] = field(default_factory=dict)
    constants: dict[str, Tensor] = field(default_factory=dict)


def check_split_points(module: nn.Module, split_points: Sequence[str], num_stages: int, module_name: str) -> None:
    """Split points must name submodules, one fewer than the stages.

    Raises:
        ValueError: Wrong count or unknown names (the message lists valid names to pick from).
    """
    if len(split_points) != num_stages - 1:
        raise ValueError(
            f"split_points has {len(split_points)} names but {num_stages} stages need {num_stages - 1} "
            f"(each names the module where a stage begins)."
        )
    names = {name for name, _ in module.named_modules() if name}
    unknown = [p for p in split_points if p not in names]
    if unknown:
        where = f"{module_name}." if module_name else ""
        examples = sorted(names, key=lambda n: (n.count("."), n))[:12]
        raise ValueError(
            f"split_points {unknown} name no submodule of {type(module).__name__} (names are relative to it, "
            f"e.g. {', '.join(where + e for e in examples)})."
        )


def build_local_pipeline(
    module: nn.Module,
    example_args: tuple[Any, ...],
    example_kwargs: dict[str, Any],
    split_points: Sequence[str],
    stage_to_rank: Sequence[int],
    pp_rank: int,
    device: torch.device,
    group: ProcessGroup,
    chained: bool = False,
    tensor_parallel: StageTensorParallel | None = None,
    allocate_later: bool = False,
    divided_later: Collection[str] = (),
) -> LocalPipeline:
    """Split ``module`` at ``split_points`` and build this rank's stages; rebinds ``module`` (see module doc).

    Args:
        module: The module whose ``forward`` the pipeline replaces, with all its parameters.
        example_args: One micro-batch of ``forward``'s positional inputs.
        example_kwargs: One micro-batch of its keyword inputs.
        split_points: Submodule names where stages 1, 2, ... begin.
        stage_to_rank: Pipeline rank of each stage index.
        pp_rank: This rank's index in the pipeline group.
        device: Where the stages run.
        group: The pipeline process group.
        chained: Build plain ``PipelineStage``s that pass activations from each stage to the next one only
            (what V-shaped schedules need: there two consecutive stages share a rank, and only those stages
            hand activations over in memory). The traced stages are checked to form such a chain.
        tensor_parallel: Split this rank's stages over a tensor-parallel mesh (traced stages only).
        allocate_later: For a module built on the meta device: leave this rank's stage tensors on the meta
            device (the caller shards them first, then allocates only its shards).
        divided_later: For a module built on the meta device: names (relative to ``module``) of parameters left
            on the meta device even without ``allocate_later`` (routed experts, which the caller divides over
            expert-parallel ranks first: the rank then allocates its experts only).

    Raises:
        TypeError: The module can be neither traced nor sliced.
        ValueError: The split points do not produce ``len(stage_to_rank)`` stages.
    """
    num_stages = len(stage_to_rank)
    local = stages_on(stage_to_rank, pp_rank)
    mark_routed_experts(module)  # before the skeleton is copied: its experts call this module's
    skeleton = meta_copy(module)
    # A module built with meta parameters (deferred initialisation) is traced as its meta skeleton, and
    # only this rank's stage tensors are allocated on the device.
    deferred = any(p.is_meta for p in module.parameters())
    traced = skeleton if deferred else module
    inputs = on_meta((example_args, example_kwargs)) if deferred else (example_args, example_kwargs)
    retarget = device if deferred else None
    try:
        train_pipe = _trace(traced, *inputs, split_points, training=True, device=retarget)
    except Exception as error:
        if isinstance(module, nn.Sequential) and tensor_parallel is None:
            allocated = _allocate_local_parts(module, split_points, local, device) if deferred else {}
            result = _slice_sequential(module, split_points, stage_to_rank, local, device, group)
            result.replaced.update(allocated)
            result.note = f"torch.export cannot trace it ({root_cause(error)}), so the nn.Sequential is sliced"
            return result
        fallback = (
            "with tensor parallelism stages must be traced (an nn.Sequential is sliced only without it)"
            if tensor_parallel is not None
            else "or keep the layers in an nn.Sequential, which is split without tracing"
        )
        raise TypeError(
            f"Pipeline parallelism could not trace {type(module).__name__}.forward with torch.export: "
            f"{root_cause(error)}{where_trace_stopped(error)}. Make forward traceable (no Python control flow on "
            f"tensor values, no calls torch.export cannot capture); {fallback}."
        ) from error
    if train_pipe.num_stages != num_stages:
        raise ValueError(
            f"split_points {list(split_points)} cut {type(module).__name__} into {train_pipe.num_stages} stages, not "
            f"{num_stages}: every split point must be a module that forward calls, in the order it calls them, and not "
            f"from inside an operation the trace keeps whole (a custom torch.autograd.Function running several layers, "
            f"such as reversible layers, is one operator in the graph)."
        )
    eval_pipe = _trace(traced, *inputs, split_points, training=False, device=retarget)
    originals = _originals(module)
    stage_uses = [
        {id(originals[name]) for name, _ in _named_tensors(train_pipe.get_stage_module(s)) if name in originals}
        for s in range(num_stages)
    ]
    canonical: dict[int, Tensor] = {}
    allocate = device if deferred and not allocate_later else None
    kept = set(originals) if allocate_later else set(divided_later) & set(originals)
    for s in local:
        _share(train_pipe.get_stage_module(s), originals, canonical, allocate, kept)
    for s in local:
        _share(eval_pipe.get_stage_module(s), originals, canonical, allocate, kept)
    if deferred:
        _check_no_meta([pipe.get_stage_module(s) for pipe in (train_pipe, eval_pipe) for s in local], type(module).__name__, device, kept)
    if chained:
        check_chain(train_pipe, type(module).__name__)
        train_stages = [PipelineStage(train_pipe.get_stage_module(s), s, num_stages, device, group=group) for s in local]
        eval_stages = [PipelineStage(eval_pipe.get_stage_module(s), s, num_stages, device, group=group) for s in local]
    else:
        train_stages = [train_pipe.build_stage(s, device, group) for s in local]
        eval_stages = [eval_pipe.build_stage(s, device, group) for s in local]
    if tensor_parallel is not None:
        # After building the stages: PipelineStage moves its module to the device, which cannot swap
        # DTensor parameters shared with other modules.
        stage_modules = [pipe.get_stage_module(s) for pipe in (train_pipe, eval_pipe) for s in local]
        _split_over_tensor_parallel(stage_modules, originals, canonical, tensor_parallel)
    result = LocalPipeline("trace", local, train_stages, eval_stages, skeleton=skeleton)
    result.local_tensors = {name: canonical[id(t)] for name, t in originals.items() if id(t) in canonical}
    result.constants = {
        name: tensor
        for pipe in (train_pipe, eval_pipe)
        for s in local
        for name, tensor in _named_tensors(pipe.get_stage_module(s))
        if name not in originals
    }
    _rebind(module, originals, canonical, stage_uses, local, result)
    result.tied = _tied(originals, stage_uses, stage_to_rank)
    return result


def trace_stages(
    local: LocalPipeline,
    example_args: tuple[Any, ...],
    example_kwargs: dict[str, Any],
    split_points: Sequence[str],
    stage_to_rank: Sequence[int],
    device: torch.device,
    group: ProcessGroup,
    *,
    training: bool,
    chained: bool = False,
    tensor_parallel: StageTensorParallel | None = None,
) -> list[Any]:
    """This rank's stages for inputs of another shape, sharing its parameters with ``local``.

    Export bakes shapes into a trace, so each new shape is traced again, on the meta-device skeleton kept
    from the first build (the module itself has given its other stages' tensors away), and the new stages
    are bound to this rank's tensors by name.

    Raises:
        RuntimeError: ``local`` was built without tracing, or the new trace holds a tensor this rank does not have.
    """
    if local.skeleton is None:
        raise RuntimeError("Only traced pipelines are traced again for a new shape.")
    pipe = _trace(local.skeleton, *on_meta((example_args, example_kwargs)), split_points, training=training, device=device)
    num_stages = len(stage_to_rank)
    stages = []
    for s in local.stage_indices:
        stage_module = pipe.get_stage_module(s)
        for name, tensor in list(_named_tensors(stage_module)):
            constant = local.constants.get(name)
            if name in local.local_tensors:
                _set_by_name(stage_module, name, local.local_tensors[name])
            elif constant is not None and constant.shape == tensor.shape and constant.dtype == tensor.dtype:
                _set_by_name(stage_module, name, constant)
            elif tensor.is_meta and tensor.numel() == 0:
                _set_by_name(stage_module, name, torch.empty_like(tensor, device=device))
            elif tensor.is_meta:
                raise RuntimeError(
                    f"Tracing the pipeline again for inputs of a new shape found {name!r}, which is not a parameter or "
                    f"buffer of the module (a tensor attribute?); register it as a buffer, or keep every batch in one shape."
                )
        if tensor_parallel is not None:
            tensor_parallel.wrap(stage_module)
        if chained:
            stages.append(PipelineStage(stage_module, s, num_stages, device, group=group))
        else:
            stages.append(pipe.build_stage(s, device, group))
    return stages


def meta_copy(module: nn.Module) -> nn.Module:
    """A deep copy of ``module`` whose parameters and buffers live on the meta device (no memory is copied)."""
    memo: dict[int, Any] = {}
    for tensor in [*module.parameters(), *module.buffers()]:
        empty = torch.empty_like(tensor, device="meta")
        memo[id(tensor)] = nn.Parameter(empty, requires_grad=tensor.requires_grad) if isinstance(tensor, nn.Parameter) else empty
    return copy.deepcopy(module, memo)


def _trace(
    module: nn.Module,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    split_points: Sequence[str],
    training: bool,
    device: torch.device | None = None,
) -> Any:
    """``torch.distributed.pipelining.pipeline`` in the given mode, leaving ``module`` as it was.

    Args:
        device: Where the stages will run, for a trace of the meta skeleton: the meta device the trace
            recorded in factory calls and ``.to()`` becomes this one.
    """
    # A stage begins where a split point is called: a forward pre-hook marks it. (torch's split_spec instead
    # replaces forward on the instance, and export then records the split module's children, reached through
    # the unwrapped module, under paths relative to it: "attn", not "h.2.attn". Unflattening the stage refuses
    # those paths, for any split layer whose submodules are not themselves wrapped.)
    calls = dict.fromkeys(split_points, 0)
    in_forward: set[str] = set()
    was_training = module.training
    module.train(training)
    try:
        while True:
            # Data-dependent routing, and custom backwards that a trace through the forward would lose: one operator each.
            with _stage_markers(module, calls, in_forward), opaque_routed_experts(module), opaque_autograd_functions():
                pipe = pipeline(module, args, kwargs or None, split_policy=bind_subgraphs)
            unmarked = {name for name, count in calls.items() if count == 0} - in_forward
            if not unmarked:
                break
            # A parent that runs its layers as ``layer.forward(...)`` (SqueezeBERT's encoder) skips their hooks:
            # trace again with those split points marked inside their forward.
            in_forward |= unmarked
        _check_called_once(calls, type(module).__name__)
        check_stage_inputs(pipe)
        contiguous_boundaries(pipe)  # p2p sends need contiguous activations and gradients
        for submodule in pipe.split_gm.modules():
            if isinstance(submodule, InterpreterModule):
                clean_graph(submodule, device)
                # Run the generated Python code rather than torch.fx.Interpreter node by node (16% faster).
                submodule._run_with_interpreter = False
        return pipe
    finally:
        module.train(was_training)


@contextmanager
def _stage_markers(module: nn.Module, calls: dict[str, int], in_forward: Collection[str]) -> Iterator[None]:
    """Cut the trace where each split point in ``calls`` runs, counting its runs in ``calls`` (reset here).

    A forward pre-hook marks a split point; one in ``in_forward`` is marked by a wrapper of its instance's
    ``forward`` instead, which also sees a parent's direct ``layer.forward(...)`` call (hooks do not).
    """
    undo = []
    for name in calls:
        calls[name] = 0
        layer = module.get_submodule(name)
        if name in in_forward:
            own = layer.__dict__.get("forward")
            layer.forward = _marked_forward(layer.forward, calls, name)
            undo.append(functools.partial(restore_forward, layer, own))
        else:
            undo.append(layer.register_forward_pre_hook(_begin_stage(calls, name)).remove)
    try:
        yield
    finally:
        for step in reversed(undo):
            step()


def _begin_stage(calls: dict[str, int], name: str) -> Any:
    """Forward pre-hook of the split point ``name``: the traced graph is cut here (a no-op when run eagerly)."""

    def begin_stage(_: nn.Module, __: Any) -> None:
        calls[name] += 1
        pipe_split()

    return begin_stage


def _marked_forward(forward: Any, calls: dict[str, int], name: str) -> Any:
    """``forward`` of the split point ``name``, cutting the traced graph before it runs."""

    @functools.wraps(forward)
    def marked(*args: Any, **kwargs: Any) -> Any:
        calls[name] += 1
        pipe_split()
        return forward(*args, **kwargs)

    return marked


def _check_called_once(calls: dict[str, int], module_name: str) -> None:
    """A stage begins where its split point runs: one that runs several times per forward cuts several stages."""
    repeated = {name: count for name, count in calls.items() if count > 1}
    if repeated:
        listed = ", ".join(f"{name} runs {count} times" for name, count in repeated.items())
        raise ValueError(
            f"split_points cut {module_name} where a module runs more than once per forward ({listed}: the model "
            f"calls these layers again, e.g. in recurrent cycles over the same blocks), and each call would begin a "
            f"stage. Name split points that run once per forward, or set pipeline_parallel_size=1 for this model."
        )


def _split_over_tensor_parallel(
    stage_modules: list[nn.Module], originals: dict[str, Tensor], canonical: dict[int, Tensor], tp: StageTensorParallel
) -> None:
    """Replace this rank's parameters by DTensors placed by the plan, in every stage module and in ``canonical``."""
    name_of = _parameter_names(originals)
    placed = {
        id(tensor): tp.distribute(name_of[key], tensor)
        for key, tensor in canonical.items()
        if isinstance(tensor, nn.Parameter) and key in name_of and tp.places(name_of[key])
    }
    for stage_module in stage_modules:
        for name, tensor in list(_named_tensors(stage_module)):
            if id(tensor) in placed:
                _set_by_name(stage_module, name, placed[id(tensor)])
        tp.wrap(stage_module)
    for key, tensor in list(canonical.items()):
        canonical[key] = placed.get(id(tensor), tensor)


def replace_stage_tensors(local: LocalPipeline, placed: dict[int, Tensor]) -> None:
    """Swap tensors of this rank's stages by identity (``id(old) -> new``): in every stage graph, in the tensors
    new traces are bound to, and in ``local.replaced`` (what the optimizers adopt)."""
    if not placed:
        return
    for stage in [*local.train_stages, *local.eval_stages]:
        for name, tensor in list(_named_tensors(stage.submod)):
            if id(tensor) in placed:
                _set_by_name(stage.submod, name, placed[id(tensor)])
    local.local_tensors = {name: placed.get(id(t), t) for name, t in local.local_tensors.items()}
    local.replaced = {key: placed.get(id(p), p) if p is not None else None for key, p in local.replaced.items()}


def _slice_sequential(
    module: nn.Sequential,
    split_points: Sequence[str],
    stage_to_rank: Sequence[int],
    local: list[int],
    device: torch.device,
    group: ProcessGroup,
) -> LocalPipeline:
    children = [name for name, _ in module.named_children()]
    not_children = [p for p in split_points if p not in children]
    if not_children:
        raise ValueError(
            f"{type(module).__name__} is split by slicing (it cannot be traced), so split_points must name its direct "
            f"children ({', '.join(children)}); got {not_children}."
        )
    bounds = [0, *(children.index(p) for p in split_points), len(children)]
    if any(a >= b for a, b in pairwise(bounds)):
        raise ValueError(f"split_points {list(split_points)} must be increasing children of the nn.Sequential.")
    parts = [nn.Sequential(*list(module)[a:b]) for a, b in pairwise(bounds)]
    num_stages = len(parts)
    for part in parts:
        contiguous_module_boundaries(part)  # p2p sends need contiguous activations and gradients

    def stage(s: int) -> PipelineStage:
        return PipelineStage(parts[s], s, num_stages, device, group=group)

    # Separate stage objects for training and evaluation: their receive buffers differ (grad vs inference).
    result = LocalPipeline("sequential", local, [stage(s) for s in local], [stage(s) for s in local])
    originals = _originals(module)
    stage_uses = [{id(t) for _, t in _named_tensors(part)} for part in parts]
    canonical = {id(t): t for s in local for _, t in _named_tensors(parts[s])}
    _rebind(module, originals, canonical, stage_uses, local, result)
    result.tied = _tied(originals, stage_uses, stage_to_rank)
    return result


def _named_tensors(module: nn.Module) -> Iterator[tuple[str, Tensor]]:
    """Parameters and buffers by every name they have (aliases of tied weights included)."""
    yield from module.named_parameters(remove_duplicate=False)
    yield from ((name, b) for name, b in module.named_buffers(remove_duplicate=False) if b is not None)


def _originals(module: nn.Module) -> dict[str, Tensor]:
    return dict(_named_tensors(module))


def _share(
    stage_module: nn.Module,
    originals: dict[str, Tensor],
    canonical: dict[int, Tensor],
    allocate: torch.device | None = None,
    kept: Collection[str] = (),
) -> None:
    """Make every tensor of ``stage_module`` the one object this rank holds for its original.

    Local stages (and the eval graphs) then share parameters: gradients of a weight used by two local
    stages accumulate in one ``.grad``, and the eval graph sees the trained values. With ``allocate``
    (a trace of the meta skeleton) that object is new: uninitialised memory on ``allocate`` for a meta
    original, the original itself on that device otherwise (a buffer built in ``__init__``); names in ``kept``
    stay as traced (on the meta device).
    """
    for name, tensor in list(_named_tensors(stage_module)):
        if name not in originals:
            continue
        key = id(originals[name])
        if key not in canonical:
            canonical[key] = tensor if allocate is None or name in kept else _allocated(originals[name], allocate)
        keep = canonical[key]
        if keep is not tensor:
            _set_by_name(stage_module, name, keep)


def _allocated(original: Tensor, device: torch.device) -> Tensor:
    value = torch.empty_like(original, device=device) if original.is_meta else original.detach().to(device)
    return nn.Parameter(value, requires_grad=original.requires_grad) if isinstance(original, nn.Parameter) else value


def on_meta(tree: Any) -> Any:
    """``tree`` with every tensor replaced by an empty one of its shape on the meta device."""
    return tree_map(lambda t: torch.empty_like(t, device="meta") if isinstance(t, Tensor) else t, tree)


def _check_no_meta(stage_modules: list[nn.Module], module_name: str, device: torch.device, kept: set[str] = frozenset()) -> None:
    """Refuse stage tensors of a meta trace that no original holds; empty ones (HF's empty KV cache) get memory.
    ``kept``: names left on the meta device on purpose (allocated by the caller later)."""
    for stage_module in stage_modules:
        for name, tensor in list(_named_tensors(stage_module)):
            if tensor.is_meta and tensor.numel() == 0:
                _set_by_name(stage_module, name, torch.empty_like(tensor, device=device))
    left = sorted({name for m in stage_modules for name, t in _named_tensors(m) if t.is_meta and name not in kept})
    if left:
        raise RuntimeError(
            f"Cutting {module_name} (built on the meta device) into stages found tensors that are neither parameters nor "
            f"buffers ({left[:8]}): their values cannot be recovered. Register them as buffers, or build the module "
            f"without trainer.init_module(empty_init=True)."
        )


def _allocate_local_parts(module: nn.Sequential, split_points: Sequence[str], local: list[int], device: torch.device) -> dict[int, Tensor]:
    """Give the layers of this rank's slices of a meta ``nn.Sequential`` memory on ``device`` (in place)."""
    children = [name for name, _ in module.named_children()]
    bounds = [0, *(children.index(p) for p in split_points if p in children), len(children)]
    replaced: dict[int, Tensor] = {}
    for s in local:
        for layer in list(module)[bounds[s]:bounds[s + 1]] if s + 1 < len(bounds) else []:
            replaced.update(allocate_meta_in_place(layer, device))
    return replaced


def allocate_meta_in_place(module: nn.Module, device: torch.device) -> dict[int, Tensor]:
    """Replace every meta parameter and buffer of ``module`` with uninitialised memory on ``device``.

    Returns:
        ``id(old parameter) -> new parameter`` (for optimizers built over the old ones).
    """
    replaced: dict[int, Tensor] = {}
    for sub in module.modules():
        for store in (sub._parameters, sub._buffers):
            for name, tensor in store.items():
                if tensor is not None and tensor.is_meta:
                    new = _allocated(tensor, device)
                    store[name] = new
                    if isinstance(tensor, nn.Parameter):
                        replaced[id(tensor)] = new
    return replaced


def _rebind(
    module: nn.Module,
    originals: dict[str, Tensor],
    canonical: dict[int, Tensor],
    stage_uses: list[set[int]],
    local: list[int],
    result: LocalPipeline,
) -> None:
    used_elsewhere = set().union(*stage_uses) - set().union(*(stage_uses[s] for s in local))
    for name, original in originals.items():
        key = id(original)
        if key in canonical:
            _set_by_name(module, name, canonical[key])
        elif key in used_elsewhere:
            _set_by_name(module, name, None)
        else:
            continue  # not used by forward at all: left as it is
        if isinstance(original, nn.Parameter):
            result.replaced[key] = canonical.get(key)  # type: ignore[assignment]


def _parameter_names(originals: dict[str, Tensor]) -> dict[int, str]:
    """``id(parameter) -> its first name`` (tied weights have several)."""
    names: dict[int, str] = {}
    for name, tensor in originals.items():
        if isinstance(tensor, nn.Parameter):
            names.setdefault(id(tensor), name)
    return names


def _tied(originals: dict[str, Tensor], stage_uses: list[set[int]], stage_to_rank: Sequence[int]) -> list[TiedParameter]:
    first_name = _parameter_names(originals)
    tied = []
    for key in sorted(set().union(*stage_uses), key=lambda k: first_name.get(k, "")):
        stages = [s for s, uses in enumerate(stage_uses) if key in uses]
        ranks = tuple(sorted({stage_to_rank[s] for s in stages}))
        if len(ranks) > 1 and key in first_name:
            tied.append(TiedParameter(first_name[key], ranks, stage_to_rank[stages[0]]))
    return tied


def _set_by_name(module: nn.Module, name: str, value: Tensor | None) -> None:
    parent_name, _, attribute = name.rpartition(".")
    parent = module.get_submodule(parent_name) if parent_name else module
    setattr(parent, attribute, value)


def remap_optimizer(optimizer: torch.optim.Optimizer, replaced: dict[int, nn.Parameter | None]) -> None:
    """Point an optimizer built over the whole module at this rank's stage parameters.

    Parameters that moved to a stage object are swapped (with any optimizer state already loaded, e.g.
    from a checkpoint); those living on other ranks are dropped; parameters outside the pipeline stay.
    A stage parameter that tensor parallelism placed on its mesh gets its state placed the same way.
    """
    seen: set[int] = set()
    for group in optimizer.param_groups:
        kept = []
        for param in group["params"]:
            local = replaced.get(id(param), param)
            state = optimizer.state.pop(param, None)
            if local is None or id(local) in seen:
                continue
            seen.add(id(local))
            if state is not None:
                optimizer.state[local] = _placed_like(state, local)
            kept.append(local)
        group["params"] = kept


def _placed_like(state: dict[str, Any], param: Tensor) -> dict[str, Any]:
    """``state`` of a whole parameter, its per-element tensors (AdamW's moments) placed as ``param`` is.

    A checkpoint's optimizer state is loaded before the first batch cuts the pipeline, onto the whole parameters;
    tensor-parallel stages then replace those by DTensors (:meth:`StageTensorParallel.distribute`), and their whole
    state must become DTensors the same way (every rank holds the same values: each keeps its part, no
    communication). Scalars (the step count) stay as they are.
    """
    if not isinstance(param, DTensor):
        return state
    return {
        key: distribute_tensor(value, param.device_mesh, param.placements, src_data_rank=None)
        if isinstance(value, Tensor) and not isinstance(value, DTensor) and value.shape == param.shape else value
        for key, value in state.items()
    }
