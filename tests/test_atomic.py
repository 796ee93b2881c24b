"""Files and directories written through mobile_moe.utils.atomic get the mode open() and mkdir() would give them."""

from __future__ import annotations

import errno
import os

import pytest

from mobile_moe.errors import UsageError
from mobile_moe.utils.atomic import atomic_path, check_not_an_input, write_text_atomic


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


def test_a_name_near_the_file_systems_limit_is_written_and_leaves_no_temporary(tmp_path):
    target = tmp_path / ("r" * 240 + ".json")  # legal (244 bytes); its temporary would not be if it spelled it out
    write_text_atomic(target, "{}")
    assert target.read_text() == "{}" and os.listdir(tmp_path) == [target.name]


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EROFS, errno.EACCES, errno.ENAMETOOLONG])
def test_a_write_the_file_system_refuses_is_one_line_and_leaves_the_target_as_it_was(tmp_path, code):
    target = tmp_path / "results.json"
    target.write_text("earlier")
    with pytest.raises(UsageError) as refused, atomic_path(target) as tmp:
        tmp.write_text("half")
        raise OSError(code, os.strerror(code))  # what a full disk or a read-only mount raises mid-write
    assert str(refused.value).startswith(f"cannot write {target}: {os.strerror(code)};")
    assert "\n" not in str(refused.value)
    assert target.read_text() == "earlier" and os.listdir(tmp_path) == ["results.json"]


def test_an_output_that_is_an_input_by_any_path_is_refused(tmp_path):
    source = tmp_path / "best.pt"
    source.write_bytes(b"weights")
    os.link(source, tmp_path / "hard.pt")
    for alias in (source, tmp_path / "." / "best.pt", tmp_path / "hard.pt"):
        with pytest.raises(UsageError, match="which this command reads"):
            check_not_an_input(alias, [tmp_path / "config.json", source], "--out")
    check_not_an_input(tmp_path / "new.npy", [source], "--out")  # a new file is no input
    assert source.read_bytes() == b"weights"


@pytest.mark.parametrize("directory", [False, True])
def test_a_second_writer_of_one_output_is_refused_naming_the_first_until_it_ends(tmp_path, directory):
    """Two commands writing one output would each replace the other's: while a live process holds a temporary for
    the target, another writer is refused in one line naming it; once that process is gone, its temporary is stale
    and removed, and the write goes through."""
    import subprocess
    import sys

    target = tmp_path / ("bundle" if directory else "file.json")
    first = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        held = tmp_path / f".{target.name}.tmp-{first.pid}-abcd1234"
        held.mkdir() if directory else held.write_text("half written")
        with pytest.raises(UsageError, match=rf"{target.name} is being written by another mobile-moe command "
                                             rf"\(pid {first.pid}\b.*\) right now"):  # fmt: skip
            write_text_atomic(target, "second")
        assert held.exists() and not target.exists()
    finally:
        first.kill()
        first.wait()
    with atomic_path(target, directory=directory) as tmp:
        (tmp / "x").write_text("") if directory else tmp.write_text("second")
    assert not held.exists() and target.exists()


def test_a_file_where_a_folder_of_the_path_should_be_is_one_line(tmp_path):
    """reproduce with DIR/scores a plain file ended in a NotADirectoryError traceback: the one writer says it."""
    (tmp_path / "scores").write_text("a file")
    with pytest.raises(UsageError, match="Not a directory; a folder on that path is a file; move the file"):
        write_text_atomic(tmp_path / "scores" / "cell" / "seed-0.json", "{}")
    assert (tmp_path / "scores").read_text() == "a file"


def test_files_written_together_replace_their_targets_together_or_not_at_all(tmp_path):
    """atomic_files: each staged under its target's own name (a plot writer reads the suffix), all renamed at the end;
    an error before the end leaves every old file, and no temporary beside any target."""
    from mobile_moe.utils.atomic import atomic_files

    targets = [tmp_path / "fig.md", tmp_path / "plots" / "fig.png"]
    targets[1].parent.mkdir()
    for target in targets:
        target.write_text("old")
    with pytest.raises(RuntimeError), atomic_files(targets) as staged:
        assert [path.name for path in staged] == ["fig.md", "fig.png"]
        staged[0].write_text("new")
        raise RuntimeError("the plot failed")
    assert [target.read_text() for target in targets] == ["old", "old"]
    with atomic_files(targets) as staged:
        for path in staged:
            path.write_text("new")
    assert [target.read_text() for target in targets] == ["new", "new"]
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["fig.md", "fig.png", "plots"]


def test_a_stop_during_the_renames_of_files_written_together_waits_for_the_last(tmp_path, monkeypatch):
    """A SIGTERM that lands between two renames is raised after the last one: the new set, whole."""
    import signal

    from mobile_moe.utils import atomic
    from mobile_moe.utils.interrupts import Terminated, stop_signals

    targets = [tmp_path / "fig.md", tmp_path / "fig.csv"]
    for target in targets:
        target.write_text("old")
    real_replace, renamed = os.replace, []

    def replace_then_stop(source, target):
        real_replace(source, target)
        renamed.append(target)
        if len(renamed) == 1:
            signal.raise_signal(signal.SIGTERM)

    monkeypatch.setattr(atomic.os, "replace", replace_then_stop)
    with stop_signals(), pytest.raises(Terminated), atomic.atomic_files(targets) as staged:
        for path in staged:
            path.write_text("new")
    assert renamed == targets and [target.read_text() for target in targets] == ["new", "new"]


def test_a_scratch_folder_a_killed_command_left_is_removed_by_the_next_and_a_live_ones_stays(tmp_path, monkeypatch):
    """bench's working images and the emulated device live in TMPDIR: a SIGKILL leaves them there, so the next
    command removes what a process that is gone left, and never what a running one holds."""
    import subprocess
    import sys
    import tempfile

    from mobile_moe.utils.atomic import scratch_folder

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    killed = tmp_path / ".mobile-moe-bench.tmp-999999999-abcd1234"  # no such pid
    killed.mkdir()
    running = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        live = tmp_path / f".mobile-moe-bench.tmp-{running.pid}-efgh5678"
        live.mkdir()
        with scratch_folder("mobile-moe-bench") as folder, scratch_folder("mobile-moe-bench") as beside:
            assert folder.is_dir() and beside.is_dir() and folder != beside and folder.parent == tmp_path
            assert not killed.exists() and live.is_dir()
        assert not folder.exists() and not beside.exists() and live.is_dir()
    finally:
        running.kill()
        running.wait()
