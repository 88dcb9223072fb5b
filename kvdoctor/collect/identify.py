"""Which engine serves ``--server``, its version and the served model, asked of the server itself.

One table, :data:`ENGINES`: per engine, the name it writes into the OpenAI model listing's
``owned_by``, the endpoints whose answer alone proves the engine (``proof``) and the endpoints
read once it is known (``details``), each with how to read version, model and configuration
from the answer. Shapes verified in the engines' sources:

=============  ==========================================================================
vLLM           ``/v1/models`` (``owned_by: "vllm"``, ``max_model_len``), ``/version``;
               vllm 0.32.0 vllm/entrypoints/serve/engine/protocol.py ModelCard,
               vllm/entrypoints/serve/instrumentator/basic.py show_version
SGLang         ``/server_info`` (0.5) or ``/get_server_info``: server args + ``version``;
               ``/model_info`` or ``/get_model_info``; ``owned_by: "sglang"``; sglang 0.4.0
               sglang/srt/server.py, 0.5.23 sglang/srt/entrypoints/http_server.py
TGI            ``/info`` (``router: "text-generation-router"``, ``version``, ``model_id``,
               ``max_total_tokens``); huggingface/text-generation-inference router/src/lib.rs
               Info, router/src/server.rs @db931fcf (its ``owned_by`` is the model id)
llama.cpp      ``/props`` (``build_info``, ``model_alias``/``model_path``, ``total_slots``,
               ``default_generation_settings.n_ctx``); ``owned_by: "llamacpp"``; seen on b11434
TensorRT-LLM   trtllm-serve: ``owned_by: "tensorrt_llm"``, ``/version``
               (NVIDIA/TensorRT-LLM tensorrt_llm/serve/openai_server.py, openai_protocol.py);
               Triton: ``/v2/models/tensorrt_llm/config`` (``backend: "tensorrtllm"``, the
               tensorrtllm_backend config.pbtxt parameters) and ``/v2`` (``name: "triton"``)
=============  ==========================================================================

A metric-name prefix the scrape collector saw (``vllm:``, ``trtllm_`` ...) counts as evidence too.
:class:`IdentifyCollector` asks at start, again after a server restart (the agent tells it) and
every few minutes, each request with a short deadline (:func:`kvdoctor.collect.scrape.http_get`),
in the agent's worker threads: never on the proxy's event loop. A server that answers none of it
leaves the engine unknown; the source status says why ("engine unknown: ...").
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable

import orjson

from ..engines.cmdline import config_from_cmdline
from ..engines.llamacpp import llamacpp_config_from_props, llamacpp_model_name, llamacpp_version
from ..model import Event
from .base import SourceUnavailable
from .scrape import BodyTooLarge, http_get

#: each request's deadline: identity endpoints answer from memory, in milliseconds
TIMEOUT_S = 1.0
#: answers larger than this are not identity answers (SGLang's /server_info is ~20 KB)
MAX_BODY_BYTES = 1 << 20
#: asked again this often once known (a restart the scrape did not see, e.g. under --no-scrape)
RECHECK_S = 120.0
#: while unknown, asked again after this, doubling up to RETRY_MAX_S
RETRY_S, RETRY_MAX_S = 2.0, 20.0
#: an identity without version or model is asked again this many times at the retry pace
INCOMPLETE_TRIES = 4

Reader = Callable[[Any], "dict[str, Any] | None"]


@dataclass(frozen=True, slots=True)
class Probe:
    path: str
    #: parsed JSON answer -> {"version", "model", "config"} (any of them), or None when the
    #: answer is not this engine's (for a proof: the engine is not proven by it)
    read: Reader


@dataclass(frozen=True, slots=True)
class EngineProbes:
    engine: str
    #: what the engine writes into /v1/models data[].owned_by (None: nothing of its own)
    owned_by: str | None
    proof: tuple[Probe, ...] = ()
    details: tuple[Probe, ...] = ()
    #: read the served model's name from /v1/models (vLLM, SGLang, trtllm-serve: the served name)
    model_from_listing: bool = True


@dataclass(frozen=True, slots=True)
class Identity:
    engine: str | None
    version: str | None = None
    model: str | None = None
    #: neutral config keys read on the way (context length, SGLang's scheduler settings, ...)
    config: dict[str, Any] = field(default_factory=dict)
    #: the endpoints whose answers were used, in order
    via: tuple[str, ...] = ()
    #: why the engine is unknown ("" when known)
    reason: str = ""
    #: the server did not answer at all (refused, timed out)
    unreachable: bool = False


# -- readers: one per answer shape ----------------------------------------------------------------

def _version_only(body: Any) -> dict[str, Any] | None:
    """vLLM's and trtllm-serve's ``/version``: ``{"version": "..."}``."""
    if isinstance(body, dict) and isinstance(body.get("version"), str) and body["version"]:
        return {"version": body["version"]}
    return None


def _int(v: Any) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def _sglang_server_info(body: Any) -> dict[str, Any] | None:
    """``dataclasses.asdict(ServerArgs)`` + scheduler info + ``version``: the server arguments as
    resolved at start, so the effective settings themselves (chunk size by GPU memory, ...)."""
    if not (isinstance(body, dict) and "model_path" in body and "disable_radix_cache" in body):
        return None
    cfg: dict[str, Any] = {"prefix_caching": not body["disable_radix_cache"]}
    chunk = _int(body.get("chunked_prefill_size"))
    if chunk is not None:
        cfg["chunked_prefill"] = chunk > 0
        if chunk > 0:
            cfg["max_batched_tokens"] = chunk
    for src, key in (("max_running_requests", "max_running_requests"), ("context_length", "context_len_tokens"),
                     ("page_size", "kv_block_size_tokens"), ("max_total_num_tokens", "kv_capacity_tokens"),
                     ("max_prefill_tokens", "max_prefill_tokens")):
        if _int(body.get(src)) is not None:
            cfg[key] = body[src]
    if isinstance(body.get("kv_cache_dtype"), str):
        cfg["kv_cache_dtype"] = body["kv_cache_dtype"]
    name = body.get("served_model_name") or body.get("model_path")
    return {"version": body.get("version") if isinstance(body.get("version"), str) else None,
            "model": name if isinstance(name, str) else None, "config": cfg}


def _sglang_model_info(body: Any) -> dict[str, Any] | None:
    if not (isinstance(body, dict) and "model_path" in body and "is_generation" in body):
        return None
    name = body.get("served_model_name") or body.get("model_path")
    return {"model": name} if isinstance(name, str) else {}


def _tgi_info(body: Any) -> dict[str, Any] | None:
    if not isinstance(body, dict):
        return None
    router = body.get("router")
    if not ((isinstance(router, str) and router.startswith("text-generation-router"))
            or {"model_id", "max_total_tokens", "max_input_tokens", "version"} <= set(body)):
        return None
    cfg = {k: body[k] for k in ("max_input_tokens",) if _int(body.get(k)) is not None}
    if _int(body.get("max_total_tokens")) is not None:
        cfg["context_len_tokens"] = body["max_total_tokens"]
    return {"version": body.get("version") if isinstance(body.get("version"), str) else None,
            "model": body.get("model_id") if isinstance(body.get("model_id"), str) else None, "config": cfg}


def _llamacpp_props(body: Any) -> dict[str, Any] | None:
    if not (isinstance(body, dict) and ("default_generation_settings" in body or "build_info" in body)):
        return None
    try:
        cfg = llamacpp_config_from_props(body, None)
    except (ValueError, TypeError, AttributeError, OverflowError):  # an odd /props: identity without config
        cfg = {}
    cfg.pop("model", None)
    return {"version": llamacpp_version(body), "model": llamacpp_model_name(body), "config": cfg}


def _param(params: Any, name: str) -> bool | None:
    """A tensorrtllm_backend config.pbtxt parameter as a boolean (``{"string_value": "true"}``);
    None when absent or still a template placeholder (``${enable_kv_cache_reuse}``)."""
    v = (params or {}).get(name, {})
    s = str(v.get("string_value", "") if isinstance(v, dict) else "").strip().lower()
    return True if s in ("true", "1") else False if s in ("false", "0") else None


def _triton_trtllm_config(body: Any) -> dict[str, Any] | None:
    """Triton's ``/v2/models/tensorrt_llm/config``: the model's config.pbtxt as JSON."""
    if not (isinstance(body, dict) and body.get("backend") == "tensorrtllm"):
        return None
    cfg: dict[str, Any] = {}
    if _int(body.get("max_batch_size")):
        cfg["max_running_requests"] = body["max_batch_size"]
    for param, key in (("enable_kv_cache_reuse", "prefix_caching"), ("enable_chunked_context", "chunked_prefill")):
        v = _param(body.get("parameters"), param)
        if v is not None:
            cfg[key] = v
    return {"model": body.get("name") if isinstance(body.get("name"), str) else None, "config": cfg}


def _triton_server(body: Any) -> dict[str, Any] | None:
    """KServe v2 server metadata; Triton's own version is not TensorRT-LLM's: kept as config."""
    if not (isinstance(body, dict) and body.get("name") == "triton"):
        return None
    return {"config": {"triton_version": body["version"]}} if isinstance(body.get("version"), str) else {}


#: the table: engine -> how to recognise it and read its version, model and settings
ENGINES: dict[str, EngineProbes] = {e.engine: e for e in (
    EngineProbes("vllm", "vllm", details=(Probe("/version", _version_only),)),
    EngineProbes("sglang", "sglang",
                 proof=(Probe("/server_info", _sglang_server_info), Probe("/get_server_info", _sglang_server_info)),
                 details=(Probe("/model_info", _sglang_model_info), Probe("/get_model_info", _sglang_model_info))),
    EngineProbes("tgi", None, proof=(Probe("/info", _tgi_info),), model_from_listing=False),
    EngineProbes("llamacpp", "llamacpp", proof=(Probe("/props", _llamacpp_props),), model_from_listing=False),
    EngineProbes("trtllm", "tensorrt_llm", proof=(Probe("/v2/models/tensorrt_llm/config", _triton_trtllm_config),),
                 details=(Probe("/version", _version_only), Probe("/v2", _triton_server))),
)}
_OWNERS = {e.owned_by: e.engine for e in ENGINES.values() if e.owned_by}


def _from_listing(body: Any) -> tuple[str | None, str | None, dict[str, Any]]:
    """(owned_by, first served model id, config) from an OpenAI ``/v1/models`` answer."""
    data = body.get("data") if isinstance(body, dict) else None
    rows = [m for m in data or () if isinstance(m, dict)]
    if not rows:
        return None, None, {}
    owner = rows[0].get("owned_by") if isinstance(rows[0].get("owned_by"), str) else None
    model = rows[0].get("id") if isinstance(rows[0].get("id"), str) else None
    lens = [m["max_model_len"] for m in rows if _int(m.get("max_model_len"))]
    return owner, model, ({"context_len_tokens": max(lens)} if lens else {})


class _Asker:
    """GETs with a deadline, answers parsed as JSON; stops at the first sign the server is not
    answering (refused or timed out), and keeps a line per endpoint for the 'unknown' reason."""

    def __init__(self, base_url: str, timeout_s: float, get: Callable[..., tuple[int, bytes]]):
        self.base_url, self.timeout_s, self.get = base_url.rstrip("/"), timeout_s, get
        self.down: str | None = None
        self.seen: list[str] = []

    def json(self, path: str) -> Any:
        if self.down:
            return None
        try:
            status, body = self.get(self.base_url + path, self.timeout_s, MAX_BODY_BYTES)
        except BodyTooLarge:
            self.seen.append(f"{path} too large")
            return None
        except OSError as e:  # refused, reset, timed out: do not go on asking a server in trouble
            self.down = f"{path}: {str(e)[:120] or type(e).__name__}"
            return None
        if status != 200:
            self.seen.append(f"{path} {status}")
            return None
        try:
            return orjson.loads(body)
        except orjson.JSONDecodeError:
            self.seen.append(f"{path} not JSON")
            return None


def identify(base_url: str, timeout_s: float = TIMEOUT_S, hint: str | None = None,
             get: Callable[..., tuple[int, bytes]] = http_get) -> Identity:
    """Ask the server at ``base_url`` what it is. ``hint``: the engine its /metrics names say
    (the scrape collector's), taken as evidence when the model listing says nothing."""
    ask = _Asker(base_url, timeout_s, get)
    listing = ask.json("/v1/models")
    if ask.down:
        return Identity(None, reason=f"server unreachable ({ask.down})", unreachable=True)
    owner, listed_model, listed_cfg = _from_listing(listing)
    via: list[str] = ["/v1/models"] if listing is not None else []
    engine = _OWNERS.get(owner or "") or (hint if hint in ENGINES else None)
    found: dict[str, Any] = {}
    if engine is None:  # no name in the listing: the endpoints only one engine has
        for spec in ENGINES.values():
            for probe in spec.proof:
                got = probe.read(ask.json(probe.path))
                if ask.down:
                    return Identity(None, reason=f"server unreachable ({ask.down})", unreachable=True)
                if got is not None:
                    engine, found = spec.engine, got
                    via.append(probe.path)
                    break
            if engine:
                break
    if engine is None:
        said = ([f"/v1/models owned_by {owner!r}"] if owner else []) + ask.seen
        return Identity(None, reason="engine unknown: no engine's endpoints answered as one ("
                        + ", ".join(said or ["nothing"]) + ")")
    spec = ENGINES[engine]
    config = {**listed_cfg, **found.get("config", {})}
    version, model = found.get("version"), found.get("model")
    proven = bool(found)  # one proof answer suffices (SGLang: /server_info, else /get_server_info)
    for probe in spec.proof + spec.details:
        if (probe in spec.proof and proven) or (probe.read is _sglang_model_info and (model or listed_model)):
            continue
        got = probe.read(ask.json(probe.path))
        if ask.down:
            break
        if got is None:
            continue
        proven = proven or probe in spec.proof
        via.append(probe.path)
        version, model = version or got.get("version"), model or got.get("model")
        config.update(got.get("config", {}))
    if not via:  # only the metric names said it, and no endpoint answered (a server still loading: 503)
        return Identity(None, reason=f"{engine} by its metric names, but no identity endpoint answered ("
                        + ", ".join(ask.seen or ["nothing"]) + ")")
    if spec.model_from_listing and listed_model:
        model = listed_model  # the served name clients ask for (llama.cpp lists its model's path: not that)
    return Identity(engine, version, model, config, tuple(via))


class IdentifyCollector:
    """Polled source "identify": emits an ``identity`` event (engine, engine_version, model,
    the endpoints read) when what the server says about itself changes, and a ``config`` event
    for settings read on the way. Asked at start, at once after :meth:`again` (the agent calls
    it when the server comes back or restarts), and every RECHECK_S; a server that cannot be
    identified is retried (RETRY_S, doubling to RETRY_MAX_S) and reported as not ok."""

    name = "identify"

    def __init__(self, base_url: str, server: str | None = None, interval_s: float = 1.0,
                 timeout_s: float = TIMEOUT_S, hint: Callable[[], str | None] | None = None,
                 get: Callable[..., tuple[int, bytes]] = http_get,
                 cmdline: Callable[[], list[str] | None] | None = None):
        """``hint``: the engine the scrape's metric names say; ``cmdline``: the server process's
        arguments when it runs on this host (HostCollector.server_cmdline), read for the flags
        the engine does not report (kvdoctor.engines.cmdline)."""
        self.base_url = base_url.rstrip("/")
        self.server = server or self.base_url
        self.interval_s, self.timeout_s = interval_s, timeout_s
        self.hint, self.get, self.cmdline = hint, get, cmdline
        self._argv_read = False  # the current process's command line read (again after a restart)
        self._incomplete = 0  # answers in a row that lacked version or model
        self.identity: Identity | None = None  # the last one found (kept while the server is away)
        self.asked = 0
        self._due = 0.0  # monotonic time of the next question
        self._retry_s = RETRY_S
        self._failure: str | None = None
        self._emitted: tuple | None = None
        self._config: dict[str, Any] = {}

    def again(self) -> None:
        """Ask at the next poll (the server came back or restarted: it may be another version)."""
        self._due = 0.0
        self._retry_s = RETRY_S
        self._argv_read = False
        self._incomplete = 0

    def collect(self, now_s: float) -> list[Any]:
        if time.monotonic() < self._due:
            if self._failure:
                raise SourceUnavailable(self._failure)
            return self._command_line(now_s)
        self.asked += 1
        found = identify(self.base_url, self.timeout_s, self.hint() if self.hint else None, self.get)
        if found.engine is None:
            self._due = time.monotonic() + self._retry_s
            self._retry_s = min(self._retry_s * 2, RETRY_MAX_S)
            known = self.identity
            self._failure = found.reason + (f"; last identified: {known.engine} {known.version or ''}".rstrip()
                                            if known and known.engine else "")
            raise SourceUnavailable(self._failure)
        # an answer without version or model (a server still starting, an endpoint missing) is
        # asked again soon, a few times, before the slow re-check
        incomplete = (found.version is None or found.model is None) and self._incomplete < INCOMPLETE_TRIES
        self._incomplete = self._incomplete + 1 if incomplete else 0
        self._due = time.monotonic() + (self._retry_s if incomplete else RECHECK_S)
        self._retry_s, self._failure = (min(self._retry_s * 2, RETRY_MAX_S) if incomplete else RETRY_S), None
        self.identity = found
        out: list[Any] = []
        key = (found.engine, found.version, found.model)
        if key != self._emitted:
            self._emitted = key
            out.append(Event(time_s=now_s, kind="identity", server=self.server,
                             detail={"engine": found.engine, "engine_version": found.version, "model": found.model,
                                     "via": list(found.via)}))
        if found.config and any(self._config.get(k) != v for k, v in found.config.items()):
            self._config.update(found.config)
            out.append(Event(time_s=now_s, kind="config", server=self.server,
                             detail={**found.config, "engine": found.engine}))
        return out + self._command_line(now_s)

    def _command_line(self, now_s: float) -> list[Any]:
        """The known flags of the server's command line, once per server process (the host
        collector finds the process; until it has, this is tried at every poll)."""
        engine = self.identity.engine if self.identity else None
        if self._argv_read or engine is None or self.cmdline is None:
            return []
        argv = self.cmdline()
        if not argv:
            return []
        self._argv_read = True
        settings = config_from_cmdline(engine, argv)
        return [Event(time_s=now_s, kind="config", server=self.server,
                      detail={"command_line": settings, "engine": engine})]
