"""Every user mistake around models ends in a one-line error and leaves the cache clean."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import gguf
import numpy as np
import pytest
from click.testing import CliRunner

from polspec.cli import main
from polspec.errors import PolspecError
from polspec.models.fetch import cached_blob, source_key, work_dir
from polspec.models.files import IMPORT_FORMAT, file_sha256, import_gguf_file, known_sha256
from polspec.models.registry import ModelEntry, add_user_model, load_registry, parse_registry
from polspec.models.sources import parse_source
from polspec.models.tokenizers import fetch_tokenizer_file
from polspec.settings import blobs_dir, models_dir

from helpers import wait_for


def leftovers(directory: Path) -> list[str]:
    """Anything in a cache directory besides the sha256 index: partial work or a bad import."""
    if not directory.exists():
        return []
    return sorted(p.name for p in directory.iterdir() if p.name != "sha256-index.json")


def run_cli(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(main, list(args))
    return result.exit_code, result.output


def test_unknown_alias_lists_close_matches(isolated_home):
    code, output = run_cli("models", "show", "gema3-270m")
    assert code == 1
    assert output.strip().count("\n") == 0
    assert "unknown model alias 'gema3-270m'" in output and "gemma3-270m" in output


@pytest.mark.slow
def test_truncated_gguf_names_the_file_and_leaves_no_import(isolated_home, tmp_path, smollm2_gguf):
    truncated = tmp_path / "truncated.gguf"
    with open(smollm2_gguf, "rb") as source:
        truncated.write_bytes(source.read(smollm2_gguf.stat().st_size // 2))
    with pytest.raises(PolspecError, match=r"truncated\.gguf: truncated or corrupt GGUF"):
        import_gguf_file(truncated)
    assert leftovers(models_dir()) == []


@pytest.mark.slow
def test_header_cut_short_is_reported_as_corrupt(isolated_home, tmp_path, smollm2_gguf):
    cut = tmp_path / "cut.gguf"
    with open(smollm2_gguf, "rb") as source:
        cut.write_bytes(source.read(4096))
    with pytest.raises(PolspecError, match=r"cut\.gguf: truncated or corrupt GGUF"):
        import_gguf_file(cut)
    assert leftovers(models_dir()) == []


def test_a_file_that_is_not_gguf(isolated_home, tmp_path):
    text = tmp_path / "notes.gguf"
    text.write_text("not weights\n")
    with pytest.raises(PolspecError, match=r"notes\.gguf: not a GGUF file"):
        import_gguf_file(text)
    assert leftovers(models_dir()) == []
    assert not (models_dir() / "sha256-index.json").exists()  # refused before its bytes were hashed


def test_unsupported_architecture_is_named(isolated_home, tmp_path):
    path = tmp_path / "mamba.gguf"
    writer = gguf.GGUFWriter(str(path), "mamba")
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(PolspecError, match=r"unsupported architecture 'mamba'"):
        import_gguf_file(path)
    assert leftovers(models_dir()) == []


def test_a_gguf_without_a_tokenizer_names_the_file(isolated_home, tmp_path):
    """Adapters and weight-only files hold no tokenizer: a KeyError traceback before."""
    path = tmp_path / "weights-only.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    for add, value in ((writer.add_block_count, 1), (writer.add_context_length, 64), (writer.add_embedding_length, 8),
                       (writer.add_feed_forward_length, 16), (writer.add_head_count, 2),
                       (writer.add_layer_norm_rms_eps, 1e-5)):
        add(value)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    code, output = run_cli("models", "import", str(path), "--name", "w")
    assert code == 1 and output == (f"polspec: error: {path}: no tokenizer in this GGUF (tokenizer.ggml.tokens): "
                                    "polspec imports whole models, not adapters or weights alone\n")
    assert leftovers(models_dir()) == [] and not (isolated_home / "models.toml").exists()


def test_a_path_under_an_unknown_users_home_is_one_line(isolated_home, monkeypatch, tmp_path):
    """Path.expanduser raises a bare RuntimeError for ~user when there is no such user."""
    code, output = run_cli("models", "import", "~no-such-user-here/a.gguf", "--name", "x")
    assert code == 1 and output == "polspec: error: ~no-such-user-here/a.gguf: no user 'no-such-user-here' for its '~'\n"
    monkeypatch.chdir(tmp_path)  # a file of that name here is the file, as a shell leaves it
    (tmp_path / "~no-such-user-here.gguf").write_bytes(b"GGUF")
    code, output = run_cli("models", "import", "~no-such-user-here.gguf", "--name", "x")
    assert code == 1 and "~no-such-user-here.gguf: truncated or corrupt GGUF" in output, output
    monkeypatch.setenv("POLSPEC_HOME", "~no-such-user-here/polspec")
    code, output = run_cli("models", "list")
    assert code == 1 and output == ("polspec: error: ~no-such-user-here/polspec: no user 'no-such-user-here' for "
                                    "its '~'\n")


def test_a_cache_a_crash_left_damaged_is_built_again_not_trusted(isolated_home, smollm2_gguf):
    """Files a power cut left empty: the blob's recorded sha256 (read as '', it named the models
    folder itself, which an import would then have replaced), an import's record, the index."""
    entry = load_registry().model("smollm2-135m")
    source = parse_source(entry.source)
    blob = blobs_dir() / source_key(source) / source.filename
    blob.parent.mkdir(parents=True)
    blob.write_bytes(b"")
    blob.with_name(blob.name + ".sha256").write_text("")
    assert cached_blob(source) is None
    record = models_dir() / entry.sha256 / "polspec-import.json"
    record.parent.mkdir(parents=True)
    record.write_text("")
    (models_dir() / "sha256-index.json").write_text("")
    code, output = run_cli("models", "show", "smollm2-135m", "--json")
    assert code == 0 and json.loads(output)["path"] is None
    assert file_sha256(smollm2_gguf) == entry.sha256 and known_sha256(smollm2_gguf) == entry.sha256


