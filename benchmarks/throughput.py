"""Skewed-64 through four systems in ONE run, side by side (not a test; prints figures).

1. the appliance engine, continuous policy
2. the appliance engine, static policy (padded batches, run to the slowest)
3. transformers `generate`, static padded batches of 8 (left padding, run to the batch's longest)
4. transformers' own continuous batching (`ContinuousBatchingManager`, sdpa, 64-token pages)

Every request arrives at t=0 and generates exactly its `output_len` tokens (EOS ignored, greedy).
Output tok/s counts only each request's own forced tokens. Then the engine's efficiency: its decode
tok/s at a full batch against a bare batched forward of the same model at the same batch size and
context (transformers DynamicCache, no scheduler), and the ceiling no system can pass here with
these matmul kernels (see `throughput_ceiling`): prefill FLOPs at the best measured GEMM rate plus,
per decode step, the larger of its FLOPs and one batch-1 pass over the weights; the kernels are
timed right before and right after the engine's continuous run and once more after the last
system's run, and the fastest timing sets the ceiling. Last, what the engine's own matmuls alone
cost (`matmul_bound`): its matmul calls timed at the rows each of its steps ran, weights streamed
from memory as in a step, which splits the gap to the ceiling into the kernels' share (a step's
matmuls at tens of rows, weights cold, run well under the hot 512-row rate) and the rest of the
engine's; and what its decode attention alone costs (`attention_bound`: the C kernel at each step's
decode rows and context, every layer's cache cold), which the ceiling leaves out: matmuls and
attention timed alone are what this engine's design costs on the machine before any Python or
elementwise work (timed apart from the run, on a shared machine, the two can come out above the
run's own wall). The attention is timed again with each row's blocks contiguous in the cache
instead of scattered: what the cache's layout costs.

    python benchmarks/throughput.py [--dtype float32] [--also-bf16] [--skip-peers] [--num-threads N]
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import json
import time
from pathlib import Path

import numpy as np
import torch

from appliance.engine import EngineConfig, Knobs, LLMEngine, SamplingParams, cpu_kernels
from appliance.engine.fast_llama import PackedLinear, own_copies_on_huge_pages
from appliance.engine.model_runner import kv_cache_spec
from appliance.engine.paged_attention import kernel_scale
from appliance.model_loader import load_model

# The CPU default, also on a GPU (where the default would take 90 % of its memory for every engine).
KV_CACHE = "1GiB"
WORKLOAD = Path(__file__).resolve().parents[1] / "appliance" / "bench" / "data" / "skewed-64.json"


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    lo, hi = int(rank), min(int(rank) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (rank - lo)


def summarize(name: str, wall: float, tokens: int, e2e: list[float], ttft: list[float]) -> dict:
    return {"system": name, "wall_s": wall, "tok_s": tokens / wall, "e2e_p50": pct(e2e, 50),
            "e2e_p99": pct(e2e, 99), "ttft_p50": pct(ttft, 50), "ttft_p99": pct(ttft, 99)}


def run_engine(loaded, requests, policy: str, max_num_seqs: int) -> dict:
    knobs = Knobs(max_num_seqs=max_num_seqs, max_num_batched_tokens=512, long_prefill_token_threshold=256,
                  max_num_partial_prefills=4, max_long_partial_prefills=1, scheduling_policy=policy)
    engine = LLMEngine(EngineConfig(dtype=str(loaded.dtype).split(".")[-1], kv_cache_memory=KV_CACHE, knobs=knobs),
                       loaded=loaded)
    engine.generate([[1, 2, 3]], SamplingParams(max_tokens=2, temperature=0))  # warm-up
    t0 = time.time()
    for i, r in enumerate(requests):
        engine.add_request(str(i), r["prompt_ids"], SamplingParams(max_tokens=r["output_len"], temperature=0, ignore_eos=True), arrival=t0)
    tokens, e2e, ttft, steps, decode = 0, [], [], [], []
    while engine.has_unfinished():
        sampled = 0
        for out in engine.step():
            sampled += len(out.new_token_ids)
            if out.finished:
                e2e.append(out.metrics.finished - t0)
                ttft.append(out.metrics.first_token - t0)
        tokens += sampled
        stats = engine.last_stats
        steps.append((stats.scheduled_tokens + stats.padding_tokens, sampled))
        if stats.decode_seqs:
            decode.append((stats.decode_seqs, stats.decode_context_tokens))
    row = summarize(f"engine {policy}", time.time() - t0, tokens, e2e, ttft)
    row["steps"], row["decode"] = steps, decode
    row["linears"] = engine.runner.fast.linears() if engine.runner.fast else None
    row["block_size"] = engine.config.block_size
    row["attention_kernel"] = engine.runner.attention_kernel  # None where decode rows took SDPA
    return row


@contextlib.contextmanager
def sdpa_attention(model):
    """Run transformers' own paths with sdpa (the engine registers its paged attention)."""
    from appliance.engine.paged_attention import ATTN_IMPLEMENTATION

    model.set_attn_implementation("sdpa")
    try:
        yield
    finally:
        model.set_attn_implementation(ATTN_IMPLEMENTATION)


