"""The `kvdoctor` command. Each sub-command lives in its own module in this package and
exposes a click command named ``command``; COMMANDS names them, and a module is imported only
when its command runs (start-up stays fast: `diagnose` does not import the sidecar).

Errors the user can act on (bad input, bad rules) print one line and exit with a stable code:
1 general, 2 bad input, 3 bad rule file, 4 source unreadable (nothing to diagnose), 5 attach could not write
every record (see docs/security.md), 70 internal error. No traceback unless KVDOCTOR_DEBUG=1.
"""
from __future__ import annotations

import importlib
import os
import sys

import click

from .. import __version__
from ..errors import KvdoctorError


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
        return importlib.import_module(f"{__name__}.{module}").command

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except KvdoctorError as e:
            if os.environ.get("KVDOCTOR_DEBUG"):
                raise
            from .common import printable

            click.echo(printable(f"kvdoctor: error: {e}"), err=True)
            sys.exit(e.exit_code)
        except (click.exceptions.ClickException, click.exceptions.Exit, click.exceptions.Abort, SystemExit,
                KeyboardInterrupt):
            raise
        except Exception as e:  # a bug: still one line, with the way to the traceback
            if os.environ.get("KVDOCTOR_DEBUG"):
                raise
            from .common import printable

            click.echo(printable(f"kvdoctor: internal error: {type(e).__name__}: {e} (KVDOCTOR_DEBUG=1 shows the "
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


def main() -> None:
    import signal

    if hasattr(signal, "SIGPIPE"):  # `kvdoctor export … | head` ends quietly, like any Unix tool
        signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    cli(prog_name="kvdoctor")