def test_a_gguf_entry_without_a_sha256_reads_cached_once_imported(isolated_home, smollm2_gguf):
    """`models import` pins the sha256; an entry written by hand may not, and read uncached for
    ever (and enqueue skipped its context check)."""
    isolated_home.mkdir(parents=True)
    (isolated_home / "models.toml").write_text(f'[models.g]\nsource = "gguf:{smollm2_gguf}"\n')
    assert json.loads(run_cli("models", "show", "g", "--json")[1])["path"] is None
    imported = models_dir() / file_sha256(smollm2_gguf)  # what the import hashes, then fills
    imported.mkdir()
    (imported / "polspec-import.json").write_text(json.dumps({"format": IMPORT_FORMAT}))
    assert json.loads(run_cli("models", "show", "g", "--json")[1])["path"] == str(imported)


def test_a_model_hub_name_that_is_none_is_one_line(isolated_home):
    isolated_home.mkdir(parents=True)
    (isolated_home / "models.toml").write_text('[models.h]\nsource = "hf:Org/Repo Name"\n')
    code, output = run_cli("models", "fetch", "h")
    assert code == 1 and output.startswith("polspec: error: hf:Org/Repo Name: not a model hub repository name (")
    assert output.count("\n") == 1


def test_an_alias_written_by_hand_that_names_no_file_is_one_line(isolated_home):
    """A model hub name as the alias was taken: `models probe` then measured for a minute and
    failed on its probe file's folder (the alias names files), without naming the alias."""
    isolated_home.mkdir(parents=True)
    for alias in ("speakleash/bielik", "../x", " x"):
        (isolated_home / "models.toml").write_text(f'[models."{alias}"]\nsource = "hf:speakleash/bielik"\n')
        code, output = run_cli("models", "list")
        assert (code, output) == (1, f"polspec: error: {isolated_home / 'models.toml'}: [models.{alias}] is no alias: "
                                     "letters, digits, '.', '_' and '-', starting with a letter or digit\n")


