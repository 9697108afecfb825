"""The few library pieces the appliance uses without a public API behind them, checked against
the installed versions: each test fails naming the library and its version when the piece moves.

pyproject.toml pins the ranges tested. What each piece is for:
- gradio: `Blocks._queue.sleep_when_free` / `progress_update_sleep_when_free` (ui.app.quiet_queue
  slows the queue's idle polling; no public setting exists).
- torch: `torch.ops.mkldnn._reorder_linear_weight` / `_linear_pointwise` (fast_llama.PackedLinear
  packs each weight once for oneDNN; without them it runs plain F.linear, slower).
- uvicorn: `Server.handle_exit` as the SIGINT/SIGTERM handler while serving (ApplianceServer drains
  before shutting down and exits 0).
- transformers: `set_attn_implementation` is public; the check is that it routes attention through
  a function registered with `AttentionInterface`, which the engine's paged attention relies on.
"""

from __future__ import annotations

import signal
import threading

import pytest
import torch


def test_gradio_queue_polling_attributes_are_where_quiet_queue_sets_them():
    import gradio as gr

    from ui.app import PROGRESS_POLL_S, QUEUE_POLL_S, quiet_queue

    with gr.Blocks() as blocks:
        gr.Markdown("x")
    queue = getattr(blocks, "_queue", None)
    for name in ("sleep_when_free", "progress_update_sleep_when_free"):
        assert isinstance(getattr(queue, name, None), (int, float)), (
            f"gradio {gr.__version__}: Blocks._queue.{name} moved; update ui.app.quiet_queue and the pin in pyproject.toml")
    quiet_queue(blocks)
    assert queue.sleep_when_free >= QUEUE_POLL_S and queue.progress_update_sleep_when_free >= PROGRESS_POLL_S


def test_torch_onednn_packing_ops_exist_and_match_f_linear():
    from appliance.engine import fast_llama

    if not torch.backends.mkldnn.is_available():
        pytest.skip(f"torch {torch.__version__} is built without oneDNN")
    missing = [op for op in fast_llama.PACKED_OPS if not hasattr(torch.ops.mkldnn, op)]
    assert not missing, (f"torch {torch.__version__}: torch.ops.mkldnn.{', '.join(missing)} moved; "
                         "update appliance.engine.fast_llama.PackedLinear and the pin in pyproject.toml")
    assert fast_llama.packing_available(torch.float32)
    torch.manual_seed(0)
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        if not fast_llama.packing_available(dtype):  # a CPU without bfloat16 support in oneDNN
            continue
        weight, x, residual = torch.randn(48, 32, dtype=dtype), torch.randn(5, 32, dtype=dtype), torch.randn(5, 48, dtype=dtype)
        linear = fast_llama.PackedLinear(weight)
        expected = torch.nn.functional.linear(x, weight)
        try:
            plain, added = linear(x), linear(x, residual=residual)
        except (RuntimeError, TypeError) as exc:
            pytest.fail(f"torch {torch.__version__}: the private oneDNN linear ops changed their signature ({exc}); "
                        "update appliance.engine.fast_llama.PackedLinear")
        assert linear.packed is not None
        assert torch.allclose(plain, expected, atol=tol, rtol=tol), f"torch {torch.__version__}: packed linear differs"
        assert torch.allclose(added, residual + expected, atol=tol, rtol=tol), \
            f"torch {torch.__version__}: packed linear + residual differs"


def test_uvicorn_calls_handle_exit_on_sigint_and_sigterm_while_serving():
    import uvicorn

    from appliance.server.cli import ApplianceServer

    assert threading.current_thread() is threading.main_thread()
    server = ApplianceServer(uvicorn.Config(app=None), drain=None, drain_grace_s=0.0)  # type: ignore[arg-type]
    capture = getattr(server, "capture_signals", None)
    assert capture is not None, (f"uvicorn {uvicorn.__version__}: Server.capture_signals moved; check how it "
                                 "installs its signal handlers (ApplianceServer.handle_exit) and the pin in pyproject.toml")
    with capture():
        for sig in (signal.SIGINT, signal.SIGTERM):
            assert signal.getsignal(sig) == server.handle_exit, (
                f"uvicorn {uvicorn.__version__} no longer handles {sig.name} with Server.handle_exit; "
                "update appliance.server.cli.ApplianceServer and the pin in pyproject.toml")
    assert signal.getsignal(signal.SIGTERM) != server.handle_exit  # restored after serving


def test_transformers_set_attn_implementation_routes_through_a_registered_function():
    import transformers
    from transformers import AttentionInterface, LlamaConfig, LlamaForCausalLM
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    calls = []

    def probe(module, query, key, value, attention_mask, **kwargs):
        calls.append(query.shape)
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register("appliance_probe", probe)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, vocab_size=64))
    model.set_attn_implementation("appliance_probe")
    with torch.inference_mode():
        model(torch.tensor([[1, 2, 3]]))
    assert len(calls) == 2, (f"transformers {transformers.__version__}: set_attn_implementation no longer routes "
                             "attention through AttentionInterface functions; the engine's paged attention needs it")
