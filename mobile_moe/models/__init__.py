"""The models: the ViT (vit.py), the MoE layer and its routers (moe.py, routers.py), the Mobile V-MoE
(mobile_vmoe.py), the reference MoEs (token_moe.py: V-MoE, Experts Choice, Soft MoE; hard_moe.py; widenet.py), their
configs (config.py) and registry (registry.py: `create_model`), costs (costs.py), checkpoints (checkpoint.py) and
upcycling (upcycle.py); the model flags (cli_args.py) and `mobile-moe info` (info_cli.py)."""
