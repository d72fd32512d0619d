"""The `geotrain` command line: `main` is the console script's entry point."""

from ._logging import configure_logging as configure_logging
from ._main import build_parser as build_parser
from ._main import main as main
