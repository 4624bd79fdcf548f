#!/usr/bin/env python
"""Training entry point: ``python``, ``torchrun`` and ``deepspeed`` all start this script.

See ``dist_sr/launch/planner.py`` (or ``--help``) for the options and examples.
"""

import sys
from pathlib import Path

try:
    import dist_sr  # noqa: F401  (installed package)
except ImportError:  # a source checkout that was not pip-installed
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dist_sr.launch.planner import main

if __name__ == "__main__":
    sys.exit(main())
