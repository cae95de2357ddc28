"""Shared tiny fixtures: random tiny Ouro / Huginn models saved in the hub layout, the shipped reference
model and corpora. Nothing is downloaded (HF_HUB_OFFLINE=1)."""

from __future__ import annotations

import copy
import importlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("OMP_NUM_THREADS", "1")  # processes the tests start (spawned workers, CLIs): see one_thread

import pytest
import torch
from support.quantizers import sampled_quantizer
from transformers import AutoModelForCausalLM

import loopvq_calib  # noqa: F401  (registers the native models)
from loopvq_calib.bundle.writer import write_bundle
from loopvq_calib.calibration.capture.kv import capture_kv, write_meta
from loopvq_calib.calibration.capture.reader import CaptureReader
from loopvq_calib.calibration.finetune.train import FinetuneResult, finetune_codebooks
from loopvq_calib.codes.codec import BlockCodec, TasqTransform
from loopvq_calib.codes.layouts import codebook_shape, plan_layouts
from loopvq_calib.codes.quantizer import KVQuantizer
from loopvq_calib.config.schema import CaptureConfig, FinetuneConfig, QuantConfig, ServingConfig
from loopvq_calib.data.corpus import CalibrationSet
from loopvq_calib.kernels import cuda_build
from loopvq_calib.kernels.backends import Backend, available
from loopvq_calib.models import HuginnConfig, HuginnForCausalLM, OuroConfig, OuroForCausalLM
from loopvq_calib.models.loading import model_identity
from loopvq_calib.models.sites import kv_layout

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # the benchmarks package (benchmarks/README.md), as its scripts import it
    sys.path.append(str(ROOT))
REFERENCE_MODEL = ROOT / "artifacts" / "tiny-ouro"
DATA = ROOT / "artifacts" / "data"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
TINY_K, TINY_G, TINY_T_C = 16, 8, 4  # codebook size, group size and steps per block of tiny_quantizer


def run_kernel_script(script: str) -> dict:
    """Run ``script`` (a Triton kernel check that prints one JSON line last, given the device as its argument)
    in a child process: on the GPU when there is one, else on CPU tensors under ``TRITON_INTERPRET=1`` (which
    must be set before triton is imported, hence the child)."""
    if torch.cuda.is_available():
        code = subprocess.run([sys.executable, "-c", script, "cuda"], capture_output=True, text=True, cwd=ROOT)
    else:
        env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
        code = subprocess.run([sys.executable, "-c", script, "cpu"], capture_output=True, text=True, cwd=ROOT, env=env)
    assert code.returncode == 0, code.stderr[-3000:]
    return json.loads(code.stdout.strip().splitlines()[-1])


def calibrate_child(config: Path, **env: str) -> dict[str, Any]:
    """The ``subprocess`` arguments of a ``python -m loopvq_calib --config CONFIG`` child run from the checkout: this
    checkout importable, no PATH, the hub offline, ``env`` added."""
    return {
        "args": [sys.executable, "-m", "loopvq_calib", "--config", str(config)],
        "cwd": ROOT,
        "env": {"PYTHONPATH": str(ROOT), "PATH": "", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", **env},
    }


def load_script(name: str) -> types.ModuleType:
    """scripts/<name>.py as a module, scripts/ on ``sys.path`` (as when it runs, so that it imports its sibling
    modules). The benchmarks are a package: tests import ``benchmarks.<topic>.<module>``."""
    path = ROOT / "scripts" / f"{name}.py"
    if str(path.parent) not in sys.path:
        sys.path.append(str(path.parent))
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


def importable(name: str) -> bool:
    """Whether module ``name`` imports (an optional extra's package may be missing)."""
    try:
        importlib.import_module(name)
    except ImportError:
        return False
    return True


# lm-evaluation-harness comes with the ``eval`` and ``dev`` extras (CI installs ``dev``); without it the tests
# of task accuracy and passkey retrieval skip, like GPU tests without a GPU
needs_lm_eval = pytest.mark.skipif(
    not importable("lm_eval"), reason="needs lm-evaluation-harness: pip install 'loopvq-calib[eval]'"
)


# the fused Triton kernels run on a CUDA GPU, or in Triton's interpreter on CPU tensors (TRITON_INTERPRET=1)
KERNEL_DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
needs_triton_kernels = pytest.mark.skipif(
    not available(Backend.TRITON, KERNEL_DEVICE), reason="needs triton with a CUDA GPU, or TRITON_INTERPRET=1"
)


@pytest.fixture
def builds(monkeypatch) -> cuda_build.CudaBuilds:
    """A fresh record of NVRTC builds for the test (no earlier failure, no counters)."""
    fresh = cuda_build.CudaBuilds()
    monkeypatch.setattr(cuda_build, "BUILDS", fresh)
    return fresh


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """GPU tests (``@pytest.mark.gpu``) skip without CUDA."""
    if not torch.cuda.is_available():
        skip = pytest.mark.skip(reason="needs a CUDA GPU")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)


