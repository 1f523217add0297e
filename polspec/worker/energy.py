"""Energy meters: measure the joules a generation takes, or say why that cannot be done here.

- ``apple-silicon``: zeus-apple-silicon (CPU, GPU, ANE and DRAM through IOReport, no sudo);
- ``nvml``: the NVIDIA driver's cumulative energy counter, summed over GPUs;
- ``rapl``: Linux RAPL through powercap, summed over the package zones (not ``psys``, the
  whole platform's, which holds the packages already); each counter wraps at
  its ``max_energy_range_uj`` (about 262 kJ: 44 minutes at 100 W) and the wrap is added back,
  so a measurement is read at least every :data:`MAX_STRETCH_S`. Usually readable by root only.

Energy that cannot be measured is recorded as unavailable with the reason returned here,
never as 0 and never as an estimate. :func:`open_meter` picks the first meter that works.
"""

from __future__ import annotations

import importlib.util
import platform
import re
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

POWERCAP = Path("/sys/class/powercap")
# The longest a meter is left unread while it measures: a stretch of hours would let RAPL's
# counter wrap more than once, and the joules of each wrap but the last would go uncounted.
MAX_STRETCH_S = 60.0
# A stretch left unread this long (a path that forgot to pause, or to renew) is no measurement:
# at a few hundred watts RAPL's counter wraps within it, unseen.
MAX_UNREAD_S = 10 * MAX_STRETCH_S
_TOP_ZONE = re.compile(r"intel-rapl:\d+")  # sub-zones (intel-rapl:0:1) are inside their package


class Meter(Protocol):
    name: str

    def start(self) -> object: ...

    def stop(self, started: object) -> float:
        """Joules used since ``start`` returned ``started``."""


@dataclass(frozen=True)
class MeterAvailability:
    name: str | None  # "apple-silicon", "rapl" or "nvml"; None when no meter works here
    reason: str


@dataclass
class EnergyReading:
    """What one measurement window found: joules and the meter, or why there are none."""

    joules: float | None = None
    source: str | None = None
    unavailable_reason: str | None = None


class RaplMeter:
    """Linux RAPL package counters through powercap (microjoules, wrapping)."""

    name = "rapl"

    def __init__(self, powercap: Path = POWERCAP):
        # Top-level zones are named package-N, or psys on Intel laptops (the platform, packages
        # included: summing it with them counted the energy twice).
        zones = sorted(path for path in powercap.glob("intel-rapl:*")
                       if _TOP_ZONE.fullmatch(path.name) and _zone_name(path).startswith("package"))
        if not zones:
            raise OSError(f"no RAPL package zones under {powercap}")
        self.zones = zones
        self.ranges = [int((zone / "max_energy_range_uj").read_text()) for zone in zones]
        self.start()  # fails now, with the reason, when the counters are not readable

    def start(self) -> list[int]:
        return [int((zone / "energy_uj").read_text()) for zone in self.zones]

    def stop(self, started: object) -> float:
        total = 0
        for before, after, wrap in zip(started, self.start(), self.ranges, strict=True):
            total += after - before if after >= before else after + wrap - before
        return total / 1e6


class NvmlMeter:
    """Cumulative GPU energy (millijoules) from NVML, summed over every GPU."""

    name = "nvml"

    def __init__(self):
        import pynvml

        pynvml.nvmlInit()
        count = pynvml.nvmlDeviceGetCount()
        if not count:
            raise OSError("NVML found no GPU")
        self.nvml = pynvml
        self.handles = [pynvml.nvmlDeviceGetHandleByIndex(index) for index in range(count)]
        self.start()  # GPUs older than Volta have no energy counter: fail now

    def start(self) -> list[int]:
        return [self.nvml.nvmlDeviceGetTotalEnergyConsumption(handle) for handle in self.handles]

    def stop(self, started: object) -> float:
        used = [after - before for before, after in zip(started, self.start(), strict=True)]
        if min(used) < 0:
            raise OSError("a GPU's energy counter went back (the GPU or its driver was reset?)")
        return sum(used) / 1e3


def _zone_name(zone: Path) -> str:
    try:
        return (zone / "name").read_text().strip()
    except OSError:
        return ""


class AppleMeter:
    """Apple Silicon energy through zeus-apple-silicon (millijoules per subsystem)."""

    name = "apple-silicon"
    FIELDS = ("cpu_total_mj", "gpu_mj", "gpu_sram_mj", "ane_mj", "dram_mj")

    def __init__(self):
        from zeus_apple_silicon import AppleEnergyMonitor

        self.monitor = AppleEnergyMonitor()
        self.windows = 0

    def start(self) -> str:
        self.windows += 1
        name = f"polspec-{self.windows}"
        self.monitor.begin_window(name)
        return name

    def stop(self, started: object) -> float:
        metrics = self.monitor.end_window(started)
        # A subsystem this chip does not report is None; the others still cover the SoC. None
        # of them is no measurement, not 0 J.
        reported = [value for field in self.FIELDS if (value := getattr(metrics, field, None)) is not None]
        if not reported:
            raise OSError(f"zeus-apple-silicon reported none of {', '.join(self.FIELDS)}")
        return sum(reported) / 1e3


