"""``finetune.loop_checkpointing: auto``: a step that runs out of GPU memory without checkpointing is undone and
redone with it, and the run ends exactly as one with checkpointing on from the start; the teacher cache's sizing
turns it on when the cache would not keep every sequence; on CPU ``auto`` is off."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from conftest import run_finetune

from loopvq_calib.calibration.finetune import loop_policy, train as finetune_module
from loopvq_calib.calibration.finetune.loop_policy import LoopPolicy
from loopvq_calib.calibration.finetune.train import TeacherCache, finetune_codebooks
from loopvq_calib.config.schema import FinetuneConfig

RECIPE = {"epochs": 2, "lr": 3e-2, "select_every": 2, "batch_size": 2, "cache_teacher": "true"}


def assert_same_run(a, b) -> None:
    """Two fine-tuning results (result, selection points) are bit-identical: curve and codebooks."""
    assert a[0].curve == b[0].curve and a[0].best_step == b[0].best_step
    for key, codec in a[0].quantizer.codecs.items():
        assert torch.equal(codec.codebook, b[0].quantizer.codecs[key].codebook), key


def out_of_memory_once(monkeypatch, model, asks: list[bool]) -> None:
    """``sequence_kl`` raises a CUDA out-of-memory error at the first training call made without checkpointing
    that is not a step's first sequence (after that sequence's backward changed the gradients and the KL sum);
    ``asks`` records, per call, whether checkpointing was on."""
    real = finetune_module.sequence_kl

    def flaky(*args, **kwargs):
        asks.append(model.loop_checkpointing)
        kl = real(*args, **kwargs)
        if torch.is_grad_enabled() and not model.loop_checkpointing and asks.count(False) == 3:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 40.00 GiB (injected)")
        return kl

    monkeypatch.setattr(finetune_module, "sequence_kl", flaky)


def test_a_step_out_of_memory_is_redone_with_checkpointing_and_gives_the_checkpointed_result(
    tiny_setup, monkeypatch, caplog
):
    model = tiny_setup[0]
    on = run_finetune(tiny_setup, loop_checkpointing=True, **RECIPE)
    off = run_finetune(tiny_setup, loop_checkpointing=False, **RECIPE)
    assert_same_run(run_finetune(tiny_setup, loop_checkpointing="auto", **RECIPE), off)  # CPU: auto is off
    monkeypatch.setattr(loop_policy, "AUTO_DEVICES", ("cuda", "cpu"))
    asks: list[bool] = []
    out_of_memory_once(monkeypatch, model, asks)
    gets: list[int] = []
    get = TeacherCache.get
    monkeypatch.setattr(TeacherCache, "get", lambda self, seq, *a: gets.append(seq) or get(self, seq, *a))
    with caplog.at_level(logging.INFO, logger="loopvq_calib"):
        auto = run_finetune(tiny_setup, loop_checkpointing="auto", **RECIPE)
    assert_same_run(auto, on)
    # the step-0 selection (no gradient), then the first step's two sequences, the second raising; redone with
    # checkpointing, which stays on; the model's own setting is back afterwards
    assert asks[:3] == [False, False, False] and all(asks[3:]) and len(asks) > 6 and model.loop_checkpointing is False
    assert "loop checkpointing auto -> on" in caplog.text and "injected" in caplog.text
    plan = finetune_module.teacher_plan(tiny_setup[1], FinetuneConfig(**RECIPE))
    flat = [s for group in plan for s in group]
    assert gets == flat[:3] + flat[1:]  # the redone step asks the cache again for what it asked


def test_auto_turns_checkpointing_on_when_the_teacher_cache_would_not_keep_every_sequence(tiny_setup, monkeypatch):
    """At the cache's sizing (after the second step) ``auto`` keeps checkpointing off only if the cache would keep
    every sequence still asked for; otherwise it is on from the third step and the cache is sized two steps
    later, with the peak measured before the first step as its floor."""
    monkeypatch.setattr(loop_policy, "AUTO_DEVICES", ("cuda", "cpu"))
    model, calib, init = tiny_setup
    cfg = dict(RECIPE, batch_size=1, cache_teacher="auto", loop_checkpointing="auto")
    for keeps_all, expected in ((False, [False, False, True, True, True, True]), (True, [False] * 6)):
        asks, sizings, progress = [], [], []
        real = finetune_module.sequence_kl
        monkeypatch.setattr(
            finetune_module,
            "sequence_kl",
            lambda *a, _r=real, _asks=asks, **k: _asks.append(model.loop_checkpointing) or _r(*a, **k),
        )
        monkeypatch.setattr(
            TeacherCache,
            "tiers_now",
            lambda self, device, to_come=0, peak_floor=0, _k=keeps_all: (
                (set(range(self.still_asked())), set()) if _k else ({0}, set())
            ),
        )

        def record_sizing(self, device, to_come=0, peak_floor=0, _sizings=sizings, _progress=progress):
            """The cache's sizing, recorded as the number of steps done by then."""
            _sizings.append(len(_progress))

        monkeypatch.setattr(TeacherCache, "settle", record_sizing)
        finetune_codebooks(
            model, calib, init, cfg=FinetuneConfig(**cfg), device=torch.device("cpu"), progress=progress.append
        )
        monkeypatch.undo()
        monkeypatch.setattr(loop_policy, "AUTO_DEVICES", ("cuda", "cpu"))
        steps = [on for on, grad in zip(asks, grad_calls(asks, calib, cfg)) if grad]
        assert steps == expected and sizings == ([3] if not keeps_all else [1])


