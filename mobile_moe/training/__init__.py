"""mobile_moe/training/: datasets and data specs, recipes, the router loss, train/evaluate loops, DDP, run directories.

Entry points: `mobile_moe.training.train.train` (Python), `mobile-moe train` / `mobile-moe evaluate` (CLI),
`mobile_moe.training.run_dir.load_run` (read a finished run), `mobile_moe.training.data.open_data` (data specs).
"""
