"""The k-means stage: Fisher-weighted codebooks per layout, solved by batched weighted k-means
(torch, the fused Triton kernels or faiss).
"""
