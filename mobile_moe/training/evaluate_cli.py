"""`mobile-moe evaluate RUN_DIR --data SPEC [--split val|test] [--json] [--confusion FILE.npy|.csv]`."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from mobile_moe.errors import UsageError
from mobile_moe.utils.atomic import check_not_an_input, check_writable
from mobile_moe.utils.devices import DEVICES, resolve_device


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", metavar="RUN_DIR", help="a training run directory")
    parser.add_argument("--data", help="data spec (default: the run's own); classes must match the run's")
    parser.add_argument("--split", choices=["train", "val", "test"], default="test", help="(default test)")
    parser.add_argument("--checkpoint", choices=["best", "last"], default="best", help="best.pt or checkpoint.pt")
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--device", choices=DEVICES, default="cpu")
    parser.add_argument(
        "--confusion",
        metavar="FILE.npy|.csv",
        help="also save the (C, C) confusion counts (row = truth); a .csv starts with a row of class names",
    )
    parser.add_argument("--json", action="store_true", help="print exactly one JSON object")


def run(args: argparse.Namespace) -> None:
    # numpy and torch load only when the command runs, so `mobile-moe evaluate --help` stays fast
    import numpy as np

    from mobile_moe.formats.confusion import check_confusion_output, confusion_from_predictions, save_confusion
    from mobile_moe.training.evaluate import collect_predictions, evaluate
    from mobile_moe.training.run_dir import load_run

    if args.batch_size < 1:
        raise UsageError(f"--batch-size {args.batch_size}: must be at least 1")
    if args.confusion:  # before any work, not after it; never over a file of the run it reads, or not ours
        check_writable(args.confusion)
        run_files = Path(args.run_dir).iterdir() if Path(args.run_dir).is_dir() else []
        check_not_an_input(args.confusion, run_files, "--confusion")
        check_confusion_output(args.confusion, "--confusion")
    loaded = load_run(args.run_dir, args.checkpoint)
    data = loaded.open_data(args.data)  # refuses data with other classes than the run's
    device = resolve_device(args.device)
    model = loaded.model.to(device)
    dataset = data.split(args.split)
    scores = evaluate(model, dataset, loaded.super_assignment, args.batch_size, device)
    result = {"run": str(loaded.run_dir), "data": data.spec, "split": args.split, **scores}
    if args.confusion:
        probs, labels = collect_predictions(model, dataset, args.batch_size, device)
        counts = confusion_from_predictions(probs, labels, hard=True).astype(np.int64)
        save_confusion(args.confusion, counts, list(data.class_names))
        result["confusion"] = str(args.confusion)
    if args.json:
        print(json.dumps(result))
        return
    print(f"{loaded.run_dir} on {data.spec} [{args.split}], {scores['images']} images")
    print(f"  top-1 {100 * scores['top1']:.2f}%   top-5 {100 * scores['top5']:.2f}%")
    if scores["router_accuracy"] is not None:
        print(f"  router accuracy (vs super-classes) {100 * scores['router_accuracy']:.2f}%")
    if "expert_load" in scores:
        print(
            f"  expert MLPs run per image (one per chosen expert and MoE block, summed over the blocks): mean "
            f"{scores['experts_per_image_mean']:.2f}, "
            f"max {scores['experts_per_image_max']}; token assignments dropped {100 * scores['dropped']:.2f}%"
        )
        for e, (load, acc) in enumerate(zip(scores["expert_load"], scores["expert_accuracy"], strict=True)):
            acc_text = "   -  " if acc is None else f"{100 * acc:5.1f}%"
            print(f"  expert {e}: load {100 * load:5.1f}%  top-1 {acc_text}")
    if args.confusion:
        print(f"  confusion counts -> {args.confusion}")
