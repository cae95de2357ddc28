"""Per-site, teacher-forced check of a served quantized cache (benchmarks/decode/bench_decode_model.py): the model
decodes through :class:`SiteCheckCache`, which holds the served cache and a reference cache (``backend="torch"``)
filled identically. At every KV site's decode call it runs the served cache's ``attend`` (the kernel, or when that
declines, the served cache's ``update`` and SDPA) and the reference computation (the reference cache's ``update``,
then :func:`~loopvq_calib.models.common.sdpa`, as the models' ``attend`` does), records the relative L2 error of the
served output against the reference one, and returns the reference output: every site sees the inputs of the reference
trajectory, so each error is that site's own, not amplified by earlier sites."""

from __future__ import annotations

import statistics
from typing import Any

import torch

from loopvq_calib.models.common import sdpa


class SiteCheckCache:
    """Decode through ``reference``, comparing ``served`` at every site; other cache methods are the reference
    cache's. Decode steps only (one token per forward): a longer forward's ``update`` reaches the reference alone."""

    def __init__(self, served: Any, reference: Any) -> None:
        self.served, self.reference = served, reference
        self.sites: list[int] = []
        self._errors: list[torch.Tensor] = []  # 0-d, on the device (read once at the end)

    def attend(self, site: int, q: torch.Tensor, *, key: torch.Tensor, value: torch.Tensor, ctx: Any) -> torch.Tensor:
        """The reference cache's attention output for this decode call, after recording the served one's error."""
        got = self.served.attend(site, q, key=key, value=value, ctx=ctx)
        if got is None:  # the served cache's reference path serves this call
            got = sdpa(q, *self.served.update(site, key, value, positions=ctx.positions, rope=ctx.rope), mask=ctx.mask)
        want = sdpa(q, *self.reference.update(site, key, value, positions=ctx.positions, rope=ctx.rope), mask=ctx.mask)
        self.sites.append(site)
        self._errors.append((got.float() - want.float()).norm() / want.float().norm())
        return want

    def __getattr__(self, name: str) -> Any:
        return getattr(self.reference, name)

    def relative_errors(self) -> list[float]:
        """The served-vs-reference relative error of each ``attend`` call so far, in call order (``self.sites``)."""
        return torch.stack(self._errors).tolist() if self._errors else []

    def summary(self) -> dict[str, Any]:
        """max / median / per-call list of the relative errors and the path that served (kernel or reference)."""
        errors = self.relative_errors()
        return {
            "site_served_path": "kernel" if self.served.served_by_kernel else "reference",
            "site_relative_error_max": max(errors),
            "site_relative_error_median": statistics.median(errors),
            "site_relative_errors": errors,
        }
