"""Errors a user can act on. The CLI prints them as one line and exits with ``exit_code``."""


class KvdoctorError(Exception):
    exit_code = 1


class InputError(KvdoctorError):
    """Malformed or unknown input: the message names the file, line or field and what was expected."""

    exit_code = 2


class RuleError(KvdoctorError):
    """A rule file that does not validate: the message names file, rule id, field path and the fix."""

    exit_code = 3


class SourceError(KvdoctorError):
    """A source that could not be read at all (Prometheus refused or unreachable, nothing under
    the selector): nothing to diagnose. The message names the source and the first reason."""

    exit_code = 4
