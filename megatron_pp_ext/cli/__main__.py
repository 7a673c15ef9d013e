"""``python -m megatron_pp_ext.cli`` == ``mppx``."""

import sys

from .core import main

sys.exit(main())
