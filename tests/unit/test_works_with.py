"""The README's "Works with" table is the one the transformers test matrix renders."""

import pytest

pytest.importorskip("transformers")


def test_readme_table_matches_the_test_matrix():
    from tests.works_with import README, readme_table, render

    assert readme_table(README.read_text()) == render(), "README is stale: run `python -m tests.works_with`"
