"""``python -m backport``: checks whether the installed torch has the bug and whether
``backport.apply()`` fixes it. What it runs and its exit status: ``python -m backport
--help`` (written once, in backport/_diagnose.py).
"""

import os
import sys
import warnings


# torch warns at import when numpy is absent, and the diagnosis needs no numpy.
# The filter must be in place before torch is imported, here and in the ranks.
_IGNORE_NUMPY = "ignore:Failed to initialize NumPy:UserWarning"
warnings.filterwarnings("ignore", message="Failed to initialize NumPy", category=UserWarning)
os.environ["PYTHONWARNINGS"] = ",".join(
    filter(None, [os.environ.get("PYTHONWARNINGS"), _IGNORE_NUMPY])
)

from backport._diagnose import main


if __name__ == "__main__":
    sys.exit(main())