def test_none_is_no_alias_in_any_case(isolated_home, tmp_path):
    """``[models.None]`` was taken, and --draft None then queued target-only work with a note that
    --k had no effect."""
    isolated_home.mkdir(parents=True)
    (isolated_home / "models.toml").write_text('[models.None]\nsource = "hf:Org/model"\n')
    code, output = run_cli("models", "list")
    assert (code, output) == (1, f"polspec: error: {isolated_home / 'models.toml'}: [models.None] cannot be an alias: "
                                 "none means no model (--draft none)\n")
    (isolated_home / "models.toml").unlink()
    code, output = run_cli("models", "import", str(tmp_path / "a.gguf"), "--name", "NONE")
    assert (code, output) == (1, "polspec: error: --name 'NONE' cannot be an alias: none means no model (--draft none)\n")


def test_a_probe_of_a_model_against_itself_is_refused_before_anything_loads(isolated_home):
    code, output = run_cli("models", "probe", "gemma3-270m", "gemma3-270m")
    assert (code, output) == (1, "polspec: error: the draft gemma3-270m is the target's own model: its steps cost "
                                 "what the target's do, so no acceptance pays; probe a smaller draft\n")
    assert not (isolated_home / "models").exists()  # nothing fetched


def test_work_that_a_killed_process_left_is_removed_by_the_next(isolated_home):
    """A fetch or import killed (for memory, say) left gigabytes in the cache for good. Work of
    a live process, of another machine sharing the cache, or touched within the hour (should
    another machine share this one's name), stays."""
    running = work_dir(models_dir(), "import")  # this process's, in use
    killed = subprocess.run([sys.executable, "-c", "import os; from polspec.models.fetch import work_dir; "
                             "from polspec.settings import models_dir; work = work_dir(models_dir(), 'import'); "
                             "(work / 'model.safetensors').write_bytes(b'x'); print(work.name); os._exit(9)"],
                            capture_output=True, text=True, env=os.environ)
    gone = killed.stdout.strip()
    host, _, rest = gone.removeprefix(".import-").partition("-")
    elsewhere = models_dir() / f".import-{'0' * len(host)}-{rest}"  # that pid on a machine sharing the cache
    fetching = models_dir() / f".fetch-{host}-{rest}"  # the same kind of folder is its own kind's to clean
    for folder in (elsewhere, fetching):
        folder.mkdir()
    assert sorted(leftovers(models_dir())) == sorted([gone, running.name, elsewhere.name, fetching.name])
    work = work_dir(models_dir(), "import")  # the killed one's was written a moment ago: kept
    assert sorted(leftovers(models_dir())) == sorted([gone, running.name, work.name, elsewhere.name, fetching.name])
    two_hours_ago = time.time() - 2 * 3600
    for path in (*models_dir().rglob("*"),):
        os.utime(path, (two_hours_ago, two_hours_ago))
    last = work_dir(models_dir(), "import")
    assert sorted(leftovers(models_dir())) == sorted([running.name, work.name, last.name, elsewhere.name,
                                                      fetching.name])


def test_an_import_keeps_a_registry_file_that_writes_its_models_inline(tmp_path):
    """A [models.NAME] table after `models = { ... }` is no TOML: the import said it succeeded
    and every command after it failed on the file it had written."""
    user_file = tmp_path / "models.toml"
    text = 'models = { mine = { source = "dir:/tmp/mine" } }\n'
    user_file.write_text(text)
    with pytest.raises(PolspecError, match=r"^.*models\.toml: cannot add a \[models\.new\] table to it: it writes "
                                           r"its models inline \(models = \{ \.\.\. \}\); write each as a "):
        add_user_model(ModelEntry(alias="new", source="dir:/tmp/new", architecture="llama", tokenizer_family="new"),
                       user_file)
    assert user_file.read_text() == text


