"""One module per subcommand, each a plain function; ``ecache_cli.cli`` registers them (these modules
never import ``cli``, so there is no import cycle)."""
