"""`mobile-moe import`: a dense run directory from a local timm or torchvision ViT checkpoint
(mobile_moe/training/imported.py).

mobile-moe import timm:deit_tiny_patch16_224 --weights deit_tiny.safetensors --out runs/deit-ti
mobile-moe import torchvision:vit_b_32 --weights vit_b_32.pth --class-names data/val --out runs/vit-b32
"""

from __future__ import annotations

import argparse
import json


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", metavar="LIBRARY:NAME", help="timm:NAME (a timm ViT or DeiT) or torchvision:vit_*")
    parser.add_argument(
        "--weights", required=True, metavar="FILE", help="the checkpoint (.safetensors, or torch.save'd .pth/.bin)"
    )
    parser.add_argument("--out", required=True, metavar="RUN_DIR", help="a new run directory")
    parser.add_argument(
        "--class-names",
        metavar="FILE|DIR",
        help="names of the model's classes in output order: a text file (one per line), a JSON list, or an image "
        "folder whose class folders name them (default for 1000 classes: ImageNet-1k's WordNet ids)",
    )
    parser.add_argument("--json", action="store_true", help="print the source record as one JSON object")


def run(args: argparse.Namespace) -> None:
    # torch loads only when the command runs, so `--help` stays fast
    from mobile_moe.training.imported import import_run

    record = import_run(args.model, args.weights, args.out, args.class_names)
    if args.json:
        print(json.dumps({"run": str(args.out), **record}))
        return
    difference = record["max_abs_logit_difference"]
    logits = "the source's logits exactly" if difference == 0 else f"logits within {difference:.2g} of the source's"
    print(f"{record['model']} -> {args.out} (weights sha256 {record['sha256'][:12]}..., {logits})")
