"""The synchronous engine: add request -> schedule -> run -> postprocess, one iteration per step().

Not thread-safe: one thread owns it (AsyncEngine runs it in its own thread). Knob changes are
applied between steps, so every iteration runs with one consistent knob set.
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch

from ..model_loader import LoadedModel, load_model
from .block_manager import BlockManager
from .config import DEFAULT_CPU_KV_MEMORY, EngineConfig, parse_bytes
from .detokenizer import IncrementalDetokenizer
from .knobs import Knobs, KnobState, KnobUpdate
from .model_runner import ModelRunner, kv_cache_spec
from .sampler import make_generator, sample
from .sampling import InvalidRequestError, SamplingParams
from .scheduler import Scheduler, SchedulerOutput
from .sequence import Sequence, Status
from .stats import (
    FinishReason,
    InFlightRequest,
    IterationStats,
    KnobChange,
    RequestStats,
    StatsSink,
    decode_context_tokens,
    iteration_stats,
)
from .validation import RequestErrorCode

log = logging.getLogger(__name__)


@dataclass
class RequestOutput:
    """What one request produced in one step (a delta), or its final state when finished."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    token_ids: list[int]
    finished: bool
    finish_reason: FinishReason | None
    prompt_tokens: int
    output_tokens: int
    cached_tokens: int = 0  # prompt tokens served from the prefix cache
    error: str | None = None
    text: str = ""  # all text so far (complete on the final output)
    metrics: RequestStats | None = field(default=None, repr=False)


