"""Built-in ``mppx`` subcommands. Every module here is imported by the CLI and registers its
command(s) with :func:`megatron_pp_ext.cli.register_command`; add a module to add a command."""
