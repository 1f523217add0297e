"""MLX backend set-up: the Linux BLAS fix, the device and the dtype policy.

Import this module before anything imports ``mlx.core``. On Linux the CPU wheel of MLX
bundles a reference BLAS (about 3 GFLOP/s for a float32 matmul on a 2-core machine);
loading an optimised OpenBLAS into the global symbol namespace first makes MLX bind to it
instead (about 200-300 GFLOP/s). That must happen before the MLX shared library is loaded,
so it runs at import time of this module. Everything else (device, dtype) happens in
:func:`setup`, which is idempotent.

Environment overrides:
- ``POLSPEC_DEVICE``: ``cpu`` or ``gpu`` (default: gpu where Metal or CUDA is available).
- ``POLSPEC_DTYPE``: ``float32``, ``float16``, ``bfloat16`` or ``native`` (the weights' own
  dtype or quantization). Default: ``float32`` on the CPU, ``native`` on a GPU.
- ``POLSPEC_BLAS``: ``off`` skips the BLAS fix (for benchmarks), or a path to a BLAS library.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import platform
import sys
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path

from polspec.errors import PolspecError
from polspec.settings import blas_choice, mlx_device, mlx_dtype

INSTALL_HINT = (
    "no MLX backend is installed: run pip install 'polspec[cpu]' on a Linux CPU, "
    "'polspec[cuda]' on Linux with an NVIDIA GPU, or plain 'polspec' on macOS"
)


@dataclass(frozen=True)
class BlasFix:
    """Outcome of the Linux BLAS fix: the library loaded, or why none was."""

    library: str | None
    reason: str

    @property
    def active(self) -> bool:
        return self.library is not None


@dataclass(frozen=True)
class Backend:
    """The MLX backend this process runs on."""

    platform: str
    mlx_version: str
    kind: str  # "metal", "cuda" or "cpu": where the gpu device would run
    device: str  # "cpu" or "gpu": the default device chosen
    dtype: str  # the dtype policy, one of polspec.settings.DTYPES
    blas: BlasFix

    @property
    def summary(self) -> str:
        """One line naming what a measurement ran on: MLX version, device, dtype and BLAS fix."""
        return f"MLX {self.mlx_version} on {self.device}, dtype {self.dtype}, BLAS fix {'on' if self.blas.active else 'off'}"


def _openblas_candidates() -> list[Path]:
    """cmeel-openblas in every site-packages on the path, then the system's OpenBLAS."""
    roots = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"], *sys.path}
    found = [Path(root) / "cmeel.prefix" / "lib" / "libopenblas.so.0" for root in roots if root]
    found = [path for path in found if path.exists()]
    system = ctypes.util.find_library("openblas")
    if system:
        found.append(Path(system))
    return found


# OpenBLAS builds without DYNAMIC_ARCH run one CPU's kernels only, and the wrong ones die with
# SIGILL on the first matmul. cmeel-openblas wheels are such builds, each for its build host:
# 0.3.23 and 0.3.31 are SKYLAKEX (AVX-512), 0.3.29 is ZEN (AVX2). Core name -> CPU flags it needs.
_AVX512 = frozenset({"avx512f", "avx512bw", "avx512dq", "avx512vl"})
_OPENBLAS_CORE_FLAGS = {
    "SKYLAKEX": _AVX512,
    "COOPERLAKE": _AVX512 | {"avx512_bf16"},
    "SAPPHIRERAPIDS": _AVX512 | {"avx512_bf16"},
    "HASWELL": frozenset({"avx2", "fma"}),
    "ZEN": frozenset({"avx2", "fma"}),
    "SANDYBRIDGE": frozenset({"avx"}),
}


def cpu_flags() -> frozenset[str] | None:
    """The x86 CPU's feature flags from /proc/cpuinfo, or None where there are none to read."""
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "flags":
            return frozenset(value.split())
    return None


def openblas_core(library: Path) -> str | None:
    """The CPU an OpenBLAS build's kernels are for (``openblas_get_corename``), or None for a
    library that does not say or does not load.

    Reads it through a private handle: that runs the library's start-up code, as loading it for
    MLX would, but no BLAS kernel, which is where a build for the wrong CPU dies.
    """
    try:
        corename = ctypes.CDLL(str(library)).openblas_get_corename
    except (OSError, AttributeError):
        return None
    corename.restype = ctypes.c_char_p
    return corename().decode().upper()


def missing_cpu_flags(core: str | None, flags: frozenset[str] | None) -> list[str]:
    """The CPU flags OpenBLAS ``core`` needs that ``flags`` lacks; none when either is unknown."""
    if core is None or flags is None:
        return []
    return sorted(_OPENBLAS_CORE_FLAGS.get(core, frozenset()) - flags)


