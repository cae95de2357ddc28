"""Loop-aware fine-tuning: KL goes down on the reference model, best-epoch selection, frozen weights, exact
gradients through the lookup, disabled = k-means codebooks."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from conftest import make_tiny_huginn, make_tiny_ouro, run_finetune
from support.builders import random_quantizer
from support.quantizers import sampled_quantizer

from loopvq_calib.calibration.finetune import schedule, teacher_cache as teacher_cache_module, train as finetune_module
from loopvq_calib.calibration.finetune.teacher_cache import ranked
from loopvq_calib.calibration.finetune.train import TeacherCache, finetune_codebooks, selection_kl, sequence_kl
from loopvq_calib.calibration.pipeline import calibrate
from loopvq_calib.calibration.stages import load_calibration, load_quantizer
from loopvq_calib.codes.codec import scatter_groups
from loopvq_calib.codes.objective import kl_per_position, sink_mask, teacher
from loopvq_calib.config.schema import FinetuneConfig
from loopvq_calib.data.corpus import CalibrationSet
from loopvq_calib.models import KVRecorder, KVSubstituter, kv_hook
from loopvq_calib.models.loading import load_model
from loopvq_calib.runtime.processes import DistContext


@pytest.fixture(scope="module")
def reference_setup(tmp_path_factory, reference_model_dir, calib_corpus):
    """Capture + k-means (loopvq, 0.5 bit, K 256, G 16) on the shipped reference model, small data."""
    out = tmp_path_factory.mktemp("ft-run")
    cfg = {
        "model": {"name_or_path": str(reference_model_dir)},
        "data": {"dataset": str(calib_corpus), "num_sequences": 8, "sequence_length": 128, "heldout_sequences": 2},
        "kmeans": {"iterations": 15, "backend": "torch"},
        "output": {"dir": str(out)},
    }
    calibrate(cfg, stages=["kmeans"])
    model, _ = load_model(reference_model_dir, "float32", torch.device("cpu"))

    calib = load_calibration(out / "data")
    return model, calib, load_quantizer(out / "kmeans")


@pytest.mark.slow  # the shipped reference model
def test_finetuning_lowers_selection_kl_and_keeps_the_best_epoch(reference_setup):
    model, calib, init = reference_setup
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    result = finetune_codebooks(model, calib, init, cfg=FinetuneConfig(epochs=2, lr=1e-3), device=torch.device("cpu"))
    curve = [c["selection_kl"] for c in result.curve]
    assert [c["step"] for c in result.curve] == [0, 4, 8, 12] and result.curve[0]["train_kl"] is None
    assert min(curve[1:]) < curve[0]
    best = min(range(4), key=curve.__getitem__)
    assert (result.best_step, result.best_epoch) == (result.curve[best]["step"], result.curve[best]["epoch"])
    # the returned codebooks are the best point's: re-measuring gives its selection KL
    again = selection_kl(model, calib, result.quantizer, cfg=FinetuneConfig(), device=torch.device("cpu"))
    assert again == pytest.approx(curve[best], rel=1e-5)
    for k, v in model.state_dict().items():
        assert torch.equal(v, weights[k]), f"model weight {k} changed"


@pytest.mark.slow  # the shipped reference model
def test_epoch_zero_is_kept_when_training_only_hurts(reference_setup):
    model, calib, init = reference_setup
    paper = FinetuneConfig(epochs=1, lr=5.0, lr_schedule="constant", warmup_steps=0, select_every=0, proximal=0.0)
    result = finetune_codebooks(model, calib, init, cfg=paper, device=torch.device("cpu"))
    assert result.curve[1]["selection_kl"] > result.curve[0]["selection_kl"]
    assert result.best_epoch == 0
    for key, codec in result.quantizer.codecs.items():
        assert torch.equal(codec.codebook, init.codecs[key].codebook)


@pytest.mark.slow  # the shipped reference model
def test_disabled_gives_exactly_the_kmeans_codebooks(reference_setup):
    model, calib, init = reference_setup
    result = finetune_codebooks(model, calib, init, cfg=FinetuneConfig(enabled=False), device=torch.device("cpu"))
    assert result.best_epoch == 0 and len(result.curve) == 1
    for key, codec in result.quantizer.codecs.items():
        assert torch.equal(codec.codebook, init.codecs[key].codebook)


@pytest.mark.slow  # the shipped reference model
def test_codebook_gradient_is_exact_through_the_lookup(reference_setup):
    """No straight-through estimator: d KL / d codebook equals the gradient obtained by decoding with an
    explicit one-hot matrix product of the (fixed) assignments."""
    model, calib, init = reference_setup
    q = copy.deepcopy(init)
    key = "key.b0.l2"
    cb = q.codecs[key].codebook.clone().requires_grad_(True)
    q.codecs[key].codebook = cb
    ids = calib.input_ids[:1]
    cfg = FinetuneConfig()
    sequence_kl(model, ids, q, sink_tokens=calib.sink_tokens, cfg=cfg, device=torch.device("cpu")).backward()
    grad = cb.grad.clone()

    codec = q.codecs[key]

    rec = KVRecorder()
    with kv_hook(model, rec):
        model(ids)
    x = torch.stack([rec.keys[s][0] for s in codec.layout.sites], 1)
    idx = codec.encode(x).indices.long()  # [N, H, n]
    cb2 = init.codecs[key].codebook.clone().requires_grad_(True)
    onehot = F.one_hot(idx, cb2.shape[2]).float()  # [N, H, n, K]
    z = torch.einsum("thnk,hnkg->thng", onehot, cb2)

    decoded = scatter_groups(z, codec.layout.groups, codec.layout.steps)
    q2 = copy.deepcopy(init)
    q2.codecs.pop(key)

    fp = teacher(model, ids)
    qk, qv = q2.quantize_sites(fp.keys, fp.values)
    for m, site in enumerate(codec.layout.sites):
        qk[site] = decoded[:, m].reshape(fp.keys[site].shape)
    sub = KVSubstituter(lambda s: (qk[s], qv[s]), sink_mask(ids, calib.sink_tokens))
    with kv_hook(model, sub):
        logits = model(ids).logits
    kl_per_position(fp.logits[:, calib.sink_tokens :], logits[:, calib.sink_tokens :]).mean().backward()
    torch.testing.assert_close(grad, cb2.grad, rtol=1e-4, atol=1e-9)
    used = torch.zeros(cb.shape[:3], dtype=torch.bool)
    used.scatter_(2, idx.permute(1, 2, 0), True)
    assert grad[~used].abs().max() == 0 and grad[used].abs().sum() > 0


@pytest.mark.slow  # the shipped reference model
def test_cached_teacher_gives_the_same_result(reference_setup):
    model, calib, init = reference_setup
    a = finetune_codebooks(
        model, calib, init, cfg=FinetuneConfig(epochs=1, cache_teacher="true"), device=torch.device("cpu")
    )
    b = finetune_codebooks(
        model, calib, init, cfg=FinetuneConfig(epochs=1, cache_teacher="false"), device=torch.device("cpu")
    )
    assert a.curve == b.curve
    for key in a.quantizer.codecs:
        assert torch.equal(a.quantizer.codecs[key].codebook, b.quantizer.codecs[key].codebook)


@pytest.mark.slow  # the shipped reference model
def test_teacher_cache_auto_keeps_what_fits(reference_setup, monkeypatch):
    """auto keeps the teacher outputs (logits + keys/values, size measured on the first one) of as many
    sequences as fit: 2 GiB of host memory on CPU; on CUDA what the first steps' reserved peak left of the
    device's memory less a 10 % margin and memory still to come. The first sequences asked for are kept,
    and a kept sequence is not recomputed."""
    model, calib, _ = reference_setup
    c = model.config
    per_seq = 64 * (c.vocab_size + 2 * model.kv_layout().num_sites * c.num_key_value_heads * c.head_dim) * 4  # fp32
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    auto = FinetuneConfig(cache_teacher="auto")
    ids = calib.input_ids[:, :64]
    ten = [[i] for i in range(10)]
    cache = TeacherCache(model, auto, ten)
    assert cache.capacity is None and cache.per_sequence is None
    cache.get(0, ids[:1], cpu)
    assert cache.per_sequence == per_seq and cache.capacity == 10
    monkeypatch.setattr(teacher_cache_module, "TEACHER_CACHE_BYTES", 3 * per_seq + 1)
    part = TeacherCache(model, auto, ten)
    first = [part.get(i, ids[i : i + 1], cpu) for i in range(5)]
    assert part.capacity == 3 and sorted(part.store) == [0, 1, 2]
    assert part.get(1, ids[1:2], cpu) is first[1] and part.get(4, ids[4:5], cpu) is not first[4]
    torch.testing.assert_close(part.get(4, ids[4:5], cpu).logits, first[4].logits)
    assert TeacherCache(model, FinetuneConfig(cache_teacher="true"), ten).capacity == 10

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: type("P", (), {"total_memory": 100 * per_seq}))
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda d=None: 80.5 * per_seq)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda d=None: 80.5 * per_seq)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d=None: (19.5 * per_seq, 100 * per_seq))  # nothing outside
    monkeypatch.setattr(teacher_cache_module, "host_available", lambda: 0)  # no host tier here
    on_gpu = TeacherCache(model, auto, ten)
    on_gpu.settle(cuda)
    assert on_gpu.capacity is None  # nothing measured yet: still undecided
    on_gpu.per_sequence = per_seq  # as measured on the first teacher output
    on_gpu.settle(cuda, to_come=2 * per_seq)
    assert on_gpu.capacity == 7  # 90 % of 100 sequences' worth, less the peak of 80.5 and 2 to come
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda d=None: 95 * per_seq)
    over = TeacherCache(model, auto, ten)
    over.per_sequence = per_seq
    over.settle(cuda)
    assert over.capacity == 0
    assert TeacherCache(model, FinetuneConfig(cache_teacher="false"), [[0]]).capacity == 0


@pytest.mark.slow  # the shipped reference model
def test_teacher_cache_is_sized_after_the_second_step(reference_setup, monkeypatch):
    """finetune_codebooks settles the cache once, after the second optimizer step, passing the bytes still to
    come: the codebooks (the best epoch's copy). A fresh run's peak already holds the first (joined) selection
    batch, so nothing is added for it; a resumed run adds 2 x its sequences' outputs (``selection_extra``)."""
    model, calib, init = reference_setup
    calls = []
    progress = []
    monkeypatch.setattr(
        TeacherCache,
        "settle",
        lambda self, device, to_come=0, peak_floor=0: calls.append((len(progress), to_come, peak_floor)),
    )
    finetune_codebooks(
        model, calib, init, cfg=FinetuneConfig(epochs=1), device=torch.device("cpu"), progress=progress.append
    )
    codebook_bytes = sum(c.codebook.numel() * 4 for c in init.codecs.values())  # fp32 during fine-tuning
    assert calls == [(1, codebook_bytes, 0)] and len(progress) > 2  # no floor on CPU (no peak statistics)
    cache = TeacherCache(model, FinetuneConfig(), [[0], [1]])
    fp = teacher(model, calib.input_ids[:1])
    cache.get(0, calib.input_ids[:1], torch.device("cpu"))
    per_sequence = sum(t.numel() * t.element_size() for t in [fp.logits, *fp.keys.values(), *fp.values.values()])
    assert finetune_module.selection_extra(cache, FinetuneConfig(), 3) == 2 * 3 * per_sequence
    assert finetune_module.selection_extra(cache, FinetuneConfig(selection_batch=2), 3) == 2 * 2 * per_sequence
    assert finetune_module.selection_extra(cache, FinetuneConfig(selection_batch=1), 3) == 0


@pytest.mark.gpu
def test_teacher_cache_on_cuda_ignores_memory_freed_before_finetuning(tiny_setup):
    """Memory an earlier stage freed but the caching allocator still reserves (the capture's device store) is
    not counted against the teacher cache: with a block of all but 2 GiB of the card allocated and freed just
    before, ``auto`` still keeps every sequence of the tiny model (a few MB each; the cache settles after the
    second step, so the second epoch keeps the first two), and the block is back on the device (CUDA's free
    memory) when fine-tuning ends."""
    model, calib, init = tiny_setup
    cuda = torch.device("cuda")
    model = copy.deepcopy(model).to(cuda)
    free, _ = torch.cuda.mem_get_info(cuda)
    block = torch.empty(free - (2 << 30), dtype=torch.uint8, device=cuda)
    held = block.numel()
    del block  # freed into the caching allocator, still reserved
    assert torch.cuda.memory_reserved(cuda) >= held
    result = finetune_codebooks(model, calib, init, cfg=FinetuneConfig(epochs=2, cache_teacher="auto"), device=cuda)
    assert result.teacher_kept == calib.input_ids.shape[0]
    assert torch.cuda.mem_get_info(cuda)[0] >= held


@pytest.mark.parametrize("make", ["ouro", "huginn"])
def test_loop_checkpointing_gives_the_same_gradients(make):
    model = make_tiny_ouro() if make == "ouro" else make_tiny_huginn()
    ids = torch.randint(0, 4096, (1, 20), generator=torch.Generator().manual_seed(0))
    grads = []
    for on in (False, True):
        q = random_quantizer(model.kv_layout())
        for c in q.codecs.values():
            c.codebook.requires_grad_(True)
        model.loop_checkpointing = on
        sequence_kl(model, ids, q, sink_tokens=4, cfg=FinetuneConfig(), device=torch.device("cpu")).backward()
        grads.append(torch.cat([c.codebook.grad.flatten() for c in q.codecs.values()]))
    model.loop_checkpointing = False
    assert grads[0].abs().sum() > 0
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-5, atol=1e-8)


