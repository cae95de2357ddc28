import json, time, sys
import torch
sys.path.insert(0, "scripts")
from bench_kmeans import problems
from loopvq_calib import kmeans_triton as kt
from loopvq_calib.kmeans_backends import kmeans_pp_init, weighted_kmeans
from loopvq_calib.config import KMeansConfig
from torch.profiler import profile, ProfilerActivity

P, N, G, K = 512, 32640, 16, 256
x, w = problems(P, N, G, K)
x, w = x.cuda().contiguous(), w.cuda().contiguous()
init = kmeans_pp_init(x, w, K, torch.Generator().manual_seed(1), fused=True)
cfg = KMeansConfig(iterations=25, tolerance=0.0)
weighted_kmeans(x[:4], w[:4], init[:4], cfg, "triton", "cuda")
for it in (1, 25):
    c = KMeansConfig(iterations=it, tolerance=0.0)
    torch.cuda.synchronize(); t = time.time()
    weighted_kmeans(x, w, init, c, "triton", "cuda"); torch.cuda.synchronize()
    print(json.dumps({"iterations": it, "s": round(time.time() - t, 4)}), flush=True)
rows = torch.arange(P, device="cuda")
for acc in (True, False):
    kt.lloyd_step(x, w, init, rows, acc); torch.cuda.synchronize(); t = time.time()
    for _ in range(10): kt.lloyd_step(x, w, init, rows, acc)
    torch.cuda.synchronize(); print(json.dumps({"lloyd_step_ms": round((time.time() - t) * 100, 3), "accumulate": acc}), flush=True)
with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
    weighted_kmeans(x, w, init, KMeansConfig(iterations=5, tolerance=0.0), "triton", "cuda"); torch.cuda.synchronize()
print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25))
print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=25))
