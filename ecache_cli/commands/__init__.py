"""One module per subcommand; importing it registers the command on ``ecache_cli.cli.app``."""
