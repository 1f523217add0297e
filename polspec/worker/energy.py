"""Energy meters: which one can measure on this machine, or why none can.

Energy that cannot be measured is recorded as unavailable with the reason returned here,
never as 0 and never as an estimate.
"""

from __future__ import annotations

import importlib.util
import platform
from dataclasses import dataclass
from pathlib import Path

POWERCAP = Path("/sys/class/powercap")


@dataclass(frozen=True)
class MeterAvailability:
    name: str | None  # "apple-silicon", "rapl" or "nvml"; None when no meter works here
    reason: str


def _nvml() -> tuple[bool, str]:
    if importlib.util.find_spec("pynvml") is None:
        return False, "no NVIDIA driver bindings (nvidia-ml-py)"
    import pynvml

    try:
        pynvml.nvmlInit()
        count = pynvml.nvmlDeviceGetCount()
    except Exception as error:  # NVML raises its own error type for every missing piece
        return False, f"NVML unusable ({error})"
    return count > 0, "NVIDIA GPU energy counter through NVML" if count else "NVML found no GPU"


def detect_meter(powercap: Path = POWERCAP) -> MeterAvailability:
    """The energy meter usable on this machine, or the reason there is none."""
    if platform.system() == "Darwin":
        if importlib.util.find_spec("zeus_apple_silicon") is None:
            return MeterAvailability(None, "zeus-apple-silicon is not installed")
        return MeterAvailability("apple-silicon", "zeus-apple-silicon (CPU, GPU, ANE, DRAM)")
    nvml_ok, nvml_reason = _nvml()
    if nvml_ok:
        return MeterAvailability("nvml", nvml_reason)
    domains = sorted(powercap.glob("intel-rapl:*/energy_uj")) if powercap.exists() else []
    if not domains:
        return MeterAvailability(None, f"no RAPL domains under {powercap}; {nvml_reason}")
    try:
        domains[0].read_text()
    except PermissionError:
        return MeterAvailability(None, f"{domains[0]} is not readable (RAPL is usually root-only); {nvml_reason}")
    return MeterAvailability("rapl", f"Linux RAPL through powercap ({len(domains)} domains)")