def test_select_every_n_steps(tiny_setup):
    """3 training sequences x 2 epochs = 6 steps; every 2 steps -> points 0, 2, 4, 6; every 4 -> 0, 4 and
    the last step 6; the kept codebooks are the ones measured at the best point."""
    result, seen = run_finetune(tiny_setup, epochs=2, lr=3e-2, select_every=2)
    assert [(e["epoch"], e["step"]) for e in result.curve] == [(0, 0), (1, 2), (2, 4), (2, 6)]
    assert result.curve[0]["train_kl"] is None and all(e["train_kl"] > 0 for e in result.curve[1:])
    best = min(range(4), key=lambda i: result.curve[i]["selection_kl"])
    assert result.best_step == result.curve[best]["step"] and result.best_epoch == result.curve[best]["epoch"]
    for key, codec in result.quantizer.codecs.items():
        torch.testing.assert_close(codec.codebook, seen[best][1].codecs[key].codebook, rtol=0, atol=0)
    result4, _ = run_finetune(tiny_setup, epochs=2, lr=3e-2, select_every=4)
    assert [e["step"] for e in result4.curve] == [0, 4, 6]
    per_epoch, _ = run_finetune(tiny_setup, epochs=2, lr=3e-2, select_every=0)
    assert [(e["epoch"], e["step"]) for e in per_epoch.curve] == [(0, 0), (1, 3), (2, 6)]


