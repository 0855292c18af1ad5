"""Step-bucketed system metrics (`OTEL_TRAIN_SYSTEM_METRICS=1`): CPU, memory and GPUs per step.

A daemon thread samples every `interval_s` seconds and files each sample under the step running
when it was taken (the latest step entered, read from the step context: nothing is added to the
training thread). When the step changes, the finished step's samples become two points per series,
``<series>/mean`` and ``<series>/max``, appended to the `ot.log` buffer, so they reach every backend
like any logged gauge. A step shorter than the interval gets points only when a sample fell in it.

Series (their OTel semantic conventions are in `otel_train.vocab.semconv`):

* ``system/cpu_percent``: this process's CPU, 100 = one core (psutil);
* ``system/rss_mb``: this process's resident memory;
* ``system/host_memory_percent``, ``system/host_memory_used_mb``: the host's memory;
* ``gpu<i>/util_percent``, ``gpu<i>/memory_used_mb``, ``gpu<i>/power_w``, ``gpu<i>/temperature_c``:
  every GPU NVML sees (``pip install 'otel-train[gpu]'``; no NVML or no GPU: no GPU series);
* ``cuda<i>/max_allocated_mb``: `torch.cuda.max_memory_allocated`, only when the program already
  imported torch and initialised CUDA (otel-train never imports torch).
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from otel_train.capture.step import current_step

__all__ = ["SystemSampler"]

_logger = logging.getLogger(__name__)
_MB = 1024.0 * 1024.0

class _Nvml:
    """Every GPU NVML sees; a readout a device does not support is dropped for that device."""

    def __init__(self) -> None:
        self.handles: list[Any] = []
        self._broken: set[tuple[int, str]] = set()
        try:
            import pynvml
        except ImportError:
            if os.path.exists("/dev/nvidiactl"):
                _logger.warning("OTEL_TRAIN_SYSTEM_METRICS: this host has NVIDIA GPUs but nvidia-ml-py is not "
                                "installed, so no GPU series: pip install 'otel-train[gpu]'")
            return
        try:
            pynvml.nvmlInit()
            self.handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
        except Exception as err:  # no driver, no GPU: no GPU series
            _logger.debug("NVML unavailable (%s): no GPU series", err)
            self.handles = []
            return
        self._nvml = pynvml

    def read(self, out: dict[str, float]) -> None:
        if not self.handles:
            return
        nv = self._nvml
        readers: tuple[tuple[str, Callable[[Any], float]], ...] = (
            ("util_percent", lambda h: float(nv.nvmlDeviceGetUtilizationRates(h).gpu)),
            ("memory_used_mb", lambda h: nv.nvmlDeviceGetMemoryInfo(h).used / _MB),
            ("power_w", lambda h: nv.nvmlDeviceGetPowerUsage(h) / 1000.0),
            ("temperature_c", lambda h: float(nv.nvmlDeviceGetTemperature(h, nv.NVML_TEMPERATURE_GPU))),
        )
        for i, handle in enumerate(self.handles):
            for name, read in readers:
                if (i, name) in self._broken:
                    continue
                try:
                    out[f"gpu{i}/{name}"] = read(handle)
                except Exception:  # not supported on this device (power on some boards): stop asking
                    self._broken.add((i, name))

    def close(self) -> None:
        if self.handles:
            self.handles = []
            with contextlib.suppress(Exception):
                self._nvml.nvmlShutdown()


def _torch_cuda(out: dict[str, float]) -> None:
    torch = sys.modules.get("torch")  # only a program that imported torch itself
    cuda = getattr(torch, "cuda", None)
    if cuda is None:
        return
    try:
        if not cuda.is_initialized():  # never initialise CUDA from here
            return
        for i in range(cuda.device_count()):
            out[f"cuda{i}/max_allocated_mb"] = cuda.max_memory_allocated(i) / _MB
    except Exception:
        return


class SystemSampler:
    """Samples the system on a daemon thread and appends each step's mean and max.

    Args:
        append: Where finished steps go: ``append(step, {"system/cpu_percent/mean": ...}, time_ns)``
            (the `ot.log` buffer's append).
        interval_s: Seconds between samples.
        step_of: Which step a sample taken now belongs to (default: the latest step entered).

    Raises:
        ModuleNotFoundError: psutil is not installed.

    Example:
        >>> got = []
        >>> sampler = SystemSampler(lambda step, values, t: got.append((step, sorted(values))), 1.0, lambda: 3)
        >>> sampler.sample_now()
        >>> sampler.stop()
        >>> got[0][0], "system/rss_mb/max" in got[0][1]
        (3, True)
    """

    def __init__(self, append: Callable[[int, Mapping[str, float], int], None], interval_s: float,
                 step_of: Callable[[], int | None] = current_step) -> None:
        try:
            import psutil
        except ImportError as err:
            raise ModuleNotFoundError("OTEL_TRAIN_SYSTEM_METRICS needs psutil: pip install psutil",
                                      name="psutil") from err
        self._append = append
        self._interval_s = interval_s
        self._step_of = step_of
        self._process = psutil.Process()
        self._psutil = psutil
        self._process.cpu_percent(None)  # the first reading only sets the baseline
        self._nvml = _Nvml()
        self._lock = threading.Lock()
        self._step: int | None = None
        self._sums: dict[str, float] = {}
        self._maxs: dict[str, float] = {}
        self._count = 0
        self._last_ns = 0
        self.samples = 0  # samples taken so far
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="otel-train-system", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s):
            try:
                self.sample_now()
            except Exception:  # a failed sample is skipped; the thread goes on
                _logger.debug("system sample failed", exc_info=True)

    def read(self) -> dict[str, float]:
        """One reading of every series."""
        mem = self._process.memory_info()
        host = self._psutil.virtual_memory()
        out = {
            "system/cpu_percent": float(self._process.cpu_percent(None)),
            "system/rss_mb": mem.rss / _MB,
            "system/host_memory_percent": float(host.percent),
            "system/host_memory_used_mb": host.used / _MB,
        }
        self._nvml.read(out)
        _torch_cuda(out)
        return out

    def sample_now(self) -> None:
        """Take one sample and file it under the current step (the sampler thread calls this)."""
        step = self._step_of()
        if step is None:
            return  # before the first step: nothing to file it under
        values = self.read()
        now = time.time_ns()
        with self._lock:
            if step != self._step:
                self._emit()
                self._step = step
            for key, value in values.items():
                self._sums[key] = self._sums.get(key, 0.0) + value
                prev = self._maxs.get(key)
                self._maxs[key] = value if prev is None or value > prev else prev
            self._count += 1
            self._last_ns = now
            self.samples += 1

    def _emit(self) -> None:
        if not self._count or self._step is None:
            return
        n = self._count
        row: dict[str, float] = {}
        for key, total in self._sums.items():
            row[f"{key}/mean"] = total / n
            row[f"{key}/max"] = self._maxs[key]
        self._append(self._step, row, self._last_ns)
        self._sums, self._maxs, self._count = {}, {}, 0

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop the thread and append the last step's samples. Idempotent."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
            self._thread = None
        with self._lock:
            self._emit()
        self._nvml.close()
