"""Torch version flags of the tests, defined once."""

import torch


# torch 2.7: fully_shard rejects the root's reshard_after_forward=None and never
# reshards a root after a forward. Under pytest, test/conftest.py skips every test
# not marked torch27 there; the unittest skipIfs on this flag in the test modules
# are for running a file alone (`python test/test_x.py`), which skips no conftest.
IS_TORCH_27 = torch.__version__ >= (2, 7) and torch.__version__ < (2, 8)