def open_meter(powercap: Path = POWERCAP, *, device: str) -> tuple[Meter | None, str]:
    """The first meter that can measure here the ``device`` MLX decodes on (``cpu`` or ``gpu``,
    :func:`polspec.backend.setup`) and what it measures, or None and every reason. A meter of
    the other device would record the energy of one that idles (an NVIDIA GPU beside a CPU
    run) or miss the one that works (the CPU package under a CUDA run)."""
    candidates = []  # (module to import, package that provides it, meter factory, what it measures)
    reasons = []
    apple = platform.system() == "Darwin"
    if apple:
        candidates.append(("zeus_apple_silicon", "zeus-apple-silicon", AppleMeter,
                           "zeus-apple-silicon (CPU, GPU, ANE, DRAM)"))
    if device == "gpu":
        candidates.append(("pynvml", "nvidia-ml-py", NvmlMeter, "NVIDIA GPU energy counter through NVML"))
        if not apple:
            reasons.append("RAPL measures the CPU package, and MLX decodes on the GPU here")
    else:
        if importlib.util.find_spec("pynvml") is not None:
            reasons.append("NVML measures NVIDIA GPUs, and MLX decodes on the CPU here")
        candidates.append((None, None, lambda: RaplMeter(powercap), "Linux RAPL package energy through powercap"))
    for module, package, make, about in candidates:
        if module is not None and importlib.util.find_spec(module) is None:
            reasons.append(f"{package} is not installed")
            continue
        try:
            return make(), about
        except PermissionError as error:
            reasons.append(f"{error.filename} is not readable (RAPL is usually root-only)")
        except Exception as error:  # each meter's library raises its own error types
            reasons.append(f"{package or 'RAPL'}: {error}")
    return None, "; ".join(reasons)


def detect_meter(powercap: Path = POWERCAP, *, device: str) -> MeterAvailability:
    """The energy meter usable on this machine for ``device``, or the reason there is none."""
    meter, about = open_meter(powercap, device=device)
    return MeterAvailability(meter.name if meter else None, about)


@contextmanager
def measure_energy(meter: Meter | None, unavailable_reason: str,
                   synchronize=None) -> Iterator[tuple[EnergyReading, Callable[[], None]]]:
    """A measurement window: the reading, filled in when the block ends, and a function for the
    work inside to call now and then (each round), which reads the meter every
    :data:`MAX_STRETCH_S` (:meth:`Measurement.renew`).

    ``synchronize`` (``mx.synchronize``) runs before each end of the window, so that queued
    GPU work is inside it. Without a meter the reading carries ``unavailable_reason``; a meter
    that fails leaves the reading unavailable with why, and never the work inside undone.
    """
    measurement = Measurement(meter, synchronize)
    measurement.resume()
    reading = EnergyReading(unavailable_reason=None if meter else unavailable_reason)
    yield reading, measurement.renew
    if meter is not None:
        measurement.pause()
        measured = measurement.reading()
        reading.joules, reading.source, reading.unavailable_reason = (measured.joules, measured.source,
                                                                       measured.unavailable_reason)


class Measurement:
    """Joules over stretches of time that :meth:`resume` starts and :meth:`pause` ends (a
    batched worker pauses while it measures a probe, which is not decoding).

    A meter that fails at either end makes the whole reading unavailable, with the reason: a
    sum that misses a stretch would be an undercount, not a measurement.
    """

    def __init__(self, meter: Meter | None, synchronize=None):
        self.meter, self.synchronize = meter, synchronize
        self.joules, self.stretches = 0.0, 0
        self.started: object | None = None
        self.stretch_began = 0.0  # time.monotonic() when the running stretch began
        self.failure: str | None = None

    @property
    def running(self) -> bool:
        return self.started is not None

    def resume(self) -> None:
        if self.meter is None or self.running or self.failure is not None:
            return
        if self.synchronize is not None:
            self.synchronize()
        try:
            self.started = self.meter.start()
            self.stretch_began = time.monotonic()
        except Exception as error:  # a counter that vanished (driver reset, permissions)
            self.failure = f"{self.meter.name} failed at the start of a window: {error}"

    def renew(self) -> None:
        """End the running stretch and begin the next once it has run :data:`MAX_STRETCH_S`: a
        wrapping counter (RAPL's) is read before it can wrap twice."""
        if self.running and time.monotonic() - self.stretch_began >= MAX_STRETCH_S:
            self.pause()
            self.resume()

    def pause(self) -> None:
        if not self.running:
            return
        if self.synchronize is not None:
            self.synchronize()
        started, self.started = self.started, None
        unread = time.monotonic() - self.stretch_began
        if unread > MAX_UNREAD_S and self.failure is None:
            self.failure = (f"{self.meter.name} went unread for {unread:.0f} s, long enough for a counter to wrap "
                            "unseen")
            return
        try:
            self.joules += self.meter.stop(started)
            self.stretches += 1
        except Exception as error:  # a counter that vanished mid-run (driver reset, permissions)
            self.failure = f"{self.meter.name} failed during the window: {error}"

    def reading(self) -> EnergyReading:
        """What the paused stretches measured (a running one is not in it)."""
        if self.failure is not None:
            return EnergyReading(unavailable_reason=self.failure)
        if not self.stretches:
            return EnergyReading(unavailable_reason="nothing was measured")
        if self.joules <= 0:  # a machine that computed used energy: the counter is not live
            return EnergyReading(unavailable_reason=f"{self.meter.name}'s counters did not move during the window "
                                                    "(a window shorter than the meter's updates, or a counter that "
                                                    "does not count)")
        return EnergyReading(joules=self.joules, source=self.meter.name)
