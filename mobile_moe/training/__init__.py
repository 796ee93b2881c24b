"""mobile_moe/training/: recipes, the router loss, train/evaluate loops, DDP, run directories (data: mobile_moe/data/).

Entry points: `mobile_moe.training.train.train` (Python), `mobile-moe train` / `mobile-moe evaluate` (CLI),
`mobile_moe.training.run_dir.load_run` (read a finished run).
"""
