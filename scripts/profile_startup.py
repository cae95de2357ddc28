"""Where the real command's time before its first stage goes: the checks and set-up of ``Pipeline(...)``
(``loopvq-calibrate`` does exactly this before the data stage), step by step, then the one-time Triton
compilation the k-means stage would pay for the run's codebook shape. One JSON line; run it under
``python -X importtime`` for the imports (docs/performance.md).

    python -X importtime scripts/profile_startup.py --config configs/ouro-1.4b.yaml \
        --set model.name_or_path=/tmp/ouro-1.4b-random --set data.dataset=artifacts/data/shakespeare-calib.jsonl \
        2> importtime.txt
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time

START = time.perf_counter()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True)
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY.PATH=VALUE")
    args = p.parse_args()
    from loopvq_calib.cli import _quiet_libraries

    _quiet_libraries()
    from loopvq_calib.calibration.pipeline import Pipeline
    from loopvq_calib.config.load import load_config

    imports = time.perf_counter() - START
    cfg = load_config(args.config, args.overrides)
    with tempfile.TemporaryDirectory() as out:
        pipeline = Pipeline(cfg, f"{out}/run")
    line = {"imports_s": round(imports, 3), **pipeline.startup, "store": pipeline.store.store if pipeline.store else None}
    line.pop("entered_at", None)
    import torch

    if pipeline.kmeans_device.type == "cuda":
        from loopvq_calib.kernels import kmeans as kmeans_triton

        k, g = cfg.quant.codebook_size, cfg.quant.group_size
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(2, 32640, g, generator=gen).to(pipeline.kmeans_device)
        w = torch.rand(2, 32640, generator=gen).to(pipeline.kmeans_device)
        uniforms = torch.rand(k, 2, generator=gen, dtype=torch.float64).to(pipeline.kmeans_device)
        for name, fn in (("compile_kmeans_pp_s", lambda: kmeans_triton.kmeans_pp(x, w, k, uniforms=uniforms)),
                         ("compile_lloyd_s", lambda: kmeans_triton.lloyd_step(
                             x, w, x[:, :k].contiguous(), rows=torch.arange(2, device=x.device), accumulate=True))):
            for attempt in ("", "_again"):
                torch.cuda.synchronize()
                t = time.perf_counter()
                fn()
                torch.cuda.synchronize()
                line[name + attempt] = round(time.perf_counter() - t, 3)
    line["device"] = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    line["total_s"] = round(time.perf_counter() - START, 3)
    print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
