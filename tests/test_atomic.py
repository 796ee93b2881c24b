"""Files and directories written through mobile_moe.atomic get the mode open() and mkdir() would give them."""

from __future__ import annotations

import os

import pytest

from mobile_moe.atomic import atomic_path, write_text_atomic


@pytest.mark.parametrize("umask, file_mode, dir_mode", [(0o022, 0o644, 0o755), (0o077, 0o600, 0o700)])
def test_written_files_carry_the_umasks_mode(tmp_path, umask, file_mode, dir_mode):
    old = os.umask(umask)
    try:
        write_text_atomic(tmp_path / "report.md", "text")
        with atomic_path(tmp_path / "bundle", directory=True) as folder:
            (folder / "inside").write_text("x")
    finally:
        os.umask(old)
    assert (tmp_path / "report.md").stat().st_mode & 0o777 == file_mode
    assert (tmp_path / "bundle").stat().st_mode & 0o777 == dir_mode
