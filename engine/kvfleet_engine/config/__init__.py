"""Typed engine settings, read once at the edge (CLI flags or LLM(...) keywords), then split into
small sub-configs; each component receives only its own. No torch here.

model: the checkpoint's config; cache, scheduler, runner, parallel: one component's settings
each; engine_config: EngineConfig, which checks and assembles them; cli: the `kvfleet serve`
flags."""

from kvfleet_engine.config.cache import KV_CACHE_DTYPES, CacheConfig
from kvfleet_engine.config.engine_config import EngineConfig
from kvfleet_engine.config.model import DTYPES, ModelConfig
from kvfleet_engine.config.parallel import ParallelConfig, check_model_split
from kvfleet_engine.config.runner import ATTENTION_BACKENDS, RunnerConfig
from kvfleet_engine.config.scheduler import SchedulerConfig

__all__ = [
    "ATTENTION_BACKENDS",
    "DTYPES",
    "KV_CACHE_DTYPES",
    "CacheConfig",
    "EngineConfig",
    "ModelConfig",
    "ParallelConfig",
    "RunnerConfig",
    "SchedulerConfig",
    "check_model_split",
]
