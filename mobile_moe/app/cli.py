"""The `mobile-moe` console script: one subcommand per package, imported only when chosen.

A command module exposes `configure(parser)` (adds its arguments) and `run(args) -> int | None`. `--help` lists the
commands whose module is installed without importing any of them, so the CLI starts fast.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import errno
import importlib
import importlib.util
import os
import signal
import sys
import threading
import warnings
from importlib.metadata import version
from typing import NoReturn

from mobile_moe.errors import Note, RuntimeFailure, UsageError, exception_chain
from mobile_moe.utils.interrupts import STOPPED_LINES, Terminated, stop_signals

# command -> (module, one-line help). Commands whose module does not exist yet are not offered.
COMMANDS: dict[str, tuple[str, str]] = {
    "info": ("mobile_moe.models.info_cli", "parameters (total, active) and FLOPs of a model"),
    "pack": ("mobile_moe.data.pack_cli", "a pre-resized image store of a data spec, for --data packed:STORE"),
    "train": ("mobile_moe.training.cli", "train a dense ViT, a Mobile V-MoE or a reference MoE"),
    "import": ("mobile_moe.training.import_cli", "a dense run from a local timm or torchvision ViT checkpoint"),
    "evaluate": ("mobile_moe.training.evaluate_cli", "evaluate a trained run on a data split"),
    "superclass": ("mobile_moe.super_class.cli", "super-classes from a dense model's confusion graph, or show them"),
    "export": ("mobile_moe.export.cli", "split a model into router and expert graphs (ExecuTorch, ONNX, Core ML)"),
    "predict": ("mobile_moe.export.predict_cli", "classify image files with an exported bundle"),
    "sdk": ("mobile_moe.library.cli", "the SDK folder an app links: libmobile_moe, its header, pkg-config, Java"),
    "bench": ("mobile_moe.device_bench.cli", "measure latency and memory of bundles on the host or a phone"),
    "reproduce": ("mobile_moe.evidence.cli", "regenerate one of the paper's figures on your data: table, CSV and plot"),
    "demo": ("mobile_moe.app.demo", "the main job, end to end, on built-in data"),
}


class ArgumentParser(argparse.ArgumentParser):
    """argparse that reports bad arguments as a UsageError (one line, exit status 2) instead of usage + exit, pointing
    at the help of the command they were given to; and takes no abbreviations (`--epoch` is not `--epochs`: a typo
    must not quietly set another flag)."""

    def __init__(self, *args, help_prog: str | None = None, **kwargs) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)
        self.help_prog = help_prog  # whose --help to point to; argparse reports a subcommand's unknown flags here

    def error(self, message: str) -> None:  # type: ignore[override]
        raise UsageError(f"{message} (see `{self.help_prog or self.prog} --help`)")


def _available_commands() -> dict[str, tuple[str, str]]:
    def installed(module: str) -> bool:
        try:
            return importlib.util.find_spec(module) is not None
        except ModuleNotFoundError:
            return False

    return {name: entry for name, entry in COMMANDS.items() if installed(entry[0])}


def build_parser(chosen: str | None) -> ArgumentParser:
    """The parser; only the chosen command's module is imported to add its arguments."""
    available = _available_commands()
    parser = ArgumentParser(prog="mobile-moe", description="Mobile V-MoE toolkit: train, split, export, benchmark.",
                            help_prog=f"mobile-moe {chosen}" if chosen in available else None)  # fmt: skip
    parser.add_argument("--version", action="version", version=f"%(prog)s {version('mobile-moe')}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (module, help_text) in available.items():
        sub = commands.add_parser(name, help=help_text, description=help_text)
        if name == chosen:
            command = importlib.import_module(module)
            command.configure(sub)
            sub.set_defaults(run=command.run)
    return parser


def _interrupt_behind(error: BaseException) -> KeyboardInterrupt | None:
    """The Ctrl-C or SIGTERM an exception was raised while handling, if any: a library whose own clean-up fails as
    the interrupt unwinds it (torch.export's tracer asserts on its mode stack) must not turn a stop into a crash."""
    return next((raised for raised in exception_chain(error) if isinstance(raised, KeyboardInterrupt)), None)


def _stopped(interrupt: KeyboardInterrupt) -> int:
    signum = signal.SIGTERM if isinstance(interrupt, Terminated) else signal.SIGINT
    print(STOPPED_LINES[signum], file=sys.stderr)
    return 128 + signum


# The errors of a path the user gave (an input's, a folder's) that no command can work around, and how to fix each.
# Every command hands its inputs to pathlib, torch, numpy and PIL, which raise them from wherever they first look: a
# refusal here covers them all, where a check per reader would miss the next reader.
_PATH_FIXES = {
    errno.ENAMETOOLONG: "a name in the path is longer than the file system allows; give a shorter path",
    errno.EACCES: "this user may not read or write it, or a folder above it; check its permissions",
}


def _path_refusal(error: BaseException) -> str | None:
    """One line for an OSError of the kinds in _PATH_FIXES, naming the path; None for anything else (a bug's
    traceback stays)."""
    if not isinstance(error, OSError) or error.errno not in _PATH_FIXES or error.filename is None:
        return None
    named = error.filename2 if error.filename2 is not None else error.filename  # a rename's target, else the path
    path = os.fsdecode(named) if isinstance(named, bytes | str) else str(named)
    return f"cannot use {path}: {error.strerror}: {_PATH_FIXES[error.errno]}"


def check_working_directory() -> None:
    """A working directory that was deleted (or that we may no longer read) is one line here: torch would otherwise
    die loading itself ("Intel oneMKL FATAL ERROR: Cannot load libtorch_cpu.so"), a line that never says why."""
    try:
        os.getcwd()
    except OSError as error:
        raise UsageError(
            f"the working directory cannot be used ({error.strerror or error}: deleted, or not readable); cd to an "
            "existing directory and run the command again"
        ) from None


_PYTHON_SHOWWARNING = warnings.showwarning


def _show_notes(command: str | None) -> None:
    """mobile_moe.errors.Note warnings as one `note:` line each on stderr; other warnings as Python shows them."""

    def show(message, category, filename, lineno, file=None, line=None):
        if issubclass(category, Note):
            print(f"mobile-moe {command or ''}: note: {' '.join(str(message).split())}", file=sys.stderr)
        else:
            _PYTHON_SHOWWARNING(message, category, filename, lineno, file, line)

    warnings.showwarning = show


def main(argv: list[str] | None = None) -> int:
    """The `mobile-moe` command; argv None: this process's own command line (the console script, python -m), which
    ends the process as soon as the command has (_end_process)."""
    status = _command(argv)
    if argv is None:
        _end_process(status)
    return status


def _end_process(status: int) -> NoReturn:
    """End the process with `status` now that the command has ended and its outputs are whole: what the interpreter's
    exit does that anyone can see (non-daemon threads joined, atexit's functions run: multiprocessing's children
    reaped, finalizers' temporary folders removed; stdout and stderr flushed), without its module teardown, which
    takes about a second once torch and matplotlib are loaded, and inside which Python puts the default signal
    handlers back (a stop landing there would be swallowed, or end the process by the signal without a line). A stop
    during what runs here is the command's stop (interrupts.stop_signals: its line and 130 or 143)."""
    # The interpreter's own first step (Py_FinalizeEx's wait_for_thread_shutdown, Python/pylifecycle.c): the threading
    # atexit hooks, which tell a ThreadPoolExecutor's idle workers to end, then the join of every non-daemon thread
    # (without the hooks, the join waits forever for the idle workers of inductor's compile pool).
    threading._shutdown()
    atexit._run_exitfuncs()  # the functions the interpreter's exit runs (Lib/atexit, Modules/atexitmodule.c)
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(status)


def _command(argv: list[str] | None) -> int:
    process_command, argv = argv is None, sys.argv[1:] if argv is None else argv
    for stream in (sys.stdout, sys.stderr):  # a path whose bytes are not UTF-8 prints escaped, never a traceback
        if hasattr(stream, "reconfigure"):
            stream.reconfigure(errors="backslashreplace")
    chosen = next((arg for arg in argv if not arg.startswith("-")), None)
    _show_notes(chosen)
    try:
        with stop_signals(until_exit=process_command):
            check_working_directory()
            args = build_parser(chosen).parse_args(argv)
            return args.run(args) or 0
    except UsageError as error:
        if os.environ.get("MOBILE_MOE_DEBUG") == "1":
            raise
        return _refused(chosen, str(error))
    except RuntimeFailure as error:
        if os.environ.get("MOBILE_MOE_DEBUG") == "1":
            raise
        return _refused(chosen, str(error), status=1)
    except KeyboardInterrupt as interrupt:  # Ctrl-C, or SIGTERM (Terminated)
        return _stopped(interrupt)
    except Exception as error:
        interrupt, refusal = _interrupt_behind(error), _path_refusal(error)
        if os.environ.get("MOBILE_MOE_DEBUG") == "1" or (interrupt is None and refusal is None):
            raise
        return _stopped(interrupt) if interrupt is not None else _refused(chosen, refusal)


def _refused(command: str | None, message: str, status: int = 2) -> int:
    message = " ".join(message.split())  # ONE line, whatever a library put in the message
    print(f"mobile-moe {command or ''}: error: {message}".replace("  ", " "), file=sys.stderr)
    return status


if __name__ == "__main__":
    sys.exit(main())
