"""Lesson 05's helpers without a launch."""
from __future__ import annotations

from helpers.kit.rpc import worker_name


def test_worker_names_by_rank():
    assert [worker_name(rank) for rank in range(3)] == ["ps", "trainer1", "trainer2"]
