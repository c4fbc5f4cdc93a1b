"""``python -m posttrain.fsdp_mesh.parity``: the gradient-parity command (see ``_parity_cli``).

Kept apart from the implementation so that running it with ``-m`` does not import the module
twice (the package ``__init__`` imports ``_parity``, never this file or ``_parity_cli``).
"""

from __future__ import annotations

from posttrain.fsdp_mesh._parity_cli import main

__all__ = ["main"]

if __name__ == "__main__":
    raise SystemExit(main())
