"""The measurement drivers and the generators of the results pages, by topic (benchmarks/README.md); not part of
the package."""
