"""``python -m posttrain.launch`` is the ``posttrain`` command."""

from posttrain.launch.cli import main

main()
