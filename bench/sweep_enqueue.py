"""What enqueueing and resuming a large sweep costs: wall time and peak memory of the command.

    .venv/bin/python bench/sweep_enqueue.py --prompts 11130 --markdown      # 345,030 items, about 4 minutes
    .venv/bin/python bench/sweep_enqueue.py --prompts 11130 --checkouts /tmp/old,.   # two versions side by side

A dataset of ``--prompts`` prompts goes into a sweep of 31 cells (two drafts, three strategies,
five values of k, and the baseline), so that the sweep has 31 items per prompt. For each
checkout, in turn, on a private ``redis-server`` and a fresh SQLite file: ``polspec enqueue
sweep`` writes and enqueues it (first), then the same command again finds it and resumes it
(resume: nothing to do but check that every item has its job). Each command runs as its own
process, from that checkout's source, so that its peak memory is its own.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
# Run as a child process, outside any checkout: the CLI of the checkout on PYTHONPATH, then its own
# peak memory on stderr. An editable install's finder would import this checkout's polspec
# whatever the path says, so it is set aside.
RUN_CLI = """import resource, sys
sys.meta_path[:] = [finder for finder in sys.meta_path if not getattr(finder, "__module__", "").startswith("__editable__")]
import polspec
from polspec.cli import main
print("source", polspec.__file__, file=sys.stderr)
try:
    main(sys.argv[1:])
finally:
    try:  # this process's own high-water mark: Linux's ru_maxrss keeps the parent's across exec
        peak_kib = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmHWM:"))
    except OSError:  # no /proc (macOS), where ru_maxrss counts bytes
        peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024
    print("peak_kib", peak_kib, file=sys.stderr)
"""
SWEEP = """name = "large"
target = "gemma3-270m"
drafts = ["smollm2-135m", "gemma3-270m"]
strategies = ["naive", "context", "aligned"]
k = [1, 2, 3, 4, 6]
datasets = ["prompts.jsonl"]
max_tokens = 16
raw = true
"""
CELLS = 31


def bench_jobs():
    """bench/jobs.py, whose machine table and free port this benchmark shares."""
    spec = importlib.util.spec_from_file_location("bench_jobs", HERE / "jobs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_enqueue(checkout: Path, folder: Path, env: dict[str, str]) -> dict:
    """One ``polspec enqueue sweep``: its wall time and peak memory."""
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", RUN_CLI, "enqueue", "sweep", "--config", str(folder / "sweep.toml"),
                           "--json"], env=env | {"PYTHONPATH": str(checkout)}, cwd=folder, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if done.returncode:
        raise SystemExit(f"{checkout}: polspec enqueue sweep failed: {done.stderr.strip()}")
    report = json.loads(done.stdout)
    peak_kib = int(next(line.split()[1] for line in done.stderr.splitlines() if line.startswith("peak_kib")))
    source = next(line.split()[1] for line in done.stderr.splitlines() if line.startswith("source"))
    assert source.startswith(str(checkout)), f"{checkout}: ran polspec from {source}"
    return {"wall_s": wall, "peak_mb": peak_kib * 1024 / 1e6, "items": report["items"],
            "enqueued": report["enqueued"], "resumed": report["resumed"]}


def bench_checkout(checkout: Path, prompts: int, scratch: Path, url: str) -> dict:
    from polspec.jobs.local_redis import redis_available

    folder = scratch / checkout.resolve().name
    folder.mkdir()
    (folder / "sweep.toml").write_text(SWEEP)
    with open(folder / "prompts.jsonl", "w") as lines:
        for index in range(prompts):
            lines.write(json.dumps({"id": f"p{index}", "prompt": f"Napisz krótki tekst o mieście numer {index}."},
                                   ensure_ascii=False) + "\n")
    env = os.environ | {"POLSPEC_DB_URL": f"sqlite:///{folder / 'sweep.db'}", "POLSPEC_REDIS_URL": url}
    with redis_available(url, data=folder / "redis"):
        first = run_enqueue(checkout, folder, env)
        resume = run_enqueue(checkout, folder, env)
    assert first["items"] == resume["items"] == prompts * CELLS and first["enqueued"] == first["items"]
    assert resume["resumed"] and resume["enqueued"] == 0, resume
    commit = subprocess.run(["git", "-C", str(checkout), "describe", "--always", "--dirty"],
                            capture_output=True, text=True).stdout.strip()
    row = {"checkout": str(checkout), "commit": commit, "items": first["items"], "first": first, "resume": resume}
    print(f"{checkout} ({commit}): {row}", file=sys.stderr)
    return row


def markdown(machine: dict, rows: list[dict]) -> str:
    return "\n".join(["| machine | |", "|---|---|", *(f"| {key} | {value} |" for key, value in machine.items()), "",
                      "| commit | items | enqueue: wall | peak memory | resume: wall | peak memory |",
                      "|---|---|---|---|---|---|",
                      *(f"| {row['commit']} | {row['items']:,} | {row['first']['wall_s']:.1f} s | "
                        f"{row['first']['peak_mb']:,.0f} MB | {row['resume']['wall_s']:.1f} s | "
                        f"{row['resume']['peak_mb']:,.0f} MB |" for row in rows)])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=11_130, help="Prompts in the dataset (31 items each).")
    parser.add_argument("--checkouts", default=str(HERE.parent),
                        help="Comma-separated polspec checkouts to run in turn (default: this one).")
    parser.add_argument("--markdown", action="store_true")
    args = parser.parse_args()
    jobs = bench_jobs()
    with tempfile.TemporaryDirectory() as scratch:
        # Each checkout gets its own Redis server and database; the model cache is the real one.
        rows = [bench_checkout(Path(checkout).resolve(), args.prompts, Path(scratch),
                               f"redis://127.0.0.1:{jobs.free_port()}/0")
                for checkout in args.checkouts.split(",")]
    if args.markdown:
        print(markdown(jobs.machine_description(), rows))
    else:
        print(json.dumps({"machine": jobs.machine_description(), "runs": rows}, indent=1))


if __name__ == "__main__":
    main()