def test_a_file_where_the_cache_keeps_a_folder_is_one_line_naming_it(isolated_home):
    isolated_home.mkdir(parents=True)
    (isolated_home / "blobs").write_text("")
    code, output = run_cli("models", "fetch", "smollm2-135m")
    assert code == 1 and output == f"polspec: error: {isolated_home / 'blobs'}: File exists\n"


def test_missing_gguf_file(isolated_home, tmp_path):
    code, output = run_cli("models", "import", str(tmp_path / "nowhere.gguf"), "--name", "x")
    assert code == 1 and "nowhere.gguf: no such GGUF file" in output
    code, output = run_cli("models", "import", str(tmp_path), "--name", "x")
    assert code == 1 and f"{tmp_path}: a directory, not a GGUF file" in output and output.count("\n") == 1


@pytest.mark.parametrize("name", ['my"model', "", "tok:x", "-dash", "ze spacją"])
def test_an_alias_that_would_need_quoting_is_refused_before_the_import(isolated_home, tmp_path, name):
    code, output = run_cli("models", "import", str(tmp_path / "nowhere.gguf"), "--name", name)
    assert code == 1 and f"--name {name!r}: an alias is letters, digits" in output and output.count("\n") == 1
    assert not (isolated_home / "models.toml").exists()


@pytest.mark.parametrize("family", ['a"b\\c\nd', ""])
def test_a_tokenizer_family_is_a_name_like_an_alias(isolated_home, tmp_path, family):
    code, output = run_cli("models", "import", str(tmp_path / "nowhere.gguf"), "--name", "x", "--tokenizer-family", family)
    assert code == 1 and f"--tokenizer-family {family!r}: a family is letters, digits" in output
    assert output.count("\n") == 1 and not (isolated_home / "models.toml").exists()


def test_the_registry_file_keeps_any_text_it_is_given(tmp_path):
    """Quotes, backslashes and control characters (an end-of-sequence token can be anything)
    are escaped, so the file stays TOML and reads back the same."""
    user_file = tmp_path / "models.toml"
    odd = ModelEntry(alias="odd", source='gguf:/tmp/a "b"\\c.gguf', architecture="llama", tokenizer_family="odd",
                     eos_tokens=("</s>\n", "\x7f\t<|end|>"), sha256="0" * 64)
    add_user_model(odd, user_file)
    assert parse_registry(user_file.read_text(encoding="utf-8"), str(user_file)).models["odd"] == odd


ADD_MODELS = """
import sys
import time
from pathlib import Path
from polspec.models.registry import ModelEntry, add_user_model
user_file, prefix = Path(sys.argv[1]), sys.argv[2]
(user_file.parent / f"ready-{prefix}").touch()
while not (user_file.parent / "go").exists():  # every writer starts at once, its imports done
    time.sleep(0.01)
for index in range(20):
    add_user_model(ModelEntry(alias=f"{prefix}{index}", source="gguf:/x.gguf", architecture="llama",
                              tokenizer_family="x"), user_file)
"""


def test_imports_at_once_each_keep_their_alias(tmp_path):
    """Each import reads the registry file, adds its entry and writes it whole: two at once
    could each write what they read, and one alias was lost."""
    user_file = tmp_path / "models.toml"
    writers = [subprocess.Popen([sys.executable, "-c", ADD_MODELS, str(user_file), prefix]) for prefix in "abcdef"]
    wait_for(lambda: all((tmp_path / f"ready-{prefix}").exists() for prefix in "abcdef"), 120, "every writer ready")
    (tmp_path / "go").touch()
    assert [writer.wait() for writer in writers] == [0] * 6
    models = parse_registry(user_file.read_text(encoding="utf-8"), str(user_file)).models
    assert sorted(models) == sorted(f"{prefix}{index}" for prefix in "abcdef" for index in range(20))


