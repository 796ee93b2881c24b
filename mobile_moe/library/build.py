"""Build libmobile_moe and its clients (the native runner among them) on demand: CMake against the executorch wheel's
package config, cached by source hash.

The build directory is ~/.cache/mobile-moe/native-<hash> (MOBILE_MOE_CACHE overrides the root), where the hash covers
the runner's sources, the executorch version and the compiler, so an edit or an upgrade rebuilds and nothing else
does. A failed build raises UsageError carrying the key line of the CMake or compiler error.

`build_runner(sanitize="address")` builds an AddressSanitizer runner into its own directory (native-<hash>-asan);
run it with `sanitizer_env()` in its environment (no leak checking: the uninstrumented ExecuTorch libraries keep
allocations alive at exit; a distinct exit status for an ASan report, so a report is never mistaken for exit 1).
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

from mobile_moe.errors import UsageError
from mobile_moe.utils.atomic import write_text_atomic
from mobile_moe.utils.cache import cache_root
from mobile_moe.utils.interrupts import run_child


def _library_source_dir() -> Path:
    """libmobile_moe's tree (CMakeLists.txt, include/, src/, ...): a component at the repository's top level, which the
    wheel carries inside this package (setup.py) so an installed copy builds it too."""
    here = Path(__file__).resolve().parent
    installed = here / "libmobile_moe"
    return installed if (installed / "CMakeLists.txt").is_file() else here.parents[1] / "libmobile_moe"


SOURCE_DIR = _library_source_dir()
RUNNER_NAME = "mobile_moe_runner"


def executorch_package_dir() -> Path:
    """site-packages/executorch: CMAKE_PREFIX_PATH for find_package(executorch)."""
    import importlib.util

    spec = importlib.util.find_spec("executorch")
    if spec is None or not spec.submodule_search_locations:
        raise UsageError("the executorch package is not installed; install the pinned executorch==1.5.1")
    return Path(next(iter(spec.submodule_search_locations)))


def missing_tools() -> list[str]:
    """Build tools not on PATH (cmake, a C++ compiler); empty when the runner can be built."""
    missing = [] if shutil.which("cmake") else ["cmake"]
    if not any(shutil.which(c) for c in ("c++", "g++", "clang++")):
        missing.append("a C++ compiler (c++, g++ or clang++)")
    return missing


def jdk_include_dir() -> Path | None:
    """The include folder (jni.h) of the JDK whose javac is on PATH; None without one."""
    javac = shutil.which("javac")
    include = Path(os.path.realpath(javac)).parent.parent / "include" if javac else None
    return include if include is not None and (include / "jni.h").is_file() else None


def host_compiler() -> str:
    return shutil.which("c++") or shutil.which("g++") or ""


def source_hash(source_dir: Path = SOURCE_DIR, compiler: str | None = None) -> str:
    digest = hashlib.sha256()
    for path in sorted(source_dir.rglob("*")):
        if path.suffix in (".cpp", ".c", ".h", ".txt", ".cmake", ".map", ".in", ".java"):
            digest.update(str(path.relative_to(source_dir)).encode() + path.read_bytes())
    from executorch.version import __version__

    digest.update(__version__.encode())
    digest.update((host_compiler() if compiler is None else compiler).encode())
    digest.update(str(jdk_include_dir()).encode())  # a JDK installed since: built again, now with the JNI library
    return digest.hexdigest()[:16]


def key_error_line(log: str) -> str:
    """The line a human needs from a CMake/compiler log: the first compiler error, else CMake's error message."""
    lines = log.splitlines()
    for line in lines:
        if re.search(r"\berror\b:", line) and "ninja: build stopped" not in line:
            return line.strip()
    for index, line in enumerate(lines):
        if line.startswith("CMake Error"):
            following = [text.strip() for text in lines[index + 1 : index + 4] if text.strip()]
            return " ".join([line.strip(), *following])
    tail = [line.strip() for line in lines if line.strip()]
    return tail[-1] if tail else "no output"


