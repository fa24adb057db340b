"""The HTTP side of ``dlm-serve``: a Starlette app with the OpenAI completions and chat completions endpoints,
``/v1/models``, ``/health``, ``/metrics`` and the live page (``/``). See docs/serving.md.

Every error is a JSON body ``{"error": {"message": ONE LINE, "type": ..., "param": KEY, "code": ...}}`` with a
4xx/5xx status; nothing a client sends ends the server.
"""
from __future__ import annotations

import asyncio
import json
import math
import time
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, Dict, List, Optional

from starlette.applications import Starlette
from starlette.requests import Request as HttpRequest
from starlette.responses import HTMLResponse, JSONResponse, Response
from starlette.routing import Route

from dlm_engine.errors import ConfigError, UserError
from dlm_engine.serve.engine import Engine, Outcome, QueueFull, Request, ShuttingDown, new_request_id


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: Optional[str] = None, kind: str = "invalid_request_error",
                 headers: Optional[Dict[str, str]] = None):
        super().__init__(message)
        self.status, self.message, self.param, self.kind, self.headers = status, message, param, kind, headers or {}

    def response(self) -> JSONResponse:
        line = " ".join(str(self.message).split("\n")[0].split())
        return JSONResponse({"error": {"message": line, "type": self.kind, "param": self.param,
                                       "code": self.status}}, status_code=self.status, headers=self.headers)


@dataclass
class Parsed:
    """A validated OpenAI request."""

    chat: bool
    prompts: List[Any]                       # each: str, token ids or {"messages": [...]}
    options: Dict[str, Any]                  # decoding settings (RequestConfigs.get)
    stop: List[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False
    stream_steps: bool = False
    max_tokens_given: bool = False


def _type_name(v: Any) -> str:
    return {str: "a string", bool: "a boolean", int: "an integer", float: "a number", list: "an array",
            dict: "an object", type(None): "null"}.get(type(v), type(v).__name__)


def _int(body: dict, key: str, lo: Optional[int] = None) -> Optional[int]:
    v = body.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise ApiError(400, f"{key}: expected an integer, got {_type_name(v)}", key)
    if lo is not None and v < lo:
        raise ApiError(400, f"{key}={v} must be >= {lo}", key)
    return v


def _num(body: dict, key: str) -> Optional[float]:
    v = body.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise ApiError(400, f"{key}: expected a finite number, got {_type_name(v)}", key)
    return float(v)


def _bool(body: dict, key: str) -> bool:
    v = body.get(key, False)
    if v is None:
        return False
    if not isinstance(v, bool):
        raise ApiError(400, f"{key}: expected a boolean, got {_type_name(v)}", key)
    return v


def _content(m: Any, i: int) -> dict:
    if not isinstance(m, dict):
        raise ApiError(400, f"messages[{i}]: expected an object, got {_type_name(m)}", "messages")
    role, content = m.get("role"), m.get("content")
    if not isinstance(role, str):
        raise ApiError(400, f"messages[{i}].role: expected a string, got {_type_name(role)}", "messages")
    if isinstance(content, list):          # content parts: the text ones, joined
        parts = []
        for p in content:
            if not (isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)):
                raise ApiError(400, f"messages[{i}].content: only text parts are supported", "messages")
            parts.append(p["text"])
        content = "".join(parts)
    if not isinstance(content, str):
        raise ApiError(400, f"messages[{i}].content: expected a string, got {_type_name(content)}", "messages")
    return {"role": role, "content": content}


UNSUPPORTED = {"logprobs": "token log-probabilities", "echo": "echo", "best_of": "best_of",
               "top_logprobs": "token log-probabilities", "tools": "tools", "functions": "functions",
               "logit_bias": "logit_bias"}


