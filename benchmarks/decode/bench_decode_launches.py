"""The kernel launches of benchmarks/decode/bench_decode.py: a variant's spec (``--variants``, ``--table-variant``)
parsed into its settings, the settings turned into decode_attention's keyword arguments, and the launch each method's
table runs."""

from __future__ import annotations

from loopvq_calib.serving import decode_attention as da


def parse_variant(spec: str) -> dict:
    """``cuda-WxUxL[xR]`` (warps per block x tokens per lane group and step x lanes per token x most batch rows per
    pass, default 1; a trailing ``f``: the key table in float32) or ``triton-NxWxPxS`` (block_n x num_warps x
    programs per multiprocessor x sequences per program) -> the launch's settings (:func:`attention_arguments` turns
    them into decode_attention's keyword arguments)."""
    backend, shape = spec.split("-")
    nums = [int(x) for x in shape.rstrip("f").split("x")]
    if backend == "cuda":
        return {
            "backend": "cuda",
            "warps": nums[0],
            "tokens_per_iteration": nums[1],
            "lanes_per_token": nums[2],
            "rows_per_pass": nums[3] if len(nums) > 3 else 1,
            "key_float32": shape.endswith("f") or None,
        }
    return {
        "backend": "triton",
        "block_n": nums[0],
        "num_warps": nums[1],
        "programs_per_sm": nums[2],
        "batch_per_program": nums[3],
    }


def attention_arguments(launch: dict) -> dict:
    """decode_attention's keyword arguments for a launch of :func:`parse_variant` (or ``{"backend": "auto"}``)."""
    settings = {k: v for k, v in launch.items() if k != "backend"}
    if launch["backend"] == "cuda":
        return {"backend": "cuda", "cuda": da.CudaDecodeLaunch(**settings)}
    if launch["backend"] == "triton":
        return {"backend": "triton", "triton": da.TritonDecodeLaunch(**settings)}
    return {"backend": launch["backend"]}


def table_launch(table_variant: str, methods: list[str], launches: list[dict]) -> dict[str, dict]:
    """Per method, the launch the table runs (``--table-variant``): decode_attention's defaults, the fastest of the
    variants run, or the variant given."""
    launch = {m: {"backend": "auto"} for m in methods}  # the table: what a caller gets by default
    if table_variant == "best" and launches:
        for m in methods:
            runs = [r for r in launches if r["method"] == m]
            launch[m] = parse_variant(min(runs, key=lambda r: r["coded_ms"])["variant"]) if runs else launch[m]
    elif table_variant != "auto":
        launch = {m: parse_variant(table_variant) for m in methods}
    return launch
