"""`python -m mobile_moe ...` (and `torchrun ... -m mobile_moe train ...`): the `mobile-moe` command."""

import sys

from mobile_moe.app.cli import main

sys.exit(main())
