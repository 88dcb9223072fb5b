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


class NothingToDiagnose(KvdoctorError):
    """The capture (or the range asked for) holds nothing a diagnosis can judge: no requests and
    no samples, or a server that was down the whole time. Not an error in the data, so it has a
    code of its own: a script can tell "checked, healthy" (0) from "nothing was checked"."""

    exit_code = 6


#: every exit status kvdoctor's commands use, in one place (docs and --help text are made from it)
EXIT_CODES: dict[int, str] = {
    0: "ran (with or without incidents)",
    1: "general error",
    2: "bad input: an option, file or field (the message names it)",
    3: "bad rule file (file, rule id, field path)",
    4: "a source could not be read at all (Prometheus refused or unreachable, nothing under the selector)",
    5: "attach could not write every record (disk full or unwritable)",
    6: "nothing to diagnose: no requests or samples in the capture or range, or the server was down throughout",
    7: "an incident at or above --fail-on's severity",
    70: "internal error (a bug: KVDOCTOR_DEBUG=1 shows the traceback)",
}
EXIT_FAIL_ON = 7
