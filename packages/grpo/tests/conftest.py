"""Shared test setup: the worker module for multi-rank tests is importable by name."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