class LLMEngine:
    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None):
        self.config = config
        self.loaded = loaded or load_model(config.model, config.dtype, config.device)
        self.tokenizer = self.loaded.tokenizer
        self.model_name = self.loaded.name
        self.device = self.loaded.device
        self.vocab_size = self.loaded.model.config.vocab_size
        self.eos_token_ids = _eos_ids(self.loaded)
        torch.manual_seed(config.seed)

        num_blocks = self._num_blocks()
        self.block_manager = BlockManager(num_blocks, config.block_size, config.knobs.enable_prefix_caching)
        self.runner = ModelRunner(self.loaded, num_blocks, config.block_size, config.fast_forward, config.cpu_kernels)
        capacity = num_blocks * config.block_size
        limit = min(self.loaded.model.config.max_position_embeddings, capacity)
        if config.max_model_len is not None and config.max_model_len > limit:
            raise ValueError(
                f"max_model_len {config.max_model_len} exceeds what fits: model context "
                f"{self.loaded.model.config.max_position_embeddings}, KV cache {capacity} tokens"
            )
        self.max_model_len = config.max_model_len or limit
        self.cpu_kernels = self.runner.attention_kernel is not None  # in effect (built and supported)
        self.knob_state = KnobState(config.knobs)  # the one owner of the knobs, their version and history
        self.scheduler = Scheduler(self.block_manager, self.knob_state.knobs)  # told of each change
        self.iteration = 0
        self.sinks: list[StatsSink] = []
        self._seqs: dict[str, Sequence] = {}
        self._aborted: list[RequestOutput] = []
        self._tickets = itertools.count()
        self.last_stats: IterationStats | None = None
        log.info(
            "KV cache: %d blocks x %d tokens = %d tokens (%.1f MiB), max_model_len %d, %s on %s",
            num_blocks, config.block_size, capacity,
            capacity * self.runner.spec.bytes_per_token / 2**20, self.max_model_len,
            self.loaded.dtype, self.device,
        )

    # -- sizing -------------------------------------------------------------------------------
    def _num_blocks(self) -> int:
        cfg = self.config
        if cfg.num_blocks is not None:
            return cfg.num_blocks
        per_block = kv_cache_spec(self.loaded).bytes_per_token * cfg.block_size
        if cfg.kv_cache_memory is not None:
            budget = parse_bytes(cfg.kv_cache_memory)
        elif self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            budget = int(total * cfg.gpu_memory_utilization) - (total - free)
        else:
            budget = parse_bytes(DEFAULT_CPU_KV_MEMORY)
        blocks = budget // per_block
        if blocks < 1:
            raise ValueError(f"KV cache budget of {budget} bytes holds no block of {per_block} bytes")
        return int(blocks)

    # -- public API ---------------------------------------------------------------------------
    @property
    def knobs(self) -> Knobs:
        return self.knob_state.knobs

    @property
    def knob_version(self) -> int:
        return self.knob_state.snapshot.version

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    def in_flight(self) -> list[InFlightRequest]:
        """The requests not yet finished, as they stand now; callable from any thread: the table
        is copied in one call that holds the GIL throughout, and each request's fields are read
        as the engine thread last wrote them (a step in progress may have updated some)."""
        seqs = list(self._seqs.values())
        return [InFlightRequest(s.arrival, s.num_prompt_tokens, s.num_output_tokens, s.params.max_tokens, s.first_token,
                                s.num_cached_tokens or 0) for s in seqs]

    def add_sink(self, sink: StatsSink) -> None:
        self.sinks.append(sink)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._aborted)

    def encode_prompt(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def encode_chat(self, messages: list[dict]) -> list[int]:
        """Apply the model's chat template. Message text is tokenised as plain text: control
        tokens written inside a message (e.g. `<|im_start|>system`) stay ordinary characters."""
        from .chat import encode_chat

        return encode_chat(self.tokenizer, messages)

    def add_request(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        source: str = "api",
        run_id: str | None = None,
        arrival: float | None = None,
    ) -> None:
        """Queue a request; raise InvalidRequestError (nothing queued) when it cannot be served."""
        self.validate_request(prompt_ids, params)
        if request_id in self._seqs:
            raise InvalidRequestError(f"request id {request_id!r} is already in use", "request_id")
        seq = Sequence(
            request_id=request_id,
            prompt_token_ids=list(prompt_ids),
            params=params,
            detokenizer=IncrementalDetokenizer(self.tokenizer),
            generator=make_generator(params.seed, self.device),
            source=source,
            run_id=run_id,
            arrival=arrival if arrival is not None else time.time(),
            arrival_order=next(self._tickets),
        )
        self._seqs[request_id] = seq
        self.scheduler.add(seq)

    def validate_request(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Raise InvalidRequestError naming the problem; pure, safe from any thread."""
        params.validate(self.vocab_size)
        if not isinstance(prompt_ids, list) or not prompt_ids:
            raise InvalidRequestError("the prompt is empty", "prompt")
        if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < self.vocab_size for t in prompt_ids):
            raise InvalidRequestError(f"prompt token ids must be integers in [0, {self.vocab_size})", "prompt")
        total = len(prompt_ids) + params.max_tokens
        if total > self.max_model_len:
            raise InvalidRequestError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, you "
                f"requested {total} tokens ({len(prompt_ids)} in the prompt, {params.max_tokens} "
                "for the completion). Please reduce the prompt or max_tokens.",
                "max_tokens" if len(prompt_ids) < self.max_model_len else "prompt",
                RequestErrorCode.CONTEXT_LENGTH_EXCEEDED,
            )

    def abort(self, request_id: str) -> bool:
        """Stop a request now and free its blocks; its final output comes with the next step."""
        seq = self._seqs.get(request_id)
        if seq is None or seq.is_finished:
            return False
        self._finish(seq, FinishReason.ABORT)
        self._aborted.append(self._output(seq, [], ""))
        return True

    def apply_knobs(self, update: KnobUpdate) -> KnobChange | None:
        """Validate the whole change (KnobError names each bad field; nothing applied) and apply it
        before the next iteration. Returns the change with the iteration at which it takes effect,
        or None when it changes nothing (no new version)."""
        change = self.knob_state.apply(update, self.iteration)
        if change is not None:
            self.scheduler.knobs = self.knob_state.knobs
            for sink in self.sinks:
                sink.on_knob_change(change)
        return change

    def update_knobs(self, changes: Mapping[str, Any], source: str = "api", **why: Any) -> KnobChange | None:
        """`why`: KnobUpdate's reason, prediction and expected_version."""
        return self.apply_knobs(KnobUpdate(changes, source, **why))

    def step(self) -> list[RequestOutput]:
        """Run one iteration; return every request's new output (finished ones included)."""
        outputs, self._aborted = self._aborted, []
        started = time.time()
        t0 = time.perf_counter()
        sched = self.scheduler.schedule()
        if sched.is_empty:
            return outputs
        context = decode_context_tokens(sched)
        forward_end = None
        try:
            result = self.runner.execute(sched)
            forward_end = time.perf_counter()
            outputs.extend(self._postprocess(sched, result))
        except Exception as exc:  # the model or sampler failed: end this batch's requests, keep serving
            log.exception("iteration %d failed; ending its %d requests with an error", self.iteration, len(sched.scheduled))
            for item in sched.scheduled:  # each gets exactly one final output
                if not item.seq.is_finished:
                    self._finish(item.seq, FinishReason.ERROR, error=f"internal error in the model: {type(exc).__name__}")
                outputs.append(self._output(item.seq, [], ""))
        end = time.perf_counter()
        sample_s = end - forward_end if forward_end is not None else 0.0
        self._publish(sched, started, end - t0, sample_s, sum(o.finished for o in outputs), context)
        return outputs

    def generate(self, prompts: list[str | list[int]], params: SamplingParams) -> list[RequestOutput]:
        """Run prompts to completion (blocking); return one final output per prompt, in order."""
        ids = []
        for i, prompt in enumerate(prompts):
            rid = f"generate-{next(self._tickets)}-{i}"
            tokens = self.encode_prompt(prompt) if isinstance(prompt, str) else prompt
            self.add_request(rid, tokens, params, source="engine")
            ids.append(rid)
        finals: dict[str, RequestOutput] = {}
        while len(finals) < len(ids):
            for out in self.step():
                if out.finished:
                    finals[out.request_id] = out
        return [finals[rid] for rid in ids]

    # -- postprocess --------------------------------------------------------------------------
    def _postprocess(self, sched: SchedulerOutput, result) -> list[RequestOutput]:
        for item in sched.scheduled:
            item.seq.num_computed_tokens += item.num_tokens
        seqs = [sched.scheduled[i].seq for i in result.sample_indices]
        banned = [self._banned(seq) for seq in seqs]
        tokens = sample(result.logits, [s.params for s in seqs], [s.generator for s in seqs], banned, self.runner.kernels)
        now = time.time()
        outputs = []
        for seq, token in zip(seqs, tokens):
            seq.output_token_ids.append(token)
            if seq.first_token is None:
                seq.first_token = now
            seq.detokenizer.add(token)
            reason = self._stop_reason(seq, token)
            if reason:
                self._finish(seq, reason)
            outputs.append(self._output(seq, [token], self._new_text(seq)))
        return outputs

    def _banned(self, seq: Sequence) -> list[int]:
        if seq.num_output_tokens >= seq.params.min_tokens:
            return []
        return list(self.eos_token_ids) + list(seq.params.stop_token_ids)

    def _stop_reason(self, seq: Sequence, token: int) -> FinishReason | None:
        p = seq.params
        if seq.num_output_tokens >= p.min_tokens:
            if token in p.stop_token_ids or (not p.ignore_eos and token in self.eos_token_ids):
                return FinishReason.STOP
            if p.stop and self._truncate_at_stop(seq):
                return FinishReason.STOP
        if seq.num_output_tokens >= p.max_tokens or seq.num_tokens >= self.max_model_len:
            return FinishReason.LENGTH
        return None

    def _truncate_at_stop(self, seq: Sequence) -> bool:
        """If a stop string appeared, cut the text before it and return True."""
        text = seq.detokenizer.text
        window_start = max(0, seq.emitted_text_len - max(len(s) for s in seq.params.stop))
        hits = [i for i in (text.find(s, window_start) for s in seq.params.stop) if i >= 0]
        if not hits:
            return False
        seq.detokenizer.text = text[: min(hits)]
        return True

    def _new_text(self, seq: Sequence) -> str:
        """Text not yet returned; while a stop string could still be forming, hold its tail back."""
        if seq.is_finished and seq.finish_reason is not FinishReason.STOP:
            seq.detokenizer.flush()
        text = seq.detokenizer.text
        end = len(text)
        if not seq.is_finished and seq.params.stop:
            end = max(seq.emitted_text_len, end - (max(len(s) for s in seq.params.stop) - 1))
        piece = text[seq.emitted_text_len : end]
        seq.emitted_text_len = end
        return piece

    def _finish(self, seq: Sequence, reason: FinishReason, error: str | None = None) -> None:
        self.scheduler.remove(seq)
        seq.status = Status.FINISHED
        seq.finish_reason = reason
        seq.error = error
        seq.finished_at = time.time()
        del self._seqs[seq.request_id]
        stats = RequestStats(
            request_id=seq.request_id, source=seq.source, run_id=seq.run_id, arrival=seq.arrival,
            first_scheduled=seq.first_scheduled, first_token=seq.first_token, finished=seq.finished_at,
            prompt_tokens=seq.num_prompt_tokens, output_tokens=seq.num_output_tokens,
            cached_tokens=seq.num_cached_tokens or 0, finish_reason=reason, preemptions=seq.preemptions,
        )
        seq.stats = stats
        for sink in self.sinks:
            sink.on_request(stats)

    def _output(self, seq: Sequence, new_tokens: list[int], new_text: str) -> RequestOutput:
        return RequestOutput(
            request_id=seq.request_id,
            new_token_ids=new_tokens,
            new_text=new_text,
            token_ids=seq.output_token_ids if seq.is_finished else [],
            finished=seq.is_finished,
            finish_reason=seq.finish_reason,
            prompt_tokens=seq.num_prompt_tokens,
            output_tokens=seq.num_output_tokens,
            cached_tokens=seq.num_cached_tokens or 0,
            error=seq.error,
            text=seq.detokenizer.text[: seq.emitted_text_len] if seq.is_finished else "",
            metrics=seq.stats,
        )

    def _publish(self, sched: SchedulerOutput, started: float, duration: float, sample_s: float, finished: int,
                 context: int) -> None:
        stats = iteration_stats(sched, self.scheduler, iteration=self.iteration, started_at=started,
                                duration_s=duration, sample_s=sample_s, finished=finished,
                                decode_context_tokens=context, knob_version=self.knob_version)
        self.last_stats = stats
        self.iteration += 1
        for sink in self.sinks:
            sink.on_iteration(stats)


def _eos_ids(loaded: LoadedModel) -> frozenset[int]:
    ids: set[int] = set()
    gen = getattr(loaded.model, "generation_config", None)
    for source in (getattr(gen, "eos_token_id", None), loaded.tokenizer.eos_token_id):
        if isinstance(source, int):
            ids.add(source)
        elif source:
            ids.update(source)
    return frozenset(ids)
