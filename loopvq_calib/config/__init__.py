"""Configuration: the one config tree of ``loopvq-calibrate`` (``schema``), read from YAML and ``--set``
overrides (``source``, ``load``) and checked in one place (``validate``). Imports nothing else of the toolkit.
"""
