"""The `kvfleet` command: a dispatcher whose subcommands import lazily."""
