"""memfit's exception types. Every message says what is wrong and what to do about it."""


class MemfitError(Exception):
    """Base class of every error memfit raises on purpose."""


class NativeBuildError(MemfitError):
    """A native extension could not be built (usually: no C++ compiler, or no ninja)."""


class TraceFormatError(MemfitError, ValueError):
    """A trace file or trace arrays are malformed."""
