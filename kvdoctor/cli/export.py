"""`kvdoctor export`: a capture's records as CSV, JSON Lines or Parquet."""
from __future__ import annotations

import sys

import click

from ..capture.export import FORMATS, WHAT
from . import params as P
from .common import load_capture, since_until_options


@click.command("export")
@click.argument("capture", type=click.Path())
@since_until_options
@click.option("--what", type=click.Choice(WHAT), default="requests", show_default=True, help="Which records.")
@click.option("--format", "fmt", type=click.Choice(FORMATS), default="csv", show_default=True)
@click.option("-o", "--output", type=P.OutputFile(dash_ok=True), metavar="FILE",
              help="File to write (default: standard output; its folder must exist).")
def command(capture, since, until, what, fmt, output):
    """A capture's records for pandas, DuckDB or a spreadsheet.

    \b
    Examples:
      kvdoctor export cap/ --what requests --format csv > requests.csv
      kvdoctor export cap/ --what gpu --format parquet -o gpu.parquet
      kvdoctor export cap/ --since 1h -o last-hour.csv      # the capture's last hour
      duckdb -c "select percentile_cont(0.99) within group (order by ttft_s) from 'requests.csv'"
    """
    from ..capture.export import table, write
    from ..errors import InputError

    to_file = output and output != "-"
    if fmt == "parquet" and not to_file and sys.stdout.isatty():
        raise InputError("--format parquet is binary: pass -o FILE or redirect standard output")
    tab = table(load_capture(capture, since, until), what)
    if to_file:
        try:
            with open(output, "wb") as f:
                write(tab, fmt, f)
        except OSError as e:
            raise InputError(f"-o {output}: cannot write ({e.strerror or e})") from None
    else:
        write(tab, fmt, sys.stdout.buffer)
        sys.stdout.flush()