def tiny_ouro_config(**overrides) -> OuroConfig:
    """A tiny Ouro: 2 layers x 4 loops, hidden 64, 4 heads of 16 (MHA unless overridden), vocab 4096."""
    kw = dict(
        vocab_size=4096,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        head_dim=16,
        rope_theta=10000.0,
        total_ut_steps=4,
        max_position_embeddings=512,
    )
    kw.update(overrides)
    return OuroConfig(**kw)


def tiny_huginn_config(**overrides) -> HuginnConfig:
    """A tiny Huginn: prelude 1 / core 2 / coda 1, hidden 64, 4 heads, r = 4, zero initial state."""
    kw = dict(
        n_embd=64,
        n_heads=4,
        n_layers=4,
        n_layers_in_prelude=1,
        n_layers_in_recurrent_block=2,
        n_layers_in_coda=1,
        intermediate_size=96,
        vocab_size=4096,
        block_size=512,
        mean_recurrence=4,
        state_init="zero",
        rope_base=10000.0,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
    )
    kw.update(overrides)
    return HuginnConfig(**kw)


def save_with_tokenizer(model: torch.nn.Module, folder: Path) -> Path:
    """``model`` in the hub layout with the reference model's tokenizer; returns ``folder``."""
    model.save_pretrained(folder)
    for name in TOKENIZER_FILES:
        shutil.copy(REFERENCE_MODEL / name, folder / name)
    return folder


def _scaled_init(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Weights large enough that loops and keys matter (std 0.02 makes a tiny model nearly constant)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=gen) * (1.0 / p.shape[-1]) ** 0.5)
            elif "bias" in name or "qk_bias" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    return model.eval()


def make_tiny_ouro(seed: int = 0, **overrides) -> OuroForCausalLM:
    """:func:`tiny_ouro_config` with random weights large enough to matter (seeded), in eval mode."""
    torch.manual_seed(seed)
    return _scaled_init(OuroForCausalLM(tiny_ouro_config(**overrides)), seed)


def make_tiny_huginn(seed: int = 0, **overrides) -> HuginnForCausalLM:
    """:func:`tiny_huginn_config` with random weights large enough to matter (seeded), in eval mode."""
    torch.manual_seed(seed)
    return _scaled_init(HuginnForCausalLM(tiny_huginn_config(**overrides)), seed)


def calib_set(n: int = 3, length: int = 24, sinks: int = 4) -> CalibrationSet:
    """``n`` random sequences of ``length`` tokens (seed 0): the first held out, the others for training."""
    gen = torch.Generator().manual_seed(0)
    return CalibrationSet(torch.randint(0, 4096, (n, length), generator=gen), list(range(1, n)), [0], sinks)


@pytest.fixture(scope="session", autouse=True)
def one_thread() -> Iterator[None]:
    """Every test runs single-threaded torch and faiss: the tiny models and problems gain nothing from a second
    intra-op thread, while two OpenMP teams (torch's, faiss's) synchronising on every small op cost several times
    the work on 2 cores (docs/ci.md). A test about threads sets its own."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    faiss = _faiss_or_none()
    faiss_threads = faiss.omp_get_max_threads() if faiss else None
    if faiss:
        faiss.omp_set_num_threads(1)
    yield
    torch.set_num_threads(threads)
    if faiss:
        faiss.omp_set_num_threads(faiss_threads)


def _faiss_or_none() -> types.ModuleType | None:
    try:
        import faiss
    except ImportError:
        return None
    return faiss


@pytest.fixture(scope="session")
def tiny_ouro_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny random Ouro saved once per session."""
    return save_with_tokenizer(make_tiny_ouro(), tmp_path_factory.mktemp("tiny-ouro"))


