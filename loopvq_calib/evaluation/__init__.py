"""Evaluation: :func:`~loopvq_calib.evaluation.evaluate.evaluate` measures bundles against full precision (KL and
perplexity on held-out text, ``evaluate``), checks its inputs first (``inputs``, settings in ``options``), serves
the model through the quantized cache for task accuracy, passkey retrieval and bytes per token (``served``,
``passkey``; lm-evaluation-harness, the optional ``eval`` extra, only in ``harness``) and renders the
``loopvq-eval`` report (``report``); ``kv_structure`` measures the KV cache's correlation across loop steps.
"""
