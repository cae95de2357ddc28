"""The method registry (config/methods.py): the built-in declarations, registration and look-up, what config
validation and ``QuantConfig`` read from it, and docs/method.md's table of the declarations."""

from __future__ import annotations

import pytest
from conftest import ROOT

from loopvq_calib.config.load import load_config
from loopvq_calib.config.methods import (
    DEFAULT_METHOD,
    QuantMethod,
    get_method,
    method_names,
    methods,
    register_method,
    unregister_method,
)
from loopvq_calib.config.schema import QuantConfig
from loopvq_calib.config.source import ConfigError

# docs/method.md section 4, written out: name -> (codes span loop steps, has a TaSQ stage)
PAPER = {"cq": (False, False), "tasq": (False, True), "loopvq": (True, False), "tasq+loopvq": (True, True)}


@pytest.fixture
def registered():
    """Register methods for one test; every registration is undone after it."""
    names = []

    def register(method: QuantMethod) -> QuantMethod:
        names.append(register_method(method).name)
        return method

    yield register
    for name in names:
        unregister_method(name)


def test_built_in_methods_in_order_with_their_properties():
    assert method_names() == tuple(PAPER) and DEFAULT_METHOD == "loopvq" == QuantConfig().method
    for name, (loop_axis, tasq) in PAPER.items():
        m = get_method(name)
        assert (m.loop_axis, m.uses_tasq, m.fused_decode) == (loop_axis, tasq, True)
        assert m.block_steps(4) == (4 if loop_axis else 1)
        assert (m.tasq_on("key"), m.tasq_on("value")) == (tasq, False)
        q = QuantConfig(method=name, steps_per_block=4)
        assert (q.loop_axis, q.uses_tasq, q.block_steps, q.declaration) == (loop_axis, tasq, m.block_steps(4), m)


def test_a_config_not_validated_yet_may_name_no_method():
    q = QuantConfig(method="vq", steps_per_block=4)  # what load_config's resolve_derived sees before validation
    assert (q.declaration, q.loop_axis, q.uses_tasq, q.block_steps) == (None, False, False, 1)


def test_registration_refuses_a_taken_name_and_unknown_groupings_and_look_up_names_the_registered():
    with pytest.raises(ValueError, match="quantization method 'cq' is already registered"):
        register_method(QuantMethod("cq"))
    with pytest.raises(ValueError, match=r"method 'x': unknown TaSQ groupings \['rows'\]; known: free, channels"):
        register_method(QuantMethod("x", tasq_groupings=("free", "rows")))
    with pytest.raises(KeyError, match="no quantization method 'x'; registered: cq, tasq, loopvq, tasq\\+loopvq"):
        get_method("x")
    assert "x" not in method_names()


def test_config_validation_asks_the_registry(registered):
    with pytest.raises(ConfigError, match="quant.method: 'toy' is not allowed; choose one of cq, tasq, loopvq"):
        load_config({"quant": {"method": "toy"}})
    registered(QuantMethod("toy", tasq_groupings=("free",)))
    cfg = load_config({"quant": {"method": "toy"}})
    assert (cfg.quant.uses_tasq, cfg.quant.block_steps, cfg.capture.fisher_channels) == (True, 1, 16)
    with pytest.raises(ConfigError, match="tasq.grouping: 'channels' is not allowed; choose one of free$"):
        load_config({"quant": {"method": "toy"}, "tasq": {"grouping": "channels"}})
    assert load_config({"quant": {"method": "cq"}, "tasq": {"grouping": "channels"}}).tasq.grouping == "channels"
    assert methods()[-1].name == "toy" and method_names()[:4] == tuple(PAPER)


def _docs_table() -> dict[str, list[str]]:
    text = (ROOT / "docs" / "method.md").read_text()
    section = text[text.index("## 4. Methods") : text.index("## 5.")]
    rows = [line.strip("|").split("|") for line in section.splitlines() if line.startswith("| `")]
    return {cells[0].strip().strip("`"): [c.strip() for c in cells[1:]] for cells in rows}


def test_docs_table_is_the_registry():
    def row(m: QuantMethod) -> list[str]:
        groups = f"`{m.loop_layout}`" if m.loop_axis else "(one step per block: CQ groups)"
        tasq = ", ".join(f"`{g}`" for g in m.tasq_groupings) or "no"
        return ["yes" if m.loop_axis else "no", groups, tasq, "yes" if m.fused_decode else "no"]

    table = _docs_table()
    assert list(table) == list(method_names())
    assert table == {m.name: row(m) for m in methods()}
