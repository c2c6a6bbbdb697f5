"""The package version (bumped with `hatch version`)."""

__version__ = "0.1.0"
