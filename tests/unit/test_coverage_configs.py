"""The sweep's tiny-config derivation and cell classification (no processes)."""

import pytest

pytest.importorskip("transformers")

from tests.coverage.cells import describe_failure  # noqa: E402
from tests.coverage.configs import EAGER_EXPERTS, PATCH, WINDOW, build_model, tiny_config  # noqa: E402


def test_windowed_hierarchies_get_an_image_every_stage_tiles_with_windows():
    config = tiny_config("image_classification", "swin")
    grid = config.image_size // config.patch_size
    for stage in range(len(config.depths)):
        assert (grid // 2**stage) % config.window_size == 0, (config.image_size, stage)
    assert config.image_size % (WINDOW * PATCH * 2 ** (len(config.depths) - 1)) == 0


def test_group_norms_of_hierarchical_models_fit_their_widths():
    config = tiny_config("image_classification", "bit")
    assert all(width % config.num_groups == 0 for width in [config.embedding_size, *config.hidden_sizes])


def test_every_layout_builds_experts_the_reference_can_run_in_float64():
    # transformers' default (grouped_mm) has no float64 CPU kernel; pipelines trace eager experts as one operator.
    model = build_model("causal_lm", "mixtral")
    assert EAGER_EXPERTS == "eager" == model.config._experts_implementation


def test_an_error_our_library_explains_is_a_refusal():
    explained = RuntimeError("Your LightningModule has parameters that did not take part in the loss returned by training_step.")
    assert describe_failure(explained, trained_steps=1)["status"] == "refused"
    assert describe_failure(RuntimeError("something else"), trained_steps=1)["status"] == "crash"


# --- rules that make a shrunk stack keep the layout its default mixes ---------------------------------------------


def _heads_dim(config, layer):
    return config.per_layer_config[layer].head_dim


def test_layer_indexed_overrides_follow_the_layer_count_and_stay_on_their_kind():
    from tests.coverage.configs import HIDDEN, HEADS, LAYERS

    config = tiny_config("causal_lm", "gemma4_text")  # full-attention layers twice as wide per head
    assert config.num_hidden_layers == LAYERS and set(config.layer_types) == {"sliding_attention", "full_attention"}
    for layer, kind in enumerate(config.layer_types):
        assert _heads_dim(config, layer) == (2 if kind == "full_attention" else 1) * (HIDDEN // HEADS), (layer, kind)


def test_a_layer_override_keeps_its_latent_attention_head_width_the_sum_of_its_parts():
    config = tiny_config("causal_lm", "dots3_note_text")  # sliding layers: head_dim = qk_nope + qk_rope
    sliding = [i for i, kind in enumerate(config.layer_types) if kind == "sliding_attention"]
    assert sliding and len(sliding) < config.num_hidden_layers
    for layer in sliding:
        view = config.per_layer_config[layer]
        assert view.head_dim == view.qk_nope_head_dim + view.qk_rope_head_dim


def test_layer_index_lists_are_remapped_into_the_shrunk_stack_keeping_listed_and_unlisted_layers():
    config = tiny_config("causal_lm", "kolibri1_1")  # indexer layers: a subset of the indexed-attention layers
    indexed = [i for i, kind in enumerate(config.layer_types) if kind == "indexed_attention"]
    assert config.index_layers and set(config.index_layers) <= set(indexed) and indexed[0] in config.index_layers
    cross = tiny_config("causal_lm", "mllama").text_config
    assert cross.cross_attention_layers and all(0 <= i < cross.num_hidden_layers for i in cross.cross_attention_layers)
    assert len(cross.cross_attention_layers) < cross.num_hidden_layers


def test_an_index_list_that_already_fits_the_shrunk_stack_stays():
    assert tiny_config("causal_lm", "flint").mlp_only_layers == [0, 1]


def test_shared_cache_layers_scale_with_the_stack_leaving_producers_and_users():
    config = tiny_config("causal_lm", "gemma3n_text")
    assert 0 < config.num_kv_shared_layers < config.num_hidden_layers
    producing = set(config.layer_types[: config.num_hidden_layers - config.num_kv_shared_layers])
    assert producing == set(config.layer_types[config.num_hidden_layers - config.num_kv_shared_layers:])
    assert max(config.intermediate_size) <= 64  # a feed-forward width per layer is made tiny too


def test_a_layer_period_longer_than_the_shrunk_stack_keeps_both_kinds():
    config = tiny_config("causal_lm", "jamba")  # attention every 8th layer from the 4th by default
    assert set(config.layers_block_type) == {"attention", "mamba"}


def test_widths_equal_to_a_hidden_size_follow_it_across_sub_configs():
    config = tiny_config("causal_lm", "dots3_note")  # vision adapter: vision width in, text width out
    assert config.vision_config.adapter_in_dim == config.vision_config.hidden_size
    assert config.vision_config.adapter_out_dim == config.text_config.hidden_size


def test_state_space_heads_keep_tiling_the_expanded_width():
    config = tiny_config("causal_lm", "bamba")
    assert config.mamba_n_heads * config.mamba_d_head == config.mamba_expand * config.hidden_size


def test_a_second_attention_takes_the_main_head_counts():
    from tests.coverage.configs import HEADS, KV_HEADS

    config = tiny_config("causal_lm", "inkling2_text")
    assert (config.swa_num_attention_heads, config.swa_num_key_value_heads) == (HEADS, KV_HEADS)


def test_a_routing_left_unset_beside_an_expert_width_gets_the_tiny_counts():
    from tests.coverage.configs import EXPERTS, TOP_K

    config = tiny_config("causal_lm", "dots1")
    assert (config.n_routed_experts, config.num_experts_per_tok, config.n_shared_experts) == (EXPERTS, TOP_K, 1)


@pytest.mark.parametrize("model_type", ["inkling2_text", "blt", "roc_bert", "phi4_multimodal"])
def test_vocabularies_and_side_widths_under_names_of_their_own_are_tiny(model_type):
    from tests.coverage.configs import MAX_PARAMETERS

    model = build_model("causal_lm", model_type)
    assert sum(p.numel() for p in model.parameters()) < MAX_PARAMETERS


def test_a_sub_config_override_names_only_the_fields_it_changes():
    config = tiny_config("causal_lm", "dbrx")
    assert config.attn_config.rope_theta == 10000.0 and config.ffn_config.ffn_hidden_size == 64
