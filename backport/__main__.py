import sys

from backport._diagnose import main


if __name__ == "__main__":
    sys.exit(main())
