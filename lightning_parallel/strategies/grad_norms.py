"""Gradient norms as Lightning logs them, of the whole model, under every layout.

Lightning's ``lightning.pytorch.utilities.grad_norm(module, norm_type)`` (what its docs call in
``on_before_optimizer_step``) computes ``p.grad.data.norm(norm_type)`` per parameter and then
``torch.tensor(list_of_norms).norm(norm_type)``. Under the engine that fails or lies:

* A DTensor gradient (TP, FSDP2 shards, experts over ``ep``): ``norm`` of a shard is a lazy DTensor whose placement is
  ``_NormPartial`` (each rank holds its shard's norm, not yet combined), and ``torch.tensor`` of a list of DTensors
  reads each element's storage directly, which a DTensor (a wrapper with no data of its own) does not have: "The
  tensor has a non-zero number of elements, but its data is not allocated yet".
* Pipeline stages: each rank holds its stages' parameters only, so each logs its own names and a total of its part.

:func:`grad_norm` here returns what one device would: every parameter's whole gradient norm (shards combined over
their mesh groups in one all-reduce per group for all parameters, :func:`parameter_norm_terms`) under its
single-device name on every rank (the terms of other stages' parameters added over ``pp``, of nn.ModuleList experts
other ranks hold over ``ep``: one all-reduce each), tied weights once, and the total of those. While the engine is
set up, Lightning's own ``grad_norm`` runs this one for modules the engine trains (its code object is redirected, so
``from lightning.pytorch.utilities import grad_norm`` bound before the run is covered too) and is put back at
teardown. Every rank must call it (it is collective), as Lightning's hooks do.
"""

from __future__ import annotations

import math
import weakref
from types import CodeType, FunctionType
from typing import TYPE_CHECKING, Any

import torch
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor, nn

from lightning_parallel import collectives
from lightning_parallel.parallelize.common.grad_norm import parameter_norm_terms

if TYPE_CHECKING:
    from lightning_parallel.strategies.host import EngineHost

#: Engines set up in this process (a module they train gets whole-model norms).
_ENGINES: weakref.WeakSet[Any] = weakref.WeakSet()
#: Lightning's own ``grad_norm`` code while its function runs :func:`_redirected` instead.
_LIGHTNING_CODE: list[CodeType] = []

DROP_IN = "lightning_parallel.grad_norm(module, norm_type)"


def grad_norm(module: nn.Module, norm_type: float | str, group_separator: str = "/") -> dict[str, Tensor]:
    """Each parameter's gradient norm and their total, as ``lightning.pytorch.utilities.grad_norm`` computes them
    on one device, for a module trained under any layout (every rank gets every name).

    Args:
        module: The module to inspect (the LightningModule or one of its submodules).
        norm_type: The p of the p-norm (``'inf'`` for the largest absolute value).
        group_separator: Between ``grad_{p}_norm`` and each parameter's name, as in Lightning.

    Returns:
        ``{"grad_{p}_norm{sep}{name}": norm, ..., "grad_{p}_norm_total": total}`` (0-dim tensors on the gradients'
        device); empty when no parameter has a gradient.
    """
    norm_type = float(norm_type)
    if norm_type <= 0:
        raise ValueError(f"`norm_type` must be a positive number or 'inf' (infinity norm). Got {norm_type}")
    engine, prefix = _engine_of(module)
    duplicates = _norm_duplicates(engine)
    held = [(name, p.grad) for name, p in module.named_parameters() if p.grad is not None and id(p) not in duplicates]
    terms = parameter_norm_terms([g for _, g in held], norm_type)
    names = _whole_names(engine, module, prefix, [name for name, _ in held])
    inf = math.isinf(norm_type)
    if names is None:  # every rank holds the same names
        kept, values = [name for name, _ in held], terms
    else:
        values, kept = _combine_over_ranks(engine, prefix, names, held, terms, inf)
    if not kept:
        return {}
    total = values.max() if inf else values.sum().pow(1.0 / norm_type)
    roots = values if inf else values.pow(1.0 / norm_type)
    norms = {f"grad_{norm_type}_norm{group_separator}{name}": roots[i] for i, name in enumerate(kept)}
    norms[f"grad_{norm_type}_norm_total"] = total
    return norms


