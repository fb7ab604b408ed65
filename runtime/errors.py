"""The one exception hierarchy of cuteaot.

Every error a user can cause derives from :class:`CuteAotError`, so a serving
engine can catch one type.  Messages say what was expected, what was given and
how to fix it.
"""

from __future__ import annotations


class CuteAotError(Exception):
    """Base of every error cuteaot raises on purpose."""


class SpecError(CuteAotError, ValueError):
    """A YAML spec is malformed; the message names file, line and field."""

    def __init__(self, file: str, line: int | None, field: str, message: str):
        self.file = file
        self.line = line
        self.field = field
        where = f"{file}:{line}" if line is not None else file
        super().__init__(f"{where}: {field}: {message}")


class BuildError(CuteAotError, RuntimeError):
    """Compiling or assembling a bundle failed."""


class AbiMismatchError(BuildError):
    """The PTX `.entry` of a compiled kernel disagrees with its declared signature."""


class BundleError(CuteAotError, RuntimeError):
    """A bundle cannot be used as it is."""


class BundleNotFoundError(BundleError, FileNotFoundError):
    """The path given as a bundle holds no manifest.json (missing, a file, or a build's output root)."""


class SchemaMismatchError(BundleError):
    """The manifest's schema version (or structure) is not the one this runtime reads."""


class IntegrityError(BundleError):
    """A cubin is missing, truncated or differs from the checksum in the manifest."""


class ArchNotInBundleError(BundleError):
    """The bundle holds no kernels for the live GPU's architecture / device profile."""


class NoDeviceError(BundleError):
    """No CUDA device is visible, so a bundle cannot be loaded for launching."""


class UnknownSpecializationError(CuteAotError, LookupError):
    """A call asks for a specialization the bundle does not contain (frozen resolution)."""


class BadInputError(CuteAotError, ValueError):
    """A tensor or scalar argument is invalid (dtype, shape, device, layout, range)."""


class LaunchError(CuteAotError, RuntimeError):
    """The CUDA driver refused a load or a launch."""


class CaptureError(CuteAotError, RuntimeError):
    """Something that must happen before CUDA-graph capture (allocating a workspace) was asked for during it."""


class LaunchArgumentError(CuteAotError, TypeError):
    """A kernel launch passed argument names other than the kernel's declared parameters."""
