"""Configuration: the one config tree of ``loopvq-calibrate`` (``schema``), read from YAML and ``--set``
overrides (``source``, ``load``) and checked in one place (``validate``), and the registry of quantization methods
that the config names (``methods``). Imports nothing else of the toolkit.
"""