def run_hf_static(loaded, requests, batch_size: int) -> dict:
    from transformers import LogitsProcessor, LogitsProcessorList

    model, tok = loaded.model, loaded.tokenizer
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    t0 = time.time()
    tokens, e2e, ttft = 0, [], []

    class FirstCall(LogitsProcessor):
        def __init__(self):
            self.at = None

        def __call__(self, input_ids, scores):
            self.at = self.at or time.time()
            return scores

    with torch.inference_mode(), sdpa_attention(model):
        for start in range(0, len(requests), batch_size):
            batch = requests[start : start + batch_size]
            width = max(len(r["prompt_ids"]) for r in batch)
            ids = torch.tensor([[pad] * (width - len(r["prompt_ids"])) + r["prompt_ids"] for r in batch],
                               device=loaded.device)
            mask = torch.tensor([[0] * (width - len(r["prompt_ids"])) + [1] * len(r["prompt_ids"]) for r in batch],
                                device=loaded.device)
            longest = max(r["output_len"] for r in batch)
            first = FirstCall()
            model.generate(ids, attention_mask=mask, max_new_tokens=longest, min_new_tokens=longest,
                           do_sample=False, pad_token_id=pad, logits_processor=LogitsProcessorList([first]))
            done = time.time()
            for r in batch:
                tokens += r["output_len"]  # only the request's own tokens count
                e2e.append(done - t0)
                ttft.append(first.at - t0)
    return summarize(f"transformers generate, padded batches of {batch_size}", time.time() - t0, tokens, e2e, ttft)


def run_hf_continuous(loaded, requests) -> dict:
    from transformers import ContinuousBatchingConfig, GenerationConfig

    model = loaded.model
    gc = GenerationConfig(do_sample=False, max_new_tokens=max(r["output_len"] for r in requests))
    wanted = dict(page_size=64, num_blocks=512, max_batch_tokens=512, max_requests_per_batch=64,
                  use_cuda_graph=False, use_async_batching=False, auto_switch_to_flash=False,
                  allow_block_sharing=False)
    accepted = inspect.signature(ContinuousBatchingConfig).parameters  # the options move between versions
    cbc = ContinuousBatchingConfig(**{k: v for k, v in wanted.items() if k in accepted})
    with sdpa_attention(model):
        manager = model.init_continuous_batching(generation_config=gc, continuous_batching_config=cbc)
    manager.start()
    try:
        t0 = time.time()
        p0 = time.perf_counter()
        for i, r in enumerate(requests):
            manager.add_request(r["prompt_ids"], request_id=str(i), max_new_tokens=r["output_len"],
                                eos_token_id=-1, record_timestamps=True)
        tokens, e2e, ttft = 0, [], []
        while len(e2e) < len(requests):
            res = manager.get_result(timeout=600)
            if res is None:
                raise RuntimeError("transformers continuous batching returned no result")
            tokens += len(res.generated_tokens)
            e2e.append(res.timestamps[-1] - p0)
            ttft.append(res.timestamps[0] - p0)
        return summarize("transformers continuous batching", time.time() - t0, tokens, e2e, ttft)
    finally:
        manager.stop(block=True)


