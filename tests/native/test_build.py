"""How splice builds its native libraries: one build per key, shared by installs, safe when processes race.

A tiny C source stands in for ``gemv.cpp`` (the build path is the same; compiling it takes a fraction of a second), in
a temporary ``SPLICE_CACHE`` so the cache other runs use is left alone.
"""
from __future__ import annotations

import ctypes
import fcntl
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from splice import native

pytestmark = pytest.mark.skipif(shutil.which(os.environ.get("CXX", "c++")) is None, reason="no C++ compiler")

TINY = 'extern "C" int splice_tiny_answer() { return 42; }\n'
BUILD = """
import sys
from pathlib import Path
from splice import native
print(native.build_library(Path(sys.argv[1]), "tiny", ["-O1"], [], what="a test library"))
"""


def tiny_source(folder: Path, text: str = TINY) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    source = folder / "tiny.cpp"
    source.write_text(text)
    return source


def start_build(source: Path, cache: Path, log: Path, **env_changes: str) -> subprocess.Popen:
    env = {**os.environ, "SPLICE_CACHE": str(cache), **env_changes}
    return subprocess.Popen([sys.executable, "-c", BUILD, str(source)], env=env, stdout=subprocess.PIPE,
                            stderr=log.open("w"), text=True)


def wait_for(condition, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)


