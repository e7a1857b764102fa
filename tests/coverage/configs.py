"""Which families the sweep covers, and a tiny config for each, derived generically from its config class.

Every model type of the installed transformers' causal-LM, masked-LM and image-classification auto mappings
is a family. Its tiny config starts from the config class's defaults and shrinks every size by attribute
name (so the same rule covers ``hidden_size``, ``n_embd``, ``d_model`` ...); a family's own structure (head
dims, sliding windows, expert counts, per-layer lists, CNN stage lists, sub-configs) is rescaled, not
dropped. The few families that need more are in :data:`OVERRIDES`, each with its reason.
"""

from __future__ import annotations

import inspect
import zlib
from typing import Any

HIDDEN = 32
LAYERS = 4  # two blocks per stage under pp2
HEADS = 4
KV_HEADS = 2  # grouped-query attention where the family has it (MHA and MQA stay what they are)
INTERMEDIATE = 64
VOCAB = 128
POSITIONS = 64
SEQUENCE = 16  # tokens per training row
IMAGE = 32
PATCH = 4
NUM_LABELS = 4
EXPERTS = 4
WINDOW = 2  # attention window (in patches) of Swin-like hierarchical vision models
TOP_K = 2

TASKS = ("causal_lm", "masked_lm", "image_classification")

_QSA = {"indexer_n_heads": HEADS, "indexer_kv_heads": 1, "indexer_head_dim": HIDDEN // HEADS, "indexer_budget": SEQUENCE // 2,
        "indexer_compress_ratio": 4}  # Qwen4-Exp's token indexer: one key head, a budget of half the row in blocks of 4

_ALL_MAMBA = ("its default makes every layer a Mamba layer, and transformers cannot build the attention mask of a cache "
              "with no attention layer; the checkpoints mix attention layers in (here every other one)")

