"""The engine's periodic statistics line (vLLM's "Avg prompt throughput ..." log)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

logger = logging.getLogger("llmc")


class StatsLogger:
    """Counts tokens per step; every `interval` seconds logs one line of throughput and state. The engine
    logs from its steps (offline: steps run back to back); a server turns that off (`enabled`) and logs on
    a timer instead (server/metrics.log_stats_periodically), so that an idle gap neither delays a line
    nor dilutes the next one's rates."""

    def __init__(self, interval: float, enabled: bool):
        self.interval = interval
        self.enabled = enabled
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0
        self._last_time = time.monotonic()
        self._last_prompt_tokens = 0
        self._last_generation_tokens = 0

    def record(self, num_prefill_tokens: int, num_generated: int, stats: Callable[[], dict]) -> None:
        """Count a step's tokens; `stats()` (the engine's counters) is called only when a line is due."""
        self.num_prompt_tokens += num_prefill_tokens
        self.num_generation_tokens += num_generated
        now = time.monotonic()
        if self.enabled and now - self._last_time >= self.interval:
            self._log(now - self._last_time, stats())
            self._last_time = now
            self._last_prompt_tokens = self.num_prompt_tokens
            self._last_generation_tokens = self.num_generation_tokens

    def _log(self, elapsed: float, stats: dict) -> None:
        prompt_rate = (self.num_prompt_tokens - self._last_prompt_tokens) / elapsed
        generation_rate = (self.num_generation_tokens - self._last_generation_tokens) / elapsed
        logger.info(stats_line(stats, prompt_rate, generation_rate))


def stats_line(stats: dict, prompt_rate: float, generation_rate: float) -> str:
    """The statistics line: the engine's state (`Engine.stats()`'s keys) and the interval's token rates."""
    line = (f"running {stats.get('num_running', 0)}, waiting {stats.get('num_waiting', 0)}, "
            f"KV cache {100 * stats.get('kv_cache_usage', 0.0):.1f}%, "
            f"prefix hit rate {100 * stats.get('prefix_cache_hit_rate', 0.0):.1f}%, prompt {prompt_rate:.1f} tokens/s, "
            f"generation {generation_rate:.1f} tokens/s, preemptions {stats.get('num_preemptions', 0)}")
    if stats.get("num_spec_proposed"):
        line += f", spec acceptance {100 * stats['spec_acceptance_rate']:.1f}%"
    return line
