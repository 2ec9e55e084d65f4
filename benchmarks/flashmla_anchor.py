"""DeepSeek's FlashMLA (SM90), timed beside jax_sparse_mla on the same cache bytes and indices.

Used by ``bench.py --flashmla`` when the ``flash_mla`` package (a PyTorch extension, built from its
public sources; not a dependency of this project) is importable. Our ``dsv3_2`` cache is byte-identical
to FlashMLA's V3.2 FP8 cache, so the same uint8 buffer is handed to both through DLPack; FlashMLA's
prefill kernel reads a BF16 cache, which is the dequantized ``dsv3_2`` cache. FlashMLA is timed as a
CUDA graph of one call per index set, replayed ``CALLS_PER_SAMPLE`` times per sample (CUDA events),
median of the samples: the counterpart of the JAX harness's queued scan calls. Like a step of that scan,
each call's output is summed (in float32) into an accumulator, so both sides do the same work per step
besides the attention itself.
"""

from __future__ import annotations

import statistics


def import_error():
    """None when FlashMLA and PyTorch import, else the reason they do not."""
    try:
        import flash_mla  # noqa: F401
        import torch  # noqa: F401
    except Exception as error:  # any import failure means "not available"
        return f"{type(error).__name__}: {error}"
    return None


def _torch(x):
    import torch

    return torch.utils.dlpack.from_dlpack(x)


def _time_graph(calls, repeats, replays):
    """Median µs per call of ``calls`` (a list of thunks) captured in one CUDA graph."""
    import torch

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for call in calls:  # warm-up outside the graph (first-use allocations, scheduler metadata)
            call()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    graph.replay()
    torch.cuda.synchronize()
    samples = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1e3 / (replays * len(calls)))
    return statistics.median(samples)


def _consume(total, out):
    """total += sum(out) in float32: the per-step work of the JAX harness (it sums each step's output)."""
    import torch

    total.add_(out.sum(dtype=torch.float32))


def decode(q, cache, index_sets, sm_scale, repeats, replays):
    """FlashMLA's sparse FP8 decode on our ``dsv3_2`` cache.

    Args: q bf16 ``[T, H, 576]`` (JAX; H < 64 is padded with zero heads to 64, as serving engines do);
    cache uint8 ``[num_pages, page_size, 656]`` (JAX); index_sets int32 ``[steps, T, topk]`` (JAX).
    Returns ``(µs per call, out [T, H, 512] float32 numpy of index set 0, lse [T, H] numpy)``.
    """
    import flash_mla
    import torch

    tokens, heads, _ = q.shape
    padded = 64 if heads < 64 else heads
    q_t = torch.zeros((tokens, 1, padded, q.shape[-1]), dtype=torch.bfloat16, device="cuda")
    q_t[:, 0, :heads] = _torch(q)
    k_cache = _torch(cache).view(cache.shape[0], cache.shape[1], 1, cache.shape[2])
    index_t = _torch(index_sets)
    sched, _ = flash_mla.get_mla_metadata()
    results = {}
    total = torch.zeros((), dtype=torch.float32, device="cuda")

    def call(i):
        def run():
            results[i] = flash_mla.flash_mla_with_kvcache(q_t, k_cache, None, None, 512, sched, None,
                                                          softmax_scale=sm_scale, is_fp8_kvcache=True,
                                                          indices=index_t[i].view(tokens, 1, -1))
            _consume(total, results[i][0][:, 0, :heads])
        return run

    us = _time_graph([call(i) for i in range(index_t.shape[0])], repeats, replays)
    out, lse = results[0]
    torch.cuda.synchronize()
    out = out[:, 0, :heads].float().cpu().numpy()
    lse = lse.reshape(tokens, padded)[:, :heads].float().cpu().numpy() if lse.dim() == 2 else \
        lse[:, :heads].reshape(tokens, heads).float().cpu().numpy()
    return us, out, lse


