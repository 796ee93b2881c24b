"""What the rest of a run will take, in the words the training log says it: once the first steps are timed
(say_run_estimate), then after each epoch from the epochs' own wall time (time_left)."""

from __future__ import annotations

import sys

from tqdm import tqdm

from mobile_moe.utils.words import counted


def duration(seconds: float) -> str:
    """'2 h 5 min', '7 min' or '80 s' (seconds below 90: '1 min' would be 30 to 89 of them)."""
    if seconds < 90:
        return f"{max(seconds, 1):.0f} s"
    hours, minutes = divmod(round(seconds / 60), 60)
    return f"{hours} h {minutes} min" if hours else f"{minutes} min"


def say_run_estimate(seconds_per_step: float, steps: int) -> None:
    """What the rest of the run will take, said once a step is timed: a 300-epoch recipe started by mistake shows.
    With tqdm.write, so that on a terminal the line goes above the epoch's progress bar, not into it. Each epoch's line
    then updates it from the epochs' own wall time (time_left)."""
    if steps <= 0:
        return
    pace = f"{seconds_per_step:.3f} s a step"
    said = (f"about {duration(seconds_per_step * steps)} of training for the run's {counted(steps, 'step')} left "
            f"({pace}), evaluation aside; each epoch's line updates it")  # fmt: skip
    tqdm.write(said, file=sys.stdout)


RECENT_EPOCHS = 3  # the estimate of the time left follows the pace of the last few epochs (a busy machine's changes)


def time_left(epoch_seconds: list[float], epochs_left: int) -> str:
    """'  about 4 min left' from the wall time of the epochs so far (training, evaluation and checkpoint, the first
    step's warm-up taken out); '' after the last epoch."""
    if epochs_left <= 0 or not epoch_seconds:
        return ""
    recent = sorted(epoch_seconds[-RECENT_EPOCHS:])
    return f"  about {duration(recent[len(recent) // 2] * epochs_left)} left"
