"""The alias registry and its sources: parsing, user overrides, dir: and hf: sources."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from polspec.cli import main
from polspec.errors import PolspecError
from polspec.models.files import HF_ALLOW_PATTERNS
from polspec.models.loader import load_model
from polspec.models.registry import ModelEntry, add_user_model, load_registry
from polspec.models.sources import DirSource, GgufSource, HfSource, WheelPart, WheelSource, parse_source


def test_parse_every_scheme(tmp_path):
    assert parse_source("hf:speakleash/Bielik-11B-v2.3-Instruct") == HfSource("speakleash/Bielik-11B-v2.3-Instruct")
    assert parse_source(f"dir:{tmp_path}") == DirSource(tmp_path)
    assert parse_source("gguf:/models/x.gguf") == GgufSource(Path("/models/x.gguf"))
    two = parse_source("wheel:a-b==1.0#a_b/data/x.part00+c==2#c/data/x.part01")
    assert two == WheelSource((WheelPart("a-b", "1.0", "a_b/data/x.part00"), WheelPart("c", "2", "c/data/x.part01")))
    assert two.filename == "x"


@pytest.mark.parametrize("text, message", [
    ("speakleash/Bielik", "must look like hf:REPO"),
    ("s3:bucket/key", "unknown scheme 's3'"),
    ("wheel:pkg#path", "part 'pkg#path' is not PKG==VERSION#PATH"),
    ("wheel:pkg==1.0", "part 'pkg==1.0' is not PKG==VERSION#PATH"),
])
def test_malformed_sources(text, message):
    with pytest.raises(PolspecError, match=message):
        parse_source(text)


def test_every_offline_model_pins_its_bytes():
    registry = load_registry()
    for alias in ("smollm2-135m", "gemma3-270m", "qwen2.5-coder-1.5b"):
        entry = registry.model(alias)
        assert isinstance(parse_source(entry.source), WheelSource)
        assert entry.sha256 and len(entry.sha256) == 64


def test_user_file_adds_and_overrides(isolated_home):
    isolated_home.mkdir(parents=True)
    (isolated_home / "models.toml").write_text(  # an editor's byte order mark and line ends are no error
        '\ufeff[models.gemma3-270m]\r\nsource = "gguf:/elsewhere/gemma.gguf"\r\narchitecture = "gemma3"\r\n'
        '[models.mine]\r\nsource = "dir:/models/mine"\r\n', encoding="utf-8", newline=""
    )
    registry = load_registry()
    assert registry.model("gemma3-270m").source == "gguf:/elsewhere/gemma.gguf"
    assert registry.model("mine").tokenizer_family == "mine"
    assert registry.model("smollm2-135m").sha256  # built-ins stay


def test_a_user_table_for_a_built_in_alias_changes_only_the_keys_it_gives(isolated_home):
    """It replaced the whole entry: a table giving only a local source lost the chat template
    and end tokens (generations ran to max_tokens), one giving only a draft_vocab had no source."""
    isolated_home.mkdir(parents=True)
    (isolated_home / "models.toml").write_text('[models.smollm2-135m]\nsource = "dir:/models/smollm2"\n\n'
                                               '[models.gemma3-270m]\ndraft_vocab = 4096\n')
    built_in = {alias: load_registry(isolated_home / "none.toml").model(alias) for alias in ("smollm2-135m", "gemma3-270m")}
    registry = load_registry()
    moved = registry.model("smollm2-135m")
    assert moved.source == "dir:/models/smollm2" and moved.sha256 is None  # the sha256 pinned the other source
    assert (moved.chat_template, moved.eos_tokens, moved.tokenizer_family) == (
        True, built_in["smollm2-135m"].eos_tokens, built_in["smollm2-135m"].tokenizer_family)
    assert registry.model("gemma3-270m") == dataclasses.replace(built_in["gemma3-270m"], draft_vocab=4096)
    assert moved.description == ""  # the built-in's told of its own bytes
    # An import appends its table to such a file (it read the partial tables as errors).
    add_user_model(ModelEntry("mine", "dir:/models/mine", "llama", "mine"))
    assert load_registry().model("mine").source == "dir:/models/mine"


def test_models_show_gives_an_entry_s_own_draft_vocabulary(isolated_home):
    isolated_home.mkdir(parents=True)
    (isolated_home / "models.toml").write_text('[models.mine]\nsource = "dir:/models/mine"\ndraft_vocab = 4096\n')
    shown = {alias: json.loads(CliRunner().invoke(main, ["models", "show", alias, "--json"]).output)["draft_vocab"]
             for alias in ("mine", "smollm2-135m")}
    assert shown == {"mine": 4096, "smollm2-135m": "auto"}


@pytest.mark.slow
def test_dir_source_loads_a_model_directory(isolated_home, smollm2, caplog):
    isolated_home.mkdir(parents=True)
    (isolated_home / "models.toml").write_text(f'[models.smol-dir]\nsource = "dir:{smollm2.path}"\narchitecture = '
                                               '"llama"\neos_tokens = ["<|im_end|>", "<|im_edn|>"]\n')
    loaded = load_model("smol-dir")
    assert loaded.path == smollm2.path and loaded.dtype == "float32"
    assert smollm2.tokenizer.convert_tokens_to_ids("<|im_end|>") in loaded.tokenizer.eos_token_ids
    # A typo's generations ran to max_tokens without a word.
    assert [record.getMessage() for record in caplog.records if record.levelname == "WARNING"] == [
        "smol-dir: its end-of-sequence token '<|im_edn|>' (eos_tokens) is not in its vocabulary: no generation "
        "stops at it"]


def test_dir_source_without_a_model(isolated_home, tmp_path):
    isolated_home.mkdir(parents=True)
    (isolated_home / "models.toml").write_text(f'[models.empty]\nsource = "dir:{tmp_path}"\n')
    with pytest.raises(PolspecError, match=f"{tmp_path}: not a model directory"):
        load_model("empty")


@pytest.mark.parametrize("config", ['{"model_type": "llama", ', "[1]"])
def test_a_dir_model_whose_config_is_no_json_object_is_one_line(isolated_home, tmp_path, config):
    (tmp_path / "config.json").write_text(config)
    isolated_home.mkdir(parents=True)
    (isolated_home / "models.toml").write_text(f'[models.mine]\nsource = "dir:{tmp_path}"\n')
    result = CliRunner().invoke(main, ["models", "show", "mine"])
    assert result.exit_code == 1 and result.output.startswith(
        f"polspec: error: {tmp_path / 'config.json'}: not a model configuration") and result.output.count("\n") == 1


def test_offline_hub_is_a_one_line_error_naming_the_repo(isolated_home):
    # huggingface_hub reads HF_HUB_OFFLINE when imported, hence a fresh process.
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(isolated_home / "hf"),
           "HF_HUB_CACHE": str(isolated_home / "hf" / "hub")}  # a cache the user set would win over HF_HOME
    result = subprocess.run(
        [sys.executable, "-c", "from polspec.cli import main; main(['models', 'fetch', 'bielik-11b'])"],
        capture_output=True, text=True, env=env,
    )
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [
        "polspec: error: cannot get hf:speakleash/Bielik-11B-v2.3-Instruct: the model hub is offline or "
        "unreachable and the model is not in the local hub cache (LocalEntryNotFoundError)"
    ]


def test_a_hub_model_in_the_local_cache_is_listed_as_cached_without_importing_transformers(isolated_home):
    """`models list` looks for each hf: model in the local hub cache, where mlx-lm would find it;
    it imported transformers and mlx-lm to do so (3-4 s of every listing)."""
    repository = isolated_home / "hf" / "hub" / "models--someone--tiny"
    commit = "0123456789abcdef0123456789abcdef01234567"
    snapshot = repository / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")
    (repository / "refs").mkdir()
    (repository / "refs" / "main").write_text(commit)
    (isolated_home / "models.toml").write_text('[models.tiny]\nsource = "hf:someone/tiny"\n')
    listing = ("import json, sys\nfrom polspec.cli import main\n"
               "try:\n    main(['models', 'list', '--json'])\nexcept SystemExit as stop:\n    assert stop.code == 0\n"
               "print(json.dumps(sorted({'transformers', 'mlx_lm', 'mlx.core', 'torch'} & set(sys.modules))))")
    env = {**os.environ, "HF_HOME": str(isolated_home / "hf"), "HF_HUB_CACHE": str(isolated_home / "hf" / "hub"),
           "POLSPEC_HOME": str(isolated_home)}
    lines = subprocess.run([sys.executable, "-c", listing], capture_output=True, text=True, env=env,
                           check=True).stdout.splitlines()
    rows = {row["alias"]: row for row in map(json.loads, lines[:-1])}
    assert rows["tiny"]["cached"] and rows["tiny"]["path"] == str(snapshot)
    assert not rows["bielik-11b"]["cached"]  # no snapshot of its repository here
    assert json.loads(lines[-1]) == []  # what imports them: a model's load, a tokenizer's, a GGUF import


def test_the_hub_files_fetched_are_mlx_lm_s():
    from mlx_lm.utils import DEFAULT_ALLOW_PATTERNS

    assert HF_ALLOW_PATTERNS == DEFAULT_ALLOW_PATTERNS
