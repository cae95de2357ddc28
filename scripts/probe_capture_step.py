"""Time one capture step (forward + backward with Fisher probes at every KV site) and a plain forward on
Ouro-1.4B shapes with random bf16 weights, 1 x 2,048 tokens, on the GPU. Prints JSON (three runs each;
the first includes CUDA warm-up). Used for the capture analysis in docs/performance.md.

    python scripts/probe_capture_step.py
"""

import json
import time

import torch

from loopvq_calib.models import KVRecorder, OuroConfig, OuroForCausalLM, kv_hook

cfg = OuroConfig(vocab_size=49152, hidden_size=2048, intermediate_size=5632, num_hidden_layers=24, num_attention_heads=16,
                 num_key_value_heads=16, rope_theta=1e6, total_ut_steps=4)
torch.manual_seed(0)
with torch.device("cuda"):
    m = OuroForCausalLM(cfg).to(torch.bfloat16).eval()
for p in m.parameters():
    p.requires_grad_(False)
ids = torch.randint(0, 49152, (1, 2048), device="cuda")
res = {}
for it in range(3):
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    t = time.time()
    rec = KVRecorder(fisher=True)
    with kv_hook(m, rec):
        out = m(ids)
        loss = torch.nn.functional.cross_entropy(out.logits[0, :-1].float(), ids[0, 1:], reduction="sum")
        loss.backward()
    f = rec.fisher()
    torch.cuda.synchronize()
    res[f"fwd_bwd_fisher_{it}"] = time.time() - t
    res["peak_gb"] = torch.cuda.max_memory_allocated() / 1e9
    del rec, out, loss, f
for it in range(3):
    torch.cuda.synchronize()
    t = time.time()
    with torch.no_grad():
        out = m(ids)
    torch.cuda.synchronize()
    res[f"fwd_{it}"] = time.time() - t
print(json.dumps(res))
