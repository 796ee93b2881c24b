"""The paper's recipe, steps 2-3 (Sec. 2.2): a dense model's confusion on held-out data -> E super-classes.

confusion = confusion_from_run("runs/dense", split="val")  # mobile_moe.training.evaluate; soft by default
super_classes = derive_super_classes(confusion.matrix, 10, class_names=confusion.class_names)
super_classes.save("super_classes.json")

mobile_moe/super_class/ is the lower package: its library modules never import training. Reading a run is training's
(confusion_from_run); the entries that need both (`superclass derive --run`, the demo step) import it to compose them.
"""

from __future__ import annotations

import numpy as np

from mobile_moe.errors import UsageError
from mobile_moe.formats.confusion import check_confusion, classes_without_images
from mobile_moe.formats.superclasses import SuperClasses, default_names, unnamed_classes
from mobile_moe.super_class.clustering import cluster
from mobile_moe.super_class.quality import quality, stability


def derive_super_classes(
    confusion: np.ndarray,
    num_super_classes: int,
    method: str = "spectral",
    seed: int = 0,
    class_names: list[str] | None = None,
    source: str = "confusion matrix",
    affinity: str = "auto",
    stability_resamples: int = 0,
) -> SuperClasses:
    """Cluster a confusion matrix into exactly `num_super_classes` super-classes, with its quality measured; with
    `stability_resamples`, also how stable the grouping is over that many bootstrap resamples of the images
    (quality.stability)."""
    confusion = check_confusion(confusion)
    num_classes = confusion.shape[0]
    if class_names is None:
        class_names = unnamed_classes(num_classes)
    if len(class_names) != num_classes:
        raise UsageError(
            f"{len(class_names)} class names for a {num_classes}-class confusion matrix; give one per class"
        )
    details: dict = {}
    assignment = cluster(confusion, num_super_classes, method, seed, affinity, details)
    measured = quality(confusion, assignment, classes_without_images(confusion))
    measured.update(seed=seed, affinity=details["affinity"])
    if stability_resamples:
        again = lambda matrix, other_seed: cluster(matrix, num_super_classes, method, other_seed, affinity, {})  # noqa: E731
        measured["stability"] = stability(confusion, assignment, again, stability_resamples, seed)
    return SuperClasses(
        assignment=assignment.tolist(),
        class_names=list(class_names),
        names=default_names(num_super_classes),
        method=method,
        source=source,
        quality=measured,
    )
