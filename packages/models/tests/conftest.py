"""Shared test setup for posttrain-models: one intra-op thread unless a test asks for more.

On a 2-core machine shared with other jobs, OpenMP spin-waiting makes tiny ops far slower
with 2 threads; tests that check thread-count invariance set the count themselves.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)
