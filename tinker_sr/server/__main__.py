"""``python -m tinker_sr.server``: same as ``tinker-sr serve``."""

from __future__ import annotations

import sys

from tinker_sr.cli import main

if __name__ == "__main__":
    sys.exit(main(["serve", *sys.argv[1:]]))
