"""The settings of an evaluation besides its bundles and held-out text: what is measured through the served
cache (:class:`ServedOptions`) and the thresholds a report must meet (:class:`Gates`)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class ServedOptions:
    """What is evaluated through the served cache besides the evaluation KL (``loopvq-eval``'s served-cache
    options): lm-eval tasks, uncalibrated baselines, passkey retrieval, and the serving overrides."""

    tasks: list[str] = field(default_factory=list)  # lm-eval task or group names
    baselines: list[str] = field(default_factory=list)  # names of :data:`loopvq_calib.codes.baselines.BASELINES`
    limit: float | None = None  # lm-eval: at most this many items per task (< 1: a fraction)
    sink_tokens: int | None = None  # overrides every quantized entry's sinks (None: the bundles')
    recent_window: int | None = None  # overrides every quantized entry's recent window (None: the bundles')
    batch_size: int = 1  # prompts decoded together (left-padded)
    include_path: list[str] = field(default_factory=list)  # extra lm-eval task folders
    passkey_lengths: list[int] = field(default_factory=list)  # prompt lengths (tokens) of the passkey retrieval
    passkey_trials: int = 5  # passkey prompts per length
    seed: int = 0
    confirm_run_unsafe_code: bool = False  # humaneval / mbpp execute the generated code

    @property
    def any_served(self) -> bool:
        """Whether anything is served through the cache (tasks, passkey, or baselines' bytes per token)."""
        return bool(self.tasks or self.passkey_lengths or self.baselines)


@dataclass(frozen=True)
class Gates:
    """Thresholds an evaluation must meet (None: not checked); a NaN result never passes."""

    max_kl: float | None = None  # evaluation KL of every bundle and baseline
    max_ppl_increase: float | None = None  # relative perplexity increase (0.05: 5 %)
    max_accuracy_drop: float | None = None  # task accuracy below full precision, per entry and task
