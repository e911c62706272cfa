"""`python -m fastpo ...`: the `fastpo` command (fastpo.cli), also what `torchrun -m fastpo`
runs in each process (`fastpo.cli.entry`)."""
from fastpo.cli import entry

if __name__ == "__main__":
    entry()
