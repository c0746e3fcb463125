"""`vattn.checks.not_own`: a default interpreter under /tmp (the vLLM venv the benchmarks and
slow tests would run) is used only if this user made it and nobody else may write its folders."""
from __future__ import annotations

import os

import pytest

from vattn.checks import not_own


def test_own_paths_pass_and_plants_are_named(tmp_path):
    py = tmp_path / "venv" / "bin" / "python"
    py.parent.mkdir(parents=True)
    os.symlink("/usr/bin/env", py)  # a venv's python is a link: its own mode is 0777
    os.chmod(tmp_path / "venv", 0o755)
    os.chmod(py.parent, 0o755)
    assert not_own(str(py), within=str(tmp_path)) is None
    assert "No such file" in not_own(str(tmp_path / "none" / "python"), within=str(tmp_path))
    assert not_own("/usr/bin/env", within=str(tmp_path)) is None  # outside the shared folder: not checked
    os.chmod(tmp_path / "venv", 0o777)  # a folder anyone may write: a python planted in it
    assert "writable by others" in not_own(str(py), within=str(tmp_path))
    os.chmod(tmp_path / "venv", 0o755)
    plain = py.parent / "python3"
    plain.write_text("")
    os.chmod(plain, 0o666)
    assert "writable by others" in not_own(str(plain), within=str(tmp_path))


@pytest.mark.skipif(os.getuid() != 0, reason="chown to another user needs root")
def test_another_users_file_is_named(tmp_path):
    f = tmp_path / "bin" / "python"
    f.parent.mkdir()
    f.write_text("")
    os.chown(f, 65534, 65534)
    assert "is not yours" in not_own(str(f), within=str(tmp_path))