#: model type (or ``task/model type``, where one task needs other fields) -> (extra config fields, why the generic
#: rules are not enough). Keep this short.
OVERRIDES: dict[str, tuple[dict[str, Any], str]] = {
    "gpt_neox": ({"rotary_pct": 0.5}, "exercise partial rotary (the generic config keeps the default, full)"),
    "mamba2": ({"head_dim": 16}, "its heads tile the expanded inner width: num_heads x head_dim = expand x hidden_size"),
    "squeezebert": ({"embedding_size": HIDDEN}, "its embeddings feed the first block directly: embedding_size must equal hidden_size"),
    "reformer": ({"axial_pos_embds_dim": [16, 16], "axial_pos_shape": [4, 4], "is_decoder": True},
                 "axial position embeddings: dims sum to hidden_size, shape multiplies to the sequence length; causal LM needs is_decoder"),
    "masked_lm/reformer": ({"axial_pos_embds_dim": [16, 16], "axial_pos_shape": [4, 4]},
                           "axial position embeddings: dims sum to hidden_size, shape multiplies to the sequence length "
                           "(bidirectional: its masked LM refuses is_decoder)"),
    "esm": ({"pad_token_id": 1}, "its default pad_token_id is None, but its position ids count from the padding id "
                                 "(ESM-2's tokenizer: 1)"),
    "neomme": ({"head_dim": 16}, "its validator needs the rotated part of a head (partial_rotary_factor 0.25 of head_dim) to "
                                 "be a multiple of 4: the two M-RoPE axes take frequencies in pairs"),
    "zaya": ({"num_experts_per_tok": 1}, "its validator accepts top-1 routing only (the generic top-k is 2)"),
    "kolibri1_1": ({"head_dim": 16, "index_num_heads": HEADS // KV_HEADS},
                   "its validator needs a head_dim that is a multiple of 16 (NVFP4 rounding of keys and values), and at most "
                   "as many indexer heads as query heads per key head (the default: exactly as many)"),
    "dbrx": ({"attn_config": {"rope_theta": 10000.0, "clip_qkv": 8.0}},
             "its attention reads attn_config.rope_theta, which no config default sets (a checkpoint's config.json carries "
             "it), and clamps q/k/v with clip_qkv even when it is None (the checkpoints set 8)"),
    "lfm2_moe": ({"layer_types": ["conv", "full_attention", "conv", "full_attention"]},
                 "its default layer_types is None and, unlike LFM2's, nothing derives it (every layer indexes it): "
                 "short-convolution and attention layers in turn, as the checkpoints mix them"),
    "bamba": ({"attn_layer_indices": [1, 3]}, _ALL_MAMBA),
    "granitemoehybrid": ({"layer_types": ["linear_attention", "attention", "linear_attention", "attention"]}, _ALL_MAMBA),
    "blt": ({"use_cache": False}, "a forward with a cache fails: transformers' DynamicCache reads "
                                  "BltConfig.num_hidden_layers, which Blt keeps in its sub-configs only (training needs no cache)"),
    "cohere_compass_text": ({"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 10000.0,
                                                                     "mrope_section": [2, 1, 1]}}},
                            "its default rope_parameters is empty, but its rotary embedding reads one entry per layer type "
                            "(with an M-RoPE section, here summing to half the tiny head width)"),
    "xlstm": ({"use_cache": False}, "a forward with a cache fails: its cache sizes the mLSTM state with widths rounded up to "
                                    "multiples of 64 (qk_dim, v_dim) that its layers do not round (training needs no cache)"),
    "dory": ({"num_hidden_layers": 2 * LAYERS, "n_input_layers": 2, "n_recurrent_layers": 4, "n_output_layers": 2,
              "layer_types": ["sliding_attention", "mlp", "full_attention", "mlp"] * 2},
             "its config's dict form (what the generic rules read and write) counts an attention and an MLP block per "
             "layer: 4 layers are 8 blocks, 1 input + 2 recurrent + 1 output layers, sliding and full attention in turn"),
    "xmod": ({"default_language": "en_XX"}, "its per-language adapters need the input's language: the default one, as "
                                            "set_default_language sets it (a user sets it too); en_XX is its only default language"),
    "qwen4_exp_text": (_QSA, "its default indexed-attention layers need the QSA indexer's sizes, which default to None"),
    "qwen4_exp": ({"text_config": _QSA}, "its default indexed-attention layers need the QSA indexer's sizes, which default to None"),
}

#: model type -> why no run of it can equal another run (the sweep lists it as not built, with the reason).
NOT_COMPARABLE: dict[str, str] = {
    "phimoe": "not comparable: its router (sparsemixer) samples experts with exponential_() and rand_like in "
              "training, so two runs of the same model on the same batch differ (no config field turns the sampling off)",
}

_HIDDEN_NAMES = ("hidden_size", "n_embd", "n_embed", "d_model", "dim", "model_dim", "word_embed_proj_dim")
_EMBEDDING_NAMES = ("embedding_size", "embed_dim", "embedding_dim", "projection_dim", "text_embed_dim")
_LAYER_NAMES = ("num_hidden_layers", "n_layer", "n_layers", "num_layers", "encoder_layers", "decoder_layers")
_HEAD_NAMES = ("num_attention_heads", "n_head", "n_heads", "num_heads", "encoder_attention_heads", "decoder_attention_heads")
_KV_NAMES = ("num_key_value_heads", "n_kv_heads", "num_kv_heads", "multi_query_group_num", "n_head_kv")
_INTERMEDIATE_NAMES = ("intermediate_size", "n_inner", "ffn_dim", "encoder_ffn_dim", "decoder_ffn_dim", "d_ff",
                       "ffn_hidden_size", "mlp_dim", "inner_hidden_size", "dim_ff")
_EXPERT_INTERMEDIATE = ("moe_intermediate_size", "shared_expert_intermediate_size", "expert_intermediate_size",
                        "moe_ffn_hidden_size", "shared_intermediate_size")
_EXPERT_NAMES = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts", "num_moe_experts")
_TOP_K_NAMES = ("num_experts_per_tok", "num_experts_per_token", "moe_top_k", "top_k", "moe_topk")
_POSITION_NAMES = ("max_position_embeddings", "n_positions", "n_ctx", "max_seq_len", "seq_length",
                   "max_sequence_length", "original_max_position_embeddings")
