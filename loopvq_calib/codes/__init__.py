"""Codes as tensor math: code-group layouts, the block codec (encode, decode, TaSQ transform), index
packing, a model's quantizer, uncalibrated baselines and the KL objective they are judged by. No files, no
stages, no serving.
"""
