"""`python -m services.gateway [FLAGS]`: the gateway alone, as `llmgw gateway FLAGS`."""

from __future__ import annotations

import sys

from services.cli.app import main

if __name__ == "__main__":
    sys.exit(main(["gateway", *sys.argv[1:]]))
