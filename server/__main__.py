"""`python -m server [...]` is `conveyor serve [...]`."""

from __future__ import annotations

import sys

from server.cli import main

if __name__ == "__main__":
    sys.exit(main(["serve", *sys.argv[1:]]))
