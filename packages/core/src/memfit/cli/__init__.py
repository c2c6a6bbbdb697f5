"""The ``memfit`` command line. Packages add subcommands through the ``register_commands`` hook."""