@pytest.mark.slow
def test_sha256_mismatch_after_assembly_caches_nothing(isolated_home):
    (isolated_home / "models.toml").parent.mkdir(parents=True)
    real = load_registry().tokenizer("tok:mistral-32k")
    (isolated_home / "models.toml").write_text(
        f'[tokenizers.bad-sum]\nsource = "{real.source}"\nformat = "sentencepiece"\nsha256 = "{"0" * 64}"\n'
    )
    with pytest.raises(PolspecError, match=r"sha256 mismatch for tokenizer\.model\.v1: expected 0{64}, got [0-9a-f]{64}"):
        fetch_tokenizer_file(load_registry().tokenizer("tok:bad-sum"))
    assert leftovers(blobs_dir()) == []


@pytest.mark.slow
def test_package_missing_from_the_index(isolated_home):
    (isolated_home / "models.toml").parent.mkdir(parents=True)
    (isolated_home / "models.toml").write_text(
        '[tokenizers.nowhere]\nsource = "wheel:mistral-common==0.0.0.999#x/y.model"\nformat = "sentencepiece"\n'
    )
    code, output = run_cli("models", "fetch", "tok:nowhere")
    said = output.splitlines()
    assert code == 1 and said[0] == "tok:nowhere: downloading mistral-common==0.0.0.999 (0 of 1)", output
    assert said[1].startswith("polspec: error: could not download mistral-common==0.0.0.999")
    assert leftovers(blobs_dir()) == []


def test_bad_registry_file_names_file_and_key(isolated_home):
    (isolated_home / "models.toml").parent.mkdir(parents=True)
    (isolated_home / "models.toml").write_text('[models.x]\nsource = "gguf:/x.gguf"\ncolour = "red"\n')
    code, output = run_cli("models", "list")
    assert code == 1
    assert "models.toml: [models.x] has unknown key 'colour'" in output
    (isolated_home / "models.toml").write_text('[models.x]\nsource = "nope:x"\n')
    code, output = run_cli("models", "list")
    assert code == 1 and output.count("\n") == 1
    assert "models.toml: [models.x] source 'nope:x': unknown scheme 'nope'" in output


@pytest.mark.parametrize(("text", "message"), [
    ("models = 5\n", "'models' must be tables such as [models.NAME], got 5"),
    ("tokenizers = []\n", "'tokenizers' must be tables such as [tokenizers.NAME], got []"),
    ("[models]\nmine = 5\n", "[models.mine] must be a table of keys, got 5"),
    ('[models.x]\nsource = "gguf:/x.gguf"\ndescription = 5\n', "[models.x] description must be text, got 5"),
    ('[models.x]\nsource = "gguf:/x.gguf"\nchat_template = "yes"\n', "[models.x] chat_template must be true or false"),
    ('[models.x]\nsource = "gguf:/x.gguf"\neos_tokens = "abc"\n', "[models.x] eos_tokens must be a list of texts, "
                                                                   "got 'abc'"),
    ('[models.x]\nsource = "gguf:/x.gguf"\neos_tokens = [5]\n', "[models.x] eos_tokens must be a list of texts"),
    ('[tokenizers.t]\nsource = 5\nformat = "sentencepiece"\n', "[tokenizers.t] source must be text, got 5"),
    ('[tokenizers.t]\nsource = "gguf:/x.gguf"\nformat = "sentencepiece"\n',  # models list failed, naming no file
     "[tokenizers.t] source must be a wheel: source, got 'gguf:/x.gguf'"),
    ('[models.x]\nsource = "gguf:/x.gguf"\ndraft_vocab = 100000\n',  # a worker would refuse it hours later
     '[models.x] draft_vocab must be 1024 to 65536 tokens or "full", got 100000'),
    # The cache names an import's folder by it: '' or '../..' named the models folder, or one above it.
    ('[models.x]\nsource = "gguf:/x.gguf"\nsha256 = "../.."\n', "[models.x] sha256 must be 64 hexadecimal digits, "
                                                                "got '../..'"),
    ('[models.x]\nsource = "dir:~no-such-user-here/m"\n', "[models.x] ~no-such-user-here/m: no user "
                                                          "'no-such-user-here' for its '~'"),
    ("x = " + "[" * 100_000 + "\n", "cannot be read: nesting too deep"),
])
def test_a_registry_value_of_the_wrong_kind_is_one_line(isolated_home, text, message):
    (isolated_home / "models.toml").parent.mkdir(parents=True)
    (isolated_home / "models.toml").write_text(text)
    for args in (["models", "list"], ["enqueue", "generate", "--dataset", "pl-short"]):
        code, output = run_cli(*args)
        assert code == 1 and output.count("\n") == 1 and f"models.toml: {message}" in output, output


