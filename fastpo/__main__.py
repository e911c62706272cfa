"""`python -m fastpo ...`: the `fastpo` command (fastpo.cli), also what `torchrun -m fastpo`
runs in each process. Under torchrun the entry point is wrapped in torch.distributed.elastic's
`record`, so that a failing rank's exception reaches torchrun's error summary."""
import os
import sys

from fastpo.cli import main

if __name__ == "__main__":
    if "WORLD_SIZE" in os.environ:  # started by torchrun
        from torch.distributed.elastic.multiprocessing.errors import record

        main = record(main)
    sys.exit(main())
