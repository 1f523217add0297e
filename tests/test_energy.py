"""Energy meters against a fake powercap tree on disk, and the unavailable path on this machine."""

from __future__ import annotations

import multiprocessing
import os
import shutil
import sys
import tempfile
from importlib.machinery import ModuleSpec
from pathlib import Path
from types import ModuleType, SimpleNamespace

import pytest

from polspec.worker import energy
from polspec.worker.energy import AppleMeter, Measurement, RaplMeter, detect_meter, measure_energy, open_meter


def zone(root: Path, name: str, energy: int, wrap: int = 2**32, kind: str | None = None) -> Path:
    """A powercap zone; ``kind`` is its name file's (default: package-N for intel-rapl:N, core inside one)."""
    path = root / name
    path.mkdir(parents=True)
    (path / "energy_uj").write_text(f"{energy}\n")
    (path / "max_energy_range_uj").write_text(f"{wrap}\n")
    (path / "name").write_text((kind or ("core" if name.count(":") > 1 else f"package-{name.split(':')[1]}")) + "\n")
    return path


def test_rapl_sums_package_zones_and_ignores_sub_zones(tmp_path):
    package0, package1 = zone(tmp_path, "intel-rapl:0", 5_000_000), zone(tmp_path, "intel-rapl:1", 1_000_000)
    zone(tmp_path, "intel-rapl:0:0", 42)  # the cores inside package 0: counted in the package already
    meter, about = open_meter(tmp_path, device="cpu")
    assert isinstance(meter, RaplMeter) and "RAPL" in about
    with measure_energy(meter, "unused") as (reading, _):
        (package0 / "energy_uj").write_text("7500000\n")
        (package1 / "energy_uj").write_text("1500000\n")
    assert reading.joules == pytest.approx(3.0) and reading.source == "rapl" and reading.unavailable_reason is None


def test_rapl_leaves_out_the_platform_zone_which_holds_the_packages(tmp_path):
    """Intel laptops have a top-level psys zone beside package-0: the whole platform, the package
    included. Summed with it, the package's energy counted twice (10 + 15 J read 25 J)."""
    package = zone(tmp_path, "intel-rapl:0", 1_000_000)
    psys = zone(tmp_path, "intel-rapl:1", 1_000_000, kind="psys")
    with measure_energy(RaplMeter(tmp_path), "unused") as (reading, _):
        (package / "energy_uj").write_text("11000000\n")
        (psys / "energy_uj").write_text("16000000\n")
    assert (reading.joules, reading.source) == (pytest.approx(10.0), "rapl")
    shutil.rmtree(package)
    none, reason = open_meter(tmp_path, device="cpu")  # a platform zone alone is not the CPU package
    assert none is None and "no RAPL package zones" in reason


def test_counters_that_do_not_move_are_no_measurement_not_zero(tmp_path, monkeypatch):
    """A VM can show powercap files whose counters never change; and a GPU reset sets NVML's
    counter back. Neither is 0 J, nor a negative figure."""
    zone(tmp_path, "intel-rapl:0", 1_000_000)
    with measure_energy(RaplMeter(tmp_path), "unused") as (reading, _):
        pass
    assert reading.joules is None and reading.unavailable_reason.startswith("rapl's counters did not move during "
                                                                           "the window (")
    monkeypatch.setitem(sys.modules, "pynvml", stand_in_nvml([10_000, 9_000_000, 4_000]))
    gpu, _ = open_meter(tmp_path, device="gpu")
    with measure_energy(gpu, "unused") as (reading, _):
        pass
    assert reading.joules is None and reading.unavailable_reason == (
        "nvml failed during the window: a GPU's energy counter went back (the GPU or its driver was reset?)")


def test_rapl_counter_wraparound_is_added_back(tmp_path):
    package = zone(tmp_path, "intel-rapl:0", 999_000_000, wrap=1_000_000_000)
    meter = RaplMeter(tmp_path)
    started = meter.start()
    (package / "energy_uj").write_text("2000000\n")  # wrapped past 1000 J
    assert meter.stop(started) == pytest.approx(3.0)


