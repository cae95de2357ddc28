"""The capture's store: its size (every stored tensor's bytes) and the choice of disk, host memory, device or
split from what each has room for, with room on the accelerator for the host copier's sequences in flight."""

from __future__ import annotations

import pytest
import torch
from conftest import calib_set, make_tiny_huginn, make_tiny_ouro

import loopvq_calib.calibration.capture.store as cs
from loopvq_calib.calibration.capture.kv import MemoryCapture, capture_kv
from loopvq_calib.config.schema import CaptureConfig
from loopvq_calib.config.source import ConfigError


@pytest.mark.parametrize("tasq", [False, True])
def test_capture_bytes_is_the_stored_size(tasq):
    model, calib = make_tiny_huginn(), calib_set(n=2, length=16)
    cfg = CaptureConfig(dtype="bfloat16", fisher_channels=4, store="memory")
    mem = MemoryCapture()
    capture_kv(model, calib, model.kv_layout(), cfg=cfg, out=mem, tasq_floor=1e-6 if tasq else None)
    stored = sum(t.numel() * t.element_size() for seq in mem.sequences.values() for t in seq.values())
    assert stored == cs.capture_bytes(model.kv_layout(), 2, 16, cfg=cfg, tasq_keys=tasq)


def test_store_choice_and_refusal(tmp_path, monkeypatch):
    kv = make_tiny_ouro().kv_layout()
    size = cs.capture_bytes(kv, 4, 64, cfg=CaptureConfig(fisher_channels=4))

    def choose(store: str, device: str = "cpu") -> cs.StoreChoice:
        return cs.choose_store(
            CaptureConfig(store=store, fisher_channels=4),
            kv,
            4,
            sequence_length=64,
            device=torch.device(device),
            model_bytes=100,
            step_bytes=1000,
            capture_dir=tmp_path,
        )

    monkeypatch.setattr(cs, "host_available", lambda: size)
    monkeypatch.setattr(cs, "disk_available", lambda folder: size - 1)
    auto = choose("auto")
    assert auto.store == "memory" and f"{size / 1e9:.2f} GB" in auto.reason
    with pytest.raises(ConfigError, match="capture.store: disk cannot hold the capture"):
        choose("disk")
    monkeypatch.setattr(cs, "host_available", lambda: size - 1)
    monkeypatch.setattr(cs, "disk_available", lambda folder: size)
    assert choose("auto").store == "disk"
    monkeypatch.setattr(cs, "disk_available", lambda folder: 0)
    with pytest.raises(ConfigError, match="capture.store: no store holds the capture") as err:
        choose("auto")
    assert "4 sequences x 64 tokens" in str(err.value) and "memory:" in str(err.value) and "disk:" in str(err.value)
    # one process, neither alone holds it: the first sequences stay on the accelerator, the rest in host memory;
    # the accelerator keeps room for the copier's 2 sequences in flight to host memory
    per_sequence = cs.capture_bytes(kv, 1, 64, cfg=CaptureConfig(fisher_channels=4))

    def device_room(room: int) -> None:
        """The accelerator shows ``room`` bytes free past the 1200 that come off."""
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (1200 + room, 2000))

    device_room(per_sequence * 7 // 2)  # weights 100, step 1000 and 5 % of the card 100 come off
    monkeypatch.setattr(cs, "host_available", lambda: per_sequence * 3)
    split = choose("auto", "cuda")
    assert (split.store, split.device_sequences) == ("split", 1)
    assert "1 sequences on cuda, 3 in host memory (with room on cuda for the sequences in flight to it)" in split.reason
    assert f"copies to host memory keep up to 2 sequences ({2 * per_sequence / 1e9:.2f} GB) on cuda" in split.reason
    device_room(per_sequence * 5 // 2)  # 2 sequences would fit, but not next to the 2 in flight
    with pytest.raises(ConfigError, match="no store holds the capture"):
        choose("auto", "cuda")
    # host memory holds it all: chosen only where the accelerator holds the copies in flight, else the disk
    monkeypatch.setattr(cs, "host_available", lambda: size)
    monkeypatch.setattr(cs, "disk_available", lambda folder: size)
    assert choose("auto", "cuda").store == "memory"
    device_room(2 * per_sequence - 1)
    assert choose("auto", "cuda").store == "disk" and choose("auto").store == "memory"  # (no copier on a CPU)
    with pytest.raises(ConfigError, match="capture.store: memory cannot hold the capture: .*in flight"):
        choose("memory", "cuda")
    device_room(size)
    assert (choose("auto", "cuda").store, choose("auto", "cuda").device_sequences) == ("device", 4)


def test_host_memory_store_keeps_gpu_room_only_for_the_sequences_it_can_have_in_flight(tmp_path, monkeypatch):
    """``capture.store: memory`` with one sequence per process (2 processes, 2 sequences): at most one waits on
    the GPU for its copy, so the GPU needs room for one, not two."""
    kv, cfg = make_tiny_ouro().kv_layout(), CaptureConfig(store="memory", fisher_channels=4)
    per_sequence = cs.capture_bytes(kv, 1, 64, cfg=cfg)
    monkeypatch.setattr(cs, "host_available", lambda: 2 * per_sequence)

    def choose() -> cs.StoreChoice:
        return cs.choose_store(
            cfg,
            kv,
            2,
            sequence_length=64,
            device=torch.device("cuda"),
            model_bytes=100,
            step_bytes=1000,
            capture_dir=tmp_path,
            processes=2,
        )

    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (1200 + per_sequence, 2000))
    assert choose().store == "memory" and "keep up to 1 sequences" in choose().reason
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (1200 + per_sequence - 1, 2000))
    with pytest.raises(ConfigError, match="memory cannot hold the capture"):
        choose()
