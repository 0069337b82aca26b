"""distgrad: post-reduction gradient statistics, overflow accounting and Prometheus metrics for
distributed LLM training on DeepSpeed and PyTorch FSDP/DDP.

    engine, *_ = deepspeed.initialize(...)
    dg = distgrad.instrument(engine)          # rank 0 serves http://127.0.0.1:9400/metrics
"""

from distgrad._version import __version__  # noqa: E402
from distgrad.api import instrument  # noqa: E402
from distgrad.config import ConfigError, DistgradConfig  # noqa: E402
from distgrad.core.instrument import Instrument  # noqa: E402
from distgrad.core.step import StepOutcome, StepToken  # noqa: E402
from distgrad.record import ParamStats, StepRecord  # noqa: E402

__all__ = ["instrument", "Instrument", "DistgradConfig", "ConfigError", "StepRecord", "ParamStats",
           "StepOutcome", "StepToken", "__version__"]
