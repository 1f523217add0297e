"""``polspec doctor``: is this machine ready, and how fast is it?"""

from __future__ import annotations

import json
import platform
import sys

import click

from polspec.errors import DatabaseProblem, PolspecError
from polspec.store.engine import display_url


def _redis_report(url: str) -> dict:
    import redis

    from polspec.jobs.queue import check_redis_url, display_redis_url

    report = {"url": display_redis_url(url), "reachable": False}
    try:
        check_redis_url(url)
    except PolspecError as error:
        report["error"] = str(error)
        return report
    try:
        client = redis.Redis.from_url(url, socket_connect_timeout=2, socket_timeout=2)
        info = client.info("persistence")
        try:
            config = client.config_get("appendfsync") | client.config_get("save")
        except redis.ResponseError:  # managed servers and restricted users refuse CONFIG, which the queue never uses
            config = {}
    except ValueError as error:  # from_url: not a Redis URL
        report["error"] = f"not a Redis URL ({error})"
        return report
    except (redis.ConnectionError, redis.TimeoutError) as error:
        report.update(error=str(error), answered=isinstance(error, redis.AuthenticationError))
        return report
    except redis.RedisError as error:  # the server answered, with a refusal
        report.update(error=str(error), answered=True)
        return report
    report.update(
        reachable=True,
        aof=bool(info.get("aof_enabled")),
        appendfsync=config.get("appendfsync"),  # None: the server would not say
        snapshots=(config["save"] or "off") if "save" in config else None,
    )
    if not report["aof"]:
        report["warning"] = "a Redis restart loses queued jobs (set appendonly yes)"
    return report


def _database_report(url: str) -> dict:
    from polspec.store.migrate import current_revision, head_revision, is_newer_than_polspec, newer_schema

    try:
        report = {"url": display_url(url), "head": head_revision()}
    except PolspecError as error:  # only POLSPEC_DB_URL can fail to parse; the report goes on to Redis
        return {"url": "POLSPEC_DB_URL", "head": head_revision(), "error": str(error)}
    try:
        report["revision"] = current_revision(url)
    except DatabaseProblem as error:  # the report names the URL already
        report["error"] = error.reason
        return report
    except PolspecError as error:
        report["error"] = str(error)
        return report
    if is_newer_than_polspec(report["revision"]):
        report["error"] = newer_schema(report["revision"])
    report["up_to_date"] = report["revision"] == report["head"]
    return report


def _settings_report(sqlite: bool) -> dict:
    """The settings that are set but wrong, each as the one line the commands that read it give
    (the busy timeout only for a SQLite database: nothing reads it for another)."""
    from polspec.settings import db_busy_timeout_ms, model_cache_bytes

    errors = []
    for read in (db_busy_timeout_ms, model_cache_bytes) if sqlite else (model_cache_bytes,):
        try:
            read()
        except PolspecError as error:
            errors.append(str(error))
    return {"errors": errors}


def _blas_threads_report() -> dict:
    """The threads the BLAS fix's OpenBLAS runs a product on, and whether polspec shares them
    among the processes decoding on this machine (:mod:`polspec.cpu_share`), with how many do now."""
    from polspec import backend
    from polspec.cpu_share import decoding_processes, why_not_shared

    threads = backend.blas_threads()
    if (reason := why_not_shared()) is not None:
        return {"threads": threads, "shared": False, "reason": reason}
    return {"threads": threads, "shared": True, "decoding_processes": decoding_processes()}


def collect() -> dict:
    """Everything doctor reports, as plain data."""
    from polspec import backend
    from polspec.settings import database_url, polspec_home, redis_url
    from polspec.worker.energy import detect_meter

    info = backend.setup()
    meter = detect_meter(device=info.device)
    db_url = database_url()
    return {
        "platform": f"{platform.system()} {platform.release()} {platform.machine()}",
        "python": sys.version.split()[0],
        "mlx_version": info.mlx_version,
        "device": info.device,
        "gpu": info.kind if info.kind != "cpu" else None,
        "dtype_policy": info.dtype,
        "blas_fix": {"active": info.blas.active, "library": info.blas.library, "reason": info.blas.reason},
        "blas_threads": _blas_threads_report(),
        "matmul_gflops_f32": round(backend.measure_matmul_gflops(), 1),
        "memory_bandwidth_gbps": round(backend.measure_memory_bandwidth(), 1),
        "home": str(polspec_home()),
        "settings": _settings_report(db_url.startswith("sqlite")),
        "redis": _redis_report(redis_url()),
        "database": _database_report(db_url),
        "energy": {"meter": meter.name, "available": meter.name is not None, "reason": meter.reason},
    }


