"""training/: datasets and data specs, recipes, the router loss, train/evaluate loops, DDP, run directories.

Entry points: `training.train.train` (Python), `mobile-moe train` / `mobile-moe evaluate` (CLI),
`training.run.load_run` (read a finished run), `training.data.open_data` (data specs).
"""
