"""The TaSQ stage: query statistics gathered at capture time, channel weights, the sigma rule and the
RoPE-pair-preserving grouping of key coordinates (docs/tasq.md).
"""