def efficiency(loaded, batch: int, context: int, steps: int = 12) -> tuple[float, float]:
    """(engine decode tok/s, bare forward tok/s) at `batch` sequences with `context` tokens each."""
    engine = LLMEngine(EngineConfig(dtype=str(loaded.dtype).split(".")[-1], kv_cache_memory=KV_CACHE,
                                    knobs=Knobs(max_num_seqs=batch, max_num_batched_tokens=max(512, batch),
                                                long_prefill_token_threshold=512)), loaded=loaded)
    for i in range(batch):
        engine.add_request(str(i), [100 + (i + j) % 1000 for j in range(context)],
                           SamplingParams(max_tokens=steps * 3, temperature=0, ignore_eos=True))
    while any(s.num_output_tokens == 0 for s in engine.scheduler.running) or engine.num_waiting:
        engine.step()
    engine.step()
    t = time.perf_counter()
    for _ in range(steps):
        engine.step()
    engine_rate = batch * steps / (time.perf_counter() - t)
    for i in range(batch):
        engine.abort(str(i))

    from transformers import DynamicCache

    model = loaded.model
    with sdpa_attention(model):
        with torch.inference_mode():
            ids = torch.randint(100, 1000, (batch, context), device=loaded.device)
            cache = DynamicCache(config=model.config)
            model(ids, cache=cache, use_cache=True, logits_to_keep=1)
            nxt = torch.randint(100, 1000, (batch, 1), device=loaded.device)
            model(nxt, cache=cache, use_cache=True, logits_to_keep=1)
            sync(loaded.device)
            t = time.perf_counter()
            for _ in range(steps):
                logits = model(nxt, cache=cache, use_cache=True, logits_to_keep=1).logits
                nxt = logits[:, -1].argmax(-1, keepdim=True)
            sync(loaded.device)
            bare_rate = batch * steps / (time.perf_counter() - t)
    return engine_rate, bare_rate


def kernel_speed(loaded) -> tuple[float, float]:
    """(the best GEMM rate in FLOP/s on 512 rows, the best batch-1 pass over every weight in s),
    each with the default call or, on the CPU, the engine's packed one if faster."""
    cfg, dev = loaded.model.config, loaded.device
    with torch.inference_mode():
        a = torch.randn(512, cfg.hidden_size, dtype=loaded.dtype, device=dev)
        w = torch.randn(cfg.intermediate_size, cfg.hidden_size, dtype=loaded.dtype, device=dev)
        gemm_s = min(best_of(lambda: call(a), 10, dev) for call in matmul_calls(w))
    return 2 * a.shape[0] * w.shape[0] * w.shape[1] / gemm_s, weight_pass_seconds(loaded)


def throughput_ceiling(loaded, requests, speeds: list[tuple[float, float]]) -> tuple[float, str]:
    """The output tok/s no system built on this machine's matmul kernels could beat, and how, from
    the fastest of `speeds` (kernel_speed timed right before and right after the engine's run and
    after the last run: a slow spell of a shared machine during one timing does not lower the
    ceiling).

    All prompts must be prefilled (their matmul FLOPs at the best measured GEMM rate), and decode
    step i (1..longest output) carries every request with output_len >= i: it costs at least its
    matmul FLOPs at that rate, and at least one batch-1 pass of matmuls over every weight (no
    attention, no elementwise work: a floor, not an estimate).
    """
    model = loaded.model
    embed = model.get_input_embeddings().weight
    body = sum(p.numel() for p in model.parameters()) - embed.numel()  # the tied LM head counted apart
    rate, weights_step = max(r for r, _ in speeds), min(w for _, w in speeds)
    prefill = 2 * body * sum(len(r["prompt_ids"]) for r in requests) / rate
    per_token = 2 * (body + embed.numel()) / rate
    lengths = [r["output_len"] for r in requests]
    decode = sum(max(sum(n >= i for n in lengths) * per_token, weights_step) for i in range(1, max(lengths) + 1))
    ceiling = sum(lengths) / (prefill + decode)
    timed = "; ".join(f"{r / 1e9:.0f} GFLOP/s, {1000 * w:.0f} ms" for r, w in speeds)
    how = (f"ceiling: prefill {prefill:.1f} s + {max(lengths)} decode steps {decode:.1f} s at the best GEMM "
           f"rate {rate / 1e9:.0f} GFLOP/s and a batch-1 pass over the weights in {1000 * weights_step:.0f} ms "
           f"(timed before and after the engine's run and after the last run: {timed}) "
           f"= at most {ceiling:.0f} output tok/s in {str(loaded.dtype).split('.')[-1]} on this machine")
    return ceiling, how


