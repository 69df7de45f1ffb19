"""`python -m services.cli ARGS` is `llmgw ARGS`, for machines without the console script."""

from services.cli.app import main

if __name__ == "__main__":
    raise SystemExit(main())