def parse(body: Any, chat: bool, default_gen: int, max_chars: int) -> Parsed:
    """Check an OpenAI request body; ApiError (400) naming the key."""
    if not isinstance(body, dict):
        raise ApiError(400, f"the request body must be a JSON object, got {_type_name(body)}")
    for key, what in UNSUPPORTED.items():
        v = body.get(key)
        if v not in (None, False, 0) and not (key == "logprobs" and chat and v is False):
            raise ApiError(400, f"{key}: not supported by dlm-serve ({what}: a diffusion decode does not produce them "
                                "left to right)", key)
    n = _int(body, "n", 1)
    if n not in (None, 1):
        raise ApiError(400, f"n={n}: dlm-serve returns one choice per prompt (send the prompt n times)", "n")
    if chat:
        msgs = body.get("messages")
        if not isinstance(msgs, list) or not msgs:
            raise ApiError(400, "messages: expected a non-empty array of {\"role\", \"content\"}", "messages")
        msgs = [_content(m, i) for i, m in enumerate(msgs)]
        if sum(len(m["content"]) for m in msgs) > max_chars:
            raise ApiError(400, f"messages: longer than the server's max_prompt_chars={max_chars}", "messages")
        prompts: List[Any] = [{"messages": msgs}]
    else:
        p = body.get("prompt")
        if isinstance(p, str):
            prompts = [p]
        elif isinstance(p, list) and p and all(isinstance(x, int) and not isinstance(x, bool) for x in p):
            prompts = [list(p)]
        elif isinstance(p, list) and p and all(isinstance(x, str) or (isinstance(x, list) and all(
                isinstance(t, int) and not isinstance(t, bool) for t in x)) for x in p):
            prompts = list(p)
        else:
            raise ApiError(400, "prompt: expected a string, an array of strings, token ids or arrays of token ids, "
                                f"got {_type_name(p)}", "prompt")
        long = [i for i, x in enumerate(prompts) if len(x) > max_chars]
        if long:
            raise ApiError(400, f"prompt {long[0]}: {len(prompts[long[0]])} characters, more than the server's "
                                f"max_prompt_chars={max_chars}", "prompt")
    dlm = body.get("dlm")
    if dlm is None:
        dlm = {}
    if not isinstance(dlm, dict):
        raise ApiError(400, f"dlm: expected an object of decoding options, got {_type_name(dlm)}", "dlm")
    options = dict(dlm)
    stream_steps = options.pop("stream_steps", False)
    if not isinstance(stream_steps, bool):
        raise ApiError(400, f"dlm.stream_steps: expected a boolean, got {_type_name(stream_steps)}", "dlm.stream_steps")
    max_tokens = _int(body, "max_completion_tokens", 1) if chat else None
    if max_tokens is None:
        max_tokens = _int(body, "max_tokens", 1)
    if max_tokens is not None:
        options["gen_length"] = max_tokens
    seed = _int(body, "seed", 0)
    if seed is not None:
        options["seed"] = seed
    for key in ("temperature", "top_p"):
        v = _num(body, key)
        if v is not None:
            options[f"__{key}"] = v
    stop = body.get("stop")
    if stop is None:
        stop = []
    elif isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop) or len(stop) > 16:
        raise ApiError(400, "stop: expected a non-empty string or an array of up to 16 of them", "stop")
    so = body.get("stream_options") or {}
    if not isinstance(so, dict):
        raise ApiError(400, f"stream_options: expected an object, got {_type_name(so)}", "stream_options")
    return Parsed(chat=chat, prompts=prompts, options=options, stop=stop, stream=_bool(body, "stream"),
                  include_usage=bool(so.get("include_usage")), stream_steps=stream_steps,
                  max_tokens_given=max_tokens is not None)


def apply_sampling(options: Dict[str, Any], server_strategy: str) -> Dict[str, Any]:
    """``temperature``/``top_p`` of the OpenAI body as the strategy's options of those names. A strategy without
    the option decodes greedily: temperature 0 / top_p 1 are accepted there, anything else is a 400."""
    from dlm_engine.core.registry import strategy_class

    out = {k: v for k, v in options.items() if not k.startswith("__")}
    s = out.get("strategy", server_strategy)
    name = s.get("name", server_strategy) if isinstance(s, dict) else s
    try:
        import dataclasses

        fields = [f.name for f in dataclasses.fields(strategy_class(str(name)).Config)]
    except Exception:
        fields = None          # an unknown strategy: the compose names it
    for key, neutral in (("temperature", 0.0), ("top_p", 1.0)):
        v = options.get(f"__{key}")
        if v is None or fields is None:
            continue
        if key in fields:
            out[f"strategy.{key}"] = v
        elif v != neutral:
            raise ApiError(400, f"{key}={v:g}: strategy={name} has no {key} option (it decodes greedily); "
                                f"send {key}={neutral:g} or pick a strategy that samples", key)
    return out


