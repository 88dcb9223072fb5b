"""The engine's effective configuration as signals (``config_*``): what the engine reported, the
user declared or the server's command line said, else that engine version's default
(kvdoctor/engines/defaults.py). A fix names them under ``in_effect:`` so a flag already on is
never advised (docs/rules.md, "Harm"). NaN where the setting is not known for this capture."""
from __future__ import annotations

from typing import Any

import numpy as np

from ..engines import effective_config
from .registry import signal

#: signal -> (neutral setting, unit); bools are 1/0
CONFIG_SIGNALS: dict[str, tuple[str, str]] = {
    "config_prefix_caching": ("prefix_caching", "bool"),
    "config_chunked_prefill": ("chunked_prefill", "bool"),
    "config_max_batched_tokens": ("max_batched_tokens", "tokens"),
    "config_ubatch_tokens": ("ubatch_tokens", "tokens"),
    "config_max_running_requests": ("max_running_requests", "requests"),
    "config_cache_reuse_tokens": ("cache_reuse_tokens", "tokens"),
    "config_cache_prompt": ("cache_prompt", "bool"),
}


def effective(prep) -> dict[str, tuple[Any, str]]:
    """setting -> (value, source) for the capture, computed once per Prepared."""
    def build():
        meta = prep.meta
        device = meta.gpu or (None if len(prep.gpu_t) else "cpu" if len(prep.host_t) else None)
        mem = prep.gpu.num("mem_total_bytes") if len(prep.gpu_t) else np.array([])
        mem_bytes = float(np.nanmax(mem)) if len(mem) and np.isfinite(mem).any() else None
        return effective_config(meta.engine, getattr(meta, "engine_version", None), prep.config,
                                device=device, device_mem_bytes=mem_bytes)

    return prep.memoised("effective_config", build)


def setting_text(prep, setting: str) -> str | None:
    """'prefix caching: on (default for vLLM >= 0.8.0 ...)' for outputs; None when unknown."""
    got = effective(prep).get(setting)
    if got is None or got[0] is None:
        return None
    value, source = got
    shown = ("on" if value else "off") if isinstance(value, bool) else f"{value:,}" if isinstance(value, int) else str(value)
    return f"{setting.replace('_', ' ')} {shown} ({source.split(' [', 1)[0]})"


def _register() -> None:
    for name, (setting, unit) in CONFIG_SIGNALS.items():
        def fn(w, setting=setting):
            got = effective(w.prep).get(setting)
            if got is None or got[0] is None:
                return np.nan
            v = got[0]
            return float(v) if isinstance(v, (bool, int, float)) else np.nan

        signal(name, unit, f"The engine's {setting.replace('_', ' ')} as it ran: reported, declared or on its "
                           "command line, else its version's default (kvdoctor/engines/defaults.py); NaN unknown")(fn)


_register()
