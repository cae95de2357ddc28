"""The loop-site interface every later stage uses (contract: docs/loop-sites.md).

A *KV site* is one (loop step, physical layer) pair that writes its own keys and values per token; its
``site`` id is the model's cache slot. :class:`KVLayout` lists them with the head geometry and RoPE
convention. Two hooks act on pre-RoPE keys and values during a forward: :class:`KVRecorder` observes them
(optionally with zero probes whose gradients are the empirical Fisher), :class:`KVSubstituter` replaces
them at chosen sites and positions.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn


@dataclass(frozen=True)
class KVSite:
    """One KV-writing call per token: ``stage`` is "loop" (looped), "prelude" or "coda" (Huginn only)."""

    site: int
    step: int  # loop step (0-based) for looped sites; 0 for prelude/coda
    layer: int  # physical layer index inside its stage
    looped: bool
    stage: str

    def block(self, steps_per_block: int) -> int:
        """Index of the block of ``steps_per_block`` consecutive loop steps holding this site (-1 if not looped)."""
        return self.step // steps_per_block if self.looped else -1


@dataclass(frozen=True)
class SiteBlock:
    """Sites coded together: the T_c steps of one loop block and layer, or one non-looped site."""

    name: str
    sites: tuple[KVSite, ...]  # ordered by loop step

    @property
    def steps(self) -> int:
        """Sites (loop steps) of the block."""
        return len(self.sites)


@dataclass(frozen=True)
class KVLayout:
    """All KV sites of a model at a given loop count, plus what a KV reader needs to know."""

    model_type: str
    sites: tuple[KVSite, ...]
    loop_steps: int
    kv_heads: int
    head_dim: int
    rope_style: str  # "half" or "interleaved"
    rope_theta: float

    @property
    def num_sites(self) -> int:
        """KV sites of the model at this loop count."""
        return len(self.sites)

    def to_dict(self) -> dict[str, Any]:
        """The one serialised form (capture meta, stage outputs, bundles); :meth:`from_dict` inverts it."""
        return {
            "model_type": self.model_type,
            "loop_steps": self.loop_steps,
            "kv_heads": self.kv_heads,
            "head_dim": self.head_dim,
            "rope_style": self.rope_style,
            "rope_theta": self.rope_theta,
            "sites": [dataclasses.asdict(s) for s in self.sites],
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> KVLayout:
        """The layout :meth:`to_dict` wrote."""
        sites = tuple(KVSite(**s) for s in d["sites"])
        return cls(
            d["model_type"], sites, d["loop_steps"], d["kv_heads"], d["head_dim"], d["rope_style"], d["rope_theta"]
        )

    def blocks(self, steps_per_block: int) -> list[SiteBlock]:
        """Group looped sites into blocks of ``steps_per_block`` steps per layer; others stay alone.

        ``steps_per_block = 1`` gives one block per site (channel-only layouts such as CQ).
        """
        if self.loop_steps % steps_per_block:
            raise ValueError(f"{self.loop_steps} loop steps cannot be split into blocks of {steps_per_block} steps")
        groups: dict[tuple, list[KVSite]] = {}
        for s in self.sites:
            key = ("loop", s.block(steps_per_block), s.layer) if s.looped else (s.stage, s.layer, s.site)
            groups.setdefault(key, []).append(s)
        out = []
        for key, sites in groups.items():
            sites.sort(key=lambda x: x.step)
            name = f"b{key[1]}.l{key[2]}" if key[0] == "loop" else f"{key[0]}.l{key[1]}"
            out.append(SiteBlock(name, tuple(sites)))
        return out


def kv_layout(model: nn.Module, num_steps: int | None = None) -> KVLayout:
    """The KV sites of a native looped model (Ouro or Huginn) at ``num_steps`` loops (default: config)."""
    if not hasattr(model, "kv_layout"):
        raise TypeError(f"{type(model).__name__} is not a native looped model (no kv_layout)")
    return model.kv_layout(num_steps)


@contextmanager
def _model_setting(model: nn.Module, name: str, value: object) -> Iterator[None]:
    """Set the model attribute ``name`` (a hook slot or switch) for the forwards inside the block."""
    previous = getattr(model, name)
    setattr(model, name, value)
    try:
        yield
    finally:
        setattr(model, name, previous)


def kv_hook(model: nn.Module, hook: Callable) -> AbstractContextManager[None]:
    """Install ``hook(site, key, value, positions) -> (key, value)`` for the forwards inside the block."""
    return _model_setting(model, "kv_hook", hook)


def query_observer(model: nn.Module, observer: Callable) -> AbstractContextManager[None]:
    """Call ``observer(site, pre-RoPE query [B, S, Hq, D], positions)`` at every attention inside the block."""
    return _model_setting(model, "query_observer", observer)


def loop_checkpointing(model: nn.Module, enabled: bool = True) -> AbstractContextManager[None]:
    """Activation checkpointing per loop step (recomputed in the backward pass) for the forwards inside the block."""
    return _model_setting(model, "loop_checkpointing", enabled)


class KVRecorder:
    """Observes pre-RoPE keys and values at every site (or ``sites``), [B, S, H_kv, D] each.

    With ``fisher=True`` a zero probe that requires grad is added to each key and value; after
    ``loss.backward()`` :meth:`fisher` returns the squared gradients (the empirical Fisher diagonal),
    with gradients having flowed through every later loop step.
    """

    def __init__(self, sites: Iterable[int] | None = None, fisher: bool = False, detach: bool = True) -> None:
        self.only = set(sites) if sites is not None else None
        self.fisher_enabled = fisher
        self.detach = detach
        self.keys: dict[int, torch.Tensor] = {}
        self.values: dict[int, torch.Tensor] = {}
        self._probes: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def __call__(
        self, site: int, key: torch.Tensor, value: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.only is not None and site not in self.only:
            return key, value
        if site in self.keys:
            raise RuntimeError(f"KV site {site} was written twice in one recorded forward")
        self.keys[site] = key.detach() if self.detach else key
        self.values[site] = value.detach() if self.detach else value
        if self.fisher_enabled:
            pk = torch.zeros_like(key, requires_grad=True)
            pv = torch.zeros_like(value, requires_grad=True)
            self._probes[site] = (pk, pv)
            return key + pk, value + pv
        return key, value

    def fisher(self) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """Squared gradients w.r.t. each site's pre-RoPE key and value (after backward)."""
        if not self.fisher_enabled:
            raise RuntimeError("KVRecorder was created with fisher=False")
        out = {}
        for site, (pk, pv) in self._probes.items():
            if pk.grad is None or pv.grad is None:
                raise RuntimeError(f"no gradient reached KV site {site}; call backward on the loss first")
            out[site] = (pk.grad.pow(2), pv.grad.pow(2))
        return out


