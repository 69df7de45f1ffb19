"""The `llmgw` command line: `app` holds the global options, the command registry and
how failures look; each other module here is one command group (`register(commands)`).

Nothing below the command line imports this package: services, core and schemas know
nothing of it. The names re-exported here are what tests and embedding scripts call.
"""

from services.cli.app import (
    CliError,
    UsageError,
    build_parser,
    data_dir,
    main,
    parse_time,
    resolve_broker,
    root,
)

__all__ = [
    "CliError",
    "UsageError",
    "build_parser",
    "data_dir",
    "main",
    "parse_time",
    "resolve_broker",
    "root",
]
