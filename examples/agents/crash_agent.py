"""An agent that crashes: writes a traceback-like line to stderr and exits with code 3."""

from __future__ import annotations

import sys


def main() -> int:
    """Fail the way a buggy harness does."""
    print("starting", flush=True)
    print("ValueError: the tool returned nothing", file=sys.stderr)
    return 3


if __name__ == "__main__":
    sys.exit(main())