def _preload_blas() -> BlasFix:
    if platform.system() != "Linux":
        return BlasFix(None, "not needed: MLX uses Accelerate on macOS")
    choice = blas_choice()
    if choice == "off":
        return BlasFix(None, "disabled by POLSPEC_BLAS=off")
    if "mlx.core" in sys.modules:
        return BlasFix(None, "mlx.core was imported before polspec.backend")
    candidates = [Path(choice)] if choice else _openblas_candidates()
    if not candidates:
        return BlasFix(None, "no OpenBLAS found: pip install 'polspec[cpu]' installs cmeel-openblas")
    errors = []
    flags = cpu_flags()
    for path in candidates:
        core = openblas_core(path)
        missing = missing_cpu_flags(core, flags)
        if missing:
            hint = " (pip install 'polspec[cpu]' pins a cmeel-openblas for AVX2)" if "avx512f" in missing else ""
            errors.append(f"{path} is built for {core} and needs {', '.join(missing)}, which this CPU lacks{hint}")
            continue
        try:
            ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)
        except OSError as error:
            errors.append(str(error))
            continue
        return BlasFix(str(path), "loaded before mlx.core" + (f", kernels for {core}" if core else ""))
    reason = "; ".join(errors)
    if "libgfortran" in reason:
        reason += " (install the system package libgfortran5)"
    return BlasFix(None, f"no usable OpenBLAS: {reason}")


BLAS_FIX = _preload_blas()
_backend: Backend | None = None


@functools.cache
def _blas() -> ctypes.CDLL | None:
    """The fix's library where it is an OpenBLAS (``POLSPEC_BLAS`` may name another BLAS)."""
    blas = ctypes.CDLL(BLAS_FIX.library) if BLAS_FIX.active else None
    return blas if blas is not None and hasattr(blas, "openblas_set_num_threads") else None


def blas_threads() -> int | None:
    """The threads the OpenBLAS of the BLAS fix runs a product on; None without the fix
    (macOS's Accelerate, a GPU, ``POLSPEC_BLAS=off``) or where it is another BLAS."""
    blas = _blas()
    return blas.openblas_get_num_threads() if blas is not None else None


def set_blas_threads(count: int) -> None:
    """Run the fix's OpenBLAS on ``count`` threads from its next product on. Call it while no
    product runs (MLX runs them on its stream's thread: between rounds, after the host has read
    a round's result), as OpenBLAS does not expect its pool to change under one. An OpenMP
    build of OpenBLAS would take its threads from OpenMP instead; cmeel's, which the fix tries
    first, runs its own threads."""
    blas = _blas()
    if blas is not None:
        blas.openblas_set_num_threads(count)


def _import_mlx():
    try:
        import mlx.core as mx
    except (ImportError, OSError) as error:
        raise PolspecError(f"{INSTALL_HINT} ({error})") from None
    return mx


def gpu_kind(mx) -> str | None:
    """``metal`` or ``cuda`` when MLX can run on a GPU here, else None."""
    if mx.metal.is_available():
        return "metal"
    cuda = getattr(mx, "cuda", None)
    if cuda is not None and cuda.is_available():
        return "cuda"
    return None


def setup() -> Backend:
    """Choose the device and dtype policy once per process and return them."""
    global _backend
    if _backend is not None:
        return _backend
    mx = _import_mlx()
    chosen = blas_choice()
    if chosen not in ("", "off") and not BLAS_FIX.active and platform.system() == "Linux":
        # Asked for by path, a library that did not load would leave MLX on its slow BLAS unsaid.
        raise PolspecError(f"POLSPEC_BLAS={chosen}: {BLAS_FIX.reason} (unset it for the bundled OpenBLAS, "
                           "or set it to off)")
    kind = gpu_kind(mx)
    device = mlx_device("gpu" if kind else "cpu")
    if device == "gpu" and kind is None:
        raise PolspecError("POLSPEC_DEVICE=gpu but MLX has no Metal or CUDA device here")
    mx.set_default_device(mx.gpu if device == "gpu" else mx.cpu)
    dtype = mlx_dtype("float32" if device == "cpu" else "native")
    _backend = Backend(
        platform=f"{platform.system()} {platform.machine()}",
        mlx_version=mx.__version__,
        kind=kind or "cpu",
        device=device,
        dtype=dtype,
        blas=BLAS_FIX,
    )
    return _backend


def measure_matmul_gflops(size: int = 1024, repeats: int = 3) -> float:
    """Best-of-``repeats`` float32 ``size x size`` matmul throughput on the default device."""
    mx = _import_mlx()
    a = mx.random.normal((size, size))
    b = mx.random.normal((size, size))
    mx.eval(a @ b)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        mx.eval(a @ b)
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best / 1e9


def measure_memory_bandwidth(megabytes: int = 512, repeats: int = 3) -> float:
    """Best-of-``repeats`` read bandwidth in GB/s of a float32 matrix-vector product.

    This is what decoding one token costs: every weight read once, through the BLAS, in
    nn.Linear's layout (``v @ W.T``), with no large allocation per pass. An elementwise copy
    would understate it on the CPU, where MLX runs elementwise ops on one thread.
    """
    mx = _import_mlx()
    columns = 8192
    # Random rows repeated: drawing every value takes MLX's CPU backend seconds, most of what the
    # estimate took, and the product streams the whole matrix either way.
    rows = megabytes * 2**20 // 4 // columns
    weight = mx.tile(mx.random.normal((64, columns)), (-(-rows // 64), 1))[:rows]
    vector = mx.random.normal((1, columns))
    mx.eval(vector @ weight.T)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        mx.eval(vector @ weight.T)
        best = min(best, time.perf_counter() - start)
    return weight.nbytes / best / 1e9
