"""mobile-moe: per-image sparse Mixture-of-Experts Vision Transformers (Mobile V-MoEs), trained and split for phones.

One installed namespace. The ground floor: this package's own modules (errors, preprocess) and
`mobile_moe.models` (the models, configs, registry, costs, checkpoints), `mobile_moe.utils`, `mobile_moe.formats`
(super-class and confusion files) and `mobile_moe.importers` (timm, torchvision). The stages above it, each importing
only those below it (tests/test_layering.py):

- `mobile_moe.data`: data specs and readers, the image decoder, augmentation, the packed store;
- `mobile_moe.training`: recipes, losses, the train/evaluate loops, DDP, run directories;
- `mobile_moe.super_class`: super-classes from a dense run's confusion graph;
- `mobile_moe.library`: libmobile_moe (the C library an app links), its options, its Python binding, build and SDK;
- `mobile_moe.export`: router + per-expert graphs (ExecuTorch, ONNX, Core ML), bundles, predict;
- `mobile_moe.device_bench`: latency and memory on the host, ARM64 under qemu and phones;
- `mobile_moe.evidence`: `mobile-moe reproduce` for the paper's figures;
- `mobile_moe.app`: the command's dispatch and the demo.

Nothing is imported here, so `import mobile_moe.models.registry` stays as cheap as the module it names.
"""