def prefill(q, kv_bf16, index_sets, sm_scale, repeats, replays):
    """FlashMLA's sparse prefill on a BF16 cache ``kv_bf16 [num_slots, 576]`` (JAX bfloat16).

    Returns ``(µs per call, out [T, H, 512] float32 numpy of index set 0, lse [T, H] numpy)``.
    """
    import flash_mla
    import torch

    tokens = q.shape[0]
    q_t = _torch(q).contiguous()
    kv_t = _torch(kv_bf16).view(kv_bf16.shape[0], 1, kv_bf16.shape[1])
    index_t = _torch(index_sets)
    results = {}
    total = torch.zeros((), dtype=torch.float32, device="cuda")

    def call(i):
        def run():
            results[i] = flash_mla.flash_mla_sparse_fwd(q_t, kv_t, index_t[i].view(tokens, 1, -1), sm_scale)
            _consume(total, results[i][0])
        return run

    us = _time_graph([call(i) for i in range(index_t.shape[0])], repeats, replays)
    out, _, lse = results[0]
    torch.cuda.synchronize()
    return us, out.float().cpu().numpy(), lse.float().cpu().numpy()


def _profile_main(argv):
    """``python benchmarks/flashmla_anchor.py T H``: FlashMLA's decode on a random 172 MB V3.2 FP8 cache
    (the ``dsv3_2`` layout: 512 e4m3 values without NaN codes, four FP32 scales of 2^-4, 64 BF16 lanes;
    4096 pages of 64), topk 2048, three eager calls (for ncu: the last call's kernels are the measured
    ones). ``... T H prefill``: its BF16 sparse prefill on a random BF16 cache of as many slots, three
    calls. PyTorch only, so it runs without jax_sparse_mla installed."""
    import torch

    tokens, heads = int(argv[1]), int(argv[2])
    pages, page_size, topk = 4096, 64, 2048
    generator = torch.Generator(device="cuda").manual_seed(0)
    if len(argv) > 3 and argv[3] == "prefill":
        import flash_mla

        kv = (0.5 * torch.randn((pages * page_size, 1, 576), device="cuda", generator=generator)).to(torch.bfloat16)
        q = torch.randn((tokens, heads, 576), device="cuda", generator=generator).to(torch.bfloat16)
        index_t = torch.randint(0, pages * page_size, (tokens, 1, topk), dtype=torch.int32, device="cuda",
                                generator=generator)
        for _ in range(3):
            flash_mla.flash_mla_sparse_fwd(q, kv, index_t, 576 ** -0.5)
        torch.cuda.synchronize()
        return
    cache = torch.empty((pages, page_size, 656), dtype=torch.uint8, device="cuda")
    cache[..., :512] = torch.randint(0, 256, (pages, page_size, 512), dtype=torch.uint8, device="cuda",
                                     generator=generator) & 0xF7  # exponent 1111 never occurs: no NaN
    cache[..., 512:528] = torch.full((pages, page_size, 4), 2.0 ** -4, device="cuda").view(torch.uint8)
    rope = 0.1 * torch.randn((pages, page_size, 64), device="cuda", generator=generator)
    cache[..., 528:] = rope.to(torch.bfloat16).view(torch.uint8)
    import flash_mla

    padded = 64 if heads < 64 else heads
    q_t = torch.zeros((tokens, 1, padded, 576), dtype=torch.bfloat16, device="cuda")
    q_t[:, 0, :heads] = torch.randn((tokens, heads, 576), device="cuda", generator=generator).to(torch.bfloat16)
    k_cache = cache.view(pages, page_size, 1, 656)
    index_t = torch.randint(0, pages * page_size, (tokens, 1, topk), dtype=torch.int32, device="cuda",
                            generator=generator)
    sched, _ = flash_mla.get_mla_metadata()
    for _ in range(3):
        flash_mla.flash_mla_with_kvcache(q_t, k_cache, None, None, 512, sched, None, softmax_scale=576 ** -0.5,
                                         is_fp8_kvcache=True, indices=index_t)
    torch.cuda.synchronize()


if __name__ == "__main__":
    import sys

    _profile_main(sys.argv)
