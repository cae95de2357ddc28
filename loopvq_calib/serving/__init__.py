"""Serving: the quantized KV cache (:class:`~loopvq_calib.serving.cache.QuantizedLoopKVCache`) that
``generate()`` uses, and decode attention straight from its coded pages.
"""
