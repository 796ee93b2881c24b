"""`mobile-moe predict BUNDLE_DIR IMAGE... [--json]`: classify image files with a bundle's graphs."""

from __future__ import annotations

import argparse

from mobile_moe.errors import UsageError
from mobile_moe.export.manifest_schema import SPLIT_LAYOUTS
from mobile_moe.library.options import OPTION, OPTIONS, changed, from_args
from mobile_moe.utils import jsonio
from mobile_moe.utils.words import escaped


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("bundle", metavar="BUNDLE_DIR", help="a directory written by `mobile-moe export`")
    parser.add_argument("images", metavar="IMAGE", nargs="+", help="PNG or JPEG files")
    for option in OPTIONS:  # libmobile_moe's options, as mm_options names, encodes and defaults them
        option.add_flag(parser)
    parser.add_argument("--json", action="store_true", help="print one JSON list, one object per image")
    parser.add_argument(
        "--top-k", type=int, default=5, help="classes listed per image, most probable first (default 5)"
    )
    parser.add_argument("--logits", action="store_true", help="--json: add every class's logit")


def classify(bundle, path: str, image, top_k: int = 5, logits: bool = False) -> dict:
    """The predict record (docs/formats.md, "predict --json") for one image as the bundle's read_image gave it: its
    `top_k` classes, and every logit with `logits`."""
    prediction = bundle.predict(image)
    probs, ranked = prediction.probabilities(), prediction.top_classes(top_k)
    names = bundle.manifest.class_names
    record = {
        "image": path,
        "class_index": ranked[0],
        "class": names[ranked[0]],
        "probability": float(probs[ranked[0]]),
        "top": [{"class_index": i, "class": names[i], "probability": float(probs[i])} for i in ranked],
        "experts": prediction.experts,
        "gates": prediction.gates,
    }
    if logits:
        record["logits"] = [float(v) for v in prediction.logits]
    return record


def run(args: argparse.Namespace) -> int:
    # torch and the runtimes only once the command runs: `mobile-moe predict --help` stays instant
    from mobile_moe.export.runtime import load_bundle

    options = from_args(args)
    bundle = load_bundle(args.bundle, **options)
    routing = [name for name in changed(options) if name in ("cache_experts", "cache_margin")]
    if bundle.layout not in SPLIT_LAYOUTS and routing:
        raise UsageError(
            f"{OPTION[routing[0]].flag} chooses among expert graphs loaded one by one; {args.bundle} is a "
            f"{bundle.layout} bundle (its experts, if any, sit in one graph): leave it out, or export the MoE split "
            "(the default layout)"
        )
    if args.top_k < 1:
        raise UsageError(f"--top-k {args.top_k}: list at least 1 class")
    if args.logits and not args.json:
        raise UsageError("--logits adds every class's logit to --json's records: add --json")
    # Read every image first: a bad file fails the command before any output.
    images = [bundle.read_image(path) for path in args.images]
    results = [classify(bundle, path, image, args.top_k, args.logits)
               for path, image in zip(args.images, images, strict=True)]  # fmt: skip
    if args.json:
        print(jsonio.dumps(results))  # a NaN probability (a broken model) is written as null, never as NaN
        return 0
    for result in results:
        experts = ", ".join(f"{e} (gate {g:.2f})" for e, g in zip(result["experts"], result["gates"], strict=True))
        runners_up = ", ".join(f"{escaped(c['class'])} {c['probability']:.3f}" for c in result["top"][1:])
        print(
            f"{escaped(result['image'])}: {result['class']} (p={result['probability']:.3f})"
            + (f", experts {experts}" if experts else "")
            + (f"; then {runners_up}" if runners_up else "")
        )
    return 0
