"""mobile_moe/export/: split a model into router and expert graphs, lower them (ExecuTorch, ONNX, Core ML), write a
bundle, and run bundles with a runtime that loads only the experts an image needs.

Entry points: `mobile_moe.export.bundle.export_bundle` (Python, from a model object),
`mobile_moe.export.runtime.load_bundle` (run a bundle), `mobile-moe export` / `mobile-moe predict` (CLI). Heavy
backends are imported only when used.
"""

from mobile_moe.export.quiet import quiet_third_party_loggers

quiet_third_party_loggers()