def _open_as_nobody(root: str, answer) -> None:
    os.setgid(65534)
    os.setuid(65534)
    meter, reason = open_meter(Path(root), device="cpu")
    answer.put((meter is None, reason))


def test_unreadable_rapl_is_unavailable_with_the_reason():
    root = Path(tempfile.mkdtemp())  # pytest's own directories are private to their owner
    root.chmod(0o755)
    package = zone(root, "intel-rapl:0", 10)
    (package / "energy_uj").chmod(0o400)  # readable by its owner only, like the real file
    if os.geteuid() == 0:  # root reads anything: ask as an unprivileged user, in a child process
        answer = multiprocessing.get_context("fork").Queue()
        child = multiprocessing.get_context("fork").Process(target=_open_as_nobody, args=(str(root), answer))
        child.start()
        child.join(30)
        unavailable, reason = answer.get(timeout=5)
    else:
        meter, reason = open_meter(root, device="cpu")
        unavailable = meter is None
    shutil.rmtree(root)
    assert unavailable and "energy_uj is not readable (RAPL is usually root-only)" in reason


def test_no_meter_here_gives_a_reason_not_zero(tmp_path):
    availability = detect_meter(tmp_path / "no-powercap", device="cpu")
    assert availability.name is None and "no RAPL package zones" in availability.reason
    with measure_energy(None, availability.reason) as (reading, renew):
        renew()
    assert reading.joules is None and reading.source is None and reading.unavailable_reason == availability.reason


def test_a_measurement_sums_its_stretches_and_not_what_lies_between(tmp_path):
    package = zone(tmp_path, "intel-rapl:0", 1_000_000)
    measurement = Measurement(RaplMeter(tmp_path))
    measurement.resume()
    (package / "energy_uj").write_text("3000000\n")  # 2 J while running
    measurement.pause()
    (package / "energy_uj").write_text("10000000\n")  # 7 J while paused (a probe, say)
    measurement.resume()
    measurement.resume()  # already running: the stretch goes on
    (package / "energy_uj").write_text("10500000\n")  # 0.5 J
    measurement.pause()
    reading = measurement.reading()
    assert reading.joules == pytest.approx(2.5) and reading.source == "rapl" and reading.unavailable_reason is None
    assert Measurement(RaplMeter(tmp_path)).reading().joules is None  # nothing measured is not 0 J


def test_a_long_window_reads_its_meter_before_the_counter_can_wrap_twice(tmp_path, monkeypatch):
    """A window of hours (a continuous batch) would see RAPL's counter wrap more than once
    between its two reads, and count one wrap: the meter is read every MAX_STRETCH_S instead."""
    package = zone(tmp_path, "intel-rapl:0", 0, wrap=1_000_000_000)  # wraps every 1,000 J
    clock = [0.0]
    monkeypatch.setattr(energy.time, "monotonic", lambda: clock[0])
    with measure_energy(RaplMeter(tmp_path), "unused") as (reading, renew):
        for step in range(1, 6):  # 600 J a minute for five minutes: the counter wraps three times
            clock[0] = step * energy.MAX_STRETCH_S
            (package / "energy_uj").write_text(f"{step * 600_000_000 % 1_000_000_000}\n")
            renew()
    assert reading.joules == pytest.approx(3000.0) and reading.source == "rapl"


def test_a_stretch_left_unread_longer_than_a_counter_can_hold_is_no_measurement(tmp_path, monkeypatch):
    """A stretch that ran through a long wait (a database down for an hour) counted only the
    last of RAPL's wraps: 540 kJ was stored as 15.7 kJ, a wrong number taken for a reading."""
    package = zone(tmp_path, "intel-rapl:0", 0, wrap=262_143_328_850)
    clock = [0.0]
    monkeypatch.setattr(energy.time, "monotonic", lambda: clock[0])
    measurement = Measurement(RaplMeter(tmp_path))
    measurement.resume()
    clock[0] = 90 * 60.0
    (package / "energy_uj").write_text(f"{540_000_000_000 % 262_143_328_850}\n")  # 100 W for 90 minutes
    measurement.pause()
    reading = measurement.reading()
    assert reading.joules is None and reading.unavailable_reason == (
        "rapl went unread for 5400 s, long enough for a counter to wrap unseen")


