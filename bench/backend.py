"""Backend benchmark: BLAS fix, memory bandwidth, per-forward cost rho(m), model load time.

Usage::

    .venv/bin/python bench/backend.py [--models a,b,c] [--repeats N] [--markdown]

Prints a JSON document of the measurements, or with ``--markdown`` the report that goes into
BENCHMARKS.md (machine description first). Progress goes to stderr. It measures:

1. float32 2048x2048 matmul GFLOP/s with and without the Linux BLAS fix, each in its own
   subprocess (the fix happens at import time of ``polspec.backend``, so one process cannot
   measure both), and memory bandwidth three ways (polspec's probe, a BLAS
   vector-matrix product, a numpy copy);
2. the time of one forward of m = 1, 3, 5, 9 tokens per model at the policy dtype with a warm
   KV cache of CONTEXT_TOKENS tokens, and rho(m) = T(m) / T(1), the cost model's rho;
3. model load time: ``load_model`` of an imported model in fresh subprocesses ("cached") and
   the GGUF import from the cached blob into a temporary directory ("cold").

Figures are medians over ``--repeats`` samples. Models must already be fetched
(``polspec models fetch ALIAS``) with POLSPEC_HOME pointing at their cache.
"""

from __future__ import annotations

# Must precede anything that imports mlx.core: importing it applies the Linux BLAS fix.
from polspec import backend

import argparse
import datetime
import gc
import importlib.metadata
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import mlx.core as mx

DEFAULT_MODELS = ("smollm2-135m", "gemma3-270m", "qwen2.5-coder-1.5b")
MATMUL_SIZE = 2048
BANDWIDTH_MEGABYTES = 256
GEMV_MEGABYTES = 1024  # beyond even the 480 MiB L3 some VMs report
FORWARD_TOKENS = (1, 3, 5, 9)
# Short enough that gemma3's sliding-window caches (window 512) never rotate, so they stay trimmable.
CONTEXT_TOKENS = 64
FORWARD_WARMUP_ROUNDS = 2
MAX_LOAD_RUNS = 3

POLISH_PROMPT = (
    "Kraków jest jednym z najstarszych miast w Polsce. Przez wieki był stolicą kraju i siedzibą "
    "królów, a Wawel do dziś przypomina o tamtych czasach. Na Rynku Głównym stoją Sukiennice i "
    "Kościół Mariacki, z którego wieży co godzinę rozbrzmiewa hejnał. Wisła płynie u stóp zamku, "
    "a latem nad jej brzegami spacerują mieszkańcy i turyści z całego świata. Miasto słynie też "
    "z uniwersytetu, założonego w czternastym wieku przez króla Kazimierza Wielkiego."
)
POLISH_CONTINUATION = " Dziś studiuje tu wiele tysięcy młodych ludzi z kraju i zagranicy."


def log(message: str) -> None:
    """Progress for the person running the benchmark; stdout is kept for the report."""
    print(f"[bench] {message}", file=sys.stderr, flush=True)


def median(values: list[float]) -> float:
    return statistics.median(values)


# --- the machine ---------------------------------------------------------------------------


def cpu_model() -> str:
    """The CPU's marketing name from /proc/cpuinfo (Linux) or sysctl (macOS), else platform's guess."""
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    if platform.system() == "Darwin":
        result = subprocess.run(["sysctl", "-n", "machdep.cpu.brand_string"], capture_output=True, text=True)
        if result.returncode == 0:
            return result.stdout.strip()
    return platform.processor() or platform.machine()


def ram_gib() -> float:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30


def os_description() -> str:
    """Distribution name where /etc/os-release exists, and the kernel."""
    release = Path("/etc/os-release")
    name = platform.system()
    if release.exists():
        for line in release.read_text().splitlines():
            if line.startswith("PRETTY_NAME="):
                name = line.split("=", 1)[1].strip('"')
    elif platform.system() == "Darwin":
        name = f"macOS {platform.mac_ver()[0]}"
    return f"{name}, kernel {platform.release()}"


