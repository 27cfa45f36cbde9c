"""The ``nnxscale`` command line: flags generated from the config dataclasses, each command a
call into the library. Imports nothing from jax at import time (the number of simulated CPU
devices must reach XLA first).
"""

from nnxscale.cli.commands import build_parser, main, run

__all__ = ["build_parser", "main", "run"]
