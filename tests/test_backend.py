"""Backend set-up: the Linux BLAS fix, device and dtype policy, and their one-line errors."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

from polspec import backend


def run_python(code: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env={**os.environ, **env})


def run_polspec(*args: str, **env: str) -> subprocess.CompletedProcess:
    return run_python(f"from polspec.cli import main; main({list(args)!r})", **env)


@pytest.mark.skipif(platform.system() != "Linux", reason="the BLAS fix is for MLX's Linux CPU wheel")
def test_openblas_is_loaded_before_mlx():
    assert backend.BLAS_FIX.active, backend.BLAS_FIX.reason
    mapped = Path("/proc/self/maps").read_text()
    assert Path(backend.BLAS_FIX.library).resolve().name in mapped


@pytest.mark.skipif(platform.machine() != "x86_64" or not backend.BLAS_FIX.active, reason="x86 OpenBLAS builds")
def test_openblas_build_is_checked_against_the_cpu_flags_before_mlx_binds_to_it():
    core = backend.openblas_core(Path(backend.BLAS_FIX.library))
    assert core is not None and backend.BLAS_FIX.reason.endswith(f", kernels for {core}")
    assert backend.missing_cpu_flags(core, backend.cpu_flags()) == []
    if core in ("ZEN", "HASWELL", "SKYLAKEX"):  # the builds cmeel-openblas ships
        missing = backend.missing_cpu_flags(core, frozenset({"sse4_2"}))
        assert missing and all(flag.startswith(("avx", "fma")) for flag in missing)


@pytest.mark.skipif(platform.system() != "Linux", reason="the BLAS fix is for MLX's Linux CPU wheel")
def test_blas_fix_can_be_switched_off():
    result = run_python("from polspec import backend; print(backend.BLAS_FIX.reason)", POLSPEC_BLAS="off")
    assert result.stdout.strip() == "disabled by POLSPEC_BLAS=off"


@pytest.mark.skipif(platform.system() != "Linux", reason="the BLAS fix is for MLX's Linux CPU wheel")
def test_a_blas_library_asked_for_by_path_that_does_not_load_is_a_one_line_error():
    """It left MLX on its slow BLAS, and only doctor said so, as a warning."""
    result = run_polspec("doctor", POLSPEC_BLAS="/typo/libopenblas.so")
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 1 and len(lines) == 1, result.stderr
    assert lines[0].startswith("polspec: error: POLSPEC_BLAS=/typo/libopenblas.so: no usable OpenBLAS: ")
    assert lines[0].endswith(" (unset it for the bundled OpenBLAS, or set it to off)")
    result = run_python("from polspec import backend; print(backend.BLAS_FIX.reason)", POLSPEC_BLAS=" Off ")
    assert result.stdout.strip() == "disabled by POLSPEC_BLAS=off"


def test_blas_fix_reports_mlx_imported_first():
    result = run_python("import mlx.core; from polspec import backend; print(backend.BLAS_FIX.active, backend.BLAS_FIX.reason)")
    expected = "mlx.core was imported before polspec.backend" if platform.system() == "Linux" else "not needed"
    assert expected in result.stdout


def test_cpu_policy_is_float32_by_default():
    result = run_python(
        "import json; from polspec import backend; b = backend.setup(); print(json.dumps([b.device, b.dtype]))",
        POLSPEC_DEVICE="cpu",
    )
    assert json.loads(result.stdout) == ["cpu", "float32"]


def test_dtype_override():
    result = run_python(
        "from polspec import backend; print(backend.setup().dtype)", POLSPEC_DEVICE="cpu", POLSPEC_DTYPE="bfloat16"
    )
    assert result.stdout.strip() == "bfloat16"


@pytest.mark.parametrize("name, value", [("POLSPEC_DTYPE", "float8"), ("POLSPEC_DEVICE", "tpu")])
def test_bad_override_is_a_one_line_error(name, value):
    result = run_polspec("doctor", **{name: value})
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [f"polspec: error: {name}={value!r} is not one of " + (
        "float32, float16, bfloat16, native" if name == "POLSPEC_DTYPE" else "cpu, gpu")]


def test_missing_backend_names_the_extra(tmp_path):
    # A plain `mlx` on Linux has no backend library: `import mlx.core` fails. Recreate that
    # with an `mlx` package that has no `core` module, first on the path.
    (tmp_path / "mlx").mkdir()
    (tmp_path / "mlx" / "__init__.py").write_text("")
    result = run_polspec("doctor", PYTHONPATH=str(tmp_path), POLSPEC_BLAS="off")
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "no MLX backend is installed" in lines[0] and "polspec[cpu]" in lines[0]
