"""`python -m mobile_moe ARGS` as one rank of a process group (torchrun's variables set by the caller), saying on
stderr how many DDP modules are alive when the process group is destroyed: a DDP module alive then keeps its Reducer,
which destroys the gloo group later, holding the GIL, and can deadlock (distributed.process_group). With
--interrupt-after-epoch N first, epoch N+1 is stopped as Ctrl-C stops it (KeyboardInterrupt).

    WORLD_SIZE=2 RANK=R LOCAL_RANK=R MASTER_ADDR=127.0.0.1 MASTER_PORT=PORT \\
        python tests/training/ddp_teardown.py [--interrupt-after-epoch N] train ...
"""

from __future__ import annotations

import gc
import os
import sys

import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from mobile_moe.app import cli
from mobile_moe.training import train

_destroy = dist.destroy_process_group


def destroy_process_group(*args, **kwargs):
    alive = sum(isinstance(thing, DistributedDataParallel) for thing in gc.get_objects())
    print(f"rank {os.environ['RANK']}: DDP modules alive at destroy_process_group: {alive}", file=sys.stderr)
    return _destroy(*args, **kwargs)


def interrupting(epochs: int):
    run_epoch = train._epoch

    def epoch(session, index):
        if index >= epochs:
            raise KeyboardInterrupt
        return run_epoch(session, index)

    return epoch


if __name__ == "__main__":
    dist.destroy_process_group = destroy_process_group
    argv = sys.argv[1:]
    if argv[0] == "--interrupt-after-epoch":
        train._epoch = interrupting(int(argv[1]))
        argv = argv[2:]
    sys.argv = ["mobile-moe", *argv]
    cli.main()
