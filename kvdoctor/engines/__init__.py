"""Engine knowledge: neutral metric names, one wire-name table per engine, scrape parsing, rates.

``NEUTRAL`` lists the names an ``EngineSample`` uses; ``TABLES`` the engines (vLLM, SGLang, TGI,
llama.cpp, TensorRT-LLM, DCGM); ``parse_scrape`` maps one Prometheus text scrape; ``rates``
holds the counter and histogram arithmetic analysis needs. docs/engines.md is the matrix.
"""
from . import dcgm, llamacpp, sglang, tgi, trtllm, vllm
from .neutral import CONFIG_KEYS, NEUTRAL, EngineTable, Info, Neutral, Wire, derive

#: every engine table, in detection order
TABLES: tuple[EngineTable, ...] = (vllm.TABLE, sglang.TABLE, tgi.TABLE, llamacpp.TABLE, trtllm.TABLE, dcgm.TABLE)
ENGINES: dict[str, EngineTable] = {t.name: t for t in TABLES}

from .llamacpp import llamacpp_config_from_props  # noqa: E402
from .promtext import canonical, detect_engines, parse_scrape  # noqa: E402  (needs TABLES)
from .rates import counter_increase, counter_rate, histogram_quantile, window_quantiles  # noqa: E402

__all__ = [
    "CONFIG_KEYS", "ENGINES", "NEUTRAL", "TABLES", "EngineTable", "Info", "Neutral", "Wire",
    "canonical", "counter_increase", "counter_rate", "derive", "detect_engines", "histogram_quantile",
    "llamacpp_config_from_props", "parse_scrape", "window_quantiles",
]
