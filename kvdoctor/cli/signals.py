"""`kvdoctor signals`: the signal registry."""
from __future__ import annotations

import click
import orjson


@click.command("signals")
@click.option("--format", "fmt", type=click.Choice(["text", "json"]), default="text", show_default=True)
def command(fmt):
    """Every signal rules can use: name, unit and what it measures.

    \b
    Example:
      kvdoctor signals | grep ttft
    """
    from ..signals import REGISTRY

    if fmt == "json":
        click.echo(orjson.dumps([{"name": s.name, "unit": s.unit, "doc": s.doc} for s in REGISTRY.values()],
                                option=orjson.OPT_INDENT_2).decode())
        return
    width = max(map(len, REGISTRY))
    for s in sorted(REGISTRY.values(), key=lambda s: s.name):
        click.echo(f"{s.name:<{width}}  {s.unit:<14}  {s.doc.splitlines()[0] if s.doc else ''}")