def test_two_processes_racing_build_once_and_load_the_same_library(tmp_path, monkeypatch):
    """The test holds the build lock while two processes start, so both must wait for it; released, exactly one
    builds (saying so) and the other loads its result."""
    monkeypatch.setenv("SPLICE_CACHE", str(tmp_path / "cache"))
    source = tiny_source(tmp_path / "src")
    key = native._build_key(source, ("-O1",), ())
    library = native.library_path(key, stem="tiny")
    library.parent.mkdir(parents=True)
    logs = [tmp_path / "a.log", tmp_path / "b.log"]
    with open(library.parent / "build.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        builds = [start_build(source, tmp_path / "cache", log) for log in logs]
        wait_for(lambda: all("waiting for another process" in log.read_text() for log in logs))
        fcntl.flock(lock, fcntl.LOCK_UN)
    outputs = [build.communicate(timeout=300)[0].strip() for build in builds]
    errors = [log.read_text() for log in logs]
    assert [build.returncode for build in builds] == [0, 0], errors
    assert outputs == [str(library)] * 2
    assert sum("splice: building a test library, once per machine" in text for text in errors) == 1, errors
    # no build folder left; the checksum written with the library
    assert sorted(p.name for p in library.parent.iterdir()) == ["build.lock", library.name, library.name + ".sha256"]
    assert ctypes.CDLL(str(library)).splice_tiny_answer() == 42


def test_the_key_follows_the_source_and_flags_not_the_install_path(tmp_path):
    one, other = tiny_source(tmp_path / "install-a"), tiny_source(tmp_path / "install-b")
    assert native._build_key(one, ("-O1",), ()) == native._build_key(other, ("-O1",), ())
    changed = tiny_source(tmp_path / "install-c", TINY.replace("42", "43"))
    assert native._build_key(changed, ("-O1",), ()) != native._build_key(one, ("-O1",), ())
    assert native._build_key(one, ("-O2",), ()) != native._build_key(one, ("-O1",), ())
    assert native._build_key(one, ("-O1",), ("-lm",)) != native._build_key(one, ("-O1",), ())


def test_a_built_library_is_loaded_without_building_again(tmp_path, monkeypatch):
    monkeypatch.setenv("SPLICE_CACHE", str(tmp_path / "cache"))
    source = tiny_source(tmp_path / "src")
    first = start_build(source, tmp_path / "cache", tmp_path / "first.log")
    assert first.wait(timeout=300) == 0, (tmp_path / "first.log").read_text()
    again = start_build(source, tmp_path / "cache", tmp_path / "again.log")
    assert again.wait(timeout=300) == 0
    assert "building" in (tmp_path / "first.log").read_text()
    assert (tmp_path / "again.log").read_text() == ""


def built_tiny(tmp_path, monkeypatch) -> tuple[Path, Path]:
    """The tiny library built once by a subprocess in a fresh cache: (its source, its path)."""
    monkeypatch.setenv("SPLICE_CACHE", str(tmp_path / "cache"))
    source = tiny_source(tmp_path / "src")
    first = start_build(source, tmp_path / "cache", tmp_path / "first.log")
    assert first.wait(timeout=300) == 0, (tmp_path / "first.log").read_text()
    return source, native.library_path(native._build_key(source, ("-O1",), ()), stem="tiny")


def build_again(source: Path, tmp_path: Path, **env_changes: str) -> tuple[int, str, str]:
    """(exit status, stdout, stderr) of building the tiny library again in a subprocess (a SIGBUS kills it)."""
    again = start_build(source, tmp_path / "cache", tmp_path / "again.log", **env_changes)
    out = again.communicate(timeout=300)[0].strip()
    return again.returncode, out, (tmp_path / "again.log").read_text()


def test_a_truncated_library_is_built_again_rather_than_loaded(tmp_path, monkeypatch):
    """A cache copied in part, or a disk that filled: loading a truncated library kills the process (SIGBUS)."""
    source, library = built_tiny(tmp_path, monkeypatch)
    whole = library.read_bytes()
    library.write_bytes(whole[:4096])
    returncode, out, err = build_again(source, tmp_path)
    assert returncode == 0, err
    assert f"the cached library of a test library, {library}, is damaged (4096 bytes" in err
    assert "building a test library" in err and out == str(library)
    assert library.read_bytes() == whole


def test_a_changed_library_is_built_again(tmp_path, monkeypatch):
    source, library = built_tiny(tmp_path, monkeypatch)
    whole = bytearray(library.read_bytes())
    whole[len(whole) // 2] ^= 0xFF
    library.write_bytes(bytes(whole))
    returncode, _, err = build_again(source, tmp_path)
    assert returncode == 0, err
    assert "is damaged" in err and "building a test library" in err
    assert native._library_damage(library) is None


def test_a_library_built_without_a_checksum_is_checked_by_its_elf_headers(tmp_path, monkeypatch):
    """Libraries built before the checksum was written beside them are still loaded, unless truncated."""
    source, library = built_tiny(tmp_path, monkeypatch)
    native._checksum_path(library).unlink()
    assert native._library_damage(library) is None
    returncode, _, err = build_again(source, tmp_path)
    assert returncode == 0 and err == ""  # loaded, not built
    whole = library.read_bytes()
    assert "truncated" in native._elf_damage(whole[:len(whole) - 1])
    assert "not a 64-bit little-endian ELF" in native._elf_damage(b"\0" * 100)


def test_a_missing_compiler_is_named_before_any_build_starts(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SPLICE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-c++"))
    with pytest.raises(RuntimeError,
                       match=r"no C\+\+ compiler: .*no-such-c\+\+' \(CXX\) is not on PATH; install g\+\+"):
        native.build_library(tiny_source(tmp_path / "src"), "tiny", ["-O1"], [], what="a test library")
    assert "building" not in capsys.readouterr().err
    monkeypatch.setenv("CXX", "false")
    with pytest.raises(RuntimeError, match=r"the C\+\+ compiler 'false' does not run \('false --version' exits"):
        native.build_library(tiny_source(tmp_path / "src"), "tiny", ["-O1"], [], what="a test library")


def without_a_compiler(tmp_path: Path, how: str) -> dict[str, str]:
    """Environment changes that leave no C++ compiler: CXX naming none, or a PATH holding neither c++ nor ninja."""
    if how == "CXX":
        return {"CXX": str(tmp_path / "no-such-c++")}
    (tmp_path / "empty-bin").mkdir(exist_ok=True)
    return {"PATH": str(tmp_path / "empty-bin")}


@pytest.mark.parametrize("how", ["CXX", "PATH"])
def test_a_built_library_loads_on_a_machine_without_a_compiler(tmp_path, monkeypatch, how):
    """A cache prepared where a compiler was (the key names the compiler's version, unknown without one): the library
    of the same source, flags, torch and Python is loaded, after its recorded size and sha256 are checked."""
    source, library = built_tiny(tmp_path, monkeypatch)
    returncode, out, err = build_again(source, tmp_path, **without_a_compiler(tmp_path, how))
    assert returncode == 0 and err == "", err
    assert out == str(library)


def test_without_a_compiler_a_changed_library_or_another_source_is_not_loaded(tmp_path, monkeypatch):
    """Without a compiler, nothing unverified loads (a changed file could crash the process) and a library of another
    source is not taken for this one: the missing compiler is named, as when nothing was ever built."""
    source, library = built_tiny(tmp_path, monkeypatch)
    changed = tiny_source(tmp_path / "changed", TINY.replace("42", "43"))
    returncode, _, err = build_again(changed, tmp_path, **without_a_compiler(tmp_path, "CXX"))
    assert returncode == 1 and "RuntimeError: no C++ compiler: " in err and "to load instead" in err
    whole = bytearray(library.read_bytes())
    whole[len(whole) // 2] ^= 0xFF
    library.write_bytes(bytes(whole))
    returncode, _, err = build_again(source, tmp_path, **without_a_compiler(tmp_path, "CXX"))
    assert returncode == 1 and "RuntimeError: no C++ compiler: " in err and "building" not in err


def test_the_key_names_the_compiler_apart_from_everything_else(tmp_path, monkeypatch):
    """``<inputs>_<compiler>``: another compiler builds its own library, and the inputs alone find it without one."""
    source = tiny_source(tmp_path / "src")
    key = native._build_key(source, ("-O1",), ())
    monkeypatch.setattr(native, "_compiler_version", lambda: "another compiler 1.0")
    other = native._build_key(source, ("-O1",), ())
    assert other != key and other.split("_")[0] == key.split("_")[0] == native._inputs_key(source, ("-O1",), ())


def test_a_cache_that_is_a_file_is_named_with_what_to_do(tmp_path, monkeypatch):
    from splice.models import CacheError

    (tmp_path / "cache").write_text("not a folder")
    monkeypatch.setenv("SPLICE_CACHE", str(tmp_path / "cache"))
    with pytest.raises(CacheError, match=r"splice's cache '.*cache' \(SPLICE_CACHE\) cannot be used: making kernels/"
                                         r"\w+ failed \(.*\); set SPLICE_CACHE to a writable folder"):
        native.build_library(tiny_source(tmp_path / "src"), "tiny", ["-O1"], [], what="a test library")
