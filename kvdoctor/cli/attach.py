"""`kvdoctor attach`: the live sidecar."""
from __future__ import annotations

import asyncio
import gc
import logging
import re
import sys
import time
from pathlib import Path
from urllib.parse import urlparse

import click

from ..errors import InputError
from . import params as P
from .common import objective_options, pop_objectives

#: the longest the relay's event loop waits for the GIL while another thread of the sidecar holds it
GIL_SWITCH_S = 0.0005


def _engine_config(items: tuple[str, ...], option: str = "--engine-config") -> dict:
    out = {}
    for item in items:
        m = re.fullmatch(r"([a-z_][a-z0-9_]*)=(.+)", item.strip())
        if not m:
            raise InputError(f"{option} {item!r}: expected KEY=VALUE, e.g. cache_type_k=q4_0 or max_running_requests=8")
        v = m[2]
        out[m[1]] = int(v) if v.isdigit() else (float(v) if re.fullmatch(r"\d+\.\d+", v) else v)
    return out


def _collectors(server_url: str, gpu: str, pid: int | None, scrape_interval: float, gpu_interval: float,
                nvml_replay: str | None, scrape: bool):
    from ..collect.scrape import ScrapeCollector

    out = [ScrapeCollector(server_url, interval_s=scrape_interval, parse_in_process=True)] if scrape else []
    port = urlparse(server_url).port
    host = None
    try:
        from ..collect.host import HostCollector

        host = HostCollector(pid=pid, port=None if pid else port)
        out.append(host)
    except ImportError:
        pass
    if gpu != "none":
        from ..collect.nvml import NvmlCollector

        gpus = "auto" if gpu == "auto" else [int(x) for x in gpu.split(",")]
        nvml = None
        if nvml_replay:
            from ..collect.nvml import ReplayNvml

            nvml = ReplayNvml(nvml_replay, loop=True)
        out.append(NvmlCollector(gpus=gpus, server_pids=host.server_pids if host else None, nvml=nvml, interval_s=gpu_interval))
    return out


def read_token(token: str | None, token_file: str | None, option: str = "--token") -> str | None:
    """The bearer token from ``option`` or ``option``-file (first line), checked for an HTTP header."""
    if token_file:
        try:
            lines = Path(token_file).read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError) as e:
            raise InputError(f"{option}-file {token_file}: cannot read ({getattr(e, 'strerror', None) or e})") from None
        token = lines[0].strip() if lines else ""
        if not token:
            raise InputError(f"{option}-file {token_file}: empty; expected the token on its first line")
    if token is not None and (not token.strip() or any(ord(c) < 33 or ord(c) > 126 for c in token)):
        raise InputError(f"{option}: expected printable ASCII without spaces (it travels in an HTTP header)")
    return token


_read_token = read_token  # the name tests and older callers use


def _check_gpus(ctx, param, value: str) -> str:
    v = value.strip()
    if v in ("auto", "none") or all(x.strip().isdigit() and int(x) < 1024 for x in v.split(",")):
        return v
    raise click.BadParameter(f"{value!r}: expected auto, none or GPU indexes such as 0,1", ctx, param)


def port_free(host: str, port: int) -> str | None:
    """Why HOST:PORT cannot be listened on (in use, not an address here), or None. Checked before
    anything starts, so a busy port is one line and no capture folder (gRPC's C core would also
    log its own lines about it)."""
    import errno
    import socket

    if port == 0:
        return None
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        return f"cannot resolve {host!r} ({e.strerror})"
    family, _, _, _, addr = infos[0]
    s = socket.socket(family, socket.SOCK_STREAM)
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the servers do: a TIME_WAIT port is free
        s.bind(addr)
    except OSError as e:
        return "port in use" if e.errno == errno.EADDRINUSE else (e.strerror or str(e))
    finally:
        s.close()
    return None


