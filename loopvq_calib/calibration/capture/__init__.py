"""The capture stage: pre-RoPE keys and values at every KV site with their empirical Fisher, and
where the capture is kept (accelerator, host memory or disk).
"""