MATMUL_GRID = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)


def matmul_bound(linears: list[PackedLinear], steps: list[tuple[int, int]], device: torch.device) -> float:
    """Seconds the engine's own matmul calls (`linears`: the layers' projections, then the LM head)
    take alone at the rows each of its `steps` ran ((rows forwarded, rows sampled)), every weight
    streamed from memory once per step as in a forward: each call set timed (best of 3) over
    MATMUL_GRID rows and interpolated linearly between. As in a step, each call's input is warm (one
    per input width: in a step it is the previous op's output) and its output is let go at once (a
    list keeping every output faults in fresh pages as it grows). No attention, no elementwise work,
    no Python: what the engine's wall would be if its matmuls were all it did."""
    *body, head = linears
    widest = max(max(r, s) for r, s in steps)
    grid = [g for g in MATMUL_GRID if g < widest] + [widest]
    with torch.inference_mode():
        def pass_times(calls: list[PackedLinear]) -> list[float]:
            times = []
            for rows in grid:
                inputs = {width: torch.randn(rows, width, dtype=calls[0].weight.dtype, device=device)
                          for width in {lin.weight.shape[1] for lin in calls}}

                def one_pass() -> None:
                    for lin in calls:
                        lin(inputs[lin.weight.shape[1]])

                times.append(best_of(one_pass, 3, device))
            return times

        body_s, head_s = pass_times(body), pass_times([head])

    forwarded, sampled = zip(*steps)
    at = [0, *grid]  # no rows, no time
    return float(np.interp(forwarded, at, [0.0, *body_s]).sum() + np.interp(sampled, at, [0.0, *head_s]).sum())


def attention_bound(loaded, kernels, decode: list[tuple[int, int]], block_size: int,
                    contiguous: bool = False) -> tuple[float, float]:
    """(seconds, GB read) of the C attention kernel (`kernels`) alone at the run's decode rows,
    each of `decode`'s steps ((decode rows, their summed context)) attended in every layer, each
    row at the step's mean context, its blocks scattered over a cache as large as the largest
    step needs (or, `contiguous`, each row's blocks one after another from a random place, as an
    allocator that kept a sequence's blocks together would lay them out), every layer's cache in
    turn (cold, as in a step). Decode attention reads every key and value of every row's context
    once, in any system with this cache's dtype. Prefill rows are left out."""
    spec = kv_cache_spec(loaded)
    heads = loaded.model.config.num_attention_heads
    contexts = [total // rows for rows, total in decode]
    widths = [-(-ctx // block_size) for ctx in contexts]
    blocks = max(rows * width for (rows, _), width in zip(decode, widths))
    scale = kernel_scale(None, spec.head_dim)
    gen = torch.Generator().manual_seed(0)
    caches = [tuple(torch.randn(spec.num_kv_heads, blocks * block_size, spec.head_dim, generator=gen).to(spec.dtype)
                    for _ in range(2)) for _ in range(spec.num_layers)]
    seconds = 0.0
    for (rows, _), ctx, width in zip(decode, contexts, widths):
        if contiguous:  # each row's run of blocks placed at random, fresh blocks every step
            starts = torch.randperm(blocks // width, generator=gen)[:rows] * width
            tables = (starts[:, None] + torch.arange(width)).contiguous()
        else:
            tables = torch.randperm(blocks, generator=gen)[: rows * width].view(rows, width).contiguous()
        ctx_lens = torch.full((rows,), ctx, dtype=torch.int64)
        q = torch.randn(rows, heads, spec.head_dim, generator=gen).to(spec.dtype)
        out = torch.empty_like(q)
        start = time.perf_counter()
        for k_cache, v_cache in caches:
            kernels.paged_attend(q, k_cache, v_cache, tables, ctx_lens, block_size, scale, out)
        seconds += time.perf_counter() - start
    tokens = sum(rows * ctx for (rows, _), ctx in zip(decode, contexts))
    return seconds, tokens * spec.bytes_per_token / 1e9


def weight_arrangements(model) -> list[list[torch.Tensor]]:
    """Every weight matrix a forward multiplies by, the (tied) LM head last, in each arrangement a
    system may stream them: as the model holds them and, where its layers have llama's projections,
    with each layer's q/k/v and gate/up as one matrix each, as the engine's lean forward holds them
    (fewer, larger calls: on an AMD EPYC Zen 5 the model's 211 fp32 matrices took 9.3-9.5 ms a pass
    where its 121 fused ones took 8.2-8.5). The fused arrangement only where it holds every weight
    of the other (no layer with projections beyond these)."""
    head = model.get_input_embeddings().weight
    as_held = [m.weight for m in model.model.modules() if isinstance(m, torch.nn.Linear)] + [head]
    names = {"self_attn": ("q_proj", "k_proj", "v_proj", "o_proj"), "mlp": ("gate_proj", "up_proj", "down_proj")}
    layers = getattr(model.model, "layers", [])
    if not layers or not all(hasattr(getattr(layer, part, None), name) for layer in layers
                             for part, group in names.items() for name in group):
        return [as_held]
    fused = []
    for layer in layers:
        attn, mlp = layer.self_attn, layer.mlp
        fused += [torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]), attn.o_proj.weight,
                  torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]), mlp.down_proj.weight]
    fused.append(head)
    if sum(w.numel() for w in fused) != sum(w.numel() for w in as_held):
        return [as_held]
    return [as_held, fused]


