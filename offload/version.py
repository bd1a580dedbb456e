"""The package version (its own module so any part of Offload can read it without importing the rest)."""

__version__ = "0.1.0"
