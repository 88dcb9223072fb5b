"""Engine knowledge: neutral metric names, one wire-name table per engine, scrape parsing, rates.

``NEUTRAL`` lists the names an ``EngineSample`` uses; ``TABLES`` the engines (vLLM, SGLang, TGI,
llama.cpp, TensorRT-LLM, DCGM); ``parse_scrape`` maps one Prometheus text scrape; ``rates``
holds the counter and histogram arithmetic analysis needs; ``effective_config`` (defaults.py)
gives the configuration an engine ran with (reported, declared, else its default for that
version) and ``has_feature`` (capabilities.py) which features it has at all. docs/engines.md is
the matrix.
"""
from . import dcgm, llamacpp, sglang, tgi, trtllm, vllm
from .neutral import CONFIG_KEYS, NEUTRAL, EngineTable, Info, Neutral, Wire, derive

#: every engine table, in detection order
TABLES: tuple[EngineTable, ...] = (vllm.TABLE, sglang.TABLE, tgi.TABLE, llamacpp.TABLE, trtllm.TABLE, dcgm.TABLE)
ENGINES: dict[str, EngineTable] = {t.name: t for t in TABLES}

from .capabilities import CAPABILITIES, FEATURES, capability, has_feature  # noqa: E402
from .defaults import DEFAULTS, SETTINGS, default_for, effective_config, version_key  # noqa: E402
from .llamacpp import llamacpp_config_from_props  # noqa: E402
from .promtext import canonical, detect_engines, parse_scrape  # noqa: E402  (needs TABLES)
from .rates import counter_increase, counter_rate, histogram_quantile, window_quantiles  # noqa: E402

__all__ = [
    "CAPABILITIES", "CONFIG_KEYS", "DEFAULTS", "ENGINES", "FEATURES", "NEUTRAL", "SETTINGS", "TABLES", "EngineTable",
    "Info", "Neutral", "Wire", "canonical", "capability", "counter_increase", "counter_rate", "default_for", "derive",
    "detect_engines", "effective_config", "has_feature", "histogram_quantile", "llamacpp_config_from_props",
    "parse_scrape", "version_key", "window_quantiles",
]
