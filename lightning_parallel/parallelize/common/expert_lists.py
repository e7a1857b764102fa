"""Finding Mixture-of-Experts blocks whose experts are an ``nn.ModuleList`` of MLPs, by structure.

Shared by the layers that must tell such experts from a stack of layers (the trunk a pipeline cuts, the tensor-parallel
plan, the planner) and by expert parallelism, which divides them (:mod:`lightning_parallel.parallelize.expert.module_list`).
No Lightning here.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn


@dataclass(frozen=True)
class ExpertList:
    """One MoE block's experts kept as an ``nn.ModuleList``.

    Attributes:
        block: FQN of the MoE block (the list's parent), whose forward loops over the experts.
        attribute: The list's name on the block.
        num_experts: ``E``, the list's length.
        parameters: Each expert's parameter names (the same for every expert).
    """

    block: str
    attribute: str
    num_experts: int
    parameters: tuple[str, ...]

    @property
    def fqn(self) -> str:
        """The list's FQN."""
        return f"{self.block}.{self.attribute}" if self.block else self.attribute

    def parameter_names(self, experts: range | list[int]) -> list[str]:
        """FQNs of the parameters of ``experts`` (global indices)."""
        return [f"{self.fqn}.{e}.{name}" for e in experts for name in self.parameters]


def _structure(module: nn.Module) -> tuple[tuple[str, tuple[int, ...]], ...]:
    return tuple((name, tuple(p.shape)) for name, p in module.named_parameters())


def expert_list(block_fqn: str, block: nn.Module, attribute: str, experts: nn.ModuleList) -> ExpertList | None:
    """``experts`` as MoE experts of ``block``, or ``None``.

    An ``nn.ModuleList`` of two or more MLPs of one type with the same parameters (names and shapes), every module
    holding parameters in them an ``nn.Linear``, next to a router: a 2-D parameter of the block outside the list
    (not an embedding table) of ``[E, H]`` or ``[H, E]``, ``H`` an input width of the experts' layers
    (``nn.Linear(H, E)``'s weight, or a raw matrix). The router and the plain MLPs are what tell experts apart
    from a stack of layers (whose norms and attention are not linear layers).
    """
    count = len(experts)
    if count < 2 or len({type(child) for child in experts}) != 1:
        return None
    structure = _structure(experts[0])
    if not structure or any(_structure(child) != structure for child in experts):
        return None
    holders = [m for m in experts[0].modules() if any(True for _ in m.parameters(recurse=False))]
    if not all(isinstance(m, nn.Linear) for m in holders):
        return None
    if router_of(block, experts) is None:
        return None
    return ExpertList(block_fqn, attribute, count, tuple(name for name, _ in structure))


def router_of(block: nn.Module, experts: nn.ModuleList) -> nn.Parameter | None:
    """The router of ``block``'s ``experts``: its first 2-D parameter outside the list (not an embedding table) of
    ``[E, H]`` or ``[H, E]``, ``H`` an input width of the experts' linear layers; ``None`` if it has none."""
    count = len(experts)
    widths = {m.in_features for m in experts[0].modules() if isinstance(m, nn.Linear)}
    shapes = {(count, w) for w in widths} | {(w, count) for w in widths}
    listed = {id(p) for p in experts.parameters()}
    return next(
        (p for sub in block.modules() if not isinstance(sub, nn.Embedding)
         for p in sub.parameters(recurse=False) if p.dim() == 2 and id(p) not in listed and tuple(p.shape) in shapes),
        None,
    )


def find_expert_lists(module: nn.Module) -> dict[str, ExpertList]:
    """Every MoE block under ``module`` whose experts are an ``nn.ModuleList``: list FQN -> :class:`ExpertList`."""
    found: dict[str, ExpertList] = {}
    for fqn, block in module.named_modules():
        for attribute, child in block.named_children():
            if isinstance(child, nn.ModuleList):
                experts = expert_list(fqn, block, attribute, child)
                if experts is not None:
                    found[experts.fqn] = experts
    return found
