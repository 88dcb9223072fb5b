"""`kvdoctor export`: a capture's records as CSV, JSON Lines or Parquet."""
from __future__ import annotations

import sys

import click

from ..capture.export import FORMATS, WHAT


@click.command("export")
@click.argument("capture", type=click.Path())
@click.option("--what", type=click.Choice(WHAT), default="requests", show_default=True, help="Which records.")
@click.option("--format", "fmt", type=click.Choice(FORMATS), default="csv", show_default=True)
@click.option("-o", "--output", type=click.Path(), help="File to write (default: standard output).")
def command(capture, what, fmt, output):
    """A capture's records for pandas, DuckDB or a spreadsheet.

    \b
    Examples:
      kvdoctor export cap/ --what requests --format csv > requests.csv
      kvdoctor export cap/ --what gpu --format parquet -o gpu.parquet
      duckdb -c "select percentile_cont(0.99) within group (order by ttft_s) from 'requests.csv'"
    """
    from ..capture import load
    from ..capture.export import table, write

    if fmt == "parquet" and not output and sys.stdout.isatty():
        raise click.UsageError("parquet is binary: pass -o FILE or redirect standard output")
    tab = table(load(capture), what)
    if output:
        with open(output, "wb") as f:
            write(tab, fmt, f)
    else:
        write(tab, fmt, sys.stdout.buffer)
        sys.stdout.flush()