def _run(command: list[str], what: str) -> None:
    result = run_child(command, capture_output=True, text=True)
    if result.returncode != 0:
        raise UsageError(
            f"building the native runner failed at {what}: {key_error_line(result.stdout + result.stderr)}"
        )


SANITIZERS = {"address": "asan", "undefined": "ubsan", "thread": "tsan"}
ASAN_EXIT_CODE = 86  # what a sanitizer report (address, undefined, thread) exits with under sanitizer_env()


class SanitizerUnavailable(UsageError):
    """A sanitizer build that failed for want of the compiler's sanitizer runtime (libasan, libubsan, libtsan): a
    reason to skip the sanitizer's tests on this machine. Any other failed build is an error in our code."""


def sanitizer_env(base: dict[str, str] | None = None) -> dict[str, str]:
    """Environment for running a sanitizer build: leak checking off, a distinct exit status for a report."""
    env = dict(os.environ if base is None else base)
    env["ASAN_OPTIONS"] = f"detect_leaks=0:exitcode={ASAN_EXIT_CODE}:abort_on_error=0"
    env["UBSAN_OPTIONS"] = f"halt_on_error=1:print_stacktrace=1:exitcode={ASAN_EXIT_CODE}"
    env["TSAN_OPTIONS"] = f"halt_on_error=1:exitcode={ASAN_EXIT_CODE}"
    return env


@dataclass(frozen=True)
class CrossBuild:
    """A build for another machine (mobile_moe/device_bench/arm64.py makes the linux-arm64 one): its name (the cache
    directory's suffix), the executorch package to build against, the extra cmake arguments (its toolchain file) and its
    compiler (part of the cache key)."""

    target: str
    prefix: Path
    cmake_args: tuple[str, ...]
    compiler: str


