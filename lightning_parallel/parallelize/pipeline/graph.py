"""The traced pipeline's graph: the passes that make export's stage code runnable, and what a failed trace says.

Export's graphs need a little cleaning before the stages run them as generated Python code (metadata
assertions DTensor has no rule for, empty cache tensors in ``cat``, writes into cache tensors nothing reads, a
node named ``self``, a meta trace's device), and ``torch.no_grad()`` blocks their subgraph bound into the call (a forward
writing into its parameters there is refused); a split can be checked for stages that read values they are never given, and V-shaped schedules
for a plain chain. When export fails, the error names the innermost module code it was in. No Lightning here.
"""

from __future__ import annotations

import os
import traceback
from typing import Any

import torch
from torch import Tensor, nn
from torch.export.unflatten import InterpreterModule
from torch.utils._pytree import tree_map


def check_stage_inputs(pipe: Any) -> None:
    """Refuse a split whose stage reads values its caller does not pass (torch 2.13's split can leave a stage
    with inputs that another stage computes), or whose later stage reads a model input directly (torch's stages
    receive only the previous stage's outputs): either would fail only when the schedule first runs it."""
    stages = [name for name, _ in pipe.split_gm.named_children()]
    for node in pipe.split_gm.graph.nodes:
        if node.op == "call_module" and node.target in stages[1:]:
            direct = [arg.target for arg in node.all_input_nodes if arg.op == "placeholder"]
            if direct:
                raise TypeError(
                    f"pipeline stage {stages.index(node.target)} reads the model's input(s) {', '.join(map(str, direct))} "
                    "directly (a layer after the first stage uses them, e.g. routing by token id), but torch's pipeline "
                    "stages receive only what the previous stage sends. Choose split_points that keep every layer "
                    "reading them in stage 0, or set pipeline_parallel_size=1 for this model."
                )
    for owner_name, owner in pipe.split_gm.named_modules():
        if not isinstance(getattr(owner, "graph", None), torch.fx.Graph):
            continue
        for node in owner.graph.nodes:
            if node.op != "call_module":
                continue
            graph = getattr(owner.get_submodule(node.target), "graph", None)
            wanted = [n.target for n in graph.nodes if n.op == "placeholder"] if isinstance(graph, torch.fx.Graph) else []
            given = len(node.args) + len(node.kwargs)
            if len(wanted) > given:
                where = f"{owner_name}.{node.target}" if owner_name else node.target
                raise TypeError(
                    f"the split at the split points gives {where} inputs it never receives "
                    f"({', '.join(map(str, wanted[given:][:5]))}): values one stage computes are read by an earlier "
                    f"one (a module or tensor shared across layers?). Choose other split_points"
                )