def _combine_over_ranks(
    engine: EngineHost, prefix: str, names: list[str], held: list[tuple[str, Tensor]], terms: Tensor, inf: bool
) -> tuple[Tensor, list[str]]:
    """Every rank's terms by the whole model's names: a [2, names] table (terms, held by some rank), reduced over the
    ranks holding different parameters; returns the terms and names that some rank holds."""
    index = {name: i for i, name in enumerate(names)}
    table = torch.zeros(2, len(names), dtype=terms.dtype, device=terms.device)
    if held:
        at = torch.tensor([index[name] for name, _ in held], device=terms.device)
        table[0, at] = terms
        table[1, at] = 1
    op = collectives.MAX if inf else collectives.SUM
    experts = engine.expert_parallel
    if experts.list_group is not None:
        listed = tuple(f"{fqn}." for fqn in experts.expert_lists)
        rows = [i for i, name in enumerate(names) if (prefix + name).startswith(listed)]
        if rows:  # each expert is held by one rank of the group; the other parameters by all of them
            at = torch.tensor(rows, device=terms.device)
            table[:, at] = collectives.all_reduce(table[:, at].contiguous(), op=op, group=experts.list_group)
    if engine.pipeline_parallel.staged:
        collectives.all_reduce(table, op=op, group=engine.pipeline_runner.pp_group)
    found = table[1].tolist()  # one host read: which names some rank holds
    kept = [i for i, flag in enumerate(found) if flag > 0]
    return table[0, torch.tensor(kept, dtype=torch.long, device=terms.device)], [names[i] for i in kept]


def _whole_names(engine: EngineHost | None, module: nn.Module, prefix: str, local: list[str]) -> list[str] | None:
    """Every name some rank may hold under ``module``, in one order on every rank; ``None`` where every rank holds
    the same parameters (no pipeline stages, no nn.ModuleList experts divided over ``ep``)."""
    if engine is None:
        return None
    staged = engine.pipeline_parallel.staged
    experts = engine.expert_parallel
    if not staged and experts.list_group is None:
        return None
    if staged:
        # The whole module's state-dict names, taken before the cut: the same on every rank (buffers and second
        # names of tied weights among them are held by no rank as parameters, and dropped).
        whole = [name[len(prefix):] for name in engine.pipeline_runner.whole_shapes if name.startswith(prefix)]
        return list(dict.fromkeys([*whole, *local]))
    remote = [name[len(prefix):] for name in experts.remote_expert_shapes if name.startswith(prefix)]
    ordered = experts.whole_order([prefix + name for name in dict.fromkeys([*local, *remote])])
    return [name[len(prefix):] for name in ordered]


def _norm_duplicates(engine: EngineHost | None) -> set[int]:
    """Copies of tied weights another pipeline stage counts."""
    if engine is None or not engine.pipeline_parallel.staged:
        return set()
    return {id(p) for p in engine.pipeline_runner.norm_duplicates(engine.lightning_module)}


def _engine_of(module: nn.Module) -> tuple[EngineHost | None, str]:
    """The engine training ``module`` and ``module``'s name prefix in its LightningModule (``"a.b."``)."""
    for engine in list(_ENGINES):
        root = engine.lightning_module
        if root is None:
            continue
        for name, sub in root.named_modules():
            if sub is module:
                return engine, f"{name}." if name else ""
    return None, ""


# ---------------------------------------------------------------------- Lightning's own grad_norm


def _redirected(module: Any, norm_type: Any, group_separator: Any = "/") -> Any:
    # Runs as Lightning's grad_norm's code (with that function's globals): import what it needs here.
    from lightning_parallel.strategies import grad_norms  # noqa: PLW0406 (this code runs as Lightning's function)

    return grad_norms._dispatch(module, norm_type, group_separator)


def _dispatch(module: nn.Module, norm_type: Any, group_separator: str) -> dict[str, Tensor]:
    if _engine_of(module)[0] is not None or not _LIGHTNING_CODE:
        return grad_norm(module, norm_type, group_separator)
    from lightning.pytorch.utilities import grads

    lightning = FunctionType(_LIGHTNING_CODE[0], grads.__dict__, "grad_norm", grads.grad_norm.__defaults__)
    return lightning(module, norm_type, group_separator)


def attach(engine: EngineHost) -> None:
    """From ``engine``'s setup until its teardown, Lightning's ``grad_norm`` of a module it trains is :func:`grad_norm`."""
    _ENGINES.add(engine)
    if _LIGHTNING_CODE:
        return
    from lightning.pytorch.utilities import grads

    function = getattr(grads, "grad_norm", None)
    code = getattr(function, "__code__", None)
    if code is None or code.co_freevars or code.co_argcount != 3:
        rank_zero_warn(
            f"lightning.pytorch.utilities.grad_norm is not the function lightning_parallel knows (Lightning 2.6): under "
            f"sharded, tensor- or pipeline-parallel layouts call {DROP_IN} instead."
        )
        return
    _LIGHTNING_CODE.append(code)
    function.__code__ = _redirected.__code__


def detach(engine: EngineHost) -> None:
    """``engine`` tears down: once no engine is set up, Lightning's ``grad_norm`` is its own again."""
    _ENGINES.discard(engine)
    if _ENGINES or not _LIGHTNING_CODE:
        return
    from lightning.pytorch.utilities import grads

    grads.grad_norm.__code__ = _LIGHTNING_CODE.pop()


#: An error Lightning's own grad_norm raises on DTensor gradients (when not redirected here).
UNALLOCATED = ".*data is not allocated yet.*"
HINT = (
    f"Lightning's grad_norm cannot read DTensor gradients (sharded, tensor- or expert-parallel parameters): call "
    f"{DROP_IN}, which returns each parameter's whole-model norm and the total on every rank."
)
