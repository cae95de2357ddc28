"""Quantization methods, each declared once as a :class:`QuantMethod` and registered by name; config validation,
layouts, the bundle rules and the served cache look a method up here (docs/architecture.md, "Adding a quantization
method"). The built-in methods are declared at the end, in the order messages and docs list them."""

from __future__ import annotations

from dataclasses import dataclass

TASQ_GROUPINGS = ("free", "channels")  # how the TaSQ stage may group a key block (``tasq.grouping``, docs/tasq.md)


@dataclass(frozen=True)
class QuantMethod:
    """What a quantization method is. Every method is served by the block codec
    (:class:`~loopvq_calib.codes.codec.BlockCodec`), with the TaSQ transform on its key blocks when it has a TaSQ
    stage. A block of one site (a channel-only method's, or a non-looped layer's) always takes CQ groups;
    ``loop_layout`` says how a block of several loop steps is grouped."""

    name: str  # the value of ``quant.method`` and of a bundle's ``method`` field
    # the default groups of a block of several loop steps: a rule of codes/layouts.py's LOOP_LAYOUTS; None: the
    # method is channel-only (its codes never span loop steps, every block is one site)
    loop_layout: str | None = None
    tasq_groupings: tuple[str, ...] = ()  # the ``tasq.grouping`` values its TaSQ stage takes; (): no TaSQ stage
    fused_decode: bool = True  # decode steps may attend from its codes in the fused kernels (else the reference path)

    @property
    def loop_axis(self) -> bool:
        """Whether codes span the T_c loop steps of a block."""
        return self.loop_layout is not None

    @property
    def uses_tasq(self) -> bool:
        """Whether the method has a TaSQ stage (the transform on its key blocks)."""
        return bool(self.tasq_groupings)

    def block_steps(self, steps_per_block: int) -> int:
        """Loop steps coded jointly: ``steps_per_block`` (T_c) for a loop-axis method, 1 for a channel-only one. A
        bundle's ``steps_per_block`` field must equal it."""
        return steps_per_block if self.loop_axis else 1

    def tasq_on(self, kind: str) -> bool:
        """Whether blocks of ``kind`` (key or value) carry the TaSQ transform: the key blocks of a TaSQ method."""
        return self.uses_tasq and kind == "key"


_REGISTRY: dict[str, QuantMethod] = {}


def register_method(method: QuantMethod) -> QuantMethod:
    """Add ``method`` to the registry (its name must be new and its TaSQ groupings known); returns it."""
    if method.name in _REGISTRY:
        raise ValueError(f"quantization method {method.name!r} is already registered")
    unknown = sorted(set(method.tasq_groupings) - set(TASQ_GROUPINGS))
    if unknown:
        raise ValueError(
            f"method {method.name!r}: unknown TaSQ groupings {unknown}; known: {', '.join(TASQ_GROUPINGS)}"
        )
    _REGISTRY[method.name] = method
    return method


def unregister_method(name: str) -> None:
    """Remove the method ``name`` (a plug-in's or a test's own registration, undone)."""
    del _REGISTRY[name]


def get_method(name: str) -> QuantMethod:
    """The registered method ``name``; KeyError naming the registered ones otherwise."""
    if name not in _REGISTRY:
        raise KeyError(f"no quantization method {name!r}; registered: {', '.join(_REGISTRY)}")
    return _REGISTRY[name]


def method_names() -> tuple[str, ...]:
    """The registered methods' names, in registration order (the order messages and docs list them)."""
    return tuple(_REGISTRY)


def methods() -> tuple[QuantMethod, ...]:
    """The registered methods, in registration order."""
    return tuple(_REGISTRY.values())


# -- the built-in methods (docs/method.md section 4) ---------------------------------------------------------------
# coupled quantization, the baseline: G consecutive channels of one loop step per code
CQ = register_method(QuantMethod("cq"))
# the TaSQ key transform (channel weights, sigma, a fitted permutation) before CQ-style channel groups
TASQ = register_method(QuantMethod("tasq", tasq_groupings=TASQ_GROUPINGS))
# loop-axis groups: c = G / T_c channels at each of the T_c loop steps of a block per code
LOOPVQ = register_method(QuantMethod("loopvq", loop_layout="loop-axis"))
# the TaSQ key transform, then loop-axis groups over the transformed block
TASQ_LOOPVQ = register_method(QuantMethod("tasq+loopvq", loop_layout="loop-axis", tasq_groupings=TASQ_GROUPINGS))
DEFAULT_METHOD = LOOPVQ.name  # ``quant.method`` when a config leaves it out
