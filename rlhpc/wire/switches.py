"""SGLang's environment switches that rlhpc sets on its engines, read as SGLang reads them.

The CPU engine server reads the same names with the same defaults and the same parsing, so one
environment means the same to both engines; ``rlhpc.engine_server.sglang.engine_env`` sets
them. tests/unit/test_sglang_strict.py checks each name, default and parser against the wheel.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

log = logging.getLogger(__name__)

# /health runs a one-token generation unless this is off (environ.py: EnvBool(True)). A paused
# engine holds such a /health for HEALTH_CHECK_TIMEOUT seconds, then answers 503.
HEALTH_GENERATION = "SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION"
# How long that /health waits for the engine to make progress (http_server.py: int, default 20)
HEALTH_CHECK_TIMEOUT = "SGLANG_HEALTH_CHECK_TIMEOUT"
HEALTH_CHECK_TIMEOUT_DEFAULT_S = 20
# Output logprobs of the model's own distribution instead of logits / temperature
# (sampler.py: get_bool_env_var, default false)
RETURN_ORIGINAL_LOGPROB = "SGLANG_RETURN_ORIGINAL_LOGPROB"
# A TP engine refuses to start when its GPUs' free memory differs by over 10% (environ.py:
# EnvBool(True); SGLang's spelling). Colocated TP ranks share GPUs with actor ranks of unequal size.
TP_MEMORY_IMBALANCE_CHECK = "SGLANG_ENABLE_TP_MEMORY_INBALANCE_CHECK"

# SGLang's EnvBool.parse
ENV_BOOL_TRUE = ("true", "1", "yes", "y")
ENV_BOOL_FALSE = ("false", "0", "no", "n")
# sglang.srt.utils.get_bool_env_var
BOOL_ENV_VAR_TRUE = ("true", "1")
BOOL_ENV_VAR_FALSE = ("false", "0")


def env_bool(env: Mapping[str, str], name: str, default: bool) -> bool:
    """SGLang's ``EnvBool`` field: unset is ``default``; an unknown value warns and is ``default``."""
    value = env.get(name)
    if value is None:
        return default
    if value.lower() in ENV_BOOL_TRUE:
        return True
    if value.lower() in ENV_BOOL_FALSE:
        return False
    log.warning('Invalid value for %s: "%s" is not a valid boolean value, using default "%s"', name, value, default)
    return default


def bool_env_var(env: Mapping[str, str], name: str) -> bool:
    """SGLang's ``get_bool_env_var(name)``: true only for "true" or "1" (any case); unset is false,
    an unknown value warns and is false."""
    value = env.get(name, "false").lower()
    if value not in BOOL_ENV_VAR_TRUE + BOOL_ENV_VAR_FALSE:
        log.warning("get_bool_env_var(%s) encountered unrecognized value=%s and will treat as false", name, value)
    return value in BOOL_ENV_VAR_TRUE


def health_check_timeout_s(env: Mapping[str, str]) -> int:
    """SGLang's ``HEALTH_CHECK_TIMEOUT``: ``int(os.getenv(name, 20))``."""
    return int(env.get(HEALTH_CHECK_TIMEOUT, HEALTH_CHECK_TIMEOUT_DEFAULT_S))