@pytest.mark.parametrize("vanishes", ["at the start", "during"])
def test_a_meter_that_fails_leaves_the_energy_unavailable_and_the_work_done(tmp_path, vanishes):
    package = zone(tmp_path, "intel-rapl:0", 1_000_000)
    meter = RaplMeter(tmp_path)
    if vanishes == "at the start":  # the counter vanished before the window (a driver reset)
        (package / "energy_uj").unlink()
    work_done = False
    with measure_energy(meter, "unused") as (reading, _):
        if vanishes == "during":
            (package / "energy_uj").unlink()
        work_done = True
    assert work_done and reading.joules is None and reading.source is None
    assert reading.unavailable_reason.startswith(f"rapl failed {vanishes} ") and "energy_uj" in reading.unavailable_reason
    measurement = Measurement(meter)
    (package / "energy_uj").write_text("2000000\n")
    measurement.resume()
    measurement.pause()
    (package / "energy_uj").unlink()
    measurement.resume()  # fails: a later stretch that works cannot make the sum whole again
    (package / "energy_uj").write_text("4000000\n")
    measurement.resume()
    measurement.pause()
    assert measurement.reading().joules is None and "failed at the start" in measurement.reading().unavailable_reason


class StandInAppleMonitor:
    """zeus-apple-silicon's monitor runs on macOS only: its two calls, answering ``fields``."""

    def __init__(self, **fields):
        self.fields = fields

    def begin_window(self, name: str) -> None:
        pass

    def end_window(self, name: str) -> SimpleNamespace:
        return SimpleNamespace(**{field: self.fields.get(field) for field in AppleMeter.FIELDS})


def test_an_apple_window_whose_subsystems_all_go_unreported_is_unavailable_not_zero():
    meter = AppleMeter.__new__(AppleMeter)
    meter.windows = 0
    meter.monitor = StandInAppleMonitor(cpu_total_mj=1500, dram_mj=500)  # no GPU or ANE figures: still a reading
    with measure_energy(meter, "unused") as (reading, _):
        pass
    assert (reading.joules, reading.source) == (pytest.approx(2.0), "apple-silicon")
    meter.monitor = StandInAppleMonitor()
    with measure_energy(meter, "unused") as (reading, _):
        pass
    assert reading.joules is None and "reported none of cpu_total_mj" in reading.unavailable_reason


def stand_in_nvml(millijoules: list[int]) -> ModuleType:
    """pynvml for one GPU whose energy counter reads ``millijoules`` in turn (no NVIDIA driver here)."""
    readings = iter(millijoules)
    module = ModuleType("pynvml")
    module.__spec__ = ModuleSpec("pynvml", None)
    module.nvmlInit = lambda: None
    module.nvmlDeviceGetCount = lambda: 1
    module.nvmlDeviceGetHandleByIndex = lambda index: index
    module.nvmlDeviceGetTotalEnergyConsumption = lambda handle: next(readings)
    return module


def test_the_meter_is_the_decoding_device_s(tmp_path, monkeypatch):
    """An NVIDIA GPU beside a CPU run idles: its counter is not the run's energy, nor is the
    CPU package's that of a run on the GPU."""
    package = zone(tmp_path, "intel-rapl:0", 1_000_000)
    monkeypatch.setitem(sys.modules, "pynvml", stand_in_nvml([10_000, 10_000, 12_500]))
    gpu, _ = open_meter(tmp_path, device="gpu")
    with measure_energy(gpu, "unused") as (reading, _):
        pass
    assert (reading.joules, reading.source) == (pytest.approx(2.5), "nvml")
    cpu, _ = open_meter(tmp_path, device="cpu")
    with measure_energy(cpu, "unused") as (reading, _):
        (package / "energy_uj").write_text("4000000\n")
    assert (reading.joules, reading.source) == (pytest.approx(3.0), "rapl")
    none, reason = open_meter(tmp_path / "no-powercap", device="cpu")
    assert none is None and "MLX decodes on the CPU here" in reason and "no RAPL package zones" in reason