@pytest.fixture(scope="session")
def tiny_huginn_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny random Huginn saved once per session."""
    return save_with_tokenizer(make_tiny_huginn(), tmp_path_factory.mktemp("tiny-huginn"))


@pytest.fixture(scope="session")
def reference_model_dir() -> Path:
    """The shipped reference model (artifacts/tiny-ouro)."""
    return REFERENCE_MODEL


@pytest.fixture(scope="session")
def calib_corpus() -> Path:
    """The shipped calibration corpus."""
    return DATA / "shakespeare-calib.jsonl"


@pytest.fixture(scope="session")
def heldout_corpus() -> Path:
    """The shipped held-out corpus."""
    return DATA / "shakespeare-heldout.jsonl"


@pytest.fixture(scope="module")
def tiny_captures(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple]:
    """Float32 captures (with query statistics) of 3 random sequences of 64 tokens on the tiny Ouro and Huginn:
    name -> (model, KV layout, calibration set, reader)."""
    out = {}
    for name, make in {"ouro": make_tiny_ouro, "huginn": make_tiny_huginn}.items():
        model = make()
        kv = kv_layout(model)
        torch.manual_seed(1)
        calib = CalibrationSet(input_ids=torch.randint(0, 4096, (3, 64)), train=[0, 1], heldout=[2], sink_tokens=4)
        folder = tmp_path_factory.mktemp(f"capture-{name}")
        cfg = CaptureConfig(dtype="float32")
        capture_kv(model, calib, kv, cfg=cfg, out=folder)
        write_meta(folder, calib, kv, cfg=cfg)
        out[name] = (model, kv, calib, CaptureReader(folder))
    return out


@pytest.fixture(scope="module")
def tiny_setup() -> tuple[OuroForCausalLM, CalibrationSet, KVQuantizer]:
    """Fine-tuning on a tiny random Ouro: 4 sequences of 24 tokens (3 train, 1 selection), codebooks of real
    group vectors."""
    model = make_tiny_ouro()
    ids = torch.randint(0, 4096, (4, 24), generator=torch.Generator().manual_seed(1))
    return model, CalibrationSet(ids, [0, 1, 2], [3], 4), sampled_quantizer(model, ids[:2], "loopvq", codebook_size=8)


def run_finetune(setup: tuple, **cfg) -> tuple[FinetuneResult, list[tuple[dict, KVQuantizer]]]:
    """Fine-tune ``setup`` (model, calibration set, initial quantizer) on the CPU with ``FinetuneConfig(**cfg)``
    -> the result and (curve entry, quantizer) at every selection point."""
    model, calib, init = setup
    seen = []
    result = finetune_codebooks(
        model,
        calib,
        init,
        cfg=FinetuneConfig(**cfg),
        device=torch.device("cpu"),
        on_select=lambda e, q: seen.append((dict(e), copy.deepcopy(q))),
    )
    return result, seen


def tiny_quantizer(model_dir: Path, method: str = "tasq+loopvq", sharing: str = "none") -> KVQuantizer:
    """Random codebooks (K 16, G 8, T_c 4) on the tiny Ouro's layout (2 layers x 4 steps, 4 heads of 16)."""
    kv = AutoModelForCausalLM.from_pretrained(model_dir).kv_layout()
    quant = QuantConfig(
        method=method,
        bits=None,
        codebook_size=TINY_K,
        group_size=TINY_G,
        steps_per_block=TINY_T_C,
        codebook_sharing=sharing,
    )
    gen = torch.Generator().manual_seed(0)
    codecs = {}
    for lay in plan_layouts(kv, quant):
        transform = None
        if quant.uses_tasq and lay.kind == "key":
            transform = TasqTransform(torch.rand(lay.steps, kv.kv_heads, kv.head_dim, generator=gen) + 0.5, 1e-4)
        codecs[lay.key] = BlockCodec(lay, torch.randn(codebook_shape(lay, TINY_K, sharing), generator=gen), transform)
    return KVQuantizer(codecs, method, TINY_K, TINY_G, TINY_T_C, sharing, kv)


def write_tiny_bundle(
    out: Path,
    model_dir: Path,
    name: str = "tiny",
    *,
    config: dict | None = None,
    quantizer: KVQuantizer | None = None,
    codebook_dtype: str = "float16",
) -> Path:
    """A bundle of ``quantizer`` (default :func:`tiny_quantizer`) for ``model_dir`` named org/tiny-ouro, with a
    few metrics."""
    return write_bundle(
        out,
        quantizer or tiny_quantizer(model_dir),
        name=name,
        identity=model_identity(model_dir, "org/tiny-ouro", "main"),
        calibration={"dataset": "shakespeare", "num_sequences": 4},
        serving=ServingConfig(8, 64, 8),
        metrics={"heldout_kl": 0.0123, "heldout_kl_init": 0.0456, "ppl_increase": 0.021, "finetune_curve": [{}, {}]},
        codebook_dtype=codebook_dtype,
        config=config or {"quant": {"method": "tasq+loopvq"}},
        producer_version="0.1.0",
    )
