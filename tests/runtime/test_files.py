"""The atomic-write helper hashes what it writes: safetensors files laid out as the library lays them out, and the
digest log of a recording folder, checked against hashlib over the finished files' bytes."""

from __future__ import annotations

import hashlib
import io
import json
import multiprocessing
import threading
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save

from loopvq_calib.runtime.files import (
    DIGEST_LOG,
    HashingWriter,
    recording_digests,
    take_digests,
    write_bytes_atomic,
    write_safetensors,
    write_tensors_atomic,
)


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def mixed_tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "key.0": torch.randn(4, 2, 8, generator=g).bfloat16(),
        "fisher_key.0": torch.rand(4, 2, 4, generator=g).half(),
        "input_ids": torch.arange(4),
        "qstat.0": torch.randn(2, 8, generator=g),
        "scalar": torch.tensor(2.5),
        "empty": torch.zeros(0, 3),
        "mask": torch.tensor([True, False, True]),
        "wide": torch.randn(3).double(),
        "small": torch.arange(5, dtype=torch.int32),
        "bytes": torch.arange(7, dtype=torch.uint8),
    }


@pytest.mark.parametrize("metadata", [None, {}, {"sequence": "3"}])
def test_safetensors_are_written_as_the_library_writes_them(metadata):
    tensors = mixed_tensors()
    out = io.BytesIO()
    write_safetensors(out, tensors, metadata)
    assert out.getvalue() == save(tensors, metadata=metadata)


def test_a_tensor_file_reads_back_and_returns_the_sha256_of_its_bytes(tmp_path):
    tensors = mixed_tensors()
    tensors["strided"] = torch.arange(12.0).reshape(3, 4).t()  # not contiguous: written as its values
    path = tmp_path / "t.safetensors"
    digest = write_tensors_atomic(path, tensors, {"sequence": "7"})
    assert digest == sha(path)
    back = load_file(path)
    assert back.keys() == tensors.keys() and all(torch.equal(back[k], tensors[k]) for k in tensors)
    assert [p.name for p in tmp_path.iterdir()] == ["t.safetensors"]  # no temporary sibling left


def test_an_unknown_dtype_is_refused_naming_the_tensor():
    with pytest.raises(ValueError, match=r"no safetensors dtype for odd \(torch.complex64\)"):
        write_safetensors(io.BytesIO(), {"fine": torch.zeros(1), "odd": torch.zeros(1, dtype=torch.complex64)})


def test_the_hashing_writer_counts_and_hashes_what_passes_through():
    out = io.BytesIO()
    w = HashingWriter(out)
    assert w.write(b"abc") == 3 and w.write(memoryview(torch.arange(4, dtype=torch.int16).numpy())) == 8
    assert w.size == 11 == len(out.getvalue()) and w.sha256.hexdigest() == hashlib.sha256(out.getvalue()).hexdigest()


def test_a_recording_folder_logs_every_write_under_it_from_any_thread(tmp_path):
    folder, elsewhere = tmp_path / "stage", tmp_path / "other"
    (folder / "sub").mkdir(parents=True)
    elsewhere.mkdir()
    with recording_digests(folder):
        write_bytes_atomic(folder / "a.json", b'{"a": 1}')
        worker = threading.Thread(
            target=write_tensors_atomic, args=(folder / "sub" / "t.safetensors", {"x": torch.ones(3)})
        )
        worker.start()
        worker.join()
        write_bytes_atomic(elsewhere / "b.json", b"{}")  # not under the folder
        write_bytes_atomic(folder / "a.json", b'{"a": 22}')  # written again: the last digest counts
    write_bytes_atomic(folder / "late.json", b"{}")  # after the block: not recorded
    digests = take_digests(folder)
    assert digests == {
        name: (sha(folder / name), (folder / name).stat().st_size) for name in ("a.json", "sub/t.safetensors")
    }
    assert not (folder / DIGEST_LOG).exists() and not (elsewhere / DIGEST_LOG).exists()
    assert take_digests(folder) == {}


def test_a_line_cut_short_by_a_kill_is_skipped(tmp_path):
    with recording_digests(tmp_path):
        write_bytes_atomic(tmp_path / "kept.bin", b"123")
    with open(tmp_path / DIGEST_LOG, "a") as log:
        log.write(json.dumps({"file": "cut.bin", "sha256": "ab"})[:20])
    assert take_digests(tmp_path) == {"kept.bin": (sha(tmp_path / "kept.bin"), 3)}


def test_a_linked_log_is_not_read_nor_removed(tmp_path):
    target = tmp_path / "mine.txt"
    target.write_text(json.dumps({"file": "x", "sha256": "0" * 64, "bytes": 1}) + "\n")
    folder = tmp_path / "stage"
    folder.mkdir()
    (folder / DIGEST_LOG).symlink_to(target)
    assert take_digests(folder) == {} and (folder / DIGEST_LOG).is_symlink()
    with recording_digests(folder), pytest.raises(OSError):  # nor appended to through the link
        write_bytes_atomic(folder / "a.bin", b"1")
    assert target.read_text().count("\n") == 1


def _write_many(folder: str, rank: int) -> None:
    with recording_digests(Path(folder)):
        for i in range(25):
            write_bytes_atomic(Path(folder) / f"r{rank}-{i}.bin", bytes([rank, i]) * (100 + i))


def test_processes_writing_into_one_folder_log_every_file(tmp_path):
    """Two processes at once (as the ranks of a distributed run write into the stage's shared folder)."""
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_write_many, args=(str(tmp_path), rank)) for rank in (1, 2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    assert [p.exitcode for p in procs] == [0, 0]
    files = sorted(p for p in tmp_path.iterdir() if p.name != DIGEST_LOG)
    assert len(files) == 50
    assert take_digests(tmp_path) == {p.name: (sha(p), p.stat().st_size) for p in files}
