"""Functions behind the non-train `temper` subcommands (their parameters become flags)."""
