"""``python -m hixl``: the same as the ``hixl`` command."""

from __future__ import annotations

import sys

from hixl.cli import main

if __name__ == "__main__":
    sys.exit(main())
