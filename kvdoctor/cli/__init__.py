"""The `kvdoctor` command. Each sub-command lives in its own module in this package and
exposes a click command named ``command``; COMMANDS names them, and a module is imported only
when its command runs (start-up stays fast: `diagnose` does not import the sidecar).

Errors the user can act on (bad input, a bad option value, bad rules) print one line on standard
error and exit with a stable code from kvdoctor.errors.EXIT_CODES, which every command's --help
ends with (made here from the table, not written by hand). No traceback unless KVDOCTOR_DEBUG=1.
"""
from __future__ import annotations

import importlib
import os
import sys

import click

from .. import __version__
from ..errors import EXIT_CODES, KvdoctorError, NothingToDiagnose


#: command name -> module in this package (tests check every module with a `command` is here)
COMMANDS = {
    "advise": "advise", "attach": "attach", "compare": "compare", "diagnose": "diagnose", "export": "export", "import": "import_cmd", "oncall": "oncall",
    "plan": "plan", "quality": "quality", "report": "report", "rules": "rules", "signals": "signals",
    "summary": "summary",
}


class _Group(click.Group):
    def list_commands(self, ctx):
        return sorted(COMMANDS)

    def get_command(self, ctx, name):
        module = COMMANDS.get(name)
        if module is None:
            return None
        command = importlib.import_module(f"{__name__}.{module}").command
        _add_exit_epilog(command, name)
        return command

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except KvdoctorError as e:
            if os.environ.get("KVDOCTOR_DEBUG"):
                raise
            from ..units import printable

            label = "nothing to diagnose" if isinstance(e, NothingToDiagnose) else getattr(e, "label", "error")
            # one line whatever the data held: a newline inside a quoted CSV header, a file name
            text = str(e).replace("\r", "\\r").replace("\n", "\\n")
            click.echo(printable(f"kvdoctor: {label}: {text}"), err=True)
            sys.exit(e.exit_code)
        except click.exceptions.UsageError as e:  # a bad option value: one line too, naming the option
            from ..units import printable

            where = f" (see {e.ctx.command_path} --help)" if e.ctx is not None else ""
            click.echo(printable(f"kvdoctor: error: {_one_line(_usage_text(e))}{where}"), err=True)
            sys.exit(e.exit_code)
        except (click.exceptions.ClickException, click.exceptions.Exit, click.exceptions.Abort, SystemExit,
                KeyboardInterrupt):
            raise
        except Exception as e:  # a bug: still one line, with the way to the traceback
            if os.environ.get("KVDOCTOR_DEBUG"):
                raise
            from ..units import printable

            text = str(e).replace("\r", "\\r").replace("\n", "\\n")
            click.echo(printable(f"kvdoctor: internal error: {type(e).__name__}: {text} (KVDOCTOR_DEBUG=1 shows the "
                                 "traceback; please report it)"), err=True)
            sys.exit(70)


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(__version__, prog_name="kvdoctor")
def cli() -> None:
    """Find out why an LLM inference service is slow or falling over, and what to change.

    \b
    Offline, on a capture or another tool's trace:
      kvdoctor import llmperf results_individual_responses.json -o cap/
      kvdoctor diagnose cap/            # incidents, causes, evidence, fixes
      kvdoctor summary cap/             # the short on-call text
    Live, beside a running server:
      kvdoctor attach --server http://127.0.0.1:8000
    """


#: exit statuses beyond 0, 1, 2 and 70 (which every command has), by command
COMMAND_EXITS: dict[str, tuple[int, ...]] = {
    "diagnose": (3, 4, 6, 7), "summary": (3, 6, 7), "report": (3, 4, 6, 7), "compare": (3, 6, 7),
    "attach": (3, 5), "oncall": (3,), "advise": (6,), "rules list": (3,), "rules show": (3,), "rules test": (3,),
    "rules export": (3,),
}
_ALWAYS = (0, 1, 2, 70)


def exit_epilog(name: str) -> str:
    """The "Exit status" block of a command's --help, from kvdoctor.errors.EXIT_CODES."""
    codes = sorted({*_ALWAYS, *COMMAND_EXITS.get(name, ())})
    extra = {1: " (rules test: a case failed; rules export --check: files differ)"} if name in ("rules test", "rules export") else {}
    return "\b\nExit status:\n" + "\n".join(f"  {c:<3} {EXIT_CODES[c]}{extra.get(c, '')}" for c in codes)


def exit_codes_markdown() -> str:
    """The exit-status table of docs/cli.md (a generated block; tests/test_cli_docs.py checks it)."""
    rows = ["| status | meaning | commands |", "|---|---|---|"]
    for code, meaning in EXIT_CODES.items():
        cmds = "every command" if code in _ALWAYS else ", ".join(f"`{c}`" for c, codes in COMMAND_EXITS.items()
                                                                 if code in codes)
        rows.append(f"| {code} | {meaning} | {cmds} |")
    return "\n".join(rows) + "\n"


def _add_exit_epilog(command: click.Command, name: str) -> None:
    if command.epilog is None:
        command.epilog = exit_epilog(name)
    if isinstance(command, click.Group):
        for sub_name, sub in command.commands.items():
            _add_exit_epilog(sub, f"{name} {sub_name}")


def _usage_text(e: click.exceptions.UsageError) -> str:
    """A bad value as the project words every input error: ``--option 'value': what was expected``."""
    if isinstance(e, click.BadParameter) and not isinstance(e, click.MissingParameter) and e.param is not None:
        p = e.param
        name = next((o for o in p.opts if o.startswith("--")), None) or (p.opts[0] if p.opts else None)
        if not name or p.param_type_name == "argument":
            name = p.human_readable_name
        return f"{name} {e.message}" if e.message.startswith("'") else f"{name}: {e.message}"
    return e.format_message()


def _one_line(text: str) -> str:
    return " ".join(x.strip() for x in text.splitlines() if x.strip())


def main() -> None:
    import signal

    if hasattr(signal, "SIGPIPE"):  # `kvdoctor export … | head` ends quietly, like any Unix tool
        signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    cli(prog_name="kvdoctor")
