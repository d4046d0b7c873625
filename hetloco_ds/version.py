"""The package version, in a module of its own: what records it (hf_export's provenance) imports
it without importing the package's entry points."""
__version__ = "0.2.0"
