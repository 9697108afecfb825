"""One chat at a time, as the web UI's chat meets the engine (not a test; prints figures).

A chat prompt of about 200 tokens, greedy, `--max-tokens` forced output tokens, one request alone
in the engine (the server's settings otherwise): TTFT (prefill of the prompt + first token) and
decode tok/s after the first token, side by side with the weight-streaming limit: one batch-1
matmul pass over every weight matrix, timed here (see `throughput.weight_pass_seconds`), which a
batch-1 decode step cannot beat (it reads every weight once).

    python benchmarks/single_stream.py [--dtypes float32,bfloat16] [--max-tokens 128] [--runs 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from throughput import weight_pass_seconds  # noqa: E402

from appliance.cli import build_parser  # noqa: E402
from appliance.engine import LLMEngine, SamplingParams  # noqa: E402
from appliance.model_loader import load_model  # noqa: E402
from appliance.settings import engine_config_from_args  # noqa: E402

QUESTION = ("I am planning a week-long walking holiday in the Scottish Highlands in late September. "
            "I will carry a tent, cook for myself and walk about twenty kilometres a day. ")


def chat_prompt(engine: LLMEngine, target: int = 200) -> list[int]:
    """A user message repeated until the templated chat prompt holds about `target` tokens."""
    text = ""
    while True:
        ids = engine.encode_chat([{"role": "user", "content": text + "What should I pack, and why?"}])
        if len(ids) >= target:
            return ids
        text += QUESTION


def one_chat(engine: LLMEngine, prompt: list[int], max_tokens: int) -> tuple[float, float]:
    """(TTFT s, decode tok/s after the first token) of one request alone in the engine."""
    params = SamplingParams(max_tokens=max_tokens, min_tokens=max_tokens, temperature=0, ignore_eos=True)
    t0 = time.perf_counter()
    engine.add_request(f"chat-{t0}", prompt, params)
    first = last = None
    while engine.has_unfinished():
        for out in engine.step():
            if out.new_token_ids:
                last = time.perf_counter()
                first = first or last
    return first - t0, (max_tokens - 1) / (last - first)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--runs", type=int, default=3, help="chats per dtype (the median is printed)")
    args = ap.parse_args()
    print(f"{'dtype':10s} {'prompt':>7s} {'TTFT ms':>8s} {'decode tok/s':>13s} {'weight pass ms':>15s} "
          f"{'limit tok/s':>12s} {'of limit':>9s}")
    for dtype in args.dtypes.split(","):
        loaded = load_model(dtype=dtype, device="cpu")
        engine = LLMEngine(engine_config_from_args(build_parser().parse_args(["serve", "--dtype", dtype])), loaded=loaded)
        prompt = chat_prompt(engine)
        one_chat(engine, prompt[:20], 4)  # warm-up
        runs = [one_chat(engine, prompt, args.max_tokens) for _ in range(args.runs)]
        ttft = statistics.median(r[0] for r in runs)
        rate = statistics.median(r[1] for r in runs)
        limit = 1 / weight_pass_seconds(loaded)
        print(f"{dtype:10s} {len(prompt):7d} {1000 * ttft:8.0f} {rate:13.1f} {1000 / limit:15.1f} {limit:12.1f} "
              f"{100 * rate / limit:8.0f} %", flush=True)


if __name__ == "__main__":
    main()
