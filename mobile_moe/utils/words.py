"""The toolkit's messages: counts ("1 epoch", "3 epochs") and text from outside (a file, a process) shown safely."""

from __future__ import annotations

import unicodedata


def counted(count: int, noun: str) -> str:
    """`count` and `noun`, the noun plural (an s) unless the count is one."""
    return f"{count} {noun}" if count == 1 else f"{count} {noun}s"


def has_control_character(text: str) -> bool:
    """Whether `text` holds a control character (Unicode category Cc: a newline, tab, escape, ...), which would forge a
    line or a colour where a command prints it."""
    return any(unicodedata.category(character) == "Cc" for character in text)


def escaped(text: str) -> str:
    """`text` as printed where a control character in it would forge a line or a colour: quoted with its control
    characters escaped where it holds any, else as it is."""
    return repr(text) if has_control_character(text) else text


def shown(text: str, limit: int = 300) -> str:
    """Text from a file or a process for a message line: on one line, at most `limit` characters, escaped."""
    text = " ".join(text.split())
    return escaped(text if len(text) <= limit else text[: limit - 3] + "...")
