"""Decode rows sorted by context length are cut into groups of similar length."""

from __future__ import annotations

from appliance.engine.model_runner import length_groups


def test_one_group_when_lengths_are_close():
    assert length_groups([10, 9, 8, 6, 5]) == [(0, 5)]


def test_a_row_half_as_long_and_far_shorter_starts_a_group():
    assert length_groups([40, 30, 21, 19, 12, 3, 1]) == [(0, 3), (3, 5), (5, 7)]


def test_short_contexts_stay_together_within_the_slack():
    assert length_groups([5, 2, 1, 1]) == [(0, 4)]
    assert length_groups([6, 1]) == [(0, 1), (1, 2)]


def test_groups_cover_every_row_once():
    blocks = [64, 63, 40, 33, 20, 16, 9, 8, 8, 4, 2, 1]
    groups = length_groups(blocks)
    assert [i for s, e in groups for i in range(s, e)] == list(range(len(blocks)))
    for s, e in groups:  # no row pays more than double its work or `slack` blocks of padding
        assert all(2 * blocks[i] >= blocks[s] or blocks[s] - blocks[i] <= 4 for i in range(s, e))


def test_no_rows_no_groups():
    assert length_groups([]) == []
