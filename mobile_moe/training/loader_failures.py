"""A DataLoader worker's death, told apart from any other RuntimeError of the training loop and put in one line."""

from __future__ import annotations


def worker_failure(error: RuntimeError) -> str | None:
    """torch's sentence for a DataLoader worker that died (a signal: the kernel's out-of-memory killer, a kill), with
    what likely killed it; None for any other error. torch/utils/data/dataloader.py and _utils/signal_handling.py
    word it "DataLoader worker (pid(s) N) exited unexpectedly" or "... is killed by signal: Killed."."""
    text = str(error)
    if "DataLoader worker" not in text or not ("exited unexpectedly" in text or "killed by signal" in text):
        return None
    sentence = text.strip().splitlines()[0].rstrip(". ")
    return f"{sentence} (killed from outside: the kernel's out-of-memory killer, or a signal sent to it)"