def build_runner(
    source_dir: Path = SOURCE_DIR,
    build_root: Path | None = None,
    sanitize: str | None = None,
    cross: CrossBuild | None = None,
) -> Path:
    """Path to a built runner, configuring and compiling it first when this source has not been built yet.
    sanitize="address" (or "undefined", or "thread") builds a sanitizer runner into a separate cache directory;
    `cross` builds for another machine into its own."""
    if sanitize is not None and sanitize not in SANITIZERS:
        raise UsageError(f"sanitize={sanitize!r}: choose one of {', '.join(SANITIZERS)}")
    if cross is None:
        missing = missing_tools()
        if missing:
            raise UsageError(f"cannot build libmobile_moe and its native runner: {' and '.join(missing)} not found; "
                             "install them (Debian: apt-get install cmake g++)")  # fmt: skip
        prefix, extra, compiler = executorch_package_dir(), [], host_compiler()
    else:
        if sanitize is not None:
            raise UsageError(f"sanitizer builds are for the host; build {cross.target} without sanitize")
        prefix, extra, compiler = cross.prefix, list(cross.cmake_args), cross.compiler
    suffix = f"-{SANITIZERS[sanitize]}" if sanitize else "" if cross is None else f"-{cross.target}"
    build_dir = (build_root or cache_root()) / f"native-{source_hash(source_dir, compiler)}{suffix}"
    runner = build_dir / RUNNER_NAME
    if built_intact(runner):
        return runner
    try:
        build_dir.mkdir(parents=True, exist_ok=True)
        # One build at a time per directory (parallel test workers, two benches): the others wait, then find it.
        with open(build_dir / ".lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not built_intact(runner):  # never built, or damaged since (truncated, replaced, a link): built again
                _configure_and_compile(source_dir, build_dir, prefix=prefix, sanitize=sanitize, cmake_extra=extra)
    except UsageError as error:
        runtime = SANITIZERS.get(sanitize or "", "")
        if runtime and any(f"{mark}{runtime}" in str(error) for mark in ("lib", "-l")):
            raise SanitizerUnavailable(f"this compiler has no {sanitize} sanitizer runtime ({error})") from None
        raise
    except OSError as error:  # a read-only or full cache folder
        raise UsageError(
            f"cannot build the native runner in {build_dir}: {error.strerror or error}; set MOBILE_MOE_CACHE to a "
            "writable folder"
        ) from None
    return runner


def _configure_and_compile(
    source_dir: Path, build_dir: Path, *, prefix: Path, sanitize: str | None, cmake_extra: list[str]
) -> None:
    runner = build_dir / RUNNER_NAME
    if runner.is_dir() and not runner.is_symlink():  # not ours to delete, and no runner can be renamed over it
        raise UsageError(f"{runner} is a directory where the built runner belongs; remove it, then run this again")
    work = build_dir / "cmake-build"
    generator = ["-G", "Ninja"] if shutil.which("ninja") else []
    configure = ["cmake", "-S", str(source_dir), "-B", str(work), *generator, "-DCMAKE_BUILD_TYPE=Release"]
    configure += [f"-DCMAKE_PREFIX_PATH={prefix}", f"-DMOBILE_MOE_SANITIZE={sanitize or ''}", *cmake_extra]
    jdk_include = jdk_include_dir()
    if jdk_include is not None and not cmake_extra:  # the host's JDK, for host builds only
        configure.append(f"-DMOBILE_MOE_JNI_INCLUDE={jdk_include}")
    _run(configure, "cmake configure")
    _run(["cmake", "--build", str(work), "--parallel", "2"], "compile")
    # Copy, then rename into place: a concurrent or interrupted build never leaves a half-written runner behind. Its
    # digest, written last, is what later runs check it against (built_intact).
    staged = build_dir / f".{RUNNER_NAME}.{os.getpid()}"
    runner.unlink(missing_ok=True)  # a link in its place would otherwise survive the rename's target check
    shutil.copy2(work / RUNNER_NAME, staged)
    digest = file_digest(staged)
    os.replace(staged, runner)
    write_text_atomic(digest_file(runner), digest + "\n")


LIBRARY_NAME = "libmobile_moe.so"  # mobile_moe.h's C API, built with the runner (libmobile_moe's CMakeLists.txt)
JNI_LIBRARY_NAME = "libmobile_moe_jni.so"  # the Java binding's JNI part, where CMake found a JDK


def build_library(**options) -> Path:
    """libmobile_moe, the runtime as a library (include/mobile_moe.h), from the same CMake build as the runner
    (build_runner's options: a sanitizer, a cross build); its JNI part lies beside it where a JDK was found."""
    return built_beside_runner(LIBRARY_NAME, **options)


INTERNAL_CHECKS_NAME = "mobile_moe_internal_checks"  # the tests' white-box tool (tests/internal_checks.cpp)


def build_internal_checks() -> Path:
    """The test suite's tool that runs the library's hashes and file checks on given files, from the host build."""
    return built_beside_runner(INTERNAL_CHECKS_NAME)


def built_beside_runner(name: str, **options) -> Path:
    """`name` from the runner's CMake build (build_runner's options), building it first where needed."""
    built = build_runner(**options).parent / "cmake-build" / name
    if not built.is_file():
        raise UsageError(f"the native build has no {name} at {built}; remove {built.parent} and build again")
    return built


def digest_file(runner: Path) -> Path:
    return runner.with_name(f"{runner.name}.sha256")


def file_digest(path: Path) -> str:
    with open(path, "rb") as file:
        return hashlib.file_digest(file, "sha256").hexdigest()


def built_intact(runner: Path) -> bool:
    """Whether the cached `runner` is the one its build wrote: a regular file (no link), executable, with the SHA-256
    recorded beside it when it was built. A cache is trusted for what it holds, not because a file is there."""
    try:
        if runner.is_symlink() or not runner.is_file() or not os.access(runner, os.X_OK):
            return False
        return digest_file(runner).read_text().strip() == file_digest(runner)
    except OSError:
        return False