def held_back(text: str, stops: List[str]) -> int:
    """Characters at the end of ``text`` that could start a stop string (not sent until it is known)."""
    keep = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), 0, -1):
            if text.endswith(s[:k]):
                keep = max(keep, k)
                break
    return keep


def cut_at_stop(text: str, stops: List[str]):
    """``(text before the first stop string, whether one was found)``."""
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    if not hits:
        return text, False
    return text[:min(hits)], True


class Server:
    """What the routes share: model, request configs, engine, metrics."""

    def __init__(self, lm, configs, engine: Engine, metrics, cfg, out_dir: Path):
        self.lm, self.configs, self.engine, self.metrics, self.cfg = lm, configs, engine, metrics, cfg
        self.out_dir = Path(out_dir)
        self.name = str(cfg.served_model_name or cfg.model.name)
        self.created = int(time.time())
        self.default_gen = int(cfg.gen_length)
        self.timeout = float(cfg.request_timeout)
        self.max_chars = int(cfg.max_prompt_chars)
        self.max_body = int(cfg.max_body_bytes)
        self.pieces = _pieces(lm)

    def requests_for(self, parsed: Parsed, loop, queues) -> List[Request]:
        """Validated engine requests, one per prompt (ApiError 400 on a bad setting or prompt)."""
        from dlm_engine.app import inputs as inp
        from dlm_engine.serve.config import batch_key

        options = apply_sampling(parsed.options, self.configs.default_strategy)
        try:
            cfg = self.configs.get(options)
            items, ids, _ = inp.prepare(self.lm, parsed.prompts, int(cfg.gen_length), cfg)
        except (ConfigError, UserError) as exc:
            msg = str(exc).strip().splitlines()[0]
            if parsed.max_tokens_given and msg.startswith("gen_length="):
                msg = "max_tokens: " + msg
            elif "with gen_length=" in msg:
                msg = msg.replace("with gen_length=", "with max_tokens=")
            param = msg.split(":", 1)[0].split("=", 1)[0].split(" ", 1)[0] if msg else None
            raise ApiError(400, msg, param) from None
        key = batch_key(cfg)
        out = []
        for i, (item, x) in enumerate(zip(items, ids)):
            q: asyncio.Queue = asyncio.Queue()
            queues.append(q)
            out.append(Request(id=new_request_id(), cfg=cfg, key=key, prompt_ids=x, prompt=item.shown,
                               emit=_emitter(loop, q), stream_text=parsed.stream,
                               stream_steps=parsed.stream and parsed.stream_steps))
        return out


def _pieces(lm) -> Optional[List[str]]:
    """The text of each token id alone (the live page and step events show it per position)."""
    tok = lm.tokenizer
    n = lm.vocab_size
    if tok is None or not n:
        return None
    try:
        return [tok.decode([i]) for i in range(n)]
    except Exception:
        return None


def _emitter(loop, q: asyncio.Queue):
    def emit(kind: str, payload: Any) -> None:
        try:
            loop.call_soon_threadsafe(q.put_nowait, (kind, payload))
        except RuntimeError:    # the event loop is gone (server stopped)
            pass
    return emit


