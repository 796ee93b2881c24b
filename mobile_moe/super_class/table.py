"""Show a super-class division like the paper's Table 1: per super-class, its size and three random class names."""

from __future__ import annotations

import random

from mobile_moe.errors import UsageError
from mobile_moe.formats.superclasses import SuperClasses


def example_classes(super_classes: SuperClasses, examples: int = 3, seed: int = 0) -> list[list[str]]:
    """Per super-class, `examples` class names chosen at random (seeded; all of them if it has fewer)."""
    if isinstance(examples, bool) or not isinstance(examples, int) or examples < 0:
        raise UsageError(f"--examples {examples}: give a number of class names per super-class, 0 or more")
    rng = random.Random(seed)
    chosen = []
    for s in range(super_classes.num_super_classes):
        names = [super_classes.class_names[c] for c in super_classes.members(s)]
        chosen.append(rng.sample(names, min(examples, len(names))))
    return chosen


CHANCE_MARGIN = 1.1  # a within share up to 10% (relative) above chance is "at about chance"


def format_table(super_classes: SuperClasses, examples: int = 3, seed: int = 0) -> str:
    """The listing, then one line of quality (if the file has it)."""
    rows = [("ID", "size", "classes", "super-class")]
    for s, names in enumerate(example_classes(super_classes, examples, seed)):
        size = len(super_classes.members(s))
        more = [f"+{size - len(names)} more"] if size > len(names) else []  # --examples shows some, and says so
        rows.append((str(s), str(size), ", ".join(names + more), super_classes.names[s]))
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    lines = [f"{r[0]:>{widths[0]}}  {r[1]:>{widths[1]}}  {r[2]:<{widths[2]}}  {r[3]}".rstrip() for r in rows]
    header = (
        f"{super_classes.num_classes} classes -> {super_classes.num_super_classes} super-classes "
        f"({super_classes.method}; {super_classes.source})"
    )
    lines.insert(0, header)
    measured = super_classes.quality or {}
    if "within_confusion_share" in measured:
        lines.append(
            f"confusion inside super-classes: {_share(measured.get('within_confusion_share'))} "
            f"(chance {_share(measured.get('chance_share'))}{_plus_minus(measured.get('chance_share_std'))}); "
            f"sizes {measured.get('size_min', '?')}-{measured.get('size_max', '?')}, "
            f"balance {_share(measured.get('balance'), '.2f')}"
        )
    stable = measured.get("stability")
    if stable:
        lines.append(
            f"stability over {stable['resamples']} bootstrap resamples of the validation images: adjusted Rand index "
            f"{stable['mean_ari']:.2f} on average (min {stable['min_ari']:.2f}, max {stable['max_ari']:.2f}; 1: the "
            "same grouping every time, 0: no more alike than chance)"
        )
    lines += [caution for caution in (chance_caution(measured), evidence_caution(measured)) if caution]
    missing = measured.get("classes_without_images") or []
    if missing:
        lines.append(f"classes without validation images (placed by their column): {_names(super_classes, missing)}")
    return "\n".join(lines)


def _plus_minus(spread: float | None) -> str:
    return "" if spread is None else f" ± {spread:.1%}"


def chance_caution(measured: dict) -> str | None:
    """A caution when the super-classes gather no more of the dense model's confusion than random ones of the same
    sizes would (within 10%, or within two of chance's standard deviations where the file has it): then they carry
    no grouping the router could learn from (too few errors, or errors spread evenly)."""
    within, chance = measured.get("within_confusion_share"), measured.get("chance_share")
    if within is None or chance is None:
        return None
    if within > max(CHANCE_MARGIN * chance, chance + 2 * (measured.get("chance_share_std") or 0.0)):
        return None
    where = "below" if within < chance else "at about"
    return (
        f"caution: {where} chance: these super-classes hold no more of the confusion than random ones of the same "
        "sizes, so routing by them is routing by random super-classes; derive them from a better-trained dense model "
        "or more validation images"
    )


FEW_CONFUSIONS = 20  # images' worth of off-diagonal confusion below which a grouping's share is mostly luck


def evidence_caution(measured: dict) -> str | None:
    """A caution when the grouping rests on few confusions (hard counts on a small validation set: 3 mistakes make
    a 100% share) or the chance level itself is that noisy on this matrix."""
    mass, spread = measured.get("confusion_mass"), measured.get("chance_share_std")
    few = mass is not None and mass < FEW_CONFUSIONS
    if not few and not (spread is not None and spread > 0.1):
        return None
    evidence = f"{mass:.4g} images' worth of confusion" if mass is not None else "a noisy confusion matrix"
    varies = f" (chance alone varies by ±{spread:.1%})" if spread is not None else ""
    return (
        f"caution: these figures rest on {evidence}{varies}: too few to tell a grouping from luck; derive on more "
        "validation images (or soft counts, without --hard) and check how stable the grouping is with --stability 10"
    )


def _names(super_classes: SuperClasses, classes: list[int], limit: int = 10) -> str:
    text = ", ".join(super_classes.class_names[c] for c in classes[:limit])
    return text + (f" and {len(classes) - limit} more" if len(classes) > limit else "")


def _share(value: float | None, spec: str = ".1%") -> str:
    """A quality number as text; "n/a" where the file holds null (undefined, e.g. no off-diagonal confusion)."""
    return "n/a" if value is None else format(value, spec)
