"""`python -m decoders.serve`: an OpenAI-compatible HTTP server on the serving engine.

    python -m decoders.serve --model llama-1b                      # random weights, token-id prompts
    python -m decoders.serve --model path/to/checkpoint --port 8000 --max-batch 64

Endpoints: `POST /v1/completions` (a prompt as text when the checkpoint has a tokenizer, or as a
list of token ids), `POST /v1/chat/completions` (when the tokenizer has a chat template), both with
server-sent-event streaming; `GET /v1/models`, `GET /health`, `GET /metrics` (Prometheus text).

One engine thread owns the `Engine` (every `add_request` / `cancel` / `step` happens on it); HTTP
handlers run on uvicorn's asyncio loop and talk to it through a thread-safe inbox, and the engine
thread hands each request's outputs back to its handler with `loop.call_soon_threadsafe`.

Without a tokenizer (the presets), response text is the new token ids joined by spaces; every choice
also carries `token_ids`, the new tokens themselves. A bad request is a 4xx with an OpenAI-style
error body; a full engine answers 503; a client that disconnects has its request cancelled.
"""

import argparse
import asyncio
import contextlib
import json
import logging
import math
import queue
import secrets
import signal
import socket
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field

import torch

import decoders
from decoders import cli
from decoders.base import UsageError
from decoders.engine import Engine, EngineFull, Request
from decoders.sampling import Sampling

try:
    import uvicorn
    from starlette.applications import Starlette
    from starlette.exceptions import HTTPException
    from starlette.responses import JSONResponse, PlainTextResponse, StreamingResponse
    from starlette.routing import Route
except ImportError as e:
    print(f"error: decoders.serve needs the serve extra (pip install -e '.[serve]'): {e}", file=sys.stderr)
    raise SystemExit(2) from None

log = logging.getLogger("decoders.serve")

# Histogram buckets (seconds): time to first token spans queueing and prefill, inter-token latency one step.
TTFT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
ITL_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
# A non-streaming handler checks this often whether its client is still there.
DISCONNECT_POLL_S = 0.5


