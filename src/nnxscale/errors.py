"""Every error nnxscale raises for input it cannot use derives from :class:`NnxscaleError`.

The message says what was wrong (the offending name and numbers) and what to do. The CLI
prints such an error as one line and exits with code 2; any other exception is a bug in
nnxscale or below it, and the CLI lets its traceback show.

Each class also derives from the built-in exception a Python caller would expect
(``ValueError`` for bad values, ``FileNotFoundError`` for a missing file), so
``except ValueError`` keeps working.
"""

from __future__ import annotations


class NnxscaleError(Exception):
    """Base class of nnxscale's user-facing errors."""


class MeshError(NnxscaleError, ValueError):
    """A mesh spec that cannot be built on the devices that exist."""


class LayoutError(NnxscaleError, ValueError):
    """A PartitionSpec that cannot lay out a tensor on a mesh."""


class RulesError(NnxscaleError, ValueError):
    """A rules preset or rules spec that cannot be used."""


class ConfigError(NnxscaleError, ValueError):
    """A configuration that cannot be run, or that conflicts with the run directory."""


class ModelError(NnxscaleError, ValueError):
    """A model config, preset or weights file that does not describe a usable model."""


class ModelFileNotFoundError(ModelError, FileNotFoundError):
    """A model directory or one of its files does not exist."""


class DataError(NnxscaleError, ValueError):
    """A data source, split or batch layout that cannot be used."""


class CheckpointError(NnxscaleError, RuntimeError):
    """A checkpoint that cannot be saved or restored as asked; the message says what to do."""


class JobError(NnxscaleError, ValueError):
    """A multi-process job that cannot be joined or launched as asked (flags, ports, processes)."""