_WINDOW_NAMES = ("sliding_window", "attention_window", "local_attention", "window_size_attention")
# Sizes a family adds under a name of its own, recognised by how the name ends (every head width, low rank,
# feed-forward width and position table): DeepSeek-V3.2's indexer (``index_head_dim``), DeepSeek-V4's
# ``o_lora_rank``, Whisper's ``max_target_positions``, RemBERT's ``output_embedding_size`` ... Left at their
# defaults they outweigh the shrunk model many times over, so the sweep's tp2 share would measure a config no
# one trains, not the split. The named rules above and below still decide the fields they know.
_SUFFIX_SIZES: tuple[tuple[tuple[str, ...], int], ...] = (
    (("_head_dim", "kv_channels", "dim_head"), HIDDEN // HEADS),
    (("_lora_rank",), 16),
    (("intermediate_size", "intermediate_size_mlp", "feed_forward_size", "dff", "d_inner"), INTERMEDIATE),
    (("max_source_positions", "max_target_positions"), POSITIONS),
    (("input_embedding_size", "output_embedding_size", "output_channels"), HIDDEN),
    (("zero_expert_num",), EXPERTS),
)
_SUFFIX_LARGER: tuple[tuple[tuple[str, ...], int], ...] = (
    (("vocab_size", "_vocab"), VOCAB),
    (("_embed_dim", "_out_channel", "_out_channels", "_conv_channels"), HIDDEN),
)
_MLA = {"kv_lora_rank": 16, "q_lora_rank": 16, "qk_rope_head_dim": 4, "qk_nope_head_dim": 8, "v_head_dim": 8}


def mapping(task: str) -> dict[str, str]:
    """model type -> model class name for one task (the first class where the mapping lists several)."""
    from transformers.models.auto import modeling_auto

    names = {
        "causal_lm": modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        "masked_lm": modeling_auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES,
        "image_classification": modeling_auto.MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES,
    }[task]
    return {kind: (name if isinstance(name, str) else name[0]) for kind, name in names.items()}


def families(task: str | None = None) -> list[tuple[str, str]]:
    """Every (task, model type) of the installed transformers, in mapping order."""
    return [(t, kind) for t in (TASKS if task is None else (task,)) for kind in mapping(t)]


def config_class(model_type: str) -> type:
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    return CONFIG_MAPPING[model_type]


def _real(config: Any, name: str, present: dict[str, Any]) -> str | None:
    """The stored field behind ``name`` (through the class's ``attribute_map``), if the config has it."""
    name = getattr(config, "attribute_map", {}).get(name, name)
    return name if name in present else None


def _declared(config: Any, name: str) -> bool:
    """Whether the config class gives ``name`` a value of its own (not ``None``, to be derived from other fields)."""
    declared = getattr(type(config), "__dataclass_fields__", {}).get(name)
    if declared is not None:
        return declared.default is not None
    parameter = inspect.signature(type(config).__init__).parameters.get(name)
    return parameter is not None and parameter.default is not None  # neither: set from other fields after init


def _per_layer(values: list[Any], layers: int) -> list[Any]:
    """A per-layer list of ``layers`` entries that keeps every kind the default mixes (sliding and full ...)."""
    if all(isinstance(v, (str, bool, type(None))) or (isinstance(v, int) and v in (0, 1)) for v in values):
        distinct = list(dict.fromkeys(values))
        return [distinct[i % len(distinct)] for i in range(layers)]
    return list(values[:layers]) + [values[-1]] * max(0, layers - len(values))


def _layer_index_dict(value: Any, layers: int) -> bool:
    """Whether ``value`` is keyed by layer index (``per_layer_config``: ``{"05": {"head_dim": 512}, ...}``)."""
    return (isinstance(value, dict) and bool(value) and all(isinstance(v, dict) for v in value.values())
            and all(str(k).isdigit() and int(k) < layers for k in value))


def _layer_index_list(name: str, value: Any, layers: int) -> bool:
    """Whether ``value`` lists layer indices (``attn_layer_indices``, ``index_layers``, ``hybrid_layer_ids`` ...)
    and some of them fall outside the shrunk stack (a list that already fits it stays as it is)."""
    return (("layer" in name or name.endswith(("_idxs", "_indices", "_indexes"))) and isinstance(value, list)
            and bool(value) and all(isinstance(v, int) and not isinstance(v, bool) and 0 <= v < layers for v in value)
            and len(set(value)) == len(value) < layers and max(value) >= LAYERS)


def _per_layer_choice(present: dict[str, Any], fields: dict[str, Any], layers: int, per_default: list[Any]) -> list[Any]:
    """A per-layer value (``per_default``: one per default layer) for each of the :data:`LAYERS` shrunk layers.

    Shrunk layer ``i`` stands for the default layers of its kind: those whose every per-layer list of kinds (layer
    types, MLP kinds, sliding flags ...) reads what the shrunk lists read at ``i`` (any layer when no default layer
    matches them all). The layers of one kind take in turn the distinct values their default layers have, so a kind the default
    mixes values in (indexed and plain full-attention layers) keeps them all, and each value stays on its kind.
    """
    lists = [(present[n], fields[n]) for n in fields
             if isinstance(present.get(n), list) and len(present[n]) == layers and isinstance(fields[n], list)
             and len(fields[n]) == LAYERS and all(isinstance(v, (str, bool)) for v in present[n])]
    seen: dict[tuple, int] = {}
    chosen = []
    for i in range(LAYERS):
        kind = tuple(repr(new[i]) for _, new in lists)
        candidates = [j for j in range(layers) if all(repr(old[j]) == k for (old, _), k in zip(lists, kind))] or list(range(layers))
        distinct = list({repr(per_default[j]): per_default[j] for j in candidates}.values())
        chosen.append(distinct[seen.get(kind, 0) % len(distinct)])
        seen[kind] = seen.get(kind, 0) + 1
    return chosen


def _tiny_override(name: str, value: Any, present: dict[str, Any], fields: dict[str, Any]) -> Any:
    """One layer's override of a global field, made tiny: the global's tiny value, times the override's ratio to the
    global default where that ratio is whole (a double head width stays double), else the tiny value itself."""
    if name not in fields or not isinstance(value, int) or isinstance(value, bool):
        return value
    tiny, default = fields[name], present.get(name)
    if not isinstance(tiny, int) or not isinstance(default, int) or default <= 0 or value <= 0:
        return tiny
    return tiny * value // default if tiny * value % default == 0 and tiny * value >= default else tiny


def _tiny_layer_override(override: dict[str, Any], present: dict[str, Any], fields: dict[str, Any]) -> dict[str, Any]:
    """A layer's overrides made tiny (:func:`_tiny_override`); where that layer's default head width is the sum of
    its multi-head latent attention parts (``head_dim = qk_nope_head_dim + qk_rope_head_dim``), the tiny one is too."""
    tiny = {k: _tiny_override(k, v, present, fields) for k, v in override.items()}
    parts = ("qk_nope_head_dim", "qk_rope_head_dim")
    default = {**present, **override}
    if any(p in override for p in parts) and all(isinstance(default.get(n), int) for n in ("head_dim", *parts)) \
            and default["head_dim"] == sum(default[p] for p in parts):
        merged = {**present, **fields, **tiny}
        tiny["head_dim"] = sum(merged[p] for p in parts)
    return tiny


def _follow_layer_count(present: dict[str, Any], fields: dict[str, Any], layers: int) -> None:
    """Fields that name layers of the default stack follow it to :data:`LAYERS` layers, keeping every kind:

    * a dict keyed by layer index (per-layer overrides): each shrunk layer takes the override of a default layer
      of its kind (:func:`_per_layer_choice`), its values made tiny (:func:`_tiny_override`);
    * a list of layer indices (the attention layers of a hybrid, the indexed layers ...): the shrunk layers of
      the same choice, so listed and unlisted layers both remain;
    * a count of the last layers that share earlier layers' caches (``*_shared_layers``): scaled, at least one
      layer on each side (all, or none, stays all or none);
    * a layer period and offset (``attn_layer_period``: every 8th layer from the 4th) longer than half the shrunk
      stack: period 2 and the offset modulo it, so both the layers it picks and the others remain.
    """
    for name, value in present.items():
        if _layer_index_dict(value, layers):
            width = len(str(next(iter(value))))  # "05": keys keep their zero padding
            per_default = [value.get(k) for k in (next((k for k in value if int(k) == j), None) for j in range(layers))]
            chosen = _per_layer_choice(present, fields, layers, per_default)
            fields[name] = {str(i).zfill(width): _tiny_layer_override(override, present, fields)
                            for i, override in enumerate(chosen) if override is not None}
        elif _layer_index_list(name, value, layers):
            listed = set(value)
            chosen = _per_layer_choice(present, fields, layers, [j in listed for j in range(layers)])
            fields[name] = [i for i, member in enumerate(chosen) if member]
        elif name.endswith("_shared_layers") and isinstance(value, int) and not isinstance(value, bool):
            scaled = min(LAYERS - 1, max(1, round(value * LAYERS / layers)))
            fields[name] = value if value == 0 else LAYERS if value >= layers else scaled
    for name, value in present.items():
        if name.endswith("_layer_period") and isinstance(value, int) and value > LAYERS // 2:
            offset = name[: -len("period")] + "offset"
            fields[name] = 2
            if isinstance(present.get(offset), int):
                fields[offset] = present[offset] % 2


def _stage_widths(widths: list[int]) -> list[int]:
    """CNN/hierarchical stage widths scaled so the last is 32, each a multiple of 8."""
    top = max(widths)
    return [max(8, round(w * 32 / top / 8) * 8) for w in widths]


def image_size(present: dict[str, Any]) -> int:
    """The tiny image side: :data:`IMAGE`, or more where a windowed hierarchy needs it.

    A Swin-like model (``window_size`` and a ``depths`` stage list) halves its patch grid after every stage
    but the last, and each stage's grid must be a whole number of windows: the side must be a multiple of
    window × patch × 2^(stages - 1).
    """
    depths = present.get("depths")
    if not (isinstance(depths, list) and isinstance(present.get("window_size"), int)):
        return IMAGE
    unit = WINDOW * PATCH * 2 ** (len(depths) - 1)
    return max(IMAGE, -(-IMAGE // unit) * unit)


def tiny_fields(config: Any, task: str) -> dict[str, Any]:
    """Config fields that make ``config`` (a default-constructed config) tiny; see the module docstring."""
    present = config.to_dict()
    fields: dict[str, Any] = {}

    def put(names: tuple[str, ...], value: Any, keep_none: bool = True) -> None:
        for name in names:
            real = _real(config, name, present)
            if real is not None and not isinstance(present[real], (dict, list)) and not isinstance(present[real], bool):
                if present[real] is None and keep_none:
                    continue
                fields[real] = value(present[real]) if callable(value) else value

    hierarchical = isinstance(present.get("depths"), list)  # Swin/ResNet-like: stage lists, derived widths
    if not hierarchical:
        for suffixes, size in _SUFFIX_SIZES:
            # Only sizes wider than the tiny model itself (a small default is already a tiny family's own shape),
            # and only those the class declares: one it derives from others (Zamba's head width from its hidden
            # size) follows them once they are tiny.
            names = tuple(n for n in present if n.endswith(suffixes) and _declared(config, n))
            put(names, lambda v, size=size: size if v > HIDDEN else v)
        # Vocabularies under names of their own (an unpadded LM head, hash-n-gram tables, glyph and pronunciation
        # vocabularies), and the widths and channels of side towers, as the sizes above: larger than the tiny model.
        for suffixes, size in _SUFFIX_LARGER:
            names = tuple(n for n in present if n.endswith(suffixes) and n not in fields and _declared(config, n))
            put(names, lambda v, size=size: size if v > size else v)
    if hierarchical:
        fields["depths"] = [1] * len(present["depths"])
        for name in ("hidden_sizes", "embed_dims", "embed_dim", "dims", "hidden_dims"):
            if isinstance(present.get(name), list):
                fields[name] = _stage_widths(present[name])
        for name in ("num_heads", "num_attention_heads", "heads"):
            if isinstance(present.get(name), list):
                fields[name] = [min(h, 2) for h in present[name]]
        put(("embed_dim", "embedding_size"), 16)
    else:
        put(_HIDDEN_NAMES, HIDDEN)
        put(_EMBEDDING_NAMES, 16 if _real(config, "embedding_size", present) else HIDDEN)
        put(_LAYER_NAMES, LAYERS)
        put(_HEAD_NAMES, HEADS)
        default_heads = next((present[r] for n in _HEAD_NAMES if (r := _real(config, n, present)) and isinstance(present[r], int)), None)
        # None means "as many as query heads" (MHA); MQA stays MQA; any other grouping becomes 4 q per 2 k/v heads.
        put(_KV_NAMES, lambda kv: HEADS if kv in (None, default_heads) else (1 if kv == 1 else KV_HEADS), keep_none=False)
        put(_INTERMEDIATE_NAMES, INTERMEDIATE)
        # A second attention of the family's own (Inkling's sliding layers: swa_num_attention_heads and
        # swa_num_key_value_heads) takes the same head counts as the main one.
        for name in [n for n in present if n.endswith("_num_attention_heads") and n not in fields]:
            own = present[name]
            if isinstance(own, int) and not isinstance(own, bool) and own > HEADS:
                fields[name] = HEADS
                kv = name[: -len("attention_heads")] + "key_value_heads"
                if isinstance(present.get(kv), int):
                    fields[kv] = HEADS if present[kv] == own else (1 if present[kv] == 1 else KV_HEADS)
        if "head_dim" in present and isinstance(present["head_dim"], (int, type(None))):
            # Multi-head latent attention rotates only its rope part: head_dim is that part's width there.
            fields["head_dim"] = _MLA["qk_rope_head_dim"] if "qk_rope_head_dim" in present else HIDDEN // HEADS
        put(("rotary_dim",), (HIDDEN // HEADS) // 2)  # GPT-J/CodeGen rotate part of each head
    put(("num_groups",), 4)  # group norms (BiT's too) over the now 8-multiple widths and 16-wide stems
    # Linear-attention (gated delta net) layers beside the softmax ones: their own head counts and widths.
    put(("linear_num_value_heads",), HEADS)
    put(("linear_num_key_heads",), KV_HEADS)
    put(("linear_key_head_dim", "linear_value_head_dim"), HIDDEN // HEADS)
    put(_EXPERT_INTERMEDIATE, 32)
    # A routing the default leaves unset beside a set expert width (Dots1: moe_intermediate_size, with
    # n_routed_experts, n_shared_experts and num_experts_per_tok None) would build sparse layers with no experts:
    # those counts get their tiny values too.
    moe_width = any((r := _real(config, n, present)) and isinstance(present[r], int) and present[r] > 0
                    for n in _EXPERT_INTERMEDIATE)
    put(_EXPERT_NAMES, EXPERTS, keep_none=not moe_width)
    has_experts = moe_width or any(_real(config, n, present) and present[_real(config, n, present)] for n in _EXPERT_NAMES)
    put(_TOP_K_NAMES, TOP_K, keep_none=not has_experts)
    put(("n_shared_experts", "num_shared_experts"), 1, keep_none=not moe_width)
    put(("n_group", "topk_group"), 1)
    put(("first_k_dense_replace",), 1)
    put(("n_groups",), 1)  # Mamba-2 state groups must divide its (now 4) heads
    for name, value in _MLA.items():
        put((name,), value)
    if "qk_head_dim" in present and "qk_rope_head_dim" in fields:
        fields["qk_head_dim"] = _MLA["qk_rope_head_dim"] + _MLA["qk_nope_head_dim"]
    put(("vocab_size",), VOCAB, keep_none=False)
    put(("vocab_size_per_layer_input",), VOCAB)  # Gemma-3n/4 per-layer token embeddings
    put(("hidden_size_per_layer_input",), 8)
    put(_POSITION_NAMES, POSITIONS)
    put(_WINDOW_NAMES, SEQUENCE // 2)
    put(("image_size", "img_size"), image_size(present))
    put(("patch_size",), PATCH)
    put(("window_size",), WINDOW)  # Swin-like windows must tile the patch grid and each stage's halving of it
    if task == "image_classification":
        fields["num_labels"] = NUM_LABELS
    for name, value in present.items():  # dropout off, token ids inside the small vocabulary
        if isinstance(value, float) and not isinstance(value, bool) and ("dropout" in name or "drop" in name.split("_") or name.endswith("_pdrop") or name in ("layerdrop", "drop_path_rate")):
            fields[name] = 0.0
        elif name.endswith("_token_id") and isinstance(value, int) and value >= VOCAB:
            fields[name] = VOCAB - 1 - zlib.crc32(name.encode()) % 8  # stable across processes (not hash())
    # A width the default sets equal to the hidden size (an adapter's input, a projection into the residual stream)
    # is that width under another name: it follows the hidden size.
    default_hidden = next((present[r] for n in _HIDDEN_NAMES if (r := _real(config, n, present)) and isinstance(present[r], int)), None)
    hidden = next((fields[r] for n in _HIDDEN_NAMES if (r := _real(config, n, present)) and isinstance(fields.get(r), int)), None)
    if not hierarchical and default_hidden and hidden and default_hidden > hidden:
        for name, value in present.items():
            if (name not in fields and name.endswith(("_dim", "_size")) and value == default_hidden
                    and not isinstance(value, bool) and _declared(config, name)):
                fields[name] = hidden
    # State-space heads that tile the expanded inner width (Mamba-2 in a hybrid: mamba_n_heads x mamba_d_head =
    # mamba_expand x hidden_size) keep tiling it: the tiny head count, each as wide as the tiny inner width needs.
    for heads_name in [n for n in present if n.endswith(("_n_heads", "_num_heads"))]:
        prefix = heads_name[: -len("n_heads")] if heads_name.endswith("_n_heads") else heads_name[: -len("num_heads")]
        width_name = next((prefix + s for s in ("d_head", "head_dim") if isinstance(present.get(prefix + s), int)), None)
        expand = present.get(prefix + "expand", present.get("expand"))
        if (width_name and isinstance(expand, int) and default_hidden and hidden
                and present[heads_name] * present[width_name] == expand * default_hidden
                and expand * hidden % HEADS == 0):
            fields[heads_name], fields[width_name] = HEADS, expand * hidden // HEADS
    default_layers = next((present[r] for n in _LAYER_NAMES if (r := _real(config, n, present)) and isinstance(present[r], int)), None)
    for name, value in present.items():  # per-layer lists (layer types, sliding flags ...) follow the layer count
        if not hierarchical and isinstance(value, list) and default_layers and len(value) == default_layers and len(value) > 1:
            fields[name] = _per_layer(value, LAYERS)
            if name in _INTERMEDIATE_NAMES and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
                # a feed-forward width per layer: the tiny width, in the default's proportions
                fields[name] = [max(1, INTERMEDIATE * v // max(value)) for v in fields[name]]
    if default_layers:
        _follow_layer_count(present, fields, default_layers)
    rope = present.get("rope_parameters") or present.get("rope_scaling")
    if isinstance(rope, dict) and isinstance(rope.get("mrope_section"), list):  # sums to half the head dim
        sections = rope["mrope_section"]
        half, total = (HIDDEN // HEADS) // 2, sum(sections)
        scaled = [max(1, s * half // total) for s in sections]
        scaled[0] += half - sum(scaled)
        key = "rope_parameters" if present.get("rope_parameters") else "rope_scaling"
        fields[key] = {**rope, "mrope_section": scaled}
    return fields


def tiny_config(task: str, model_type: str) -> Any:
    """The tiny config of one family (sub-configs, e.g. a vision tower's, made tiny the same way)."""
    cls = config_class(model_type)
    override = OVERRIDES.get(f"{task}/{model_type}", OVERRIDES.get(model_type, ({}, "")))[0]
    default = cls()
    fields = tiny_fields(default, task)
    subs = {name: sub for name in getattr(cls, "sub_configs", {}) or {}
            if (sub := getattr(default, name, None)) is not None and hasattr(sub, "to_dict")}
    sub_fields = {name: tiny_fields(sub, task) for name, sub in subs.items()}
    # A sub-config's width that equals another part's hidden size (a vision adapter's output into the text model)
    # follows that part's tiny hidden size.
    widths: dict[int, int] = {}
    for part, tiny in [(default, fields), *((subs[n], sub_fields[n]) for n in subs)]:
        present = part.to_dict()
        for name in _HIDDEN_NAMES:
            real = _real(part, name, present)
            if real and isinstance(present[real], int) and isinstance(tiny.get(real), int):
                widths.setdefault(present[real], tiny[real])
                break
    for name, sub in subs.items():
        for field, value in sub.to_dict().items():
            if (field not in sub_fields[name] and field.endswith(("_dim", "_size", "_size_global")) and isinstance(value, int)
                    and not isinstance(value, bool) and value in widths and value > widths[value]):
                sub_fields[name][field] = widths[value]
        fields[name] = {**sub.to_dict(), **sub_fields[name]}
    for name, value in override.items():  # a sub-config's override names only the fields it changes
        fields[name] = {**fields[name], **value} if name in subs and isinstance(value, dict) else value
    return cls(**fields)


AUTO_CLASSES = {"causal_lm": "AutoModelForCausalLM", "masked_lm": "AutoModelForMaskedLM",
                "image_classification": "AutoModelForImageClassification"}
MAX_PARAMETERS = 3_000_000  # a "tiny" config above this kept a size no rule shrank: say so rather than crawl


#: The experts implementation every mixture-of-experts layer is built with, in every layout and the single-device
#: reference: transformers' default, ``"grouped_mm"``, has no float64 CPU kernel when it runs eagerly, and
#: ``"eager"`` (a loop over the experts a batch routes to) is the same function. Pipelines trace that loop as one
#: opaque operator (``parallelize/pipeline/opaque_experts.py``), so pp2 runs it too.
EAGER_EXPERTS = "eager"


def build_model(task: str, model_type: str, experts: str | None = EAGER_EXPERTS) -> Any:
    """The family's model from its tiny config, through the task's auto class (as a user builds it), with the
    attention implementation transformers picks by default and the experts implementation ``experts``
    (``None``: transformers' default; see :data:`EAGER_EXPERTS`)."""
    import transformers

    config = tiny_config(task, model_type)
    # What a pretrained config carries; the auto class needs it to choose where the mapping lists several classes.
    config.architectures = [mapping(task)[model_type]]
    auto = getattr(transformers, AUTO_CLASSES[task])
    options = {} if experts is None else {"experts_implementation": experts}
    model = auto.from_config(config, **options)
    count = sum(p.numel() for p in model.parameters())
    if count > MAX_PARAMETERS:
        biggest = max(model.named_parameters(), key=lambda item: item[1].numel())
        raise ValueError(
            f"the tiny config still has {count:,} parameters (largest: {biggest[0]} {tuple(biggest[1].shape)}): "
            "a size field the generic rules do not know"
        )
    return model


def image_input_name(model: Any) -> str:
    """The keyword an image model takes its pixels as (``pixel_values``; Perceiver's ``inputs``)."""
    parameters = inspect.signature(model.forward).parameters
    return "pixel_values" if "pixel_values" in parameters else "inputs"
