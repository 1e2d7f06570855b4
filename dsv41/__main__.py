"""`python -m dsv41 ...` is `dsv41 ...` (what `torchrun -m dsv41 serve ...` runs on every rank)."""

import sys

from dsv41.cli import main

if __name__ == "__main__":
    sys.exit(main())
