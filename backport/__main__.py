"""``python -m backport``: see backport/_diagnose.py, or ``python -m backport --help``.

Exit status: 0 not affected, or affected and fixed by ``backport.apply()``; 1
affected and not fixed, ``apply()`` breaks a working step, unsupported torch, or
the check could not run; 2 usage error.
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