class RequestError(Exception):
    """A request the server refuses: its HTTP status and the OpenAI-style error body's fields."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None, kind: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.kind = kind or ("invalid_request_error" if status < 500 else "server_error")

    def response(self) -> JSONResponse:
        body = {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}
        return JSONResponse(body, status_code=self.status)


class Histogram:
    """A Prometheus histogram: cumulative bucket counts, sum and count."""

    def __init__(self, name: str, help_text: str, buckets: tuple[float, ...]):
        self.name, self.help, self.buckets = name, help_text, buckets
        self.counts = [0] * (len(buckets) + 1)
        self.sum = 0.0

    def observe(self, value: float, times: int = 1) -> None:
        index = next((i for i, edge in enumerate(self.buckets) if value <= edge), len(self.buckets))
        self.counts[index] += times
        self.sum += value * times

    def render(self) -> list[str]:
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
        total = 0
        for edge, count in zip(self.buckets + (math.inf,), self.counts):
            total += count
            le = "+Inf" if edge == math.inf else repr(edge)
            lines.append(f'{self.name}_bucket{{le="{le}"}} {total}')
        lines += [f"{self.name}_sum {self.sum!r}", f"{self.name}_count {total}"]
        return lines


class Metrics:
    """What `/metrics` reports; written by the engine thread and the handlers, under one lock."""

    def __init__(self):
        self.lock = threading.Lock()
        self.ttft = Histogram("declab_time_to_first_token_seconds", "Arrival of a request to its first token.", TTFT_BUCKETS)
        self.itl = Histogram("declab_inter_token_latency_seconds", "Time between consecutive tokens of a request.", ITL_BUCKETS)
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.finished: dict[str, int] = {}
        self.errors: dict[int, int] = {}

    def finish(self, reason: str) -> None:
        with self.lock:
            self.finished[reason] = self.finished.get(reason, 0) + 1

    def error(self, status: int) -> None:
        with self.lock:
            self.errors[status] = self.errors.get(status, 0) + 1

    def render(self, stats: dict) -> str:
        lines = []

        def metric(name, kind, help_text, samples):
            lines.extend([f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"])
            lines.extend(f"{name}{labels} {value}" for labels, value in samples)

        metric("declab_requests_running", "gauge", "Requests the engine is decoding.", [("", stats.get("running", 0))])
        metric("declab_requests_waiting", "gauge", "Requests queued in the engine.", [("", stats.get("waiting", 0))])
        for key, help_text in (("kv_blocks_used", "KV cache blocks in use."), ("kv_blocks_total", "KV cache blocks in the pool."),
                               ("slots_used", "Recurrent state slots in use."), ("slots_total", "Recurrent state slots.")):
            if key in stats:
                metric(f"declab_{key}", "gauge", help_text, [("", stats[key])])
        metric("declab_engine_preemptions_total", "counter", "Requests the engine preempted.", [("", stats.get("preemptions", 0))])
        metric("declab_engine_steps_total", "counter", "Engine scheduling iterations.", [("", stats.get("steps", 0))])
        with self.lock:
            metric("declab_prompt_tokens_total", "counter", "Prompt tokens of accepted requests.", [("", self.prompt_tokens)])
            metric("declab_generation_tokens_total", "counter", "Tokens served.", [("", self.generation_tokens)])
            metric("declab_requests_finished_total", "counter", "Finished requests by finish reason.",
                   [(f'{{finish_reason="{r}"}}', n) for r, n in sorted(self.finished.items())])
            metric("declab_request_errors_total", "counter", "Refused requests by HTTP status.",
                   [(f'{{status="{s}"}}', n) for s, n in sorted(self.errors.items())])
            lines += self.ttft.render() + self.itl.render()
        return "\n".join(lines) + "\n"


@dataclass
class Pending:
    """One request on its way through the engine, and where its outputs go."""

    request: Request
    loop: asyncio.AbstractEventLoop
    outbox: asyncio.Queue
    arrival: float  # perf_counter() when the HTTP request arrived
    last: float | None = None  # perf_counter() of its previous output with tokens

    def send(self, item) -> None:
        with contextlib.suppress(RuntimeError):
            # The loop is closed once the server has stopped: nobody is listening any more.
            self.loop.call_soon_threadsafe(self.outbox.put_nowait, item)


def deliver(items) -> None:
    """On the event loop: put each (outbox, item) in its outbox."""
    for outbox, item in items:
        outbox.put_nowait(item)


class EngineLoop:
    """The thread that owns the engine: applies queued adds and cancels, steps, routes outputs.

    Items put in a request's outbox: ("accepted", None), ("error", RequestError) or
    ("output", RequestOutput); an output with `finished` is the last."""

    def __init__(self, engine: Engine, device: torch.device, metrics: Metrics):
        self.engine = engine
        # The engine thread selects the device by index ("cuda" alone names the current one, which a
        # new thread would take as device 0).
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        self.metrics = metrics
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.active: dict[str, Pending] = {}
        # A snapshot of engine.stats(), replaced (never mutated) after every iteration for /metrics.
        self.stats = dict(engine.stats())
        self.thread = threading.Thread(target=self.run, name="declab-engine", daemon=True)
        self.closed = False

    def start(self) -> None:
        self.thread.start()

    def alive(self) -> bool:
        return self.thread.is_alive()

    def submit(self, pending: Pending) -> None:
        self.inbox.put(("add", pending))
        if self.closed:
            self.refuse_queued()

    def cancel(self, request_id: str, reason: str = "cancelled") -> None:
        """Cancel a request; `reason` is what the finished-requests metric counts it as."""
        self.inbox.put(("cancel", (request_id, reason)))

    def stop(self, timeout: float = 30.0) -> None:
        self.inbox.put(("stop", None))
        self.thread.join(timeout)

    def run(self) -> None:
        try:
            if self.device.type == "cuda":
                torch.cuda.set_device(self.device)
            with torch.inference_mode():
                while self.apply(self.commands()):
                    if self.engine.has_unfinished():
                        self.step()
                    self.stats = dict(self.engine.stats())
        except Exception:
            log.exception("the engine thread failed")
            self.fail_all(RequestError(500, "the engine failed (see the server log)"))
        finally:
            self.closed = True
            self.refuse_queued()

    def refuse_queued(self) -> None:
        """Once the engine thread has ended, answer whatever is still in the inbox with a 503."""
        while True:
            try:
                kind, arg = self.inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                arg.send(("error", RequestError(503, "the server is shutting down", code="shutting_down")))

    def fail_all(self, error: RequestError, reason: str = "error") -> None:
        """End every active request with `error`, cancelling it in the engine as far as it still can."""
        for request_id, pending in list(self.active.items()):
            self.active.pop(request_id)
            self.metrics.finish(reason)
            with contextlib.suppress(Exception):
                self.engine.cancel(request_id)
            pending.send(("error", error))

    def commands(self) -> list:
        """Everything in the inbox; waits for the first command when the engine has nothing to do."""
        items = [] if self.engine.has_unfinished() else [self.inbox.get()]
        while True:
            try:
                items.append(self.inbox.get_nowait())
            except queue.Empty:
                return items

    def apply(self, items: list) -> bool:
        """Add and cancel requests; False once told to stop (every request left is cancelled)."""
        for kind, arg in items:
            if kind == "add":
                self.add(arg)
            elif kind == "cancel":
                self.drop(*arg)
            else:
                self.fail_all(RequestError(503, "the server is shutting down: request cancelled", code="shutting_down"), "cancelled")
                return False
        return True

    def add(self, pending: Pending) -> None:
        try:
            request_id = self.engine.add_request(pending.request)
        except UsageError as e:
            pending.send(("error", RequestError(400, str(e))))
        except EngineFull as e:
            pending.send(("error", RequestError(503, f"server busy: {e}", code="engine_full")))
        else:
            self.active[request_id] = pending
            with self.metrics.lock:
                self.metrics.prompt_tokens += len(pending.request.prompt)
            pending.send(("accepted", None))

    def drop(self, request_id: str, reason: str) -> None:
        """Cancel a request in the engine now (its blocks or slot are freed) and forget it."""
        pending = self.active.pop(request_id, None)
        if pending is None:
            return
        self.engine.cancel(request_id)
        self.metrics.finish(reason)

    def step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception:
            log.exception("an engine step failed; ending the requests it held")
            self.fail_all(RequestError(500, "an engine step failed (see the server log)"))
            return
        now = time.perf_counter()
        # One wake-up of the event loop per step, not one per request.
        deliveries: dict[asyncio.AbstractEventLoop, list] = {}
        for out in outputs:
            pending = self.active.get(out.request_id)
            if pending is None:
                continue
            count = len(out.new_tokens)
            if count:
                with self.metrics.lock:
                    self.metrics.generation_tokens += count
                    if pending.last is None:
                        self.metrics.ttft.observe(now - pending.arrival)
                    else:
                        self.metrics.itl.observe((now - pending.last) / count, count)
                pending.last = now
            if out.finished:
                self.active.pop(out.request_id)
                self.metrics.finish(out.finish_reason or "stop")
            deliveries.setdefault(pending.loop, []).append((pending.outbox, ("output", out)))
        for loop, items in deliveries.items():
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(deliver, items)


class TextStream:
    """The text of a request's new tokens as they arrive, and where a stop string ends it.

    With a tokenizer: incremental decoding (a window of recent tokens is decoded, and text is held
    back while it ends in an incomplete character); text that could still become a stop string is
    held back too. Without one: the token ids joined by spaces."""

    def __init__(self, tokenizer, stop: list[str]):
        self.tokenizer = tokenizer
        self.stop = stop
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.ids: list[int] = []
        self.text = ""
        self.sent = 0  # characters of self.text already returned
        self.prefix = 0  # self.ids[prefix:read] is the decoding window's context
        self.read = 0
        self.stopped = False

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def add(self, ids: list[int]) -> str:
        """Text that became final with these tokens (empty once a stop string was found)."""
        if self.stopped:
            return ""
        self.ids += ids
        if self.tokenizer is None:
            self.text += "".join((" " if self.text or i else "") + str(t) for i, t in enumerate(ids))
            return self.flush()
        before = self.decode(self.ids[self.prefix : self.read])
        after = self.decode(self.ids[self.prefix :])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self.extend(after[len(before) :])
            self.prefix, self.read = self.read, len(self.ids)
        if self.stopped:
            return self.flush()
        return self.take(len(self.text) - self.hold)

    def extend(self, text: str) -> None:
        """Append decoded text; cut it at the first stop string that now appears."""
        start = max(0, len(self.text) - self.hold)
        self.text += text
        hits = [i for i in (self.text.find(s, start) for s in self.stop) if i >= 0]
        if hits:
            self.text = self.text[: min(hits)]
            self.stopped = True

    def take(self, end: int) -> str:
        end = max(self.sent, end)
        piece, self.sent = self.text[self.sent : end], end
        return piece

    def flush(self) -> str:
        """Everything not returned yet (at the end of the request)."""
        if self.tokenizer is not None and not self.stopped and self.read < len(self.ids):
            before = self.decode(self.ids[self.prefix : self.read])
            self.extend(self.decode(self.ids[self.prefix :])[len(before) :])
            self.prefix = self.read = len(self.ids)
        return self.take(len(self.text))


def is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def get(body: dict, name: str, check, what: str, default=None):
    """body[name] (or `default` when absent or null), refused with a 400 naming it when `check` fails."""
    value = body.get(name)
    if value is None:
        return default
    if not check(value):
        raise RequestError(400, f"'{name}' must be {what}, got {json.dumps(value)[:80]}", param=name)
    return value


@dataclass
class Params:
    """What a completion request asks for, validated."""

    prompt: list[int]
    max_tokens: int
    sampling: Sampling
    stop: list[str] = field(default_factory=list)
    stop_token_ids: tuple[int, ...] = ()
    stream: bool = False
    include_usage: bool = False


class Service:
    """The HTTP side: validates requests, hands them to the engine thread, turns outputs into responses."""

    def __init__(self, decoder, engine_loop: EngineLoop, metrics: Metrics, model_name: str):
        self.decoder = decoder
        self.engine = engine_loop
        self.metrics = metrics
        self.model_name = model_name
        self.tokenizer = decoder.tokenizer
        # Prompt + max_tokens the engine takes: the model's context, or less when the KV pool is smaller.
        self.max_context = engine_loop.engine.max_model_len
        self.created = int(time.time())

    async def body(self, request) -> dict:
        raw = await request.body()
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise RequestError(400, f"request body is not valid JSON: {e}") from None
        if not isinstance(body, dict):
            raise RequestError(400, "request body must be a JSON object")
        model = body.get("model")
        if model is None:
            raise RequestError(400, "missing field 'model'", param="model")
        if model != self.model_name:
            raise RequestError(404, f"model {str(model)[:80]!r} does not exist (this server has {self.model_name!r})",
                               param="model", code="model_not_found")
        return body

    def token_ids(self, ids, name: str) -> list[int]:
        vocab = self.decoder.vocab_size
        bad = next((t for t in ids if not is_int(t) or not 0 <= t < vocab), None)
        if bad is not None:
            raise RequestError(400, f"'{name}' holds {json.dumps(bad)[:40]}, not a token id of this model (0..{vocab - 1})", param=name)
        return list(ids)

    def encode(self, text: str, name: str) -> list[int]:
        if self.tokenizer is None:
            raise RequestError(400, f"{self.model_name} has no tokenizer: send '{name}' as a list of token ids", param=name)
        return self.tokenizer.encode(text)

    def completion_prompt(self, body: dict) -> list[int]:
        prompt = body.get("prompt")
        if prompt is None:
            raise RequestError(400, "missing field 'prompt'", param="prompt")
        # A list holding one prompt (["text"] or [[ids]]) is that prompt; several are refused below.
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if isinstance(prompt, str):
            return self.encode(prompt, "prompt")
        if isinstance(prompt, list) and all(is_int(t) for t in prompt):
            return self.token_ids(prompt, "prompt")
        if isinstance(prompt, list) and all(isinstance(p, (str, list)) for p in prompt):
            raise RequestError(400, "one prompt per request: send several requests instead of a list of prompts", param="prompt")
        raise RequestError(400, "'prompt' must be a string or a list of token ids", param="prompt")

    def chat_prompt(self, body: dict) -> list[int]:
        messages = body.get("messages")
        if messages is None:
            raise RequestError(400, "missing field 'messages'", param="messages")
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise RequestError(400, f"{self.model_name} has no chat template: use /v1/completions", param="messages")
        if not isinstance(messages, list) or not messages:
            raise RequestError(400, "'messages' must be a non-empty list", param="messages")
        plain = []
        for m in messages:
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise RequestError(400, "every message needs a 'role' string", param="messages")
            content = m.get("content")
            if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
                content = "".join(p["text"] for p in content)
            if not isinstance(content, str):
                raise RequestError(400, "every message's 'content' must be a string or a list of text parts", param="messages")
            plain.append({"role": m["role"], "content": content})
        try:
            text = self.tokenizer.apply_chat_template(plain, add_generation_prompt=True, tokenize=False)
        except Exception as e:
            raise RequestError(400, f"the chat template refused these messages: {e}", param="messages") from None
        # The template writes the special tokens (a leading <bos>, ...) itself.
        return self.tokenizer.encode(text, add_special_tokens=False)

    def params(self, body: dict, prompt: list[int], *, chat: bool) -> Params:
        if not prompt:
            raise RequestError(400, "the prompt has no tokens", param="prompt")
        for name, default in (("n", 1), ("best_of", 1)):
            if get(body, name, is_int, "an integer", default) != 1:
                raise RequestError(400, f"only {name} = 1 is supported", param=name)
        if get(body, "echo", lambda v: isinstance(v, bool), "a boolean", False):
            raise RequestError(400, "echo is not supported", param="echo")
        if body.get("logprobs") not in (None, False):
            raise RequestError(400, "logprobs are not supported", param="logprobs")
        # Sampling options the engine lacks are refused rather than ignored: ignoring them would change the output unasked.
        for name, neutral in (("presence_penalty", 0), ("frequency_penalty", 0), ("repetition_penalty", 1), ("min_p", 0)):
            if body.get(name) not in (None, neutral):
                raise RequestError(400, f"{name} is not supported (only {neutral})", param=name)
        if body.get("logit_bias"):
            raise RequestError(400, "logit_bias is not supported", param="logit_bias")
        room = None if self.max_context is None else self.max_context - len(prompt)
        name = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
        # OpenAI's defaults: 16 tokens for a completion, up to the context's end for a chat.
        default = room if chat and room is not None else 16
        max_tokens = get(body, name, is_int, "an integer", default)
        if max_tokens < 1:
            raise RequestError(400, f"'{name}' must be at least 1, got {max_tokens}", param=name)
        if room is not None and max_tokens > room:
            raise RequestError(400, f"this model's maximum context is {self.max_context} tokens; the prompt has "
                               f"{len(prompt)} and {name} is {max_tokens}", param=name, code="context_length_exceeded")
        temperature = get(body, "temperature", lambda v: is_number(v) and v >= 0, "a number >= 0", 1.0)
        top_p = get(body, "top_p", lambda v: is_number(v) and 0 < v <= 1, "a number in (0, 1]", 1.0)
        # vLLM's top_k = -1 means no cut, as 0 does here.
        top_k = get(body, "top_k", lambda v: is_int(v) and v >= -1, "an integer >= -1", 0)
        # The engine keeps seeds in int64 tensors: a larger one would fail the step for every request in it.
        seed = get(body, "seed", lambda v: is_int(v) and -(2**63) <= v < 2**63, "an integer within 64 bits", None)
        top_k = min(max(top_k, 0), self.decoder.vocab_size)
        sampling = Sampling(temperature=float(temperature), top_k=top_k, top_p=float(top_p),
                            seed=secrets.randbits(63) if seed is None else seed)
        stop = get(body, "stop", lambda v: isinstance(v, (str, list)), "a string or a list of strings", [])
        stop = [stop] if isinstance(stop, str) else stop
        if not all(isinstance(s, str) and s for s in stop):
            raise RequestError(400, "'stop' must hold non-empty strings", param="stop")
        if stop and self.tokenizer is None:
            raise RequestError(400, f"{self.model_name} has no tokenizer, so no stop strings: use 'stop_token_ids'", param="stop")
        stop_ids = self.token_ids(get(body, "stop_token_ids", lambda v: isinstance(v, list), "a list of token ids", []), "stop_token_ids")
        eos = self.decoder.eos_token_id
        if eos is not None and not get(body, "ignore_eos", lambda v: isinstance(v, bool), "a boolean", False):
            stop_ids.append(eos)
        stream = get(body, "stream", lambda v: isinstance(v, bool), "a boolean", False)
        options = get(body, "stream_options", lambda v: isinstance(v, dict), "an object", {})
        include_usage = get(options, "include_usage", lambda v: isinstance(v, bool), "a boolean", False)
        return Params(prompt, max_tokens, sampling, stop, tuple(dict.fromkeys(stop_ids)), stream, include_usage)

    async def completions(self, request):
        return await self.serve(request, chat=False)

    async def chat_completions(self, request):
        return await self.serve(request, chat=True)

    async def serve(self, request, *, chat: bool):
        arrival = time.perf_counter()
        try:
            body = await self.body(request)
            prompt = self.chat_prompt(body) if chat else self.completion_prompt(body)
            params = self.params(body, prompt, chat=chat)
            request_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
            pending = Pending(
                Request(prompt=params.prompt, max_new_tokens=params.max_tokens, sampling=params.sampling,
                        stop_token_ids=params.stop_token_ids, request_id=request_id),
                asyncio.get_running_loop(), asyncio.Queue(), arrival)
            self.engine.submit(pending)
            try:
                kind, error = await pending.outbox.get()
            except asyncio.CancelledError:
                # Cancelled (the server stopping) before the engine answered: it must not keep the request.
                self.engine.cancel(request_id)
                raise
            if kind == "error":
                raise error
        except RequestError as e:
            self.metrics.error(e.status)
            return e.response()
        reply = Reply(self, request_id, params, chat)
        if params.stream:
            return EventStream(self.events(reply, pending), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        return await self.collect(reply, pending, request)

    async def next_output(self, pending: Pending):
        """The request's next engine output; a refusal or failure from the engine thread is raised."""
        kind, item = await pending.outbox.get()
        if kind == "error":
            raise item
        return item

    async def collect(self, reply: "Reply", pending: Pending, request):
        finished = False
        try:
            while not (finished or reply.text.stopped):
                try:
                    out = await asyncio.wait_for(self.next_output(pending), DISCONNECT_POLL_S)
                except asyncio.TimeoutError:
                    if await request.is_disconnected():
                        return PlainTextResponse("", status_code=499)
                    continue
                finished = out.finished
                reply.add(out)
            return JSONResponse(reply.whole())
        except RequestError as e:
            finished = True
            self.metrics.error(e.status)
            return e.response()
        finally:
            if not finished:
                self.engine.cancel(reply.request_id, "stop" if reply.text.stopped else "cancelled")

    async def events(self, reply: "Reply", pending: Pending):
        """The response's server-sent events; a request abandoned before its end (the client went
        away, a stop string ended it) is cancelled in the engine, which frees its blocks or slot."""
        finished = False
        try:
            if reply.chat:
                yield sse(reply.chunk("", [], role=True))
            while not (finished or reply.text.stopped):
                out = await self.next_output(pending)
                finished = out.finished
                text = reply.add(out)
                if text or reply.delta_ids or reply.finish_reason:
                    yield sse(reply.chunk(text, reply.delta_ids))
            if reply.params.include_usage:
                yield sse(reply.usage_chunk())
        except RequestError as e:
            finished = True
            self.metrics.error(e.status)
            yield sse({"error": {"message": e.message, "type": e.kind, "param": e.param, "code": e.code}})
        finally:
            if not finished:
                self.engine.cancel(reply.request_id, "stop" if reply.text.stopped else "cancelled")
        yield "data: [DONE]\n\n"

    async def models(self, request):
        return JSONResponse({"object": "list", "data": [{
            "id": self.model_name, "object": "model", "created": self.created, "owned_by": "declab",
            "max_model_len": self.max_context, "family": self.decoder.family}]})

    async def health(self, request):
        if not self.engine.alive():
            return JSONResponse({"status": "engine stopped"}, status_code=503)
        return JSONResponse({"status": "ok"})

    async def metrics_text(self, request):
        return PlainTextResponse(self.metrics.render(self.engine.stats), media_type="text/plain; version=0.0.4")


