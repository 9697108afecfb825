"""Chat tab: multi-turn chat streamed through the server's own /v1/chat/completions.

Stop cancels the streaming event; closing the generator closes the HTTP connection and the
server aborts the request. Each reply's TTFT, decode rate, token count and how many of its prompt
tokens came from the prefix cache are listed below.
"""

from __future__ import annotations

from typing import Any, AsyncIterator

import gradio as gr

from appliance.numeric import to_ms

from ui.api_client import ApiError, ChatStats
from ui.context import DashboardContext

CHAT_CONCURRENCY = 16  # chats from different browser tabs proceed at once
STATS_HEADERS = ["reply", "TTFT (ms)", "tokens/s", "tokens", "prompt tokens cached", "finish"]


def message_text(content: Any) -> str:
    """Plain text of a chat message's content (a string, or Gradio's list of parts)."""
    if isinstance(content, str):
        return content
    if isinstance(content, dict):
        return str(content.get("text") or content.get("content") or "")
    if isinstance(content, (list, tuple)):
        return "".join(message_text(part) for part in content)
    return "" if content is None else str(content)


def build_messages(system: str, history: list[dict[str, Any]], user: str) -> list[dict[str, str]]:
    """The OpenAI messages for the next turn: system prompt, earlier turns, the new message."""
    messages = [{"role": "system", "content": system.strip()}] if system and system.strip() else []
    for turn in history:
        role = turn.get("role")
        text = message_text(turn.get("content"))
        if role in ("user", "assistant") and text:
            messages.append({"role": role, "content": text})
    messages.append({"role": "user", "content": user})
    return messages


def stats_row(number: int, stats: ChatStats) -> list[Any]:
    ttft = stats.ttft_s
    rate = stats.tokens_per_s
    return [number, to_ms(ttft, 1),
            None if rate is None else round(rate, 1), stats.tokens, cached_text(stats), stats.finish_reason or ""]


def cached_text(stats: ChatStats) -> str:
    """'48 / 60': prompt tokens served from the prefix cache out of the prompt's tokens."""
    if stats.cached_tokens is None or stats.prompt_tokens is None:
        return ""
    return f"{stats.cached_tokens} / {stats.prompt_tokens}"


class ChatTab:
    def __init__(self, ctx: DashboardContext):
        self.ctx = ctx
        self._model: str | None = None

    def build(self) -> None:
        with gr.Row():
            with gr.Column(scale=3):
                self.chatbot = gr.Chatbot(label="Conversation", elem_id="chat-history", height=420,
                                          feedback_options=None)
                # one line that grows: Gradio submits on Enter only in a one-line box, and a
                # textarea adds a line on Shift+Enter
                self.input = gr.Textbox(label="Message", placeholder="Type a message: Enter sends, Shift+Enter adds a line",
                                        elem_id="chat-input", lines=1, max_lines=8)
                with gr.Row():
                    self.send = gr.Button("Send", variant="primary", elem_id="chat-send")
                    self.stop = gr.Button("Stop", variant="stop", elem_id="chat-stop")
                    self.clear = gr.Button("Clear", elem_id="chat-clear")
            with gr.Column(scale=2):
                self.system = gr.Textbox(label="System prompt", lines=3, elem_id="chat-system")
                self.temperature = gr.Slider(0.0, 2.0, value=0.7, step=0.05, label="temperature",
                                             elem_id="chat-temperature")
                self.max_tokens = gr.Slider(1, 2048, value=256, step=1, precision=0, label="max tokens",
                                            elem_id="chat-max-tokens")
                self.error = gr.Markdown("", elem_id="chat-error")
                self.stats = gr.Dataframe(headers=STATS_HEADERS, value=[], label="Per reply", type="array",
                                          elem_id="chat-stats", interactive=False)
        inputs = [self.input, self.chatbot, self.system, self.temperature, self.max_tokens, self.stats]
        outputs = [self.chatbot, self.input, self.error, self.stats]
        send = self.send.click(self.respond, inputs, outputs, api_name="chat",
                               concurrency_limit=CHAT_CONCURRENCY, show_progress="hidden")
        submit = self.input.submit(self.respond, inputs, outputs, api_name="chat_submit",
                                   concurrency_limit=CHAT_CONCURRENCY, show_progress="hidden")
        self.stop.click(None, None, None, cancels=[send, submit], api_name="chat_stop")
        self.clear.click(self.on_clear, None, [self.chatbot, self.error, self.stats], api_name="chat_clear",
                         cancels=[send, submit])

    def on_clear(self) -> tuple[Any, ...]:
        """An empty conversation (a message being typed stays)."""
        return [], "", []

    async def model(self) -> str:
        if self._model is None:
            self._model = await self.ctx.api.model_id()
        return self._model

    async def respond(
        self,
        message: str,
        history: list[dict[str, Any]],
        system: str,
        temperature: float,
        max_tokens: float,
        rows: list[list[Any]],
        request: gr.Request,
    ) -> AsyncIterator[tuple[Any, ...]]:
        """Stream one reply; yields (chat, input box, error, per-reply table)."""
        self.ctx.check(request)
        history = list(history or [])
        rows = [list(r) for r in rows or [] if any(v not in (None, "") for v in r)]
        if not message or not message.strip():
            yield history, message, "Type a message first.", rows
            return
        messages = build_messages(system, history, message)
        shown = history + [{"role": "user", "content": message}, {"role": "assistant", "content": ""}]
        yield shown, "", "", rows
        stats = ChatStats()
        reply = ""
        try:
            async for delta in self.ctx.api.stream_chat(
                messages, model=await self.model(), temperature=float(temperature),
                max_tokens=int(max_tokens), stats=stats,
            ):
                reply += delta
                shown[-1] = {"role": "assistant", "content": reply}
                yield shown, "", "", rows
        except ApiError as exc:
            if not reply:
                shown = shown[:-1]
            yield shown, "", f"**Error:** {exc.message}", rows
            return
        rows = rows + [stats_row(len(rows) + 1, stats)]
        yield shown, "", "", rows
