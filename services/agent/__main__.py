"""`python -m services.agent ARGS` is `llmgw agent ARGS`: for hosts and tests that run an
agent as its own process without the console script."""

import sys

from services.cli import app as cli


def main() -> None:
    sys.exit(cli.main(["agent", *sys.argv[1:]]))


if __name__ == "__main__":
    main()