async def _body(request: HttpRequest, limit: int) -> Any:
    size = request.headers.get("content-length")
    if size is not None and size.isdigit() and int(size) > limit:
        raise ApiError(413, f"the request body has {size} bytes, more than the server's max_body_bytes={limit}")
    raw = bytearray()
    async for chunk in request.stream():
        raw += chunk
        if len(raw) > limit:
            raise ApiError(413, f"the request body is larger than the server's max_body_bytes={limit}")
    try:
        return json.loads(bytes(raw).decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        first = str(exc).splitlines()[0]
        raise ApiError(400, f"the request body is not valid JSON ({first})") from None


def _finish_reason(lm, row, stopped: bool) -> str:
    if stopped:
        return "stop"
    n = row.generated_tokens
    if lm.eos_id is not None and n and row.tokens[n - 1] == lm.eos_id:
        return "stop"
    return "length"


def _figures(req: Request, out: Outcome) -> Dict[str, Any]:
    r = out.row
    return {"request_id": req.id, "nfe": r.nfe, "steps": r.steps, "generated_tokens": r.generated_tokens,
            "tpf": r.tpf, "latency": r.latency, "queue_wait": out.queue_wait, "decode_time": out.decode_time,
            "batch_size": out.batch_size, "trace": out.trace, "strategy": str(req.cfg.strategy.name),
            "cache": str(req.cfg.cache.name), "gen_length": int(req.cfg.gen_length),
            "tokens": list(r.tokens), "commit_step": list(r.step_of)}


async def _wait(q: asyncio.Queue, deadline: float):
    left = deadline - time.perf_counter()
    if left <= 0:
        raise asyncio.TimeoutError()
    return await asyncio.wait_for(q.get(), left)


def create_app(server: Server) -> Starlette:
    from contextlib import asynccontextmanager

    eng, metrics = server.engine, server.metrics

    async def handle(request: HttpRequest, chat: bool) -> Response:
        endpoint = "chat" if chat else "completions"
        arrived = time.perf_counter()
        deadline = arrived + server.timeout
        try:
            body = await _body(request, server.max_body)
            parsed = parse(body, chat, server.default_gen, server.max_chars)
            model = body.get("model")
            if model is not None and model != server.name:
                raise ApiError(404, f"model '{model}' is not served here (this server serves '{server.name}')",
                               "model", "not_found_error")
            loop = asyncio.get_running_loop()
            queues: List[asyncio.Queue] = []
            if server.configs.known(apply_sampling(parsed.options, server.configs.default_strategy)):
                reqs = server.requests_for(parsed, loop, queues)
            else:   # a Hydra compose takes milliseconds: off the event loop
                reqs = await loop.run_in_executor(None, server.requests_for, parsed, loop, queues)
            try:
                eng.submit(reqs)
            except QueueFull as exc:
                raise ApiError(429, str(exc), None, "rate_limit_error",
                               {"Retry-After": str(exc.retry_after)}) from None
            except ShuttingDown:
                raise ApiError(503, "the server is shutting down", None, "server_error") from None
        except ApiError as exc:
            metrics.answered(endpoint, exc.status)
            return exc.response()
        rid = reqs[0].id
        cid = ("chatcmpl-" if chat else "cmpl-") + rid
        if parsed.stream:
            return _stream(server, parsed, reqs, queues, cid, endpoint, arrived, deadline)
        outs: List[Optional[Outcome]] = [None] * len(reqs)
        try:
            checked = time.perf_counter()
            for i, q in enumerate(queues):
                while True:
                    try:
                        kind, payload = await _wait(q, min(deadline, checked + 1.0))
                    except asyncio.TimeoutError:
                        if time.perf_counter() >= deadline:
                            raise
                        kind = None
                    if time.perf_counter() - checked >= 1.0:    # a client gone before its answer frees its rows
                        checked = time.perf_counter()
                        if await request.is_disconnected():
                            raise ApiError(499, f"request {rid}: the client closed the connection", None,
                                           "client_closed") from None
                    if kind == "done":
                        outs[i] = payload
                        break
                    if kind == "error":
                        raise ApiError(500 if payload != "cancelled" else 499, f"request {reqs[i].id}: {payload}",
                                       None, "server_error")
        except asyncio.TimeoutError:
            for r in reqs:
                eng.withdraw(r)
            metrics.answered(endpoint, 504)
            return ApiError(504, f"request {rid} timed out after request_timeout={server.timeout:g} s", None,
                            "timeout_error").response()
        except ApiError as exc:
            for r in reqs:
                eng.withdraw(r)
            metrics.answered(endpoint, exc.status)
            return exc.response()
        except asyncio.CancelledError:
            for r in reqs:
                eng.withdraw(r)
            raise
        choices, usage = [], {"prompt_tokens": 0, "completion_tokens": 0}
        for i, (r, out) in enumerate(zip(reqs, outs)):
            text, stopped = cut_at_stop(out.row.text, parsed.stop)
            reason = _finish_reason(server.lm, out.row, stopped)
            fig = _figures(r, out)
            if chat:
                choices.append({"index": i, "message": {"role": "assistant", "content": text},
                                "finish_reason": reason, "logprobs": None, "dlm": fig})
            else:
                choices.append({"index": i, "text": text, "finish_reason": reason, "logprobs": None, "dlm": fig})
            usage["prompt_tokens"] += len(r.prompt_ids)
            usage["completion_tokens"] += out.row.generated_tokens
            metrics.sequence(out.row, len(r.prompt_ids))
            metrics.queue_wait.observe(out.queue_wait)
        usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
        server_time = time.perf_counter() - arrived
        metrics.latency.observe(server_time)
        metrics.answered(endpoint, 200)
        # the request's decode: from its first batch's start to its last batch's end (one batch for one prompt)
        decode = max(o.queue_wait + o.decode_time for o in outs) - min(o.queue_wait for o in outs)
        body = {"id": cid, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
                "model": server.name, "choices": choices, "usage": usage,
                "dlm": {"request_id": rid, "request_ids": [r.id for r in reqs], "trace": choices[0]["dlm"]["trace"],
                        "server_time": server_time, "overhead": server_time - decode}}
        return JSONResponse(body, headers={"X-Request-Id": rid})

    async def completions(request):
        return await handle(request, False)

    async def chat(request):
        return await handle(request, True)

    async def models(request):
        return JSONResponse({"object": "list", "data": [{"id": server.name, "object": "model",
                                                          "created": server.created, "owned_by": "dlm_engine"}]})

    async def health(request):
        return JSONResponse({"status": "ok", "model": server.name, "queue": eng.queued, "decoding": eng.decoding,
                             "strategy": str(server.cfg.strategy.name), "cache": str(server.cfg.cache.name),
                             "max_batch_size": eng.max_batch, "gen_length": server.default_gen,
                             "max_length": _max_len(server.lm)})

    async def prom(request):
        return Response(metrics.text(), media_type="text/plain; version=0.0.4; charset=utf-8")

    async def page(request):
        html = resources.files("dlm_engine.serve").joinpath("page.html").read_text(encoding="utf-8")
        return HTMLResponse(html)

    async def options(request):
        from dlm_engine.core.registry import STRATEGIES, load_plugins

        load_plugins()
        return JSONResponse({"strategies": sorted(STRATEGIES.names()), "strategy": str(server.cfg.strategy.name),
                             "cache": str(server.cfg.cache.name), "gen_length": server.default_gen,
                             "pieces": server.pieces, "mask_id": server.lm.mask_id})

    @asynccontextmanager
    async def lifespan(app):
        eng.start()
        yield
        await asyncio.get_running_loop().run_in_executor(None, eng.close)

    return Starlette(routes=[
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/metrics", prom, methods=["GET"]),
        Route("/dlm/options", options, methods=["GET"]),
        Route("/", page, methods=["GET"]),
    ], lifespan=lifespan, exception_handlers={404: _not_found, 405: _not_allowed})


async def _not_found(request, exc):
    return ApiError(404, f"no route {request.url.path}", None, "not_found_error").response()


async def _not_allowed(request, exc):
    return ApiError(405, f"{request.method} is not allowed on {request.url.path}", None).response()


def _max_len(lm) -> Optional[int]:
    from dlm_engine.app.inputs import max_length

    return max_length(lm.config, getattr(lm, "max_length", None))


def _stream(server: Server, parsed: Parsed, reqs: List[Request], queues, cid: str, endpoint: str, arrived: float,
            deadline: float):
    from sse_starlette.sse import EventSourceResponse

    eng, metrics, chat = server.engine, server.metrics, parsed.chat
    obj = "chat.completion.chunk" if chat else "text_completion"
    created = int(time.time())

    def chunk(i: int, text: Optional[str], reason: Optional[str] = None, extra: Optional[dict] = None) -> str:
        if chat:
            delta = {} if text is None else {"content": text}
            ch = {"index": i, "delta": delta, "finish_reason": reason, "logprobs": None}
        else:
            ch = {"index": i, "text": text or "", "finish_reason": reason, "logprobs": None}
        if extra:
            ch["dlm"] = extra
        return json.dumps({"id": cid, "object": obj, "created": created, "model": server.name, "choices": [ch]})

    async def events():
        done = [False] * len(reqs)
        usage = {"prompt_tokens": 0, "completion_tokens": 0}
        first_text = True
        status = 200
        try:
            if chat:
                for i in range(len(reqs)):
                    yield {"data": json.dumps({"id": cid, "object": obj, "created": created, "model": server.name,
                                               "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                                            "finish_reason": None, "logprobs": None}]})}
            for i, (r, q) in enumerate(zip(reqs, queues)):
                sent = ""       # text sent, before the hold-back for stop strings
                shown = ""      # text the client has
                while not done[i]:
                    try:
                        kind, payload = await _wait(q, deadline)
                    except asyncio.TimeoutError:
                        status = 504
                        yield {"event": "error", "data": json.dumps({"error": {
                            "message": f"request {r.id} timed out after request_timeout={server.timeout:g} s",
                            "type": "timeout_error", "code": 504}})}
                        return
                    if kind == "step":
                        yield {"event": "dlm.step", "data": json.dumps(dict(payload, id=r.id, index=i))}
                    elif kind == "text":
                        sent += payload
                        cut, hit = cut_at_stop(sent, parsed.stop)
                        visible = cut if hit else cut[:len(cut) - held_back(cut, parsed.stop)]
                        if len(visible) > len(shown):
                            if first_text:
                                metrics.ttft.observe(time.perf_counter() - arrived)
                                first_text = False
                            yield {"data": chunk(i, visible[len(shown):])}
                            shown = visible
                    elif kind == "error":
                        status = 500
                        yield {"event": "error", "data": json.dumps({"error": {
                            "message": f"request {r.id}: {payload}", "type": "server_error", "code": 500}})}
                        return
                    else:          # done
                        out: Outcome = payload
                        final, stopped = cut_at_stop(out.row.text, parsed.stop)
                        rest = final[len(shown):] if final.startswith(shown) else final
                        if rest and first_text:
                            metrics.ttft.observe(time.perf_counter() - arrived)
                            first_text = False
                        reason = _finish_reason(server.lm, out.row, stopped)
                        yield {"data": chunk(i, rest or None if chat else rest, reason, _figures(r, out))}
                        usage["prompt_tokens"] += len(r.prompt_ids)
                        usage["completion_tokens"] += out.row.generated_tokens
                        metrics.sequence(out.row, len(r.prompt_ids))
                        metrics.queue_wait.observe(out.queue_wait)
                        done[i] = True
            if parsed.include_usage:
                usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
                yield {"data": json.dumps({"id": cid, "object": obj, "created": created, "model": server.name,
                                           "choices": [], "usage": usage})}
            yield {"data": "[DONE]"}
            metrics.latency.observe(time.perf_counter() - arrived)
        except asyncio.CancelledError:          # the client went away: its rows are freed at the next step
            status = 499
            raise
        finally:
            for r, d in zip(reqs, done):
                if not d:
                    eng.withdraw(r)
            metrics.answered(endpoint, status)

    return EventSourceResponse(events(), headers={"X-Request-Id": reqs[0].id}, ping=15,
                               shutdown_grace_period=server.timeout)
