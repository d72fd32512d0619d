"""The `geotrain` command line: `console` is the console script's entry point (`main`, which
tests call in-process, and what the process's exit needs)."""

from ._local import launched_config as launched_config
from ._logging import configure_logging as configure_logging
from ._main import build_parser as build_parser
from ._main import console as console
from ._main import main as main
