"""The paper's recipe, steps 2-3 (Sec. 2.2): a dense model's confusion on held-out data -> E super-classes.

confusion = confusion_from_run("runs/dense", split="val")           # soft by default
super_classes = derive_super_classes(confusion.matrix, 10, class_names=confusion.class_names)
super_classes.save("super_classes.json")
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

from mobile_moe.devices import resolve_device
from mobile_moe.errors import UsageError
from mobile_moe.super_class.clustering import cluster
from mobile_moe.super_class.confusion import check_confusion, classes_without_images, confusion_from_predictions
from mobile_moe.super_class.quality import quality
from mobile_moe.super_class.superclasses import SuperClasses, default_names


@dataclass
class Confusion:
    matrix: np.ndarray  # (C, C), rows = true class
    class_names: list[str]
    source: str  # where it came from, recorded in the super-class file


def derive_super_classes(
    confusion: np.ndarray,
    num_super_classes: int,
    method: str = "spectral",
    seed: int = 0,
    class_names: list[str] | None = None,
    source: str = "confusion matrix",
    affinity: str = "auto",
) -> SuperClasses:
    """Cluster a confusion matrix into exactly `num_super_classes` super-classes, with its quality measured."""
    confusion = check_confusion(confusion)
    num_classes = confusion.shape[0]
    if class_names is None:
        class_names = [f"class {c}" for c in range(num_classes)]
    if len(class_names) != num_classes:
        raise UsageError(
            f"{len(class_names)} class names for a {num_classes}-class confusion matrix; give one per class"
        )
    details: dict = {}
    assignment = cluster(confusion, num_super_classes, method, seed, affinity, details)
    measured = quality(confusion, assignment, classes_without_images(confusion))
    measured.update(seed=seed, affinity=details["affinity"])
    return SuperClasses(
        assignment=assignment.tolist(),
        class_names=list(class_names),
        names=default_names(num_super_classes),
        method=method,
        source=source,
        quality=measured,
    )


def confusion_from_run(
    run_dir: str | os.PathLike,
    data_spec: str | None = None,
    split: str = "val",
    hard: bool = False,
    device: str = "auto",
    batch_size: int = 256,
) -> Confusion:
    """The confusion matrix of a trained run's best checkpoint on a data split (soft unless `hard`).

    `data_spec` defaults to the run's own data; images are normalised with the statistics the run recorded.
    """
    from mobile_moe.training.evaluate import collect_predictions
    from mobile_moe.training.run_dir import load_run

    device = resolve_device(device)  # a typo is refused before the run is read
    run = load_run(run_dir, checkpoint="best")
    data = run.open_data(data_spec)  # the run's own data by default; refuses data with other classes
    spec = data.spec
    dataset = data.split(split)
    if len(dataset) == 0:
        raise UsageError(f"--data {spec} --split {split} has no images; choose another split")
    probs, labels = collect_predictions(run.model.to(device), dataset, batch_size=batch_size, device=device)
    matrix = confusion_from_predictions(probs, labels, hard=hard, num_classes=len(data.class_names))
    kind = "hard" if hard else "soft"
    return Confusion(matrix, list(data.class_names), f"run:{run_dir} data:{spec} split:{split} {kind}")
