"""The README's "Works with" tables and docs/coverage.md's full matrix are what the transformers test matrix renders."""

import pytest

pytest.importorskip("transformers")


def test_readme_tables_match_the_test_matrix():
    from tests.works_with import README, readme_table, render

    assert readme_table(README.read_text()) == render(), "README is stale: run `python -m tests.works_with`"


def test_coverage_page_matrix_matches_the_test_matrix():
    from tests.works_with import PAGE, PAGE_BEGIN, PAGE_END, block, render_matrix

    assert block(PAGE.read_text(), PAGE_BEGIN, PAGE_END) == render_matrix(), "docs/coverage.md is stale: run `python -m tests.works_with`"


def test_every_refused_cell_runs_and_no_cell_is_written_by_hand():
    """A refused cell is a job of its layout's launch (expect_refusal, its error checked), never a dict of words alone."""
    from tests.distributed.test_transformers import (
        LAYOUTS,
        MATRIX,
        REFUSED,
        cells_of,
        job,
    )

    for family, layout in REFUSED:
        assert family not in MATRIX[layout], (family, layout)
        assert (family, layout) in cells_of(tuple(LAYOUTS)) and job(family, layout).expect_refusal, (family, layout)
    assert not any(job(family, layout).expect_refusal for layout in LAYOUTS for family in MATRIX[layout])
