"""``python cli.py ...`` in a checkout runs the ``remat`` command line (planner/cli/main.py)."""

import sys
from pathlib import Path

if __package__ in (None, "") and __name__ == "__main__":  # `python cli.py` from anywhere
    sys.path.insert(0, str(Path(__file__).resolve().parent))

from planner.cli.app import app  # noqa: E402,F401  (tests and benchmarks drive the app itself)
from planner.cli.main import main  # noqa: E402

if __name__ == "__main__":
    main()
