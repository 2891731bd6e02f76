#!/usr/bin/env python3
"""The operator CLI (`gptoss`, installed by `make setup` into .venv/bin), runnable from a checkout too."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from cluster_ops.cli import main

if __name__ == "__main__":
    sys.exit(main())
