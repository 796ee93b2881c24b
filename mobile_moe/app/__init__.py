"""The entry points above every stage: the `mobile-moe` command's dispatch (cli.py) and the end-to-end demo (demo.py).
Installed as mobile_moe.app; `python -m mobile_moe` runs the command."""
