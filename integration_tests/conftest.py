"""Makes ``markdown_blocks`` (the doc tests' collector) importable under pytest's importlib mode."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
