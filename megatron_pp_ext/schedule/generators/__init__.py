"""Built-in schedule generators; importing this package registers them all."""

from . import loop, vshape, dualpipev  # noqa: F401
from . import grouped  # noqa: F401  (grouped-interleaved, PipeOffload)
