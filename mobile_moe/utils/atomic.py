"""Atomic writes: build at a temporary path beside the target, rename into place only when complete.

Every package writes its outputs through these, so an interrupted or failed command never leaves a half-written file
or directory where a finished one is expected:

    check_writable("out/results.json")           # before the work: UsageError now, not after an hour of it
    with atomic_path("out/results.json") as tmp:  # .results.json.tmp-<pid>-<random> beside the target
        tmp.write_text(...)                       # renamed over the target only if the block finishes

A temporary name carries the pid of the process that made it, so a later write of the same target removes the
temporaries of processes that were killed (SIGKILL runs no clean-up) and nothing else: names of any other pattern
are never touched.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path

from mobile_moe.errors import UsageError
from mobile_moe.utils.interrupts import held, raise_if_stopped

_PROCESS_STARTED = time.time() - 1.0  # (a second of slack for file-system timestamp granularity)


# The longest target name whose temporaries spell it out: a temporary adds ".", ".tmp-<pid>-" and mkstemp's 8 random
# characters, and most file systems stop at 255 bytes a name; a longer target's temporaries name it by a digest.
_LONGEST_SPELLED_NAME = 200


def _temp_prefix(target: Path) -> str:
    name = target.name
    if len(os.fsencode(name)) > _LONGEST_SPELLED_NAME:
        name = hashlib.sha256(os.fsencode(name)).hexdigest()[:32]
    return f".{name}.tmp-"


def _own_prefix(target: Path) -> str:
    """The start of the name of a temporary this process makes for `target`: .NAME.tmp-<pid>- (what _temporaries
    reads back, to tell a live writer's from a dead one's)."""
    return f"{_temp_prefix(target)}{os.getpid()}-"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return True
    return True


def _written_by_a_live_process(path: Path, pid: int) -> bool:
    if pid != os.getpid():
        return _pid_alive(pid)
    # Our own pid: ours, unless older than this process (a restarted container often reuses the same pid).
    try:
        return path.lstat().st_mtime >= _PROCESS_STARTED
    except OSError:
        return True


def process_description(pid: int) -> str:
    """'another mobile-moe command (pid N: its command line)', the command line where /proc has it: the one way
    a message names the process that holds an output."""
    try:
        command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        command = ""
    return f"another mobile-moe command (pid {pid}{': ' + command[:160] if command else ''})"


def _temporaries(target: Path) -> list[tuple[Path, int]]:
    """(path, pid) of every temporary of ours for `target` (by name: .NAME.tmp-<pid>-*)."""
    prefix = _temp_prefix(target)
    try:
        siblings = list(target.parent.iterdir()) if target.parent.is_dir() else []
    except OSError:
        return []
    found = []
    for path in siblings:
        pid_text, sep, _ = path.name[len(prefix) :].partition("-")
        if path.name.startswith(prefix) and sep and pid_text.isdigit():
            found.append((path, int(pid_text)))
    return found


def other_writer(target: str | os.PathLike) -> int | None:
    """The pid of another live process that is writing `target` now (it holds a temporary for it), or None."""
    for path, pid in _temporaries(Path(target)):
        if pid != os.getpid() and _written_by_a_live_process(path, pid):
            return pid
    return None


def remove_stale_temporaries(target: str | os.PathLike) -> list[Path]:
    """Remove the temporaries that dead processes left for `target` (ours by name: .NAME.tmp-<pid>-*); -> removed."""
    target = Path(target)
    prefix = _temp_prefix(target)
    removed = []
    for path, pid in _temporaries(target):
        if _written_by_a_live_process(path, pid):
            continue
        if path.name.startswith(f"{prefix}{pid}-old-") and not target.exists():
            os.replace(path, target)  # killed mid-swap: the previous version is the complete one
            continue
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
        removed.append(path)
    return removed


# What the file system says when a write cannot finish, and what the user can do about it.
_WRITE_FAILURES = {
    errno.ENOSPC: "free some space or choose another file system",
    errno.EDQUOT: "free some space or choose another file system",
    errno.EROFS: "choose a writable path",
    errno.EACCES: "choose a path you may write",
    errno.EPERM: "choose a path you may write",
    errno.ENAMETOOLONG: "choose a shorter name",
    errno.ENOTDIR: "a folder on that path is a file; move the file or choose another path",
}


def out_of_space(path: str | os.PathLike) -> bool:
    """Whether the file system holding `path` (a temporary just being written) has under a MiB left: what a write
    that failed without saying why (a library's own writer) ran into."""
    try:
        return shutil.disk_usage(Path(path).parent).free < 2**20
    except OSError:
        return False


def _cannot_write(target: Path, error: OSError) -> UsageError:
    reason = error.strerror or str(error)
    advice = _WRITE_FAILURES.get(error.errno, "choose a writable path")
    return UsageError(f"cannot write {target}: {reason}; {advice}")


def check_not_an_input(target: str | os.PathLike, inputs: Iterable[str | os.PathLike], what: str) -> None:
    """UsageError if `target` is one of the files the command reads (the same file by device and inode, whatever the
    path says): writing it would destroy that input. `what` names the output in the message (e.g. "--confusion")."""
    for source in inputs:
        try:
            same = os.path.samefile(target, source)
        except (OSError, ValueError):  # either is missing or unreadable: not the same existing file
            continue
        if same:
            raise UsageError(f"{what} {target} is {source}, which this command reads; write it to another file")


def _check_kind(target: Path, directory: bool) -> None:
    if target.exists() or target.is_symlink():
        if directory and not target.is_dir():
            raise UsageError(f"{target} exists and is not a directory; choose another path")
        if not directory and target.is_dir():
            raise UsageError(f"{target} is a directory; give a file path")


def within(path: str | os.PathLike, folder: str | os.PathLike) -> bool:
    """Whether `path` is `folder` or lies inside it, symbolic links followed (os.path.realpath, which never raises: a
    link loop is a path like any other, where Path.resolve raises RuntimeError)."""
    path, folder = os.path.realpath(path), os.path.realpath(folder)
    return os.path.commonpath([path, folder]) == folder


def check_replaceable(target: str | os.PathLike, *, read: Callable[[Path], object], kind: str, flag: str) -> None:
    """UsageError if `target` exists and `read` (the one reader of that kind of file, raising UsageError) refuses it:
    a command replaces an output of its own kind, an earlier run's, and never a file it did not write (a run's
    config.json given as a super-class --out, a photo as a --confusion)."""
    target = Path(target)
    if not target.exists():
        return
    try:
        read(target)
    except UsageError:
        raise UsageError(
            f"{flag} {target} exists and is not a {kind}; choose a new name (a command replaces only a file of the "
            "kind it writes)"
        ) from None


def check_output_folder(out: str | os.PathLike, *, ours: Callable[[Path], set[str] | None], kind: str,
                        flag: str = "--out") -> bool:  # fmt: skip
    """The one rule for what an output folder may replace (bundles, bench folders, stores): a new or empty
    folder is written; a folder that holds an earlier output of `kind`, recognised by its content (`ours(out)`: the
    names such an output holds, None when `out` is not one), and nothing else, is replaced whole; anything else is
    refused in one line naming what we did not write. An `out` that is a symbolic link is refused: replacing it would
    put a folder in the link's place and leave what it led to. -> whether an earlier output is there to replace."""
    out = Path(out)
    if out.is_symlink():
        raise UsageError(
            f"{flag} {out} is a symbolic link (to {os.readlink(out)}); give the folder itself or a new path: an output "
            "is never written through a link"
        )
    if not out.is_dir() or not any(out.iterdir()):
        return False
    names = ours(out)
    if names is None:
        raise UsageError(f"{flag} {out} exists and is not a {kind}; choose a new or empty folder (nothing there is "
                         "replaced)")  # fmt: skip
    foreign = sorted(entry.name for entry in out.iterdir() if entry.name not in names)
    if foreign:
        shown = ", ".join(foreign[:3]) + (f" and {len(foreign) - 3} more" if len(foreign) > 3 else "")
        raise UsageError(
            f"{flag} {out} is a {kind} but also holds {shown}, which we did not write and replacing it would delete; "
            "move them or choose a new folder (nothing written)"
        )
    return True


def check_writable(target: str | os.PathLike, directory: bool = False) -> None:
    """UsageError unless `target` (a file, or a directory if `directory`) can be written: it is not the other kind
    of thing, and a file can be created in its nearest existing ancestor directory. Creates nothing."""
    target = Path(target)
    try:  # exists() raises for a name too long or a parent we may not search
        _check_kind(target, directory)
        ancestor = target.parent if not (directory and target.is_dir()) else target
        while not ancestor.exists() and ancestor != ancestor.parent:
            ancestor = ancestor.parent
    except OSError as error:
        raise _cannot_write(target, error) from None
    if not ancestor.is_dir():
        raise UsageError(f"cannot write {target}: {ancestor} is not a directory; choose another path")
    try:  # a real probe: access() says yes to root on read-only or virtual file systems such as /proc
        fd, probe = tempfile.mkstemp(prefix=f".mobile-moe-probe-{os.getpid()}-", dir=ancestor)
        os.close(fd)
        os.unlink(probe)
    except OSError as error:
        raise _cannot_write(target, error) from None


def _replace_directory(tmp: Path, target: Path) -> None:
    """Swap the finished directory in: the old one moves aside first, so the target is never missing or mixed."""
    if not target.exists():
        os.replace(tmp, target)
        return
    old = Path(tempfile.mkdtemp(prefix=f"{_own_prefix(target)}old-", dir=target.parent))
    os.rmdir(old)
    os.replace(target, old)
    try:
        os.replace(tmp, target)
    except BaseException:  # an interrupt too: the previous version goes back, never a missing target
        os.replace(old, target)
        raise
    shutil.rmtree(old, ignore_errors=True)


def _umask() -> int:
    """The process's umask (reading it means setting it: set it straight back)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _claim(target: Path, directory: bool) -> Path:
    """A temporary beside `target` (file, or an empty directory) named as ours for it, with the mode open() or mkdir()
    would give the target; a second writer of `target` that is still alive is refused in one line that names it."""
    remove_stale_temporaries(target)
    writer = other_writer(target)
    if writer is not None:  # two writers would each replace the other's output: the second one waits for the first
        raise UsageError(
            f"{target} is being written by {process_description(writer)} right now; wait for it to finish or "
            "choose another path"
        )
    prefix = _own_prefix(target)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        if directory:
            tmp = Path(tempfile.mkdtemp(prefix=prefix, dir=target.parent))
        else:
            fd, name = tempfile.mkstemp(prefix=prefix, dir=target.parent)
            os.close(fd)
            tmp = Path(name)
        # mkstemp/mkdtemp make 0600/0700, a mode that would survive the rename: give the target what open() or
        # mkdir() would have, the user's umask applied.
        tmp.chmod((0o777 if directory else 0o666) & ~_umask())
    except OSError as error:
        raise _cannot_write(target, error) from None
    return tmp


def _discard(tmp: Path) -> None:
    if tmp.is_dir():
        shutil.rmtree(tmp, ignore_errors=True)
    else:
        tmp.unlink(missing_ok=True)


@contextlib.contextmanager
def atomic_path(target: str | os.PathLike, directory: bool = False) -> Iterator[Path]:
    """Yield a temporary path (file, or an empty directory if `directory`) that replaces `target` on success.

    On an exception (an interrupt or SIGTERM included: the CLI turns it into one) the temporary path is removed and
    `target` is left as it was. While another live process holds a temporary for `target`, a second writer is
    refused in one line that names it. An existing target directory is replaced as a whole: callers that replace a
    directory check first that everything in it is theirs (export.bundle does).
    """
    target = Path(target)
    tmp = _claim(target, directory)
    try:
        yield tmp
        raise_if_stopped()  # a stop that a library's __del__ swallowed still leaves the target as it was
        if directory:
            _replace_directory(tmp, target)
        else:
            os.replace(tmp, target)
    except BaseException as error:
        _discard(tmp)
        if isinstance(error, OSError) and error.errno in _WRITE_FAILURES:  # a full disk, a read-only file system, ...
            raise _cannot_write(target, error) from None
        raise


@contextlib.contextmanager
def atomic_files(targets: Sequence[str | os.PathLike]) -> Iterator[list[Path]]:
    """Yield a path for each of several files that make one output (a table and its plot), each under its target's
    own name (so a writer that picks the format by the suffix sees it) inside a temporary folder claimed beside the
    target; on success they replace their targets together, in one held block: a SIGINT or SIGTERM waits for the last
    rename, so an interrupted command leaves the old set or the new one. (A SIGKILL inside those few renames can still
    leave both; the same command run again completes the set.) On an exception every target is left as it was."""
    targets = [Path(target) for target in targets]
    folders: list[Path] = []
    try:
        for target in targets:
            folders.append(_claim(target, directory=True))
        yield [folder / target.name for folder, target in zip(folders, targets, strict=True)]
        with held():
            for folder, target in zip(folders, targets, strict=True):
                os.replace(folder / target.name, target)
    except OSError as error:
        if error.errno in _WRITE_FAILURES:  # a full disk, a read-only file system, ...: named by the set's first file
            raise _cannot_write(targets[0], error) from None
        raise
    finally:
        for folder in folders:
            _discard(folder)


@contextlib.contextmanager
def scratch_folder(name: str) -> Iterator[Path]:
    """A private folder in the system's temporary directory for a command's working files (bench's images, the
    emulated device's file system), removed at the end. It is named as an output's temporaries are, for the pretend
    target TMPDIR/NAME, so the folder a SIGKILLed command left (its process gone) is removed by the next one; commands
    running side by side each get their own."""
    target = Path(tempfile.gettempdir()) / name
    remove_stale_temporaries(target)
    folder = Path(tempfile.mkdtemp(prefix=_own_prefix(target), dir=target.parent))
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def write_text_atomic(target: str | os.PathLike, text: str) -> None:
    """`text` as UTF-8 at `target`, atomically. A path the OS gave us in bytes that are not UTF-8 (decoded with
    surrogate escapes) is written back as those bytes, not refused."""
    with atomic_path(target) as tmp:
        tmp.write_text(text, encoding="utf-8", errors="surrogateescape")
