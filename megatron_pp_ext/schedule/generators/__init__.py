"""Built-in schedule generators; importing this package registers them all."""

from . import loop, vshape, dualpipev  # noqa: F401
