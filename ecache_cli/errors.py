"""User-facing errors. ``cli.py`` catches :class:`EcacheError` once and prints its message on one line.

Exit codes: 2 for usage and configuration errors (bad flag values, unknown names, impossible settings),
1 for runtime errors (a missing model or dataset, an unreadable file, a failed load).
"""


class EcacheError(Exception):
    """Base of every error meant for the user; ``exit_code`` is what the CLI exits with."""

    exit_code = 1


class UsageError(EcacheError):
    """A flag, argument or setting that cannot work (exit code 2)."""

    exit_code = 2


class ConfigError(UsageError):
    """A bad profile or configuration key/value (exit code 2)."""


class ModelLoadError(EcacheError):
    """A model that cannot be found or loaded (exit code 1)."""


class DataError(EcacheError):
    """An input file or dataset that is missing, unreadable or malformed (exit code 1)."""


class IgnoredSetting(UserWarning):
    """A library setting that has no effect with the others given (e.g. ``DecodeConfig.schedule`` under the
    threshold rule: ``decoding.commit.ignored_schedule``), warned by ``Engine.start`` through ``warnings``;
    the command line warns the same rule on its own stderr line and ignores this category."""


class Terminated(KeyboardInterrupt):
    """SIGTERM during a command (``timeout``, a batch scheduler, a container stop), raised by the handler
    that ``cli.handle_errors`` installs: every ``except KeyboardInterrupt`` writes the same partial
    outputs as for Ctrl-C, and the command exits :func:`interrupted_exit_code`."""


#: Set when SIGTERM arrives during a command (cleared when a command starts).
terminated = False

#: Set when Ctrl-C or SIGTERM arrives during a command and nothing has handled it yet (cleared when a command
#: starts, and by code that catches Ctrl-C and carries on, as chat's prompt does): an error raised after it
#: (an import or C extension that turned the KeyboardInterrupt into its own ImportError) is the interrupt.
interrupt_pending = False


def interrupted_exit_code() -> int:
    """The exit status of an interrupted command: 143 (128 + SIGTERM) after SIGTERM, else 130 (Ctrl-C)."""
    return 143 if terminated else 130
