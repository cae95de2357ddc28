"""The toolkit's version: the one place it is written (pyproject reads it, stage fingerprints and bundles record
it). A module of its own so that every layer can import it without importing the package's public face."""

__version__ = "0.1.0"
