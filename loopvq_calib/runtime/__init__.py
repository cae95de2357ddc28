"""Runtime plumbing: the run's processes, CUDA streams and host memory, atomic files, clocks and the
background device warm-up. Knows nothing of models, codes or stages; every other package may use it.
"""