def grad_calls(asks: list[bool], calib, cfg: dict) -> list[bool]:
    """Which of a run's ``sequence_kl`` calls were training steps (not selections), from its plan."""
    plan = finetune_module.teacher_plan(calib, FinetuneConfig(**cfg))
    return [len(group) == 1 and group[0] in calib.train for group in plan][: len(asks)]


def test_policy_settings_and_the_model_flag():
    model = torch.nn.Linear(2, 2)
    model.loop_checkpointing = False
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert [LoopPolicy(model, s, cpu).on for s in (True, False, "auto")] == [True, False, False]
    assert not LoopPolicy(model, "auto", cpu).trying_off and LoopPolicy(model, "auto", cuda).trying_off
    with LoopPolicy(model, True, cpu) as policy:
        assert model.loop_checkpointing is True and not policy.trying_off
    assert model.loop_checkpointing is False
    policy = LoopPolicy(model, "auto", cuda)
    with policy:
        assert model.loop_checkpointing is False
        assert policy.keep_off(kept=4, asked=4, peak=1 << 30) and policy.trying_off
        assert not policy.keep_off(kept=3, asked=4, peak=1 << 30)
        assert model.loop_checkpointing is True and not policy.trying_off and "only 3 of 4" in policy.reason
    assert model.loop_checkpointing is False
    with pytest.raises(KeyError):  # other errors are not caught
        LoopPolicy(model, "auto", cuda).run_step(lambda: {}["x"], lambda: None)


@pytest.mark.gpu
def test_a_real_cuda_out_of_memory_frees_the_step_and_redoes_it(tiny_setup, monkeypatch, caplog):
    """On CUDA: a real allocator out-of-memory error in the first step (its forward's graph alive) is caught, the
    memory that step held is back before the redo (nothing kept by the traceback), and the run matches one with
    checkpointing on from the start; without the error, ``auto`` keeps checkpointing off when the teacher cache
    keeps every sequence (the tiny model's outputs are a few MB)."""
    cuda = torch.device("cuda")
    _, calib, init = tiny_setup
    model = copy.deepcopy(tiny_setup[0]).to(cuda)
    on = finetune_codebooks(model, calib, init, cfg=FinetuneConfig(**RECIPE, loop_checkpointing=True), device=cuda)
    real, seen = finetune_module.sequence_kl, {}

    def flaky(*args, **kwargs):
        if torch.is_grad_enabled() and not model.loop_checkpointing and "entry" not in seen:
            seen["entry"] = torch.cuda.memory_allocated(cuda)
            kl = real(*args, **kwargs)  # noqa: F841 (its graph is alive when the allocation fails)
            torch.empty(1 << 50, dtype=torch.uint8, device=cuda)  # 1 PiB: a real allocator error
        return real(*args, **kwargs)

    turn_on = LoopPolicy.turn_on

    def noted(self, reason: str) -> None:
        seen["switch"] = torch.cuda.memory_allocated(cuda)
        turn_on(self, reason)

    monkeypatch.setattr(LoopPolicy, "turn_on", noted)
    monkeypatch.setattr(finetune_module, "sequence_kl", flaky)
    with caplog.at_level(logging.INFO, logger="loopvq_calib"):
        auto = finetune_codebooks(
            model, calib, init, cfg=FinetuneConfig(**RECIPE, loop_checkpointing="auto"), device=cuda
        )
    assert seen["switch"] <= seen["entry"] and "ran out of GPU memory" in caplog.text
    assert [e["step"] for e in auto.curve] == [e["step"] for e in on.curve]
    torch.testing.assert_close(
        [e["selection_kl"] for e in auto.curve], [e["selection_kl"] for e in on.curve], rtol=1e-4, atol=1e-7
    )
    for key, codec in auto.quantizer.codecs.items():
        torch.testing.assert_close(codec.codebook, on.quantizer.codecs[key].codebook, rtol=1e-4, atol=1e-6)
    monkeypatch.undo()
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="loopvq_calib"):
        finetune_codebooks(
            model,
            calib,
            init,
            cfg=FinetuneConfig(**dict(RECIPE, cache_teacher="auto"), loop_checkpointing="auto"),
            device=cuda,
        )
    assert "loop checkpointing auto -> off" in caplog.text and "-> on" not in caplog.text
