"""Scratch: decode attention as in the job: 30 layers' caches, 48 requests x ~300 keys, cold (each layer's bytes evicted by the other 29)."""
import sys, time, statistics, torch
sys.path.insert(0, "/work/main/benches")
import kvcore_kernels as kk
from bench_attention_cpu import _paged, HQ, HK, D, BS
torch.set_num_threads(int(sys.argv[1]) if len(sys.argv) > 1 else 1)
B, L, LAYERS = 48, 300, 30
gen = torch.Generator().manual_seed(0)
layers = []
for _ in range(LAYERS):
    keys, values, cache, table = _paged(gen, B, L, torch.bfloat16)
    meta = kk.plan_attention(torch.arange(B + 1, dtype=torch.int32), torch.full((B,), L, dtype=torch.int32), table, BS)
    q = torch.randn(B, HQ, D, generator=gen).bfloat16()
    layers.append((q, cache, meta))
    del keys, values
nbytes = LAYERS * 2 * B * HK * L * D * 2
big = torch.ones(nbytes // 2, dtype=torch.int16)
def step():
    for q, cache, meta in layers:
        kk.paged_attention(q, cache, meta, scale=D**-0.5, backend="cpu")
step()
ts, rs = [], []
for _ in range(9):
    t0 = time.perf_counter(); step(); ts.append(time.perf_counter() - t0)
    t0 = time.perf_counter(); big.max(); rs.append(time.perf_counter() - t0)
t, r = statistics.median(ts), statistics.median(rs)
print(f"decode step attention: {t*1e3:.2f} ms ({nbytes/t/1e9:.1f} GB/s), a plain read of as many bytes {r*1e3:.2f} ms ({nbytes/r/1e9:.1f} GB/s): {r/t*100:.0f} % of it")
q, cache, meta = layers[0]
for _ in range(3): kk.paged_attention(q, cache, meta, scale=D**-0.5, backend="cpu")
ws = []
for _ in range(20):
    t0 = time.perf_counter(); kk.paged_attention(q, cache, meta, scale=D**-0.5, backend="cpu"); ws.append(time.perf_counter() - t0)
w = statistics.median(ws)
print(f"one layer repeated (warm in L3 if it fits): {w*1e3:.3f} ms x 30 = {w*30e3:.2f} ms ({nbytes/30/w/1e9:.1f} GB/s)")
