"""Counts in the toolkit's messages: "1 epoch", "3 epochs"."""


def counted(count: int, noun: str) -> str:
    """`count` and `noun`, the noun plural (an s) unless the count is one."""
    return f"{count} {noun}" if count == 1 else f"{count} {noun}s"
