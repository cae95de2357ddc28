"""Triton and CUDA kernels (k-means, nearest codeword, codeword lookup, decode attention) behind one
availability check and one dispatch rule (``backends``). Kernels take tensors and launch settings; they know
no stage, no codec and no cache.
"""
