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
