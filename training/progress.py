"""Progress: a tqdm bar with loss, accuracy and images/s on a terminal; a few plain lines otherwise (logs, CI)."""

from __future__ import annotations

import sys

from tqdm import tqdm

PLAIN_LINES_PER_EPOCH = 4


class Progress:
    def __init__(self, total: int, description: str, enabled: bool = True):
        self.total = total
        self.description = description
        self.enabled = enabled
        self.done = 0
        self.bar = tqdm(total=total, desc=description, leave=False) if enabled and sys.stderr.isatty() else None
        self.every = max(1, total // PLAIN_LINES_PER_EPOCH)

    def update(self, **stats: float) -> None:
        self.done += 1
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.set_postfix({k: f"{v:.4g}" for k, v in stats.items()}, refresh=False)
            self.bar.update(1)
        elif self.done % self.every == 0 or self.done == self.total:
            text = " ".join(f"{k} {v:.4g}" for k, v in stats.items())
            print(f"{self.description} {self.done}/{self.total} {text}", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