def package_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def blas_label(fix: backend.BlasFix) -> str:
    """A short name for the BLAS MLX binds to: the package, the library file, or MLX's own."""
    if not fix.active:
        return "MLX's bundled reference BLAS"
    version = package_version("cmeel-openblas") if "cmeel.prefix" in fix.library else None
    return f"cmeel-openblas {version}" if version else Path(fix.library).name


def blas_description(fix: backend.BlasFix) -> str:
    """Which BLAS MLX binds to in this process, and why."""
    if not fix.active:
        return f"MLX's own ({fix.reason})"
    version = package_version("cmeel-openblas") if "cmeel.prefix" in fix.library else None
    package = f" (cmeel-openblas {version})" if version else ""
    return f"{fix.library}{package}, {fix.reason}"


def machine_description() -> dict[str, str]:
    """What the figures were measured on; the dtype policy and device are polspec's defaults here."""
    policy = backend.setup()
    return {
        "CPU": f"{cpu_model()} ({platform.machine()})",
        "cores": str(os.cpu_count()),
        "RAM": f"{ram_gib():.1f} GiB",
        "OS": os_description(),
        "Python": platform.python_version(),
        "MLX": f"{policy.mlx_version} (mlx-lm {package_version('mlx-lm')})",
        "device": policy.device if policy.kind != "cpu" else f"{policy.device} (no Metal or CUDA here)",
        "dtype policy": policy.dtype,
        "BLAS": blas_description(policy.blas),
        "date": datetime.datetime.now().astimezone().isoformat(timespec="minutes"),
    }


def load_average() -> str:
    """1-minute load average: on a small machine, other work running skews absolute figures."""
    return f"{os.getloadavg()[0]:.2f}"


