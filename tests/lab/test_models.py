"""The bundled model's GGUF is converted once per version: the copy is keyed by the file's content, not by where
the package is installed or when (a new venv reuses it), and its conversion shows one loading bar."""

from __future__ import annotations

import os
import shutil

from hf_attnstore.lab import models


def test_a_reinstalled_gguf_finds_the_copy_converted_before(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_ATTNSTORE_CACHE", str(tmp_path / "cache"))
    first, second = tmp_path / "venv-a", tmp_path / "venv-b"
    first.mkdir()
    (first / "m.gguf").write_bytes(b"GGUF" + os.urandom(3 << 20))
    shutil.copytree(first, second)  # the same package in a new venv: another path, another mtime
    os.utime(second / "m.gguf", (1, 1))
    converted = tmp_path / "cache" / "models" / f"m-{models.gguf_version(first / 'm.gguf')}"
    converted.mkdir(parents=True)
    (converted / "model.safetensors").write_bytes(b"stands for the converted copy")
    assert models._converted_gguf(first, "m.gguf") == converted
    assert models._converted_gguf(second, "m.gguf") == converted  # found, not converted again
    other = tmp_path / "venv-c"
    other.mkdir()
    (other / "m.gguf").write_bytes(b"GGUF" + os.urandom(3 << 20))  # another version of the model
    assert models.gguf_version(other / "m.gguf") != models.gguf_version(first / "m.gguf")
