"""Progress: a tqdm bar with loss, accuracy and images/s on a terminal; a few plain lines otherwise (logs, CI)."""

from __future__ import annotations

import sys
import time

from tqdm import tqdm

PLAIN_LINES_PER_EPOCH = 4
PLAIN_SECONDS = 10.0  # a plain line at least this often within a long epoch, whatever its steps


class Progress:
    def __init__(self, total: int, description: str, enabled: bool = True):
        self.total = total
        self.description = description
        self.enabled = enabled
        self.done = 0
        self.bar = tqdm(total=total, desc=description, leave=False) if enabled and sys.stderr.isatty() else None
        self.every = max(1, total // PLAIN_LINES_PER_EPOCH)
        self.last_line = time.monotonic()

    def update(self, steps: int = 1, **stats: float) -> None:
        """`steps` more steps done (a log interval's), with the stats as of now."""
        before, self.done = self.done, self.done + steps
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.set_postfix({k: f"{v:.4g}" for k, v in stats.items()}, refresh=False)
            self.bar.update(steps)
        elif (self.done // self.every > before // self.every or self.done == self.total
              or time.monotonic() - self.last_line >= PLAIN_SECONDS):  # fmt: skip
            self.last_line = time.monotonic()
            text = " ".join(f"{k} {v:.4g}" for k, v in stats.items())
            print(f"{self.description} {self.done}/{self.total} {text}", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
