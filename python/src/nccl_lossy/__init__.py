"""Python helper for the nccl-net-lossy NCCL net plugin.

- :func:`library_path`: the plugin library this package carries (``NCCL_LOSSY_LIBRARY`` wins);
- :class:`LossyNetwork`: the environment that makes NCCL use the plugin (``.env()``, ``.apply()``);
- :class:`LossyMegatronIntegration`: switches, phases and steps for a training run, with the
  megatron-core compatibility patches of :mod:`nccl_lossy.megatron`;
- :func:`stats` (live counters of this process) and :func:`read_stats` (a run's files, as
  tables: per collective and phase, per step, per step x collective x phase, histograms);
- :mod:`nccl_lossy.profiler`: :class:`LossyProfiler` (torch.profiler with a schedule, Chrome
  and TensorBoard exports, the plugin's trace merged onto the same timeline) and
  :func:`merge_traces`;
- :func:`performance_monitor`: a training-step decorator writing time, throughput, lost
  packets per collective and phase, FLOPs and the loss per step as JSONL.
"""

import logging

from ._library import LibraryNotFoundError, library_path
from .control import (
    PHASE_ANY,
    PHASE_BACKWARD,
    PHASE_FORWARD,
    ControlError,
    set_enabled,
    set_phase,
    set_step,
    stats,
    write_stats,
)
from .integration import LossyMegatronIntegration
from .megatron import (
    apply_megatron_core_patch,
    megatron_core_patch,
    revert_megatron_core_patch,
)
from .monitor import PerformanceMonitor, performance_monitor
from .network import LossyConfigError, LossyNetwork, NcclAlreadyInitializedError
from .profiler import LossyProfiler, ProfilerConfig, TraceFormatError, merge_trace_files, merge_traces
from .statsfile import (
    StatsFormatError,
    load_stats_files,
    read_all,
    read_stats,
    rows_from_stats,
    summarize,
)

__version__ = "0.1.0"

logging.getLogger("nccl_lossy").addHandler(logging.NullHandler())

__all__ = [
    "ControlError",
    "LibraryNotFoundError",
    "LossyConfigError",
    "LossyMegatronIntegration",
    "LossyNetwork",
    "LossyProfiler",
    "NcclAlreadyInitializedError",
    "PHASE_ANY",
    "PHASE_BACKWARD",
    "PHASE_FORWARD",
    "PerformanceMonitor",
    "ProfilerConfig",
    "StatsFormatError",
    "TraceFormatError",
    "apply_megatron_core_patch",
    "library_path",
    "megatron_core_patch",
    "merge_trace_files",
    "merge_traces",
    "performance_monitor",
    "read_all",
    "read_stats",
    "revert_megatron_core_patch",
    "rows_from_stats",
    "set_enabled",
    "set_phase",
    "set_step",
    "stats",
    "write_stats",
    "load_stats_files",
    "summarize",
]
