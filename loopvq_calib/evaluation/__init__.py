"""Evaluation: KL and perplexity against full precision, task accuracy and passkey retrieval through
the served cache (lm-eval), and the ``loopvq-eval`` report.
"""
