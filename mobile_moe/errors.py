"""The one exception type that means "the user asked for something invalid", and the one that means "a runtime we
drive failed at work it was rightly given".

The CLI turns a UsageError into a single line on stderr and exit status 2, as it does an OSError of a path no command
can work around (a name too long, a folder this user may not read: app/cli.py), and a RuntimeFailure into its line
and exit status 1; anything else is a bug and keeps its traceback. UsageError subclasses ValueError so library callers
can catch it the usual way.
"""

from __future__ import annotations

from collections.abc import Iterator


class UsageError(ValueError):
    """Bad input: the message says what was wrong and how to fix it.

    Raised in a DataLoader worker, torch re-raises it in the main process as the same type built from "Caught
    <Type> in DataLoader worker process N. Original Traceback ... <Type>: <message>"
    (torch/_utils.py ExceptionWrapper.reraise): the constructor keeps only our own message, so the CLI still prints
    one line whichever worker met the bad input."""

    def __init__(self, message: str = ""):
        marker = f"{type(self).__name__}: "
        ours = [line.split(marker, 1)[1] for line in str(message).splitlines() if marker in line]
        super().__init__(ours[-1] if ours and str(message).startswith("Caught ") else message)


class RuntimeFailure(RuntimeError):
    """A runtime the toolkit drives failed at work it was rightly given (libmobile_moe's MM_RUNTIME_ERROR, an
    allocation it could not make): not bad input, not a bug of ours. The CLI prints its one line and exits 1."""


class Note(UserWarning):
    """Something the user should know that does not stop the command (files a folder walk skipped, ...): the CLI
    prints it as one `note:` line on stderr; a library caller gets it through the warnings module."""


def exception_chain(error: BaseException | None) -> Iterator[BaseException]:
    """`error` and the exceptions it was raised from or while handling (__cause__, else __context__), each once."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        yield error
        error = error.__cause__ or error.__context__
