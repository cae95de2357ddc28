"""benchmarks/quality/reference_models.py: the trained reference models the fine-tuning benchmarks run on, one table.

Per model: its folder, the config its runs start from, calibration and evaluation (held-out) text, loop steps,
T_c and the group size of each width (K 256). ``ouro`` and ``huginn`` ship under artifacts/; ``ouro-python`` is a
check model kept out of artifacts/: the Ouro architecture trained on the Huginn reference's Python text (built by
the commands in docs/finetune.md), calibrated and evaluated on the same Python files as ``huginn``. Every benchmark
that runs on the reference models reads this table (fine-tuning study and gain, eval_reference, quality_table).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from benchmarks.common.paths import ROOT

CODEBOOK_SIZE = 256
GROUP_SIZES = {0.5: 16, 0.25: 32}  # bits -> G at K 256
STEPS_PER_BLOCK = 4  # T_c
REFERENCE_SELECTION = 16  # selection sequences of the reference setup (configs/tiny-ouro-reference.yaml)


@dataclass(frozen=True)
class ReferenceModel:
    """A trained reference model and the text it is calibrated and evaluated on (paths relative to the checkout)."""

    folder: str
    config: str  # the config every run starts from (its model, data and quant keys are set from this table)
    calibration: str
    heldout: str  # evaluation text: never calibrates, never selects
    steps_per_block: int = STEPS_PER_BLOCK
    group_sizes: tuple[tuple[float, int], ...] = tuple(GROUP_SIZES.items())
    shipped: bool = True  # False: a check model built outside artifacts/

    def group_size(self, bits: float) -> int:
        """G of width ``bits``."""
        return dict(self.group_sizes)[bits]

    def quant(self, method: str, bits: float) -> dict[str, object]:
        """The ``quant`` keys of ``method`` at ``bits`` on this model."""
        return {
            "method": method,
            "bits": bits,
            "codebook_size": CODEBOOK_SIZE,
            "group_size": self.group_size(bits),
            "steps_per_block": self.steps_per_block,
        }


MODELS = {
    "ouro": ReferenceModel(
        "artifacts/tiny-ouro",
        "configs/tiny-ouro.yaml",
        "artifacts/data/shakespeare-calib.jsonl",
        "artifacts/data/shakespeare-heldout.jsonl",
    ),
    "huginn": ReferenceModel(
        "artifacts/tiny-huginn",
        "configs/tiny-huginn.yaml",
        "artifacts/data/python-calib.jsonl",
        "artifacts/data/python-heldout.jsonl",
    ),  # 8 recurrences: 2 blocks of T_c 4
    "ouro-python": ReferenceModel(
        "build/tiny-ouro-python",
        "configs/tiny-ouro.yaml",
        "artifacts/data/python-calib.jsonl",
        "artifacts/data/python-heldout.jsonl",
        shipped=False,
    ),
}
SHIPPED_MODELS = tuple(name for name, m in MODELS.items() if m.shipped)
# Result folders under benchmarks/results/ measured on a shipped model's earlier weights -> (model, the commit that
# shipped those weights). The pages generated from them say so; drop a folder's entry when it is re-run.
EARLIER_WEIGHTS: dict[str, tuple[str, str]] = {}


def earlier_weights_note(results_folder: str) -> str:
    """The sentence a generated page puts beside results of ``results_folder`` when they were measured on weights
    since replaced (empty when they were measured on the weights shipped now)."""
    if results_folder not in EARLIER_WEIGHTS:
        return ""
    model, commit = EARLIER_WEIGHTS[results_folder]
    return (
        f"**Measured on the previous weights of `{MODELS[model].folder}`** (shipped in `{commit}`), not on the "
        "weights shipped now; not re-run yet."
    )


def calibration_windows(model: ReferenceModel, sequence_length: int = 512) -> int:
    """Non-overlapping windows of ``sequence_length`` tokens in the model's calibration text under its own
    tokenizer, counted as the data stage cuts them (documents in order, each followed by the eos token)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(ROOT / model.folder)
    lines = (ROOT / model.calibration).read_text(encoding="utf-8").splitlines()
    texts = [json.loads(line)["text"] for line in lines if line.strip()]
    tokens = sum(len(tokenizer(t, add_special_tokens=False, verbose=False)["input_ids"]) + 1 for t in texts)
    return tokens // sequence_length


def reference_overrides(windows: int) -> list[str]:
    """The reference setup on a model with ``windows`` calibration windows of 512 tokens, as ``--set`` overrides of
    its config: every window, 16 of them for selection, k-means 100 Lloyd updates, the shipped recipe for 6 epochs
    with 4 selection points per epoch, in fp32 (configs/tiny-ouro-reference.yaml is this on 188 windows)."""
    train = windows - REFERENCE_SELECTION
    return [
        f"data.num_sequences={windows}",
        f"data.heldout_sequences={REFERENCE_SELECTION}",
        "kmeans.iterations=100",
        "kmeans.tolerance=1.0e-5",
        "finetune.epochs=6",
        "finetune.warmup_steps=4",
        f"finetune.select_every={train // 4}",
        "finetune.autocast=none",
    ]
