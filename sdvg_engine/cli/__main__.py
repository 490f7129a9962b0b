"""``python -m sdvg_engine.cli ...`` (as the ``sdvg`` command; ``torchrun -m sdvg_engine.cli bench`` shards prompts)."""

import sys

from . import main

sys.exit(main())