def bind_subgraphs(traced: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """Give each operator that runs a subgraph of ``traced`` (export's ``wrap_with_set_grad_enabled`` for a
    ``torch.no_grad()`` block, ``wrap_with_autocast``) the subgraph itself instead of a ``get_attr`` of it.

    torch 2.13's pipeline split reads the subgraph as an attribute of the stage, then rebuilds each stage from its
    module hierarchy without copying that attribute over: any forward with such a block failed with "object has no
    attribute 'submod_1'". Bound into the call, the subgraph travels with the node to whichever stage runs it, and
    runs exactly as the operator would (grad mode set, restored after).
    """
    changed = False
    for node in list(traced.graph.nodes):
        if node.op != "call_function":
            continue
        held = {
            index: getattr(traced, arg.target)
            for index, arg in enumerate(node.args)
            if isinstance(arg, torch.fx.Node) and arg.op == "get_attr" and isinstance(getattr(traced, arg.target, None), torch.fx.GraphModule)
        }
        if not held:
            continue
        _refuse_parameter_writes(traced, node, held)
        attributes = [node.args[index] for index in held]
        node.args = tuple(arg for index, arg in enumerate(node.args) if index not in held)
        node.target = _with_subgraphs(node.target, held, len(node.args) + len(held))
        for attribute in attributes:
            if not attribute.users:
                traced.graph.erase_node(attribute)
                if not any(n.op == "get_attr" and n.target == attribute.target for n in traced.graph.nodes):
                    delattr(traced, attribute.target)
        changed = True
    if changed:
        _renumber_module_calls(traced.graph)
        traced.recompile()
    return traced


def _renumber_module_calls(graph: torch.fx.Graph) -> None:
    """Number each module's calls in the graph ``m``, ``m@1``, ... again, in the order they appear.

    Export numbers them over the whole forward, so a module called first inside a ``torch.no_grad()`` block (now
    inside the bound subgraph) and again after it appears only as ``m@1``: unflattening then puts its parameters
    under ``m@1``, a name the model does not have, and the stage's copy would never be bound to the model's.
    """
    renamed: dict[str, str] = {}
    calls: dict[str, int] = {}
    for node in graph.nodes:
        stack = node.meta.get("nn_module_stack")
        if not stack:
            continue
        for key in stack:
            if key not in renamed:
                base = key.split("@", 1)[0]
                renamed[key] = base if base not in calls else f"{base}@{calls[base]}"
                calls[base] = calls.get(base, 0) + 1
        if any(renamed[key] != key for key in stack):
            node.meta["nn_module_stack"] = {renamed[key]: value for key, value in stack.items()}


def _refuse_parameter_writes(traced: torch.fx.GraphModule, node: torch.fx.Node, held: dict[int, torch.fx.GraphModule]) -> None:
    """Refuse a ``torch.no_grad()`` block that writes into a parameter (RWKV rescales its weights in place when it
    switches between training and evaluation): export turns the write into a new tensor the rest of the graph reads,
    so a traced stage would repeat the write on every call and train a copy that no gradient reaches."""
    if node.target is not torch.ops.higher_order.wrap_with_set_grad_enabled or node.args[0] is not False or len(held) != 1:
        return
    (body,) = held.values()
    operands = [arg for index, arg in enumerate(node.args) if index not in held][1:]
    bound = dict(zip((n for n in body.graph.nodes if n.op == "placeholder"), operands))
    results = next(n for n in body.graph.nodes if n.op == "output").args[0]
    written = []
    for value in results if isinstance(results, (tuple, list)) else [results]:
        # An output computed from a parameter operand in its shape: the parameter's new value.
        source = value.args[0] if isinstance(value, torch.fx.Node) and value.op == "call_function" and value.args else None
        operand = bound.get(source) if isinstance(source, torch.fx.Node) else None
        if isinstance(operand, torch.fx.Node) and operand.op == "get_attr":
            parameter = _attribute(traced, str(operand.target))
            result = value.meta.get("val")
            if isinstance(parameter, nn.Parameter) and isinstance(result, Tensor) and result.shape == parameter.shape:
                written.append(str(operand.target))
    if written:
        stack = list(node.meta.get("nn_module_stack", {}).values())
        where = f" in {stack[-1][0]} ({stack[-1][1].rsplit('.', 1)[-1]})" if stack else ""
        raise TypeError(
            f"forward{where} writes into its parameters under torch.no_grad() ({', '.join(written[:4])}"
            f"{' ...' if len(written) > 4 else ''}), e.g. rescaling weights when switching between training and "
            "evaluation: a traced stage would repeat the write on every call and compute with a copy no gradient "
            "reaches. Move the write out of forward (or disable it in the config), or set pipeline_parallel_size=1"
        )


def _attribute(module: nn.Module, target: str) -> Any:
    try:
        return module.get_parameter(target)
    except AttributeError:
        return None


def _with_subgraphs(op: Any, held: dict[int, torch.fx.GraphModule], arity: int) -> Any:
    """``op`` with the subgraphs ``held`` (argument position -> module) bound: the call passes every other argument."""

    def run_with_subgraphs(*args: Any, **kwargs: Any) -> Any:
        rest = iter(args)
        full = [held[index] if index in held else next(rest) for index in range(arity)]
        return op(*full, *rest, **kwargs)

    run_with_subgraphs.__name__ = f"{getattr(op, '__name__', 'op')}_with_subgraphs"
    run_with_subgraphs.subgraphs = list(held.values())  # type: ignore[attr-defined]  (passes reach them here)
    return run_with_subgraphs


_ASSERTIONS = (torch.ops.aten._assert_tensor_metadata.default,)


def clean_graph(submodule: InterpreterModule, device: torch.device | None) -> None:
    """Drop export's metadata assertions and retarget a meta trace to ``device``; regenerate the code.

    ``_assert_tensor_metadata`` nodes only check dtype and device of values the graph already computes,
    and DTensor has no rule for them (tensor-parallel stages run the graph on DTensors).
    """
    graph = submodule.graph
    changed = _rename_nodes_named_self(graph)
    changed = _drop_unread_writes(graph) or changed
    for node in list(graph.nodes):
        if node.op == "call_function" and node.target in _ASSERTIONS and not node.users:
            graph.erase_node(node)
            changed = True
        elif node.op == "call_function" and node.target is torch.ops.aten.cat.default and _drop_empty_cat_inputs(node):
            changed = True
        elif device is not None and node.op == "call_function":
            changed = _retarget(node, device) or changed
    if changed:
        submodule.finalize()


def _retarget(node: torch.fx.Node, device: torch.device) -> bool:
    """The meta device in ``node``'s arguments (and in the graphs of subgraphs bound into it) becomes ``device``."""
    changed = False
    for body in getattr(node.target, "subgraphs", ()):
        if any([_retarget(inner, device) for inner in body.graph.nodes if inner.op == "call_function"]):
            body.recompile()
    args, kwargs = tree_map(lambda a: device if _is_meta_device(a) else a, (node.args, node.kwargs))
    if (args, kwargs) != (node.args, node.kwargs):
        node.args, node.kwargs = args, kwargs
        changed = True
    return changed


def _rename_nodes_named_self(graph: torch.fx.Graph) -> bool:
    """Rename nodes called ``self``: the generated ``forward(self, ...)`` would assign them over ``self``.

    Export's unflattening names a submodule call after the submodule, and torch 2.13's FX namespace does not
    reserve ``self``: BERT's ``attention.self`` becomes ``self = self.self(...)``, and the next submodule
    call fails with "'Tensor' object has no attribute 'output'". (torch.fx.Interpreter, which reads the
    graph rather than the code, is unaffected; the stages run the generated code.)
    """
    renamed = False
    for node in list(graph.nodes):
        if node.name != "self" or node.op == "placeholder":
            continue
        with graph.inserting_after(node):
            replacement = graph.create_node(node.op, node.target, node.args, node.kwargs, name="self_output")
        replacement.meta = dict(node.meta)
        node.replace_all_uses_with(replacement)
        graph.erase_node(node)
        renamed = True
    return renamed


#: ATen factories: their output aliases nothing, so writes into it reach nothing but the tensor itself.
_FRESH = tuple(
    getattr(torch.ops.aten, name).default
    for name in ("zeros", "ones", "full", "zeros_like", "ones_like", "full_like", "empty_like", "new_zeros", "new_ones",
                 "new_full", "new_empty")
) + (torch.ops.aten.empty.memory_format,)


def _drop_unread_writes(graph: torch.fx.Graph) -> bool:
    """Drop tensors the graph creates and only writes into (directly or through views), never reads, with the writes.

    A Hugging Face cache built during training (``use_cache`` defaults to true) traces as such: LFM2's short
    convolution copies the last positions of its input into a fresh conv state (``zeros(...).copy_(x[..., -3:])``)
    that nothing reads. The write is wasted work, and in a tensor-parallel stage it fails outright: the source is a
    DTensor, the fresh tensor a plain one, and DTensor refuses an in-place op on a plain tensor (a bare
    ``AssertionError`` in its dispatch).
    """
    dropped = False
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target not in _FRESH:
            continue
        aliases, writes = _aliases_and_writes(node)
        if aliases is None:
            continue
        for dead in [*writes, *reversed(aliases)]:  # users before what they use
            graph.erase_node(dead)
        dropped = True
    return dropped


def _aliases_and_writes(fresh: torch.fx.Node) -> tuple[list[torch.fx.Node] | None, list[torch.fx.Node]]:
    """``fresh`` and its views, and the in-place writes into them, if nothing else uses any of them (else ``None``)."""
    aliases, writes, pending = [], [], [fresh]
    while pending:
        node = pending.pop()
        aliases.append(node)
        for user in node.users:
            schema = getattr(user.target, "_schema", None) if user.op == "call_function" else None
            first = schema.arguments[0].alias_info if schema is not None and schema.arguments else None
            if first is None or not user.args or user.args[0] is not node or node in user.args[1:]:
                return None, []
            if first.is_write and not user.users:  # x.copy_(...), x.add_(...) whose result nobody reads
                writes.append(user)
            elif not first.is_write and schema.returns and schema.returns[0].alias_info is not None:  # a view of x
                pending.append(user)
            else:
                return None, []
    return aliases, writes


def _drop_empty_cat_inputs(node: torch.fx.Node) -> bool:
    """Drop 1-D empty tensors from a ``cat``: torch skips them anyway (an empty key/value cache that Hugging
    Face models concatenate new keys to), but DTensor would try to shard them like the other inputs."""
    tensors, *rest = node.args
    kept = [t for t in tensors if not (isinstance(t, torch.fx.Node) and _is_empty_vector(t))]
    if len(kept) == len(tensors) or not kept:
        return False
    node.args = (kept, *rest)
    return True


def _is_empty_vector(node: torch.fx.Node) -> bool:
    value = node.meta.get("val")
    return isinstance(value, Tensor) and value.dim() == 1 and value.shape[0] == 0


def _is_meta_device(value: Any) -> bool:
    return isinstance(value, torch.device) and value.type == "meta"


def check_chain(pipe: Any, module_name: str) -> None:
    """Every stage must read only the previous stage's outputs (the first: only the model's inputs)."""
    producer: dict[Any, int] = {}
    checked = 0
    stage_of = {name: i for i, (name, _) in enumerate(pipe.split_gm.named_children())}
    for node in pipe.split_gm.graph.nodes:
        if node.op == "call_module" and node.target in stage_of:
            index = stage_of[node.target]
            sources = {producer.get(arg, -1) for arg in node.all_input_nodes}
            if sources != {index - 1}:
                raise ValueError(
                    f"{module_name}'s stage {index} reads activations of stages {sorted(s for s in sources if s >= 0)} "
                    f"or of the model's inputs, not only of stage {index - 1}; V-shaped schedules (zbv_zero_bubble, "
                    f"dualpipev) need a plain chain of stages. Use interleaved_zero_bubble or interleaved_1f1b."
                )
            producer[node] = index
            checked += 1
        elif node.op == "call_function" and node.all_input_nodes and node.all_input_nodes[0] in producer:
            producer[node] = producer[node.all_input_nodes[0]]  # getitem on a stage's output tuple
    if checked != pipe.num_stages:
        raise RuntimeError(f"Could not find the {pipe.num_stages} stages in the traced pipeline's graph.")


def where_trace_stopped(error: BaseException) -> str:
    """`` in Module.method (file:line)``: the innermost module code the failed trace ran, with a hint for
    control flow on tensor values (a mixture-of-experts loop over the experts a batch routes to, above all)."""
    site = None
    seen: BaseException | None = error
    while seen is not None:
        for frame, lineno in traceback.walk_tb(seen.__traceback__):
            owner = frame.f_locals.get("self")
            path = frame.f_code.co_filename
            if isinstance(owner, nn.Module) and _TORCH_FILES not in path and _OUR_FILES not in path:
                site = (type(owner).__name__, frame.f_code.co_name, os.path.basename(path), lineno)
        seen = seen.__cause__
    if site is None:
        return ""
    owner_name, method, filename, lineno = site
    text = f" in {owner_name}.{method} ({filename}:{lineno})"
    if "DataDependent" in root_cause(error) or "data-dependent" in root_cause(error):
        text += ", whose control flow depends on tensor values"
        if "expert" in owner_name.lower() or "moe" in owner_name.lower():
            text += (
                " (a loop over the experts a batch routes to; a transformers model traces with "
                "experts_implementation='grouped_mm', its default, or 'batched_mm', passed to from_pretrained "
                "or from_config)"
            )
    return text


_TORCH_FILES = os.sep + "torch" + os.sep
_OUR_FILES = os.sep + "lightning_parallel" + os.sep


def root_cause(error: BaseException) -> str:
    while error.__cause__ is not None:
        error = error.__cause__
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"