def weight_pass_seconds(loaded) -> float:
    """Best time of one batch-1 matmul over every weight matrix (each streamed once from memory,
    as a batch-1 decode step must), over every arrangement of them (`weight_arrangements`) and
    every way to multiply (`matmul_calls`)."""
    dev = loaded.device
    best = float("inf")
    with torch.inference_mode():
        for matrices in weight_arrangements(loaded.model):
            inputs = [torch.randn(1, m.shape[1], dtype=loaded.dtype, device=dev) for m in matrices]
            for calls in zip(*(matmul_calls(m) for m in matrices)):  # each way, for every matrix

                def one_pass() -> None:
                    for x, call in zip(inputs, calls):
                        call(x)

                best = min(best, best_of(one_pass, 5, dev))
    return best


def matmul_calls(w: torch.Tensor) -> list:
    """Every way the engine can multiply by w (each a function of x): the default F.linear call,
    and on the CPU oneDNN's packed matmul and, where they take w, the C kernels' own GEMM over its
    packed copy on 2 MB pages, where the engine keeps it (`huge_pages`)."""
    calls = [lambda x: torch.nn.functional.linear(x, w)]
    if w.device.type == "cpu":
        kernels = cpu_kernels.load()
        packed = PackedLinear(w, kernels=kernels)
        if packed.packed is not None:
            calls.append(packed.onednn_matmul)
        if packed.own is not None:
            own_copies_on_huge_pages([packed])
            calls.append(lambda x: kernels.gemm(x, packed.own, w.shape[0]))
    return calls