class EventStream(StreamingResponse):
    """A streaming response that always closes its event generator, so that the generator's cleanup
    (cancelling the request in the engine) runs as soon as the client is gone."""

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()


def sse(payload: dict) -> str:
    return f"data: {json.dumps(payload)}\n\n"


class Reply:
    """One request's response as it builds up: text, token ids, finish reason, usage."""

    def __init__(self, service: Service, request_id: str, params: Params, chat: bool):
        self.service = service
        self.request_id = request_id
        self.params = params
        self.chat = chat
        self.text = TextStream(service.tokenizer, params.stop)
        self.pieces: list[str] = []
        self.delta_ids: list[int] = []
        self.output_tokens = 0
        self.finish_reason: str | None = None

    def add(self, out) -> str:
        """Take one engine output; returns the text it made final."""
        self.delta_ids = list(out.new_tokens)
        self.output_tokens = out.output_tokens
        text = self.text.add(self.delta_ids)
        if self.text.stopped:
            self.finish_reason = "stop"
        elif out.finished:
            text += self.text.flush()
            # A request cancelled without the client asking is one the server gave up on.
            self.finish_reason = {"cancelled": "abort"}.get(out.finish_reason, out.finish_reason)
        self.pieces.append(text)
        return text

    def head(self, kind: str) -> dict:
        return {"id": self.request_id, "object": kind, "created": int(time.time()), "model": self.service.model_name}

    def usage(self) -> dict:
        prompt = len(self.params.prompt)
        return {"prompt_tokens": prompt, "completion_tokens": self.output_tokens, "total_tokens": prompt + self.output_tokens}

    def whole(self) -> dict:
        text = "".join(self.pieces)
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None}
        else:
            choice = {"index": 0, "text": text, "logprobs": None}
        choice.update(finish_reason=self.finish_reason, token_ids=self.text.ids)
        kind = "chat.completion" if self.chat else "text_completion"
        return {**self.head(kind), "choices": [choice], "usage": self.usage()}

    def chunk(self, text: str, ids: list[int], *, role: bool = False) -> dict:
        """One streamed event; the one carrying the finish reason carries the usage too."""
        if self.chat:
            delta = {"role": "assistant", "content": text} if role else {"content": text}
            choice = {"index": 0, "delta": delta, "logprobs": None}
        else:
            choice = {"index": 0, "text": text, "logprobs": None}
        choice.update(finish_reason=self.finish_reason, token_ids=ids)
        chunk = {**self.head("chat.completion.chunk" if self.chat else "text_completion"), "choices": [choice]}
        if self.finish_reason is not None:
            chunk["usage"] = self.usage()
        return chunk

    def usage_chunk(self) -> dict:
        return {**self.head("chat.completion.chunk" if self.chat else "text_completion"), "choices": [], "usage": self.usage()}


