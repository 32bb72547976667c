import contextlib
import os
import sys

import pytest

from _ranks import shared_worlds
from _versions import IS_TORCH_27


# The rank processes import test helpers by module name.
sys.path.insert(0, os.path.dirname(__file__))


def pytest_collection_modifyitems(config, items):
    # On torch 2.7, fully_shard rejects reshard_after_forward=None, which most
    # of the suite builds its root with: there only tests marked torch27 run
    # (test_torch27.py covers 2.7's own cases).
    if not IS_TORCH_27:
        return
    skip = pytest.mark.skip(reason="not marked torch27 (test_torch27.py covers torch 2.7)")
    for item in items:
        if item.get_closest_marker("torch27") is None:
            item.add_marker(skip)


@pytest.fixture(scope="class", autouse=True)
def one_world_per_class(request):
    """The run_ranks calls of a test class share one world of ranks per world size.

    As torch's MultiProcContinuousTest: the ranks start once per class instead
    of once per call (test/_ranks.py's RankWorld says what is reset between
    runs). Classes marked fresh_ranks start new ranks for every call.
    """
    fresh = request.cls is None or request.node.get_closest_marker("fresh_ranks")
    with contextlib.nullcontext() if fresh else shared_worlds():
        yield