def sync(device: torch.device) -> None:
    """Wait for queued GPU work, so wall-clock timings cover it (no-op on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def best_of(fn, runs: int, device: torch.device) -> float:
    fn()
    best = float("inf")
    for _ in range(runs):
        sync(device)
        t = time.perf_counter()
        fn()
        sync(device)
        best = min(best, time.perf_counter() - t)
    return best


HEADER = (f"{'system':44s} {'wall s':>8s} {'tok/s':>8s} {'e2e p50':>8s} {'e2e p99':>8s} {'ttft p50':>8s} "
          f"{'ttft p99':>8s} {'engine x':>9s}")


def row_line(r: dict, base: dict) -> str:
    return (f"{r['system']:44s} {r['wall_s']:8.1f} {r['tok_s']:8.1f} {r['e2e_p50']:8.1f} {r['e2e_p99']:8.1f} "
            f"{r['ttft_p50']:8.2f} {r['ttft_p99']:8.2f} {base['tok_s'] / r['tok_s']:8.2f}x")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--also-bf16", action="store_true", help="repeat the engine rows and efficiency in bf16")
    ap.add_argument("--skip-peers", action="store_true", help="engine rows only")
    ap.add_argument("--num-threads", type=int, default=None)
    ap.add_argument("--device", default="cpu", help="cpu or cuda (benchmarks/gpu_check.sh)")
    ap.add_argument("--model", default=None, help="model folder or .gguf (default: the embedded model)")
    ap.add_argument("--num-requests", type=int, default=64, help="use the first N requests (quick runs)")
    args = ap.parse_args()
    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    requests = json.loads(WORKLOAD.read_text())["requests"][: args.num_requests]
    print(f"skewed workload: {len(requests)} requests, {sum(r['output_len'] for r in requests)} forced output tokens, "
          f"{torch.get_num_threads()} threads")
    for dtype in [args.dtype] + (["bfloat16"] if args.also_bf16 and args.dtype != "bfloat16" else []):
        loaded = load_model(args.model, dtype=dtype, device=args.device)
        print(f"\n== {dtype} ==")
        runs = [lambda: run_engine(loaded, requests, "continuous", 64),
                lambda: run_engine(loaded, requests, "static", 64)]
        if not args.skip_peers and dtype == args.dtype:
            runs += [lambda: run_hf_static(loaded, requests, 8), lambda: run_hf_continuous(loaded, requests)]
        print(HEADER, flush=True)
        rows: list[dict] = []
        speeds = [kernel_speed(loaded)]
        for run in runs:
            rows.append(run())
            print(row_line(rows[-1], rows[0]), flush=True)
            if len(rows) == 1:
                speeds.append(kernel_speed(loaded))
        speeds.append(kernel_speed(loaded))
        ceiling, how = throughput_ceiling(loaded, requests, speeds)
        print(how, flush=True)
        print(f"engine continuous reaches {100 * rows[0]['tok_s'] / ceiling:.0f} % of that ceiling", flush=True)
        if rows[0]["linears"] is not None:
            bound = matmul_bound(rows[0]["linears"], rows[0]["steps"], loaded.device)
            tokens = rows[0]["tok_s"] * rows[0]["wall_s"]
            print(f"matmuls alone: the engine's own matmul calls at the rows each of its {len(rows[0]['steps'])} "
                  f"steps ran, weights streamed from memory as in a step, take {bound:.1f} s "
                  f"({tokens / bound:.0f} tok/s = {100 * tokens / bound / ceiling:.0f} % of the ceiling); the "
                  f"engine's {rows[0]['wall_s']:.1f} s is {100 * bound / rows[0]['wall_s']:.0f} % matmuls, "
                  f"{100 - 100 * bound / rows[0]['wall_s']:.0f} % the rest (attention, elementwise, Python)",
                  flush=True)
            if rows[0]["attention_kernel"] is not None and rows[0]["decode"]:
                attn_s, gb = attention_bound(loaded, rows[0]["attention_kernel"], rows[0]["decode"], rows[0]["block_size"])
                alone = bound + attn_s
                print(f"decode attention alone: the attention kernel at each step's decode rows and context, every "
                      f"layer's cache cold, reads {gb:.1f} GB in {attn_s:.1f} s ({gb / attn_s:.0f} GB/s); matmuls and "
                      f"it alone take {alone:.1f} s ({tokens / alone:.0f} tok/s = {100 * tokens / alone / ceiling:.0f} % "
                      f"of the ceiling), {100 * alone / rows[0]['wall_s']:.0f} % of the engine's wall", flush=True)
                together_s, _ = attention_bound(loaded, rows[0]["attention_kernel"], rows[0]["decode"],
                                                rows[0]["block_size"], contiguous=True)
                print(f"decode attention alone with each row's blocks contiguous instead of scattered: "
                      f"{together_s:.2f} s against {attn_s:.2f} s ({gb / together_s:.0f} GB/s, "
                      f"{attn_s / together_s:.2f}x as fast)", flush=True)
        for batch, ctx in ((64, 160), (1, 160)):
            eng, bare = efficiency(loaded, batch, ctx)
            print(f"efficiency at batch {batch}, context {ctx}: engine {eng:.1f} tok/s vs bare forward "
                  f"{bare:.1f} tok/s = {100 * eng / bare:.0f} %", flush=True)


if __name__ == "__main__":
    main()
