"""``python -m benchmarks.gpu_check`` (what ``scripts/gpu_check.sh`` runs)."""

import sys

from .main import main

sys.exit(main())
