"""``python -m posttrain.grpo``: the trainer command (see ``posttrain.grpo.cli``)."""

import sys

from posttrain.grpo.cli import main

sys.exit(main())