def failures(report: dict) -> list[str]:
    """What keeps polspec from working here: a wrong setting, an unreachable Redis, an unusable
    database. (A slow BLAS, Redis without AOF, an old schema or no energy meter are warnings:
    work still runs.)"""
    return [name for name, failed in (("settings", bool(report["settings"]["errors"])),
                                      ("redis", not report["redis"]["reachable"]),
                                      ("database", "error" in report["database"])) if failed]


def _print_human(report: dict, failed: list[str]) -> None:
    marks = {"ok": click.style("ok", fg="green"), "warning": click.style("--", fg="yellow"),
             "failure": click.style("!!", fg="red")}
    blas, threads = report["blas_fix"], report["blas_threads"]
    redis_report, db, energy = report["redis"], report["database"], report["energy"]
    lines = [
        ("platform", True, f"{report['platform']}, Python {report['python']}"),
        ("mlx", True, f"{report['mlx_version']} on {report['device']}"
         + (f" ({report['gpu']})" if report["gpu"] else "") + f", dtype policy {report['dtype_policy']}"),
        ("blas fix", blas["active"] or not report["platform"].startswith("Linux"),
         f"{'active' if blas['active'] else 'inactive'}: {blas['library'] or blas['reason']}"),
        ("threads", True, f"{threads['threads']} a product, shared among the polspec processes decoding on "
                               f"this machine ({threads['decoding_processes']} now)" if threads["shared"]
         else f"{threads['threads'] or '-'}, not shared: {threads['reason']}"),
        ("matmul", True, f"{report['matmul_gflops_f32']} GFLOP/s (float32, 1024x1024)"),
        ("bandwidth", True, f"{report['memory_bandwidth_gbps']} GB/s (weights read by a matrix-vector product)"),
        ("home", True, report["home"]),
        ("settings", not report["settings"]["errors"],
         "; ".join(report["settings"]["errors"]) or "model cache and busy timeout as set"),
        ("redis", redis_report["reachable"] and redis_report.get("aof", False),
         f"{redis_report['url']}: " + (
             f"reachable, AOF {'on' if redis_report['aof'] else 'off'}"
             + (f": {redis_report['warning']}" if "warning" in redis_report else "")
             if redis_report["reachable"]
             else f"{'refused' if redis_report.get('answered') else 'unreachable'} ({redis_report.get('error')})")),
        ("database", db.get("up_to_date", False),
         f"{db['url']}: " + (db["error"] if "error" in db else
                             f"revision {db['revision'] or 'none (run polspec db upgrade)'}, head {db['head']}")),
        ("energy", energy["available"], f"{energy['meter']}: {energy['reason']}" if energy["available"]
         else f"unavailable: {energy['reason']}"),
    ]
    width = max(len(name) for name, _, _ in lines)
    for name, good, text in lines:
        mark = "ok" if good else "failure" if name in failed else "warning"
        click.echo(f"{marks[mark]} {name:<{width}}  {text}")


@click.command()
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of the report.")
def doctor(as_json: bool) -> None:
    """Check the MLX backend, the BLAS fix, Redis, the database and energy metering.

    Measures float32 matmul throughput and memory bandwidth on the chosen device, so
    you can see at once whether the Linux BLAS fix is working (hundreds of GFLOP/s
    instead of single digits). Takes a few seconds. Marks: ok; -- a warning (work still
    runs: a slow BLAS, Redis without AOF, an old schema, no energy meter); !! a failure
    (a setting the commands refuse, Redis unreachable, database unusable), which also makes the
    exit status 1.

    \b
    Examples:
      polspec doctor
      polspec doctor --json | jq .matmul_gflops_f32
    """
    report = collect()
    failed = failures(report)
    if as_json:
        click.echo(json.dumps(report))
    else:
        _print_human(report, failed)
    if failed:
        sys.exit(1)