def test_a_registry_file_that_cannot_be_read_is_one_line(isolated_home):
    user_file = isolated_home / "models.toml"
    user_file.parent.mkdir(parents=True)
    user_file.write_bytes(b'[models.x]\nsource = "gguf:/\xff.gguf"\n')
    code, output = run_cli("models", "list")
    assert code == 1 and output == f"polspec: error: {user_file}:2: not UTF-8 (byte 0xff at column 17)\n"
    user_file.unlink()
    user_file.mkdir()
    code, output = run_cli("models", "list")
    assert code == 1 and output == f"polspec: error: {user_file}: Is a directory\n"

@pytest.mark.slow
def test_full_disk_during_fetch_removes_partial_files(tiny_disk, monkeypatch):
    monkeypatch.setenv("POLSPEC_HOME", str(tiny_disk))
    # The mistral-common wheel is about 6.5 MB: it cannot fit on a 3 MiB disk.
    with pytest.raises(PolspecError, match=r"no space left on device while fetching tokenizer\.model\.v1.*partial files were removed"):
        fetch_tokenizer_file(load_registry().tokenizer("tok:mistral-32k"))
    assert leftovers(blobs_dir()) == []


@pytest.mark.slow
def test_full_disk_during_an_import_removes_partial_files(tiny_disk, monkeypatch, smollm2_gguf):
    monkeypatch.setenv("POLSPEC_HOME", str(tiny_disk))
    # The weights alone are over 500 MB as float32: they cannot fit on a 3 MiB disk.
    with pytest.raises(PolspecError, match=rf"cannot write the import of {smollm2_gguf.name} into .* \(is the disk "
                                           r"full\?\): .*; partial files were removed"):
        import_gguf_file(smollm2_gguf)
    assert leftovers(models_dir()) == []


@pytest.mark.slow
def test_an_import_stopped_by_sigterm_leaves_no_work_folder(isolated_home, smollm2_gguf):
    """kill, timeout and systemd stop with SIGTERM, which ended Python without its cleanups: the
    import's work folder (gigabytes for a large model) stayed in the cache for good."""
    importing = subprocess.Popen([sys.executable, "-c", "from polspec.cli import main; main()", "models", "import",
                                  str(smollm2_gguf), "--name", "stopped"], env=os.environ | {"POLSPEC_HOME": str(isolated_home)})
    deadline = time.monotonic() + 120
    while not list(models_dir().glob(".import-*")) and time.monotonic() < deadline and importing.poll() is None:
        time.sleep(0.1)
    assert list(models_dir().glob(".import-*")), "the import never began"
    importing.send_signal(signal.SIGTERM)
    assert importing.wait(timeout=60) == 128 + signal.SIGTERM
    assert leftovers(models_dir()) == [] and not (isolated_home / "models.toml").exists()


def test_an_import_of_an_empty_path_is_refused_as_such(isolated_home):
    """It named the working directory: "/work: a directory, not a GGUF file"."""
    result = CliRunner().invoke(main, ["models", "import", "", "--name", "a"])
    assert result.exit_code == 2 and result.output.splitlines()[-1] == (
        "Error: Invalid value for 'PATH': needs a file path, got an empty one (or '.')")
