"""mobile-moe: per-image sparse Mixture-of-Experts Vision Transformers (Mobile V-MoEs), trained and split for phones.

One installed namespace. This package is the ground floor (models, routers, costs, checkpoints); the stages above it
live in subpackages installed from the repository's top-level folders of the same name:

- `mobile_moe.super_class`: super-classes from a dense model's confusion graph;
- `mobile_moe.training`: data specs, recipes, train/evaluate loops, run directories;
- `mobile_moe.export`: router + per-expert graphs (ExecuTorch, ONNX, Core ML), bundles and their runtime;
- `mobile_moe.device_bench`: latency and memory on the host, ARM64 under qemu and phones;
- `mobile_moe.evidence`: `mobile-moe reproduce` for the paper's figures.

Nothing is imported here, so `import mobile_moe.registry` stays as cheap as the module it names.
"""