def build_app(decoder, *, model_name: str | None = None, max_batch: int = 64, max_step_tokens: int = 2048,
              max_waiting: int | None = 512, **engine_options) -> Starlette:
    """The Starlette application serving `decoder`; its lifespan starts and stops the engine thread.
    `engine_options` go to `Engine` (num_blocks, kv_memory_bytes, max_model_len, cuda_graphs)."""
    metrics = Metrics()
    engine = Engine(decoder, max_batch=max_batch, max_step_tokens=max_step_tokens, max_waiting=max_waiting, **engine_options)
    engine_loop = EngineLoop(engine, decoder.device, metrics)
    service = Service(decoder, engine_loop, metrics, model_name or decoder.source)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        engine_loop.start()
        try:
            yield
        finally:
            engine_loop.stop()

    async def http_error(request, exc: HTTPException):
        metrics.error(exc.status_code)
        return RequestError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}").response()

    app = Starlette(
        routes=[
            Route("/v1/completions", service.completions, methods=["POST"]),
            Route("/v1/chat/completions", service.chat_completions, methods=["POST"]),
            Route("/v1/models", service.models, methods=["GET"]),
            Route("/health", service.health, methods=["GET"]),
            Route("/metrics", service.metrics_text, methods=["GET"]),
        ],
        exception_handlers={HTTPException: http_error},
        lifespan=lifespan,
    )
    app.state.service = service
    return app


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on host:port (port 0: a free one); a port in use or out of range is the user's error."""
    if not 0 <= port <= 65535:
        raise UsageError(f"--port must be in 0..65535, got {port}")
    try:
        info = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(info[0], socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(info[4])
    except OSError as e:
        raise UsageError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    sock.listen(2048)
    return sock


def uvicorn_server(app, *, drain_timeout: float, log_level: str = "warning") -> "uvicorn.Server":
    config = uvicorn.Config(app, log_level=log_level, timeout_graceful_shutdown=drain_timeout, lifespan="on")
    return uvicorn.Server(config)


@contextlib.contextmanager
def running(decoder, *, host: str = "127.0.0.1", port: int = 0, drain_timeout: float = 5.0, start_timeout: float = 60.0, **options):
    """Serve `decoder` from a background thread; yields the base URL (http://host:port) and stops
    the server on exit. `options` go to `build_app`."""
    app = build_app(decoder, **options)
    sock = bind(host, port)
    server = uvicorn_server(app, drain_timeout=drain_timeout)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="declab-http", daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + start_timeout
        while not server.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the server did not start")
            time.sleep(0.02)
        yield f"http://{host}:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(drain_timeout + 30)
        sock.close()


def positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def main(argv=None) -> int:
    p = cli.Parser(prog="python -m decoders.serve", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="preset or checkpoint folder")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000; 0 picks a free one)")
    p.add_argument("--served-model-name", default=None, help="the name clients send as 'model' (default: --model)")
    p.add_argument("--max-batch", type=positive, default=64, help="requests decoded together (default 64)")
    p.add_argument("--max-step-tokens", type=positive, default=2048, help="prompt + decode tokens one engine step takes (default 2048)")
    p.add_argument("--max-waiting", type=positive, default=512, help="requests queued beyond the batch before new ones get 503 (default 512)")
    p.add_argument("--max-model-len", type=positive, default=None, help="longest prompt + max_tokens (default: the model's context, or what the KV pool holds)")
    p.add_argument("--num-blocks", type=positive, default=None, help="KV cache blocks (default: 60%% of the free GPU memory; on a CPU room for --max-batch sequences of 1024 tokens)")
    p.add_argument("--page-size", type=positive, default=None, help="KV cache page size, transformer family (default: the decoder's)")
    p.add_argument("--kv-dtype", default=None, help="KV cache dtype, transformer family: fp8 | bf16 | ... (default: the model's dtype)")
    p.add_argument("--quant", default=None, help="weight quantisation: int8, int4-rtn, int4-rtn-gN (on the fly), or int4 of a quantised folder (default: the model's own weights)")
    p.add_argument("--impl", default="auto", choices=["auto", "triton", "ref"])
    p.add_argument("--dtype", default=None, help="float32, bfloat16, float16 (default: bfloat16 on a GPU, float32 on a CPU)")
    p.add_argument("--device", default=None)
    p.add_argument("--seed", type=int, default=0, help="seed of a preset's random weights")
    p.add_argument("--drain-timeout", type=float, default=30.0, help="on Ctrl-C / SIGTERM, seconds running requests may finish before they are cancelled (default 30)")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    args = p.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    with decoders.user_errors():
        if args.drain_timeout < 0:
            raise UsageError(f"--drain-timeout must be >= 0, got {args.drain_timeout:g}")
        decoders.parse_dtype(args.dtype)
        family = decoders.family_of(args.model)
        load_options, engine_options = {}, {}
        if args.page_size is not None:
            if decoders.family_class(family).state_kind != "kv":
                raise UsageError(f"--page-size applies to the transformer family, not {family}")
            load_options["page_size"] = args.page_size
        if args.kv_dtype is not None:
            if decoders.family_class(family).state_kind != "kv":
                raise UsageError(f"--kv-dtype applies to the transformer family, not {family}")
            decoders.kv_cache.parse_kv_dtype(args.kv_dtype)
            load_options["kv_dtype"] = args.kv_dtype
        from decoders.quant import check_load_quant

        check_load_quant(args.model, args.quant)
        if args.num_blocks is not None:
            if decoders.family_class(family).state_kind != "kv":
                raise UsageError(f"--num-blocks applies to the transformer family, not {family}")
            engine_options["num_blocks"] = args.num_blocks
        if args.max_model_len is not None:
            engine_options["max_model_len"] = args.max_model_len
        sock = bind(args.host, args.port)
        decoder = decoders.load(args.model, device=args.device, dtype=args.dtype, impl=args.impl, seed=args.seed, quant=args.quant,
                                **load_options)
        app = build_app(decoder, model_name=args.served_model_name or args.model, max_batch=args.max_batch,
                        max_step_tokens=args.max_step_tokens, max_waiting=args.max_waiting, **engine_options)
    host, port = sock.getsockname()[:2]
    print(f"serving {args.served_model_name or args.model} ({decoder.family}, {decoder.impl}, "
          f"{str(decoder.dtype).removeprefix('torch.')}) on http://{host}:{port}", flush=True)
    # uvicorn re-raises the signal that stopped it once it has drained; by then the work is done, so a
    # no-op handler lets the process end normally instead of dying by the signal (or a KeyboardInterrupt).
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)
    uvicorn_server(app, drain_timeout=args.drain_timeout, log_level=args.log_level).run(sockets=[sock])
    print("stopped", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
