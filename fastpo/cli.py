"""The `fastpo` command line."""
from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="fastpo", description="Multi-turn RL for LLM agents (StarPO / StarPO-S)")
    ap.add_subparsers(dest="command", required=True)
    ap.parse_args(argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