def test_teacher_cache_holds_every_sequence_a_process_is_asked_for(tiny_setup, monkeypatch):
    """With 2 processes and batch 2 each batch is split by position and the order changes every epoch, so a
    process is asked for more than its half of the sequences: ``cache_teacher: true`` keeps every distinct
    sequence it asks for (recorded here), and ``teacher_plan`` lists the asks in the order they come (here
    with a selection every 2 steps)."""
    model, calib, init = tiny_setup
    monkeypatch.setattr(DistContext, "all_reduce_sum", lambda self, t: t)  # a fake second process
    asked: dict[int, list[int]] = {}
    get = TeacherCache.get
    for rank in (0, 1):
        seen = asked.setdefault(rank, [])
        monkeypatch.setattr(TeacherCache, "get", lambda self, seq, *a, _s=seen: _s.append(seq) or get(self, seq, *a))
        cfg = FinetuneConfig(epochs=3, batch_size=2, select_every=2, cache_teacher="true")
        result = finetune_codebooks(model, calib, init, cfg=cfg, device=torch.device("cpu"), dist=DistContext(rank, 2))
        assert result.teacher_kept == len(set(seen))
        plan = schedule.teacher_plan(calib, cfg, DistContext(rank, 2))
        assert [s for group in plan for s in group] == seen and len(ranked(plan)) == len(set(seen))
    assert len(set(asked[0])) > -(-calib.input_ids.shape[0] // 2)  # more than a fixed half of the sequences
    assert schedule.teacher_plan(calib, FinetuneConfig(enabled=False), DistContext(1, 2)) == []
    usage = schedule.teacher_plan(calib, FinetuneConfig(min_usage=1, batch_size=1, epochs=1), DistContext(1, 2))
    assert usage[:1] == [[1]]  # its usage share, after its (empty) selection share


@pytest.mark.parametrize("make", ["ouro", "huginn"])
def test_batched_selection_equals_one_sequence_at_a_time(make):
    """``selection_batch`` joins the selection sequences' teacher outputs into one forward: the selection KL is
    the mean of the per-sequence KLs (up to float rounding), also under Huginn's like-init (per-row states),
    with and without a teacher cache, and an identity quantizer still scores exactly 0."""

    model = make_tiny_ouro() if make == "ouro" else make_tiny_huginn(state_init="like-init")
    ids = torch.randint(0, 4096, (6, 16), generator=torch.Generator().manual_seed(3))
    calib = CalibrationSet(ids, [0], [1, 2, 3, 4, 5], 2)
    lossy = sampled_quantizer(model, ids[:2], "loopvq", codebook_size=4)
    cpu = torch.device("cpu")
    each = [
        sequence_kl(model, ids[i : i + 1], lossy, sink_tokens=2, cfg=FinetuneConfig(), device=cpu).item()
        for i in calib.heldout
    ]
    for batch in (1, 2, 5):
        cfg = FinetuneConfig(selection_batch=batch)
        for cache in (None, TeacherCache(model, cfg, [[i] for i in range(6)])):
            got = selection_kl(model, calib, lossy, cfg=cfg, device=cpu, cache=cache)
            assert got == pytest.approx(sum(each) / len(each), rel=1e-5), (batch, cache)
    exact = sampled_quantizer(model, ids, "loopvq", codebook_size=96)
    assert selection_kl(model, calib, exact, cfg=FinetuneConfig(selection_batch=5), device=cpu) == 0.0
