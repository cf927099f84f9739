import sys, time, statistics, torch
sys.path.insert(0, "/work/main/benches")
import kvcore_kernels as kk
from bench_attention_cpu import _paged, HQ, HK, D, BS
torch.set_num_threads(1)
gen = torch.Generator().manual_seed(0)
for B, L in [(1, 16), (1, 2048), (4, 300), (4, 2400)]:
    keys, values, cache, table = _paged(gen, B, L, torch.bfloat16)
    meta = kk.plan_attention(torch.arange(B + 1, dtype=torch.int32), torch.full((B,), L, dtype=torch.int32), table, BS)
    q = torch.randn(B, HQ, D, generator=gen).bfloat16()
    for _ in range(5): kk.paged_attention(q, cache, meta, scale=D**-0.5, backend="cpu")
    ws = []
    for _ in range(50):
        t0 = time.perf_counter(); kk.paged_attention(q, cache, meta, scale=D**-0.5, backend="cpu"); ws.append(time.perf_counter() - t0)
    w = statistics.median(ws); nb = 2 * B * HK * L * D * 2
    print(f"B {B:3d} L {L:5d}: {nb/1e6:6.2f} MB, {w*1e3:.3f} ms, {nb/w/1e9:5.1f} GB/s, {w/(B*L*HK)*1e9:.2f} ns per key-head")