class KVSubstituter:
    """Replaces pre-RoPE keys/values at chosen sites and positions.

    ``provide(site) -> (key, value) or None`` gives the replacement for a site ([B, S, H_kv, D], the
    shape of this forward's keys); ``positions_mask`` [B, S] (True = replace) restricts it, e.g. to
    the tokens after the sinks. Sites for which ``provide`` returns None are left as computed.
    """

    def __init__(
        self,
        provide: Callable[[int], tuple[torch.Tensor, torch.Tensor] | None],
        positions_mask: torch.Tensor | None = None,
    ) -> None:
        self.provide = provide
        self.positions_mask = positions_mask
        self._mask: torch.Tensor | None = None  # positions_mask as [B, S, 1, 1] on the forward's device

    @classmethod
    def from_tensors(
        cls, tensors: dict[int, tuple[torch.Tensor, torch.Tensor]], positions_mask: torch.Tensor | None = None
    ) -> KVSubstituter:
        """Substitute the given (key, value) of each site in ``tensors``; other sites stay as computed."""
        return cls(tensors.get, positions_mask)

    def __call__(
        self, site: int, key: torch.Tensor, value: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        new = self.provide(site)
        if new is None:
            return key, value
        nk, nv = (t.to(key.dtype) for t in new)
        if nk.shape != key.shape or nv.shape != value.shape:
            raise ValueError(
                f"substitute for KV site {site} has shapes {tuple(nk.shape)}/{tuple(nv.shape)}, "
                f"the forward has {tuple(key.shape)}"
            )
        if self.positions_mask is None:
            return nk, nv
        if self._mask is None or self._mask.device != key.device:  # the same for every site of a forward
            self._mask = self.positions_mask.to(key.device)[:, :, None, None]
        return torch.where(self._mask, nk, key), torch.where(self._mask, nv, value)
