"""The paper's analyses on the shipped reference model: the runs and their evaluation (reproduce.py), then
docs/quality.md (reproduce_report.py, with the study's tables of reproduce_tables.py and the served-cache table of
quality_served.py) and its figures (reproduce_figures.py)."""
