"""The automatic tensor-parallel plan: attention and MLP projections recognised in the module tree.

:func:`infer_units` finds the groups of projections that are split together (one attention, one MLP, one
published entry) — a group is split whole or not at all; :func:`infer_plan` flattens them into a plan.
Groups are recognised:

- a MoE block's grouped experts (3-D ``gate_up_proj``/``down_proj``, transformers' fused layout): style
  ``experts`` (:mod:`~lightning_parallel.parallelize.tensor.experts`); ``nn.ModuleList`` experts are MLPs below;
- within one module: q/k/v/output by conventional names (the query may carry its per-head output gate fused in,
  ``q_gate_proj``, laid out per head), multi-head latent attention's per-head up
  projections (``q_b_proj``, ``kv_b_proj``) and output, fused ``q|k|v`` (blocks or grouped per key/value
  head, as ``query_key_value`` is laid out), fused ``gate|up``, and MLPs by shape (``d→h, h→d``, gated
  ``d→h, d→h, h→d``);
- across sibling modules, as BERT and its relatives write them: q/k/v in one child
  (``attention.self.{query,key,value}``) and the output projection in the next (``attention.output.dense``);
  the MLP's ``d→h`` projection alone in one child (``intermediate.dense``) and its ``h→d`` alone in the next
  (``output.dense``). Only where the children hold nothing else that depends on the split width.
- a module that weighs per-head results and combines them over every head (a sparse-attention indexer): its
  per-head queries and weights column-wise with the output gathered whole (:func:`_weighted_heads`).

Which groups divide by a given TP degree is decided by the caller
(:meth:`~lightning_parallel.parallelize.tensor.apply.TensorParallelConfig.resolve`). No Lightning here.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Mapping

from torch import nn

from lightning_parallel.parallelize.tensor.channel_recurrence import match_channel_recurrence
from lightning_parallel.parallelize.tensor.adapters import fold_side_paths
from lightning_parallel.parallelize.tensor.channels import depthwise_channels
from lightning_parallel.parallelize.tensor.experts import find_experts
from lightning_parallel.parallelize.tensor.projections import (
    KEY_VALUE_HEADS,
    QUERY_HEADS,
    features,
    head_count,
    is_projection,
)
from lightning_parallel.parallelize.tensor.projector import match_projector
from lightning_parallel.parallelize.tensor.mlp_beside import match_mlp_beside_squares
from lightning_parallel.parallelize.tensor.published_plan import published_plan
from lightning_parallel.parallelize.tensor.recurrent_block import match_gated_recurrence
from lightning_parallel.parallelize.tensor.split_region import interleaved_groups
from lightning_parallel.parallelize.tensor.state_space import find_state_space
from lightning_parallel.parallelize.tensor.tied import tied_groups

# Attention projections by conventional names: (query, key, value, output).
_ATTENTION_NAMES: tuple[tuple[str, str, str, str], ...] = (
    ("q_proj", "k_proj", "v_proj", "o_proj"),
    ("q_proj", "k_proj", "v_proj", "out_proj"),
    ("wq", "wk", "wv", "wo"),
    ("query", "key", "value", "out"),
    ("query", "key", "value", "dense"),
    ("to_q", "to_k", "to_v", "to_out"),
    ("query_proj", "key_proj", "value_proj", "out_proj"),
    ("q_lin", "k_lin", "v_lin", "out_lin"),  # XLM, FlauBERT, DistilBERT
    ("q", "k", "v", "out_proj"),  # xLSTM's mLSTM layer
    # A query projection fused with the per-head output gate (gated attention), beside separate k/v. Laid out per
    # head, as every such projection transformers has (MiniCPM5-MoE's ``q_gate_proj``, like Qwen3-Next's doubled
    # ``q_proj``, is viewed as ``[..., heads, 2·head_dim]`` and chunked on the last dim): head h's rows are
    # ``q_h | gate_h``, so a plain column split gives each rank whole heads of both.
    ("q_gate_proj", "k_proj", "v_proj", "o_proj"),
)
# Multi-head latent attention (DeepSeek-V2/V3 and kin): per-head up projections of the query (``q_b_proj``, or a
# plain ``q_proj`` without a query latent) and of the key/value latent (``kv_b_proj``), and the output projection.
# The latent down projections (``q_a_proj``, ``kv_a_proj_with_mqa``) stay replicated (tensor.latent).
_LATENT_QUERY_NAMES = ("q_b_proj", "q_proj")
_LATENT_KEY_VALUE_NAMES = ("kv_b_proj",)
# Fused projections laid out as concatenated blocks q | k | v (GQA: k and v narrower), and their output projections.
_FUSED_QKV_NAMES = ("qkv", "c_attn", "wqkv", "qkv_proj")
_ATTENTION_OUTPUT_NAMES = ("o_proj", "c_proj", "out_proj", "dense", "wo", "proj", "out")
# Fused q/k/v laid out per key/value head: for each k/v head g, its query heads, then k_g, then v_g. With as
# many k/v heads as query heads that is per-head interleaving (GPT-NeoX, BLOOM, Persimmon, Falcon-7B-style);
# with fewer, grouped (Falcon's new decoder architecture); with one k/v head, blocks q | k | v (Falcon's
# multi-query attention). Contiguous rows are then whole k/v groups: a plain column split, whole groups per rank.
_GROUPED_QKV_NAMES = ("query_key_value",)
# Fused gate | up projections of gated MLPs, and their output projections.
_FUSED_GATE_UP_NAMES = ("gate_up_proj",)
_MLP_OUTPUT_NAMES = ("down_proj", "c_proj", "fc2", "w2", "wo")

log = logging.getLogger(__name__)

#: One group of projections split together: ``{FQN: style}``.
Unit = dict[str, str]


def infer_plan(
    module: nn.Module, warn: Callable[[str], None] = log.warning, sources: dict[str, str] | None = None
) -> dict[str, str]:
    """Build a Megatron-style plan from the module tree; returns ``{FQN: style}`` (an exact-name plan).

    - attention with separate q/k/v/output projections (conventional names): q/k/v column-wise, output
      row-wise, also where the output projection lives in the next sibling module (BERT's
      ``attention.self.query`` ... ``attention.output.dense``);
    - fused q|k|v projections (``qkv_proj``, GPT-2's ``c_attn``, ...): split by blocks and whole heads
      (``fused_qkv``); ``query_key_value`` (laid out per key/value head): split by whole k/v groups
      (``colwise``); output row-wise; fused ``gate_up_proj``: ``fused_gate_up``, ``down_proj`` row-wise;
    - MLPs, recognised by shape among a module's direct projections, or one projection in each of two
      sibling modules: ``d→h, h→d`` (first column-wise, second row-wise) and gated ``d→h, d→h, h→d``;
    - projections are ``nn.Linear`` (or a subclass computing the same map) or transformers' ``Conv1D``;
    - a Hugging Face model's own published plan (its ``_tp_plan``) fills in what the above leaves out: the
      embedding and an untied output head; without one, the token embedding and the head of the same
      ``[vocabulary, width]`` shape are found by shape, tied (one tensor) or not;
    - ``nn.MultiheadAttention`` and fused projections of unknown layout stay replicated, with a warning.

    Args:
        sources: Filled with where each entry came from (``"inferred"`` or ``"model's tp_plan"``).
    """
    plan: dict[str, str] = {}
    for unit in infer_units(module, warn, sources):
        plan.update(unit)
    return plan


def infer_units(
    module: nn.Module, warn: Callable[[str], None] = log.warning, sources: dict[str, str] | None = None,
    exclude: Collection[str] = (),
) -> list[Unit]:
    """The groups of projections :func:`infer_plan` splits, each split whole or not at all; modules in ``exclude``
    (and below them) are left to another parallelism (experts that expert parallelism divides)."""
    sources = sources if sources is not None else {}
    published = published_plan(module)
    units: list[Unit] = []
    taken: set[str] = set(exclude)
    for name, layout in find_experts(module).items():
        if name in taken:
            continue
        if isinstance(layout, str):
            warn(f"{name}: grouped experts left replicated: {layout}.")
        else:
            units.append({name: "experts"})
            taken.add(name)
    # Modules whose projections no later rule looks into: state-space mixers, and the excluded ones (an MLP below an
    # excluded module, nn.ModuleList experts that expert parallelism divides, is not split either).
    mixers: set[str] = set(exclude)
    for name, layout in find_state_space(module).items():
        if _within(name, taken):
            continue
        # Its projections belong to the mixer, split or whole (none is an MLP, an attention or an output head).
        mixers.add(name)
        taken.add(name)
        if isinstance(layout, str):
            warn(f"{name}: state-space mixer left replicated: {layout}.")
        else:
            units.append({name: "state_space"})
    for name, sub in module.named_modules():
        prefix = f"{name}." if name else ""
        if _within(name, mixers):
            continue
        if isinstance(sub, nn.MultiheadAttention):
            warn(f"{name or type(sub).__name__}: nn.MultiheadAttention keeps q/k/v fused inside; left replicated.")
            continue
        projections = {child: m for child, m in sub.named_children() if is_projection(m)}
        unit = {f"{prefix}{child}": style for child, style in _match_block(sub, prefix, projections, published, warn).items()}
        if unit:
            units.append(unit)
            taken.update(unit)
    for name, sub in module.named_modules():
        if _within(name, mixers):
            continue
        for unit in _match_siblings(sub, f"{name}." if name else "", taken):
            if any(_within(fqn, exclude) for fqn in unit):
                continue
            units.append(unit)
            taken.update(unit)
    for name, sub in module.named_modules():
        prefix = f"{name}." if name else ""
        projections = {child: m for child, m in sub.named_children() if is_projection(m)}
        if not _within(name, mixers) and not any(f"{prefix}{child}" in taken for child in projections):
            unit = {f"{prefix}{child}": style for child, style in _weighted_heads(sub, projections).items()}
            if unit:
                units.append(unit)
                taken.update(unit)
    tied = _tied_modules(module)
    # What the published plan adds, one group per parent module: a column-wise projection and the row-wise one
    # reading its output (a shared expert's gate/up/down) are split together or not at all.
    leftovers: dict[str, Unit] = {}
    for fqn, style in published.items():
        if fqn in taken or any(fqn.startswith(f"{done}.") for done in taken) or fqn in tied:
            continue  # tied: shares its weight with another module (an embedding and its head): kept whole
        leftovers.setdefault(fqn.rpartition(".")[0] if style in ("colwise", "rowwise") else fqn, {})[fqn] = style
        sources[fqn] = "model's tp_plan"
    units += leftovers.values()
    taken.update(fqn for unit in leftovers.values() for fqn in unit)
    units += _vocabulary_pair(module, taken, tied)
    # Adapters added to a split projection's output (Zamba2's per-depth LoRA) split with it (tensor.adapters).
    units = fold_side_paths(module, units)
    for unit in units:
        for fqn in unit:
            sources.setdefault(fqn, "inferred")
    return units


def _within(fqn: str, names: Collection[str]) -> bool:
    """``fqn`` is one of ``names`` or below one."""
    return any(fqn == name or fqn.startswith(f"{name}.") for name in names)


def _vocabulary_pair(module: nn.Module, taken: Collection[str], tied: Collection[str]) -> list[Unit]:
    """The input embedding and the untied output head, where the model publishes no plan for them.

    Found by shape: the one ``nn.Embedding`` and the one ``nn.Linear`` whose weights are both ``[vocabulary, width]``
    (nothing else of that shape that no other group split, or, among several embeddings of that shape, the one tied to
    the head), as a language model's token embedding and head are. The
    embedding splits over the vocabulary (its output all-reduced), the head over its outputs with the logits
    gathered whole (the model's own loss reads them). A tied pair (one tensor in two modules) is one group, split
    the same way; an embedding with no such head stays whole, as the model may read its weight elsewhere.
    """
    def untaken(fqn: str) -> bool:
        return fqn not in taken and not any(fqn.startswith(f"{done}.") for done in taken)

    def free(fqn: str) -> bool:
        return fqn not in tied and untaken(fqn)

    embeddings: dict[tuple[int, ...], list[str]] = {}
    heads: dict[tuple[int, ...], list[str]] = {}
    for fqn, sub in module.named_modules():
        if isinstance(sub, nn.Embedding) and type(sub).forward is nn.Embedding.forward or _scaled_embedding(sub):
            embeddings.setdefault(tuple(sub.weight.shape), []).append(fqn)
        elif isinstance(sub, nn.Linear) and is_projection(sub):
            heads.setdefault(tuple(sub.weight.shape), []).append(fqn)
    units: list[Unit] = []
    for shape, found in embeddings.items():
        # Projections already split (an MLP whose width happens to equal the vocabulary) are not head candidates.
        matching = [fqn for fqn in heads.get(shape, []) if untaken(fqn)]
        if len(matching) != 1 or shape[0] <= shape[1]:
            continue
        if len(found) > 1:
            # Several embeddings of the head's shape (Gemma 4's per-layer input embedding may match the token
            # embedding's): the one whose weight *is* the head's (tied) is the token embedding; else ambiguous.
            found = [fqn for fqn in found if _tied_pair(module, fqn, matching[0])]
            if len(found) != 1:
                continue
        embedding, head = found[0], matching[0]
        if free(embedding) and free(head):
            units += [{embedding: "embedding_rowwise"}, {head: "colwise_gather_output"}]
        elif _tied_pair(module, embedding, head) and untaken(embedding) and untaken(head):
            # One tensor in two modules: both split its vocabulary rows (Shard(0) in either style), as one group,
            # and apply_tensor_parallel ties the two modules to the one sharded parameter again.
            units.append({embedding: "embedding_rowwise", head: "colwise_gather_output"})
    return units + _tables_of_the_vocabulary(embeddings, heads, {fqn for unit in units for fqn in unit}, untaken, free)


def _tables_of_the_vocabulary(embeddings: Mapping[tuple[int, ...], list[str]], heads: Mapping[tuple[int, ...], list[str]],
                              split: Collection[str], untaken: Callable[[str], bool], free: Callable[[str], bool]) -> list[Unit]:
    """Other embedding tables at least as large as the vocabulary the output head writes (RoCBert's shape and
    pronunciation tables beside its token embedding, BLT's hash n-gram tables): split over their rows too, each its own
    group. Smaller tables (positions, token types) stay whole: their lookup's all-reduce would cost more than they hold.
    A model reading such a table's weight outside its forward gets it gathered whole (vocabulary.gather_reads_elsewhere)."""
    # Heads: projections of an embedding's shape [vocabulary, width] that no attention or MLP took.
    vocabularies = [shape[0] for shape in embeddings for head in heads.get(shape, []) if untaken(head) and shape[0] > shape[1]]
    if not vocabularies:
        return []
    smallest = min(vocabularies)
    return [{fqn: "embedding_rowwise"} for shape, found in embeddings.items() if shape[0] >= smallest and shape[0] > shape[1]
            for fqn in found if fqn not in split and free(fqn)]


def _tied_pair(module: nn.Module, embedding: str, head: str) -> bool:
    """The head's weight is the embedding's (one tensor), no third module holds it, and neither module shares any
    other parameter, except the head's bias with modules above it (BERT's ``cls.predictions.bias``, tied.aliases):
    the tie a language model's ``tie_word_embeddings`` makes."""
    involved = [sorted(holders) for holders in tied_groups(module) if any(fqn in (embedding, head) for fqn, _ in holders)]
    pair = sorted([(embedding, "weight"), (head, "weight")])
    return pair in involved and all(group == pair or _bias_above(group, head) for group in involved)


def _bias_above(holders: list[tuple[str, str]], head: str) -> bool:
    """``holders`` are the head's bias and modules above the head holding the same tensor."""
    return (head, "bias") in holders and all((fqn, name) == (head, "bias") or head.startswith(f"{fqn}.") or not fqn
                                             for fqn, name in holders)


def _scaled_embedding(module: nn.Module) -> bool:
    """An ``nn.Embedding`` subclass whose forward scales the looked-up rows (Gemma's ``embed_scale``): linear, so
    splitting the vocabulary keeps it exact."""
    return isinstance(module, nn.Embedding) and hasattr(module, "embed_scale") and not any(
        True for name, _ in module.named_parameters() if name != "weight")


def grouped_qkv_heads(attention: nn.Module | None, projection: nn.Module) -> tuple[int, int] | None:
    """``(query heads, key/value heads)`` of a ``query_key_value`` projection laid out per k/v group, or
    ``None`` where the attention's head counts do not explain its width (its layout is then unknown)."""
    query = head_count(attention, QUERY_HEADS)
    if query is None:
        return None
    kv = head_count(attention, KEY_VALUE_HEADS)
    heads, kv_heads = query[0], (kv[0] if kv is not None else query[0])
    _, out = features(projection)
    if heads % kv_heads or out % (heads + 2 * kv_heads):
        return None
    return heads, kv_heads


def _match_block(
    sub: nn.Module, prefix: str, projections: Mapping[str, nn.Module], published: Mapping[str, str], warn: Callable[[str], None]
) -> dict[str, str]:
    """Styles for one module's direct projections (attention, fused attention, MLP), or ``{}``."""
    lowered = {child.lower(): child for child in projections}
    qkv = next((lowered[n] for n in _FUSED_QKV_NAMES if n in lowered), None)
    grouped = next((lowered[n] for n in _GROUPED_QKV_NAMES if n in lowered), None)
    gate_up = next((lowered[n] for n in _FUSED_GATE_UP_NAMES if n in lowered), None)
    if qkv is not None or grouped is not None:
        fused = qkv or grouped
        out = next((lowered[n] for n in _ATTENTION_OUTPUT_NAMES if n in lowered and lowered[n] != fused), None)
        if grouped is not None and out is not None:
            heads = grouped_qkv_heads(sub, projections[grouped])
            if heads is not None and heads[1] == 1 < heads[0]:
                # One k/v group is blocks q | k | v (Falcon's multi-query attention): split as a fused q|k|v, whose
                # one k/v head is gathered after the projection (tensor.multi_query).
                return {grouped: "fused_qkv", out: "rowwise"}
            if published.get(f"{prefix}{grouped}") == "colwise" or heads:
                return {grouped: "colwise", out: "rowwise"}
        if qkv is not None and out is not None and interleaved_groups(sub) is not None:
            # Rows in mp_num groups, each q_g | v_g | k_g for its heads (CodeGen): contiguous rows are whole
            # groups, so a plain column split gives each rank whole heads (check_plan: the degree divides mp_num).
            return {qkv: "colwise", out: "rowwise"}
        if qkv is not None and out is not None and head_count(sub, QUERY_HEADS):
            return {qkv: "fused_qkv", out: "rowwise"}
        warn(f"{prefix}{fused}: fused q/k/v projection of unknown layout (or without head counts); left replicated.")
        return {}
    if gate_up is not None:
        out = next((lowered[n] for n in _MLP_OUTPUT_NAMES if n in lowered), None)
        if out is not None:
            return {gate_up: "fused_gate_up", out: "rowwise"}
        warn(f"{prefix}{gate_up}: fused gate/up projection without a recognised output projection; left replicated.")
        return {}
    latent = _match_latent_attention(projections)
    if latent:
        out_name = next(name for name, style in latent.items() if style == "rowwise")
        return {**latent, **{gate: "colwise" for gate in _head_gates(sub, projections, out_name, latent)}}
    attention = _match_attention(projections)
    if attention:
        *qkv_names, out_name = attention
        gates = _head_gates(sub, projections, out_name, attention)
        readers = _per_head_readers(sub, projections, qkv_names, {*attention, *gates})
        return {**{child: "colwise" for child in (*qkv_names, *gates)}, out_name: "rowwise",
                **{child: "colwise_gather_input" for child in readers}}
    named = _named_gated_mlp(projections)
    if named:
        return named
    short_convolution = _match_short_convolution(sub, projections)
    if short_convolution:
        return short_convolution
    recurrence = match_gated_recurrence(sub, projections)
    if recurrence:
        return recurrence
    # Beside blocks of its own (a decoder layer holding its attention), a module's direct projections are its
    # MLP only if they widen the model (OPT's, BART's fc1/fc2): two that narrow it are a side path whose
    # hidden values may meet a replicated tensor of that width (Gemma4's per-layer input gate and
    # projection), which a column split would cut: left replicated.
    beside_blocks = any(_holds_projection(child) for child in sub.children() if not is_projection(child))
    mlp = _match_mlp(projections, widening_only=beside_blocks)
    # Not an MLP: a two-layer projector a→h, h→e (a multimodal adaptor), split once a run confirms it (tensor.projector).
    return (mlp or ({} if beside_blocks else match_projector(sub, projections)) or match_mlp_beside_squares(sub, projections)
            or match_channel_recurrence(sub, projections))


def _weighted_heads(sub: nn.Module, projections: Mapping[str, nn.Module]) -> dict[str, str]:
    """Per-head queries and per-head weights of a module no pattern above took: ``colwise_gather_output`` each.

    A module keeping its own head count ``h`` and ``head_dim`` ``d`` (``n_heads``, ``num_heads``, ... attributes of
    the module itself, not of a shared ``config``) with a projection writing one value per head (``h`` outputs)
    beside one writing a vector per head (``h·d`` outputs), none taking the heads' width ``h·d`` back to the width
    the weights are read from (no output projection) and nothing besides its projections but norms, weighs its
    heads' results and combines them over every head: the
    sparse-attention indexer of DeepSeek-V3.2 and GLM-MoE-DSA (``wq_b`` its per-head queries, ``weights_proj`` their
    weights, the weighted scores summed over the heads before a top-k). A split by heads would need that sum reduced
    inside the module's own code; instead those projections are split over their output features with the output
    gathered whole: each rank holds and computes ``1/tp`` of their weights and whatever reads their output sees the
    whole tensor, as on one device (exact whatever follows; one all-gather per projection in forward, one all-reduce
    of its input gradient in backward). The module's other projections (a key shared by every head) stay whole.
    ``{}`` for anything else, and (the caller) for a module whose projections another group already took.
    """
    heads = next((value for name in QUERY_HEADS if isinstance(value := vars(sub).get(name), int)
                  and not isinstance(value, bool) and value > 1), None)
    if heads is None:
        return {}
    head_dim = vars(sub).get("head_dim")
    if not isinstance(head_dim, int) or isinstance(head_dim, bool) or head_dim < 2:
        return {}
    widths = {name: features(projection) for name, projection in projections.items()}
    if any(True for _ in sub.parameters(recurse=False)) or any(
            param.dim() != 1 for child, m in sub.named_children() if child not in projections for param in m.parameters()):
        return {}  # besides its projections, nothing but norms (vectors): no per-head parameter, no other mixer
    weights = [name for name, (_, out) in widths.items() if out == heads]
    vectors = [name for name, (_, out) in widths.items() if out == heads * head_dim]
    if not weights or not vectors:
        return {}
    # A projection reading the heads' width and writing the width the weights are read from is an output projection
    # (heads back to the model width): an attention of another layout, whose heads this does not follow.
    model_widths = {widths[name][0] for name in weights}
    if any(width_in == heads * head_dim and out in model_widths for width_in, out in widths.values()):
        return {}
    return {name: "colwise_gather_output" for name in (*vectors, *weights)}


def _holds_projection(module: nn.Module) -> bool:
    return any(is_projection(m) for m in module.modules())


def _match_siblings(parent: nn.Module, prefix: str, taken: set[str]) -> list[Unit]:
    """Attention and MLPs split over two consecutive children of ``parent`` (BERT's layout)."""
    children = list(parent.named_children())
    units: list[Unit] = []
    used: set[str] = set()
    for (first, a), (second, b) in zip(children, children[1:]):
        if first in used:
            continue
        # Projections inside the second child that are split on their own, reading and writing the model width
        # (X-MOD's per-language adapters after the MLP's output.dense), run on its whole output: not in the way.
        beside = {fqn[len(f"{prefix}{second}."):] for fqn in taken if fqn.startswith(f"{prefix}{second}.")}
        found = _sibling_attention(a, b) or _sibling_mlp(a, b, beside)
        unit = {f"{prefix}{(first, second)[side]}.{child}": style for (side, child), style in found.items()}
        if unit and not taken.intersection(unit):
            units.append(unit)
            used.update((first, second))
    return units


def _sibling_attention(a: nn.Module, b: nn.Module) -> dict[tuple[int, str], str]:
    """q/k/v as ``a``'s only parameters, the output projection in ``b`` (with nothing else as wide as heads)."""
    projections = {name: m for name, m in a.named_children() if is_projection(m)}
    names = next((n[:3] for n in _ATTENTION_NAMES if all(x in projections for x in n[:3])), None)
    if names is None or _parameter_count(a) != sum(_parameter_count(projections[n]) for n in names):
        return {}
    d_model, width = features(projections[names[0]])
    outputs = [n for n, m in b.named_children() if is_projection(m) and n.lower() in _ATTENTION_OUTPUT_NAMES
               and features(m) == (width, d_model)]
    if len(outputs) != 1 or not _only_model_width_besides(b, outputs[0], d_model):
        return {}
    return {**{(0, n): "colwise" for n in names}, (1, outputs[0]): "rowwise"}


def _sibling_mlp(a: nn.Module, b: nn.Module, split_in_b: Collection[str] = ()) -> dict[tuple[int, str], str]:
    """``a`` holds a ``d→h`` projection, ``b`` an ``h→d`` one (and, each, parameters of width ``d``: a norm; ``b`` also
    projections ``split_in_b`` split on their own, each reading or writing ``d``: adapters after the MLP)."""
    up = [(n, m) for n, m in a.named_children() if is_projection(m)]
    down = [(n, m) for n, m in b.named_children() if is_projection(m)]
    if len(up) != 1 or len(down) != 1:
        return {}
    (up_name, up_module), (down_name, down_module) = up[0], down[0]
    d_model, hidden = features(up_module)
    if hidden == d_model or features(down_module) != (hidden, d_model):
        return {}
    beside = [n for n in split_in_b if is_projection(b.get_submodule(n)) and d_model in features(b.get_submodule(n))]
    # Besides its projection, the first child may hold a norm of the model width (applied to its input:
    # RoBERTa-PreLayerNorm's intermediate); nothing of the split width.
    if not _only_model_width_besides(a, up_name, d_model) or not _only_model_width_besides(b, down_name, d_model, beside):
        return {}
    return {(0, up_name): "colwise", (1, down_name): "rowwise"}


def _only_model_width_besides(module: nn.Module, projection: str, d_model: int, split: Collection[str] = ()) -> bool:
    """Every parameter of ``module`` outside ``projection`` (and the modules ``split``) is a vector of the model width
    (a norm, a bias)."""
    return all(
        any(name.startswith(f"{owner}.") for owner in (projection, *split)) or (param.dim() == 1 and param.numel() == d_model)
        for name, param in module.named_parameters()
    )


def _parameter_count(module: nn.Module) -> int:
    return sum(1 for _ in module.parameters())


def _tied_modules(module: nn.Module) -> set[str]:
    """Modules holding a parameter that another module holds too."""
    owners: dict[int, set[str]] = {}
    for fqn, sub in module.named_modules(remove_duplicate=False):
        for _, param in sub.named_parameters(recurse=False):
            owners.setdefault(id(param), set()).add(fqn)
    return {fqn for names in owners.values() if len(names) > 1 for fqn in names}


def _match_attention(linears: Mapping[str, nn.Module]) -> tuple[str, str, str, str] | None:
    """q/k/v/output by conventional names, in any case (ModernBERT's ``Wo``); the output projection may be any of
    the conventional output names when it reads the heads' width and writes the input width."""
    lowered = {name.lower(): name for name in linears}
    for names in _ATTENTION_NAMES:
        if all(name in lowered for name in names[:3]):
            q, k, v = (lowered[name] for name in names[:3])
            width_in, width_out = features(linears[q])
            outputs = [lowered[names[3]]] if names[3] in lowered else [
                lowered[n] for n in _ATTENTION_OUTPUT_NAMES if n in lowered and features(linears[lowered[n]]) == (width_out, width_in)]
            if len(outputs) == 1:
                return q, k, v, outputs[0]
    return None


def _head_gates(attention: nn.Module, projections: Mapping[str, nn.Module], out: str, taken: Collection[str]) -> list[str]:
    """Projections beside the attention's that gate it per head: named as gates, reading the attention's input, with
    one output per feature of the heads' output (AFMoE's ``gate_proj``) or one per query head (LFM's and Bailing's
    ``g_proj``). Split column-wise, each rank keeps the gates of its own heads. The name is required: a projection of
    the same shapes may read the values instead (Doge's ``dt_proj``, which mixes every head), and widths alone
    cannot tell which tensor it reads."""
    heads_width, model_width = features(projections[out])
    heads = head_count(attention, QUERY_HEADS)
    per_head = {heads_width} | ({heads[0]} if heads is not None else set())
    return [name for name, sub in projections.items()
            if name not in taken and _gate_name(name) and features(sub)[0] == model_width and features(sub)[1] in per_head]


def _per_head_readers(attention: nn.Module, projections: Mapping[str, nn.Module], qkv: Collection[str],
                      taken: Collection[str]) -> list[str]:
    """Projections beside the attention's reading as many features as one of its q/k/v projections writes (every head's
    values: Doge's ``dt_proj``) and writing one value per head: split by heads, their input gathered whole where it
    arrives as this rank's heads (tensor.gathered_input; the attention's own input passes as it is)."""
    counts = {c[0] for c in (head_count(attention, QUERY_HEADS), head_count(attention, KEY_VALUE_HEADS)) if c is not None}
    widths = {features(projections[name])[1] for name in qkv}
    return [name for name, sub in projections.items()
            if name not in taken and features(sub)[0] in widths and features(sub)[1] in counts and features(sub)[1] < features(sub)[0]]


def _gate_name(name: str) -> bool:
    lowered = name.lower()
    return "gate" in lowered or lowered in ("g_proj", "g")


def _match_latent_attention(linears: Mapping[str, nn.Module]) -> dict[str, str]:
    """Multi-head latent attention's split projections: query and key/value up projections column-wise, the
    output projection (reading their heads' width) row-wise; ``{}`` if ``linears`` are not one."""
    key_value = next((n for n in _LATENT_KEY_VALUE_NAMES if n in linears), None)
    query = next((n for n in _LATENT_QUERY_NAMES if n in linears), None)
    out = next((n for n in _ATTENTION_OUTPUT_NAMES if n in linears and n not in (query, key_value)), None)
    if key_value is None or query is None or out is None:
        return {}
    return {query: "colwise", key_value: "colwise", out: "rowwise"}


#: Gated MLPs by conventional names: (gate, up, down).
_GATED_MLP_NAMES = (("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2"))


def _named_gated_mlp(linears: Mapping[str, nn.Module]) -> dict[str, str]:
    """A gated MLP by its conventional names, whatever its widths (its hidden width may equal the model's)."""
    for gate, up, down in _GATED_MLP_NAMES:
        if set(linears) == {gate, up, down}:
            (g_in, g_out), (u_in, u_out), (d_in, d_out) = (features(linears[n]) for n in (gate, up, down))
            if g_in == u_in == d_out and g_out == u_out == d_in:
                return {gate: "colwise", up: "colwise", down: "rowwise"}
    return {}


def _match_short_convolution(sub: nn.Module, projections: Mapping[str, nn.Module]) -> dict[str, str]:
    """A short-convolution mixer (LFM2's, LFM3's ``ShortConv``): ``d→k·w`` projection, depthwise convolution of ``w``
    channels, ``w→d`` projection, and no other parameter (``{}`` otherwise).

    Recognised by structure: with nothing but a depthwise convolution between them holding parameters, what
    connects the projections works channel by channel (the gates ``B·x`` and ``C·conv(·)`` of the ``k = 3`` blocks
    ``B | C | x``), so the first splits column-wise by blocks (``fused_blocks``), the convolution over its channels
    (``channelwise``, :mod:`~lightning_parallel.parallelize.tensor.channels`), the last row-wise. A mixer that also holds a state-space model's parameters (Mamba's ``A_log``, ``dt_proj``) is not this.
    """
    convs = {name: child for name, child in sub.named_children() if depthwise_channels(child) is not None}
    if len(projections) != 2 or len(convs) != 1:
        return {}
    (conv_name, conv), = convs.items()
    channels = depthwise_channels(conv)
    held = {*projections, conv_name}
    if any(child not in held and any(True for _ in m.parameters()) for child, m in sub.named_children()):
        return {}
    if any(True for _ in sub.parameters(recurse=False)):
        return {}
    widths = {name: features(m) for name, m in projections.items()}
    closing = [name for name, (width_in, _) in widths.items() if width_in == channels]
    for out in closing:
        (opening, (d_model, width)), = ((n, f) for n, f in widths.items() if n != out)
        # Two or more blocks: the projection writing several blocks of the channels is the one before the
        # convolution. With one block (d→w, w→d) shapes cannot tell which projection runs first (a convolution
        # before both, as ConvNeXt's block has, would be cut on its whole input): left whole.
        if widths[out][1] == d_model and width % channels == 0 and width // channels >= 2:
            return {opening: "fused_blocks", conv_name: "channelwise", out: "rowwise"}
    return {}


def _match_mlp(linears: Mapping[str, nn.Module], widening_only: bool = False) -> dict[str, str]:
    """``d→h, h→d``, gated ``d→h, d→h, h→d``, or gated with gate|up fused ``d→2h, h→d`` (``widening_only``: ``h > d``)."""
    items = [(name, features(m)) for name, m in linears.items()]
    if len(items) == 2:
        (first, (a_in, a_out)), (second, (b_in, b_out)) = items
        if a_out == b_in and a_in == b_out and (a_out > a_in if widening_only else a_out != a_in):
            return {first: "colwise", second: "rowwise"}
        if a_out == 2 * b_in and a_in == b_out:
            # d→2h then h→d: a gated MLP whose gate and up halves share one projection (ModernBERT's Wi, chunked).
            return {first: "fused_gate_up", second: "rowwise"}
    if len(items) == 3:
        ins = [(n, f) for n, f in items if f[0] != f[1]]
        expand = [n for n, (i, o) in ins if o > i]
        reduce = [n for n, (i, o) in ins if o < i]
        if len(ins) == 3 and len(expand) == 2 and len(reduce) == 1:
            shapes = dict(items)
            if {shapes[n][1] for n in expand} == {shapes[reduce[0]][0]}:
                return {expand[0]: "colwise", expand[1]: "colwise", reduce[0]: "rowwise"}
    if len(items) >= 3 and not widening_only:
        return _match_chained_mlp(items)
    return {}


def _match_chained_mlp(items: list[tuple[str, tuple[int, int]]]) -> dict[str, str]:
    """A chain of projections, each reading what the one registered before it writes (``a→b, b→c, c→e``), holding an
    MLP ``d→h, h→d`` (Zaya's router: ``fc1``, ``fc2``, then a read-out ``out_proj``): the first such pair splits
    column- then row-wise, the others (before or after it in the chain, so reading or writing whole values) are named
    ``replicate``. Shapes cannot tell the call order of square projections; registration order is taken, and the split
    is checked by running the module (:func:`~lightning_parallel.parallelize.tensor.probe.check_mlp_splits`: another
    order is left whole, named). Projections of one square shape (BERT's ``query``/``key``/``value``, each reading the
    same input) or named as an attention's are no chain."""
    if any(a[1][1] != b[1][0] for a, b in zip(items, items[1:])):
        return {}
    if len({shape for _, shape in items}) == 1 or any(is_attention_projection(name) for name, _ in items):
        return {}
    for (first, (a_in, _)), (second, (_, b_out)) in zip(items, items[1:]):
        if a_in == b_out:
            return {**{name: "replicate" for name, _ in items}, first: "colwise", second: "rowwise"}
    return {}


def is_attention_projection(name: str) -> bool:
    """A q/k/v projection's name (separate or fused per k/v group)."""
    lowered = name.lower()
    return (lowered in _GROUPED_QKV_NAMES or lowered in _LATENT_QUERY_NAMES + _LATENT_KEY_VALUE_NAMES
            or any(lowered in names[:3] for names in _ATTENTION_NAMES))


def is_grouped_qkv(name: str) -> bool:
    """A fused projection laid out per key/value group (``query_key_value``)."""
    return name.lower() in _GROUPED_QKV_NAMES