def _limit_malloc_arenas(n: int = 2) -> None:
    """A long-running sidecar should hold what it uses, not what allocators keep in reserve:
    glibc gives each thread its own arena (two suffice here), and Arrow's bundled allocator
    keeps freed pages; the system allocator returns them. Together ~5 MiB of steady RSS."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").mallopt(-8, n)  # M_ARENA_MAX
    except (OSError, AttributeError):
        pass
    import pyarrow as pa

    pa.set_memory_pool(pa.system_memory_pool())


@click.command("attach")
@click.option("--server", "server_url", required=True, type=P.URL,
              help="The inference server: scraped for /metrics, and the proxy's upstream.")
@click.option("--proxy", type=P.Address(9000), help="Serve a streaming OpenAI-compatible proxy here; point clients at it.")
@click.option("--workers", "proxy_workers", type=P.Count(1, 64, "(relay processes)"), default=1, show_default=True,
              help="Relay processes on the --proxy address (SO_REUSEPORT; one carries ~16-60k SSE events/s on a core).")
@click.option("--otlp-receiver", type=P.Address(4318),
              help="Receive the engine's OTLP/HTTP spans here (vLLM/SGLang --otlp-traces-endpoint).")
@click.option("--otlp-grpc-receiver", type=P.Address(4317),
              help="Receive the engine's OTLP/gRPC spans here (vLLM's default protocol; port 4317 by convention).")
@click.option("--capture", "capture_dir", type=P.OutputFolder(), help="Capture folder [default: ./kvdoctor-capture-DATE-TIME].")
@click.option("--listen", default="127.0.0.1:9400", show_default=True, type=P.Address(9400),
              help="kvdoctor's own /healthz /metrics /incidents /report. Loopback unless you say otherwise.")
@click.option("--gpu", default="auto", show_default=True, metavar="auto|none|I,J", callback=_check_gpus,
              help="GPUs to sample through NVML.")
@click.option("--pid", type=P.Count(1, 1 << 22, "(a process id)"), help="The server's process id (default: found by the --server port).")
@click.option("--gpu-interval", type=P.Duration(min_s=0.01, max_s=3600), default="100ms", show_default=True,
              help="Time between GPU samples (100ms, 1s, or seconds).")
@click.option("--scrape-interval", type=P.Duration(min_s=0.05, max_s=3600), default="1s", show_default=True,
              help="Time between /metrics scrapes.")
@click.option("--no-scrape", is_flag=True, help="Do not scrape /metrics (proxy or OTLP only).")
@click.option("--rules", "rules_dirs", multiple=True, type=P.InputFile(dir_okay=True, file_okay=False),
              help="Extra rule folder (repeatable).")
@objective_options
@click.option("--lookback", type=P.Duration(min_s=1), default="5m", show_default=True,
              help="Live window the rules look back over.")
@click.option("--step", type=P.Duration(min_s=0.1), default="5s", show_default=True, help="Time between live evaluations.")
@click.option("--webhook", type=P.URL, help="POST incidents as JSON (Slack-compatible 'text' field).")
@click.option("--token", envvar="KVDOCTOR_TOKEN", help="Require 'Authorization: Bearer TOKEN' on the endpoints. "
              "Prefer env KVDOCTOR_TOKEN or --token-file: a command-line argument is visible to every local user in ps.")
@click.option("--token-file", type=click.Path(dir_okay=False), help="Read the bearer token from this file (first line).")
@click.option("--otlp-endpoint", type=P.URL, help="Export incidents (spans) and percentiles (metrics) over OTLP/HTTP.")
@click.option("--store-text", is_flag=True, help="Also store prompt and completion text (off by default).")
@click.option("--engine-config", multiple=True, metavar="KEY=VALUE",
              help="Config the engine does not expose, e.g. cache_type_k=q4_0 for llama.cpp.")
@click.option("--max-capture-bytes", type=P.Size(min_bytes=1 << 20), default="1GiB", show_default=True,
              help="Drop the oldest segments beyond this size (1GiB, 512MiB or bytes).")
@click.option("--duration", type=P.Duration(), help="Stop after this long (10m, 30s or seconds; default: until Ctrl-C / SIGTERM).")
@click.option("--nvml-replay", type=P.InputFile(), hidden=True, help="Replay recorded NVML readings (demos, tests).")
@click.option("-q", "--quiet", is_flag=True, help="Only incidents and errors on the terminal.")
def command(server_url, proxy, proxy_workers, otlp_receiver, otlp_grpc_receiver, capture_dir, listen, gpu, pid, gpu_interval, scrape_interval,
            no_scrape, rules_dirs, lookback, step, webhook, token, token_file, otlp_endpoint, store_text, engine_config,
            max_capture_bytes, duration, nvml_replay, quiet, **objectives):
    """Sidecar beside a running inference server: capture to disk and diagnose live.

    Without changing the server, it samples GPU memory and bandwidth (NVML), the server
    process (psutil), the engine's /metrics, and per-request TTFT/TPOT (through --proxy, or
    OTLP spans on --otlp-receiver). Incidents open and close on the terminal (and --webhook);
    Prometheus scrapes --listen/metrics. Ctrl-C or SIGTERM flushes and closes the capture.

    \b
    Examples:
      kvdoctor attach --server http://127.0.0.1:8000
      kvdoctor attach --server http://127.0.0.1:8080 --proxy 127.0.0.1:9000 --capture cap/
      kvdoctor attach --server http://vllm:8000 --otlp-receiver 127.0.0.1:4318 --slo ttft_p99=2s \\
          --webhook https://hooks.slack.com/services/...
    """
    from ..sidecar.agent import EXIT_CAPTURE_INCOMPLETE, Agent, AttachConfig, exit_promptly, host_port
    from ..diagnosis import Options, load_rules

    if proxy_workers > 1 and not proxy:
        raise InputError(f"--workers {proxy_workers}: relay processes need --proxy HOST:PORT")
    token = _read_token(token, token_file)
    engine_config = _engine_config(engine_config)
    if capture_dir and Path(capture_dir).is_dir() and any(Path(capture_dir).iterdir()):
        folder = Path(capture_dir)
        if not (folder / "meta.json").exists() and not any(folder.glob("*-*.jsonl")):
            raise InputError(f"--capture {capture_dir}: exists and is not empty (and not a capture); choose a new folder "
                             "(an existing capture is appended to)")
    options = Options(lookback_s=lookback, step_s=step, **pop_objectives(objectives))
    rules = load_rules([Path(d) for d in rules_dirs])
    seen: dict[tuple[str, int], str] = {}
    for option, value, default in (("--listen", listen, 9400), ("--proxy", proxy, 9000),
                                   ("--otlp-receiver", otlp_receiver, 4318),
                                   ("--otlp-grpc-receiver", otlp_grpc_receiver, 4317)):
        if not value:
            continue
        host, port = host_port(value, default, option)
        if port and (host, port) in seen:
            raise InputError(f"{option} {value}: the same address as {seen[host, port]}; give each its own port")
        seen[host, port] = option
        why = port_free(host, port)  # a busy port is one line, before anything starts or is written
        if why:
            raise InputError(f"{option} {value}: cannot listen there ({why}); choose another HOST:PORT")
    logging.basicConfig(level=logging.WARNING if quiet else logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    capture = Path(capture_dir or time.strftime("kvdoctor-capture-%Y%m%d-%H%M%S"))
    cfg = AttachConfig(
        server_url=server_url.rstrip("/"), capture_dir=capture, listen=listen, proxy=proxy, otlp_receiver=otlp_receiver,
        otlp_grpc_receiver=otlp_grpc_receiver,
        rules=rules, options=options, webhook=webhook, token=token,
        otlp_endpoint=otlp_endpoint, store_text=store_text, engine_config=engine_config,
        max_capture_bytes=max_capture_bytes, duration_s=duration,
        collectors=_collectors(server_url, gpu, pid, scrape_interval, gpu_interval, nvml_replay, not no_scrape),
        gc_between_requests=True, proxy_workers=proxy_workers,
    )
    _limit_malloc_arenas()
    logging.getLogger("kvdoctor.attach").info("capturing to %s (Ctrl-C to stop)", capture)
    agent = Agent(cfg)
    # Everything imported so far lives as long as the process: out of the collector's sight, a
    # full collection no longer walks it (~25 ms a time with the ~60k objects of these imports,
    # a stall the proxy's streams would feel in their P99)
    gc.collect()
    gc.freeze()
    # a thread of ours holding the GIL (the capture writer encoding, a scrape being parsed, a
    # live step's records pickled) keeps the relay's loop waiting until it lets go: at most
    # this long, not CPython's default 5 ms, which a stream's TTFT would carry whole
    sys.setswitchinterval(GIL_SWITCH_S)
    _run_loop(agent.run())
    problem = agent.capture_problem()
    if problem:  # the run itself went fine; say what the capture lacks, and exit non-zero for it
        click.echo(f"capture closed incomplete: {capture}: {problem}", err=True)
    else:
        click.echo(f"capture closed: {capture}  (next: kvdoctor summary {capture})", err=True)
    exit_promptly(EXIT_CAPTURE_INCOMPLETE if problem else 0)


def _run_loop(coro) -> None:
    """On uvloop where it is installed (a dependency everywhere but Windows): the proxy's cost per
    request is event-loop work, and uvloop's loop is C (benchmarks/bench_proxy.py part B, added
    TTFT P50 through `attach --proxy`: 0.71 ms on asyncio's loop, 0.62 ms on uvloop)."""
    try:
        import uvloop
    except ImportError:
        asyncio.run(coro)
    else:
        uvloop.run(coro)
