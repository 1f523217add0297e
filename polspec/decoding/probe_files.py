"""Probes on disk: one JSON file per machine and model pair under ``$POLSPEC_HOME/probes``.

A probe is valid only where it was measured, so the directory is keyed by :func:`machine_key`
(host, backend, device and dtype policy) and the file by the pair's aliases.
"""

from __future__ import annotations

import json
import logging
import platform
from pathlib import Path

from polspec.backend import setup
from polspec.decoding.costmodel import STORED_FORMATS, Probe
from polspec.files import write_file_atomically
from polspec.settings import polspec_home

log = logging.getLogger(__name__)


def machine_key() -> str:
    """Probes are valid for one machine, backend and dtype policy."""
    chosen = setup()
    return f"{platform.node() or 'host'}-{chosen.kind}-{chosen.device}-{chosen.dtype}"


def probe_path(target: str, draft: str) -> Path:
    """Where the probe of ``target`` with ``draft`` on this machine is stored."""
    return polspec_home() / "probes" / machine_key() / f"{target}__{draft}.json"


def load_probe(target: str, draft: str, formats: tuple[int, ...] = STORED_FORMATS) -> Probe | None:
    """The stored probe of this pair on this machine, if one was measured in one of ``formats``
    (an older one is measured again where it is used to decode).

    None as well when the file cannot be read as a probe (cut short by a crash, edited by hand):
    a probe is a measurement, so the pair counts as never measured (``auto`` measures it again)
    rather than failing the jobs and reports that read it.
    """
    path = probe_path(target, draft)
    if not path.exists():
        return None
    try:
        data = json.loads(path.read_text())
        return Probe.from_dict(data) if data.get("format") in formats else None
    except (OSError, ValueError, TypeError, KeyError, AttributeError) as error:
        log.warning("ignoring unreadable probe %s (%s: %s); treated as never measured", path, type(error).__name__, error)
        return None


def save_probe(probe: Probe) -> None:
    """Store ``probe`` for its pair on this machine, replacing the file at once (never half-written)."""
    path = probe_path(probe.target, probe.draft)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_file_atomically(path, lambda out: json.dump(probe.as_dict(), out, indent=1))