def busy_cpu_seconds() -> float | None:
    """CPU seconds every process on the machine has used since boot (Linux), else None."""
    stat = Path("/proc/stat")
    if not stat.exists():
        return None
    fields = [int(value) for value in stat.read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + fields[4]  # idle and iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def own_cpu_seconds() -> float:
    """CPU seconds used by this process and the children it has waited for."""
    times = os.times()
    return times.user + times.system + times.children_user + times.children_system


def measured(timings: dict, name: str, work: Callable[[], object]) -> object:
    """Run ``work`` and record its wall time and the CPU seconds other processes used meanwhile.

    Other work on a 2-core machine skews absolute figures; this says where that happened.
    """
    busy, own, start = busy_cpu_seconds(), own_cpu_seconds(), time.perf_counter()
    result = work()
    wall = time.perf_counter() - start
    others = None if busy is None else max(0.0, busy_cpu_seconds() - busy - (own_cpu_seconds() - own))
    timings[name] = {"wall": wall, "others_cpu": others}
    return result


# --- subprocess plumbing --------------------------------------------------------------------


def run_child(args: list[str], env_changes: dict[str, str | None]) -> dict:
    """Run this script with ``--child ARGS`` in a fresh interpreter and return its JSON answer.

    ``env_changes`` sets variables, or removes them where the value is None. The child's
    last stdout line is the answer; anything a library prints before it is ignored.
    """
    env = dict(os.environ)
    for name, value in env_changes.items():
        if value is None:
            env.pop(name, None)
        else:
            env[name] = value
    command = [sys.executable, str(Path(__file__).resolve()), "--child", *args]
    result = subprocess.run(command, capture_output=True, text=True, env=env)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} failed:\n{result.stderr[-2000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def blas_env(fixed: bool) -> dict[str, str | None]:
    """Environment for a child with the BLAS fix on (the default or the user's library) or off."""
    if not fixed:
        return {"POLSPEC_BLAS": "off"}
    return {"POLSPEC_BLAS": None} if os.environ.get("POLSPEC_BLAS") == "off" else {}


# --- 1. matmul and bandwidth ----------------------------------------------------------------


def child_matmul(repeats: int) -> dict:
    """In a child: ``repeats`` independent samples of polspec's matmul probe, one timed matmul each."""
    backend.setup()
    samples = [backend.measure_matmul_gflops(MATMUL_SIZE, repeats=1) for _ in range(repeats)]
    return {"blas": blas_label(backend.BLAS_FIX), "reason": backend.BLAS_FIX.reason, "active": backend.BLAS_FIX.active, "gflops": samples}


def bench_matmul(repeats: int) -> dict[str, dict]:
    """Matmul GFLOP/s samples with the BLAS fix on and off, each variant in its own process."""
    results = {}
    for name, fixed in (("with fix", True), ("without fix", False)):
        log(f"matmul {MATMUL_SIZE}x{MATMUL_SIZE} float32, {name}")
        results[name] = run_child(["matmul", "--repeats", str(repeats)], blas_env(fixed))
    return results


def numpy_copy_bandwidth(repeats: int) -> list[float]:
    """GB/s read+write of a one-thread numpy copy into a preallocated array: the memcpy reference."""
    import numpy as np

    source = np.ones(BANDWIDTH_MEGABYTES * 2**20 // 4, dtype=np.float32)
    target = np.zeros_like(source)  # zeros_like touches nothing; the warm-up copy faults the pages in
    np.copyto(target, source)
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        np.copyto(target, source)
        samples.append(2 * source.nbytes / (time.perf_counter() - start) / 1e9)
    return samples


def bench_bandwidth(repeats: int) -> dict:
    """Samples of polspec's copy-bandwidth probe, the BLAS read bandwidth and the memcpy reference."""
    log("memory bandwidth")
    backend.setup()
    return {
        "gemv": [backend.measure_memory_bandwidth(GEMV_MEGABYTES, repeats=1) for _ in range(repeats)],
        "numpy_copy": numpy_copy_bandwidth(repeats),
    }


# --- 2. per-forward time ------------------------------------------------------------------


def prompt_ids(tokenizer, count: int) -> list[int]:
    """The first ``count`` tokens of the Polish prompt: every model sees a context of equal length."""
    ids = tokenizer.encode(POLISH_PROMPT)
    if len(ids) < count:
        raise ValueError(f"the prompt has only {len(ids)} tokens for this tokenizer, need {count}")
    return ids[:count]


def draft_ids(tokenizer, count: int) -> list[int]:
    """``count`` plausible next tokens: what a verifier forward would be fed."""
    ids = tokenizer.encode(POLISH_CONTINUATION, add_special_tokens=False)
    return (ids * count)[:count]


def timed_forward(model, cache: list, ids: list[int]) -> float:
    """Seconds for one forward of ``ids`` on the warm cache; the cache is trimmed back afterwards."""
    from mlx_lm.models.cache import trim_prompt_cache

    start = time.perf_counter()
    mx.eval(model(mx.array([ids]), cache=cache))
    elapsed = time.perf_counter() - start
    if trim_prompt_cache(cache, len(ids)) != len(ids):
        raise RuntimeError("the KV cache could not be trimmed back: keep the context below the sliding window")
    return elapsed


def streamed_gigabytes(model) -> float:
    """GB of weights one forward reads: all of them, less an untied input embedding.

    An input embedding only has its rows for the given tokens gathered; when the output
    head is tied to it, it is read whole as the head and counts.
    """
    from mlx.utils import tree_flatten

    parameters = dict(tree_flatten(model.parameters()))
    untied = any(name.endswith("lm_head.weight") for name in parameters)
    return sum(
        array.nbytes for name, array in parameters.items() if not (untied and name.endswith("embed_tokens.weight"))
    ) / 1e9


def bench_forwards(alias: str, repeats: int) -> dict:
    """Per-forward seconds for each m in FORWARD_TOKENS at the policy dtype, KV cache warm.

    The m values are interleaved within each round so that drift or other load on the
    machine affects all of them alike: the ratios rho(m) are what this is for.
    """
    from mlx_lm.models.cache import make_prompt_cache

    from polspec.models.loader import load_model

    log(f"forwards: {alias}")
    loaded = load_model(alias)
    model, tokenizer = loaded.model, loaded.tokenizer
    cache = make_prompt_cache(model)
    mx.eval(model(mx.array([prompt_ids(tokenizer, CONTEXT_TOKENS)]), cache=cache))
    inputs = {m: draft_ids(tokenizer, m) for m in FORWARD_TOKENS}
    for _ in range(FORWARD_WARMUP_ROUNDS):
        for m in FORWARD_TOKENS:
            timed_forward(model, cache, inputs[m])
    samples: dict[int, list[float]] = {m: [] for m in FORWARD_TOKENS}
    for _ in range(repeats):
        for m in FORWARD_TOKENS:
            samples[m].append(timed_forward(model, cache, inputs[m]))
    result = {"dtype": loaded.dtype, "streamed_gb": streamed_gigabytes(model), "seconds": samples}
    del loaded, model, cache
    gc.collect()
    return result


# --- 3. load time -------------------------------------------------------------------------


def child_load(alias: str) -> dict:
    """In a child: seconds for ``load_model`` of an already imported model, nothing memoised."""
    from polspec.models.files import cached_path
    from polspec.models.loader import load_model
    from polspec.models.registry import load_registry

    if cached_path(load_registry().model(alias)) is None:
        raise SystemExit(f"{alias} is not fetched: run polspec models fetch {alias}")
    start = time.perf_counter()
    load_model(alias)
    return {"seconds": time.perf_counter() - start}


def bench_cached_load(alias: str, runs: int) -> dict[str, list[float]]:
    """``load_model`` seconds in fresh processes, and each process's whole wall time."""
    log(f"cached load: {alias} ({runs} fresh processes)")
    inside, whole = [], []
    for _ in range(runs):
        start = time.perf_counter()
        inside.append(run_child(["load", "--models", alias], {})["seconds"])
        whole.append(time.perf_counter() - start)
    return {"load_model": inside, "process": whole}


def gguf_blob(alias: str) -> tuple[Path, str] | None:
    """The cached GGUF file behind ``alias`` and its sha256, or None for non-GGUF sources."""
    from polspec.models.fetch import blob_sha256, cached_blob
    from polspec.models.files import file_sha256
    from polspec.models.registry import load_registry
    from polspec.models.sources import GgufSource, WheelSource, parse_source

    entry = load_registry().model(alias)
    source = parse_source(entry.source)
    if isinstance(source, WheelSource):
        blob = cached_blob(source)
        return (blob, blob_sha256(blob)) if blob else None
    if isinstance(source, GgufSource):
        return source.path, entry.sha256 or file_sha256(source.path)
    return None


def directory_gigabytes(path: Path) -> float:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) / 1e9


def bench_cold_import(alias: str) -> dict | None:
    """Seconds to import the cached GGUF blob into a temporary directory, which is then removed."""
    from polspec.models.gguf_import import import_gguf

    found = gguf_blob(alias)
    if found is None:
        log(f"cold import: {alias} has no cached GGUF blob, skipped")
        return None
    blob, sha256 = found
    log(f"cold import: {alias} from {blob}")
    scratch = Path(tempfile.mkdtemp(prefix="polspec-bench-"))
    try:
        start = time.perf_counter()
        dest = import_gguf(blob, scratch / "models" / sha256, sha256)
        seconds = time.perf_counter() - start
        written = directory_gigabytes(dest)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return {"seconds": seconds, "gguf_gb": blob.stat().st_size / 1e9, "imported_gb": written}


# --- the run ------------------------------------------------------------------------------


def run_all(models: list[str], repeats: int) -> dict:
    """Every measurement, in an order that keeps big models out of memory while others run."""
    report: dict = {"machine": machine_description(), "load_average_start": load_average()}
    report["command"] = " ".join(["bench/backend.py", *sys.argv[1:]])
    report["repeats"] = repeats
    timings: dict[str, dict] = {}
    report["timings"] = timings
    report["matmul"] = measured(timings, "matmul", lambda: bench_matmul(repeats))
    report["bandwidth"] = measured(timings, "bandwidth", lambda: bench_bandwidth(repeats))
    report["forwards"] = {
        alias: measured(timings, f"forwards {alias}", lambda: bench_forwards(alias, repeats)) for alias in models
    }
    runs = max(1, min(MAX_LOAD_RUNS, repeats))
    report["cached_load"] = {
        alias: measured(timings, f"cached load {alias}", lambda: bench_cached_load(alias, runs)) for alias in models
    }
    report["cold_import"] = {
        alias: measured(timings, f"cold import {alias}", lambda: bench_cold_import(alias)) for alias in models
    }
    report["load_average_end"] = load_average()
    return report


# --- the Markdown report ------------------------------------------------------------------


def table(header: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return lines + ["| " + " | ".join(row) + " |" for row in rows]


def machine_section(report: dict) -> list[str]:
    machine = dict(report["machine"])
    machine["load average (1 min)"] = f"{report['load_average_start']} at start, {report['load_average_end']} at end"
    return table(["", ""], [[key, value] for key, value in machine.items()])


def matmul_section(report: dict) -> list[str]:
    rows = []
    for name, result in report["matmul"].items():
        samples = result["gflops"]
        rows.append([name, f"{result['blas']} ({result['reason']})", f"{median(samples):.1f}", f"{min(samples):.1f}-{max(samples):.1f}"])
    fixed = median(report["matmul"]["with fix"]["gflops"])
    unfixed = median(report["matmul"]["without fix"]["gflops"])
    lines = [f"### float32 {MATMUL_SIZE}x{MATMUL_SIZE} matmul", ""]
    lines += table(["variant", "BLAS in that process", "GFLOP/s (median)", "range"], rows)
    lines += ["", f"The BLAS fix makes the matmul **{fixed / unfixed:.0f}x** faster "
              f"({len(report['matmul']['with fix']['gflops'])} samples per variant, each in its own process)."]
    return lines


def bandwidth_section(report: dict) -> list[str]:
    bandwidth = report["bandwidth"]
    rows = [
        [f"`polspec.backend.measure_memory_bandwidth`: MLX `v @ W.T` over a {GEMV_MEGABYTES} MiB float32 `W`",
         "read", f"{median(bandwidth['gemv']):.1f}"],
        [f"numpy `copyto` of {BANDWIDTH_MEGABYTES} MiB into a preallocated array (one thread)", "read+write",
         f"{median(bandwidth['numpy_copy']):.1f}"],
    ]
    lines = ["### Memory bandwidth", ""] + table(["estimate", "traffic", "GB/s (median)"], rows)
    lines += ["", "The first row is the access pattern of a one-token forward (every weight read once, "
              "through the BLAS); the second is the memcpy reference."]
    return lines


def forwards_section(report: dict) -> list[str]:
    header = ["model", "dtype", "weights read"] + [f"T({m})" for m in FORWARD_TOKENS]
    header += [f"rho({m})" for m in FORWARD_TOKENS[1:]] + ["weights read / T(1)"]
    rows = []
    for alias, result in report["forwards"].items():
        times = {int(m): median(samples) for m, samples in result["seconds"].items()}
        row = [alias, result["dtype"], f"{result['streamed_gb']:.2f} GB"]
        row += [f"{times[m] * 1000:.0f} ms" for m in FORWARD_TOKENS]
        row += [f"{times[m] / times[1]:.2f}" for m in FORWARD_TOKENS[1:]]
        row.append(f"{result['streamed_gb'] / times[1]:.1f} GB/s")
        rows.append(row)
    lines = [f"### Per-forward time, KV cache warm at {CONTEXT_TOKENS} tokens", ""]
    lines += table(header, rows)
    lines += ["", "T(m): one forward of m tokens, logits evaluated, the cache trimmed back after each; "
              "rho(m) = T(m) / T(1) is the cost model's rho. Weights read: every weight but an untied "
              "input embedding (only its rows for the tokens are gathered); weights read / T(1): the "
              "bandwidth a one-token forward achieves, to compare with the `v @ W.T` row above."]
    return lines


def load_section(report: dict) -> list[str]:
    rows = []
    for alias in report["cached_load"]:
        cached = report["cached_load"][alias]
        cold = report["cold_import"][alias]
        row = [alias]
        row += [f"{cold['gguf_gb']:.2f} GB", f"{cold['imported_gb']:.2f} GB", f"{cold['seconds']:.1f} s"] if cold else ["-"] * 3
        row += [f"{median(cached['load_model']):.1f} s", f"{median(cached['process']):.1f} s"]
        rows.append(row)
    header = ["model", "GGUF", "imported", "cold: GGUF import", "cached: `load_model`", "cached: whole process"]
    runs = len(next(iter(report["cached_load"].values()))["load_model"]) if report["cached_load"] else 0
    lines = ["### Model load time", ""] + table(header, rows)
    lines += ["", f"Cold: `import_gguf` from the cached GGUF blob into a temporary directory, one run "
              f"(the blob is likely in the page cache). Cached: `load_model` of the imported model "
              f"in a fresh process, median of {runs}; whole process adds starting Python and importing "
              f"MLX and mlx-lm."]
    return lines


def interference_section(report: dict) -> list[str]:
    rows = []
    for name, timing in report["timings"].items():
        others = "unknown" if timing["others_cpu"] is None else f"{timing['others_cpu']:.1f} s"
        rows.append([name, f"{timing['wall']:.0f} s", others])
    lines = ["### Other load during the run", ""]
    lines += table(["section", "wall time", "CPU time used by other processes"], rows)
    lines += ["", f"The machine has {os.cpu_count()} cores: other processes' CPU time near a section's "
              "wall time means it shared the machine and its absolute figures read slow."]
    return lines


def markdown(report: dict) -> str:
    sections = [
        machine_section(report),
        matmul_section(report),
        bandwidth_section(report),
        forwards_section(report),
        load_section(report),
        interference_section(report),
    ]
    lines = [f"Command: `.venv/bin/python {report['command']}` (medians of {report['repeats']} repeats).", ""]
    for section in sections:
        lines += section + [""]
    return "\n".join(lines)


# --- entry point --------------------------------------------------------------------------


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=",".join(DEFAULT_MODELS), help="comma-separated aliases (default: the offline models)")
    parser.add_argument("--repeats", type=int, default=5, help="samples per measurement (default 5)")
    parser.add_argument("--markdown", action="store_true", help="print the Markdown report instead of JSON")
    parser.add_argument("--child", choices=("matmul", "load"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    return args


def child_main(args: argparse.Namespace) -> None:
    """A measurement that needs a fresh process; prints its JSON answer as the last line."""
    children: dict[str, Callable[[], dict]] = {
        "matmul": lambda: child_matmul(args.repeats),
        "load": lambda: child_load(args.models),
    }
    print(json.dumps(children[args.child]()))


def main(argv: list[str] | None = None) -> None:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.child:
        child_main(args)
        return
    models = [alias.strip() for alias in args.models.split(",") if alias.strip()]
    started = time.perf_counter()
    report = run_all(models, args.repeats)
    log(f"done in {time.perf_counter() - started:.0f} s")
    print(markdown(report) if args.markdown else json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
