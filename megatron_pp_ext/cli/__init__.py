"""The ``mppx`` command line (console script ``mppx = megatron_pp_ext.cli:main``).

Subcommands are registered with :func:`register_command` (see :mod:`.core`); the built-in
ones are in :mod:`megatron_pp_ext.cli.commands`.
"""

from .core import (CLIError, Command, build_parser, load_commands, main, register_command, registered_commands)

__all__ = ["CLIError", "Command", "build_parser", "load_commands", "main", "register_command",
           "registered_commands"]
