"""The FastAPI app: OpenAI's `/v1/completions`, `/v1/chat/completions` and `/v1/models`, plus `/health` and
`/metrics`, over one `ServingGenerator` (docs/server.md has every field and error).

    app = create_app(DynamicGenerator(model), model_name="smollm2-135m")
    paged.server.run.serve(app, host="127.0.0.1", port=8000)

Every request becomes jobs of the one continuous batch. Streaming responses are server-sent events, one chunk per
choice and engine step (`data: {...}`, then `data: [DONE]`); a client that disconnects, streaming or not, has its
jobs cancelled at once. Errors are OpenAI's error objects: 400 for a bad request (naming the field), 404 for an
unknown model or route, 429 when `max_queue` jobs wait, 503 while shutting down; a job that fails mid-stream sends
one `data: {"error": ...}` event and ends that stream only.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from paged.errors import GeneratorError
from paged.host.generator import DynamicGenerator
from paged.server.errors import APIError, from_generator_error, job_failed, model_not_found
from paged.server.metrics import ServerMetrics
from paged.server.protocol import ChatCompletionRequest, CompletionRequest, error_param
from paged.server.responses import Choice, Formatter
from paged.server.service import RequestStream, ServerShutdown, ServingGenerator
from paged.server.translate import Context, Plan, chat_plan, choices_of, completion_plan

log = logging.getLogger("paged.server")


def _dumps(obj: Any) -> str:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False)


def _sse(obj: Any) -> str:
    return f"data: {_dumps(obj)}\n\n"


class _JobStream(StreamingResponse):
    """A streaming response that runs `on_close` however it ends (finished, client gone, server cancelled it),
    even when its body never started."""

    def __init__(self, content, on_close):
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.on_close = on_close

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()


def _endpoint(request: Request) -> str:
    """The metrics' `endpoint` label: the route's path template (`/v1/models/{name:path}`, not the path asked
    for, so that clients cannot add series), "other" for a path no route matched."""
    return getattr(request.scope.get("route"), "path", "other")


def _unparsable(body: bytes) -> str:
    """Why a body FastAPI could not parse is no JSON: not UTF-8, nested too deeply, or a syntax error."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as e:
        return f"invalid JSON: the body is not UTF-8 (byte 0x{body[e.start]:02x} at position {e.start})"
    try:
        json.loads(text)
    except RecursionError:
        return "invalid JSON: nested deeper than the server's JSON parser takes"
    except json.JSONDecodeError as e:
        return f"invalid JSON at position {e.pos}: {e.msg}"
    return "invalid JSON"


async def _disconnected(request: Request) -> None:
    """Returns when the client has gone away (the request body was read already)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


class _Request:
    """One request in flight: its plan, stream, choices and formatter, and its metrics when it ends."""

    def __init__(self, app_state: _State, endpoint: str, kind: str, model: str, plan: Plan, stream: RequestStream,
                 arrival: float):
        self.s = app_state
        self.endpoint = endpoint
        self.plan = plan
        self.stream = stream
        self.arrival = arrival
        self.fmt = Formatter(kind, model, plan, app_state.tokenizer)
        echo = plan.echo or []
        self.choices = [Choice(i, i // plan.n, echo[i // plan.n] if echo else "", self.fmt.token_bytes)
                        for i in range(len(plan.jobs))]
        self.by_job = {job: c for job, c in zip(plan.jobs, self.choices)}
        self.ended = False

    def absorb(self, items: list) -> tuple[list[Choice], BaseException | None]:
        """Feed a batch of results; returns the choices it touched and the exception that ended the request."""
        now = time.perf_counter()
        touched: dict[int, Choice] = {}
        for item in items:
            if isinstance(item, BaseException):
                return list(touched.values()), item
            c = self.by_job.get(item["job"])
            if c is not None:
                c.absorb(item, now)
                touched[c.index] = c
        return list(touched.values()), None

    def end(self, outcome: str | None = None) -> None:
        """Record the request's metrics once (`outcome`: cancelled / error; else each choice's finish reason)."""
        if self.ended:
            return
        self.ended = True
        m = self.s.metrics
        self.s.service.abort(self.stream)  # whatever is still running (client gone, error): cancelled now
        m.prompt_tokens.inc(sum(self.plan.prompt_lens))
        m.generation_tokens.inc(sum(c.completion_tokens for c in self.choices))
        last = None
        for c in self.choices:
            if c.first_token_time is not None:
                m.ttft.observe(c.first_token_time - self.arrival)
                last = max(last or 0.0, c.last_token_time)
                if c.final is not None and c.completion_tokens > 1:
                    m.tpot.observe((c.last_token_time - c.first_token_time) / (c.completion_tokens - 1))
        if last is not None and outcome is None:
            m.e2e.observe(last - self.arrival)
        reasons = [c.finish_reason or "error" for c in self.choices]
        for reason in reasons:
            m.choices.labels(self.endpoint, reason if outcome is None else outcome).inc()
        if outcome is None:  # one outcome per request, whatever its n: the first of these its choices had
            outcome = next(r for r in ("error", "content_filter", "length", "stop") if r in reasons)
        m.requests.labels(self.endpoint, outcome).inc()


class _State:
    def __init__(self, generator: DynamicGenerator, model_name: str, chat_template: str | None,
                 max_queue: int | None, max_step_retries: int, admission_wait_ms: float):
        self.generator = generator
        self.tokenizer = generator.tokenizer
        self.model_name = model_name
        self.service = ServingGenerator(generator, max_queue=max_queue, max_step_retries=max_step_retries,
                                        admission_wait_s=admission_wait_ms / 1000)
        self.metrics = ServerMetrics(generator, self.service.open_streams)
        self.service.on_step = self.metrics.observe_step
        self.ctx = Context(tokenizer=generator.tokenizer, max_seq_len=generator.max_seq_len,
                           chat_template=chat_template, loras=frozenset(generator.loras),
                           max_penalty_range=generator.config.max_penalty_range,
                           eos_token_ids=_config_eos(generator))
        self.created = int(time.time())

    def context(self) -> Context:
        """The translation context with the adapters the generator holds now (one loaded or unloaded after the
        app was made included)."""
        return dataclasses.replace(self.ctx, loras=frozenset(self.generator.loras))

    def served(self) -> list[str]:
        return [self.model_name, *sorted(set(self.generator.loras) - {self.model_name})]

    def check_model(self, name: str) -> bool:
        """Whether `name` is a LoRA adapter (else the base model); 404 if neither."""
        if name == self.model_name:
            return False
        if name in self.generator.loras:
            return True
        raise model_not_found(name, self.served())


def _config_eos(generator: DynamicGenerator) -> tuple[int, ...]:
    """The end-of-reply ids of the generator's model (`Model.stop_token_ids`: config.json's eos_token_id list with
    its tokenizer's EOS; a fake engine has none): replies end there too."""
    return tuple(getattr(getattr(generator.engine, "model", None), "stop_token_ids", None) or ())


def create_app(generator: DynamicGenerator, *, model_name: str, chat_template: str | None = None,
               max_queue: int | None = None, max_step_retries: int = 2, admission_wait_ms: float = 0.0) -> FastAPI:
    """The server's app over `generator` (which needs a tokenizer), serving it as `model_name` (and its loaded
    LoRA adapters under their names). `chat_template` overrides the tokenizer's; `max_queue` bounds the jobs
    waiting for admission (None: unbounded); `admission_wait_ms`: after a step in which requests ended, while jobs
    run and none waits, wait up to this long for as many new requests before the next step (docs/server.md).
    Shutdown: `app.state.paged.service.drain(grace_s)` (`serve` calls it on SIGTERM), then the app's lifespan
    closes the generator's loop."""
    if generator.tokenizer is None:
        raise ValueError("create_app: the generator needs a tokenizer (the server takes and returns text)")
    if admission_wait_ms < 0:
        raise ValueError(f"create_app: admission_wait_ms must be >= 0, got {admission_wait_ms}")
    if model_name in generator.loras:
        raise ValueError(f"create_app: a LoRA adapter is loaded under the served model's name {model_name!r}; a "
                         "request naming it could not reach both: load the adapter under another name")
    state = _State(generator, model_name, chat_template, max_queue, max_step_retries, admission_wait_ms)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        await state.service.close()

    app = FastAPI(title="paged: an OpenAI-compatible server", lifespan=lifespan, docs_url="/docs", redoc_url=None)
    app.state.paged = state

    # ------------------------------------------------------------------ errors
    def rejected(request: Request, e: APIError) -> JSONResponse:
        state.metrics.requests.labels(_endpoint(request), "rejected").inc()
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError):
        return rejected(request, e)

    bodies = {"/v1/completions": CompletionRequest, "/v1/chat/completions": ChatCompletionRequest}

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, e: RequestValidationError):
        errors = e.errors() or [{"loc": (), "msg": "invalid request"}]
        first = errors[0]
        if first.get("type") == "json_invalid":  # its loc is a byte offset, not a field
            pos = (first.get("loc") or (None,))[-1]
            detail = (first.get("ctx") or {}).get("error")
            return rejected(request, APIError(
                400, f"invalid JSON at position {pos}" + (f": {detail}" if detail else "")))
        kind = request.headers.get("content-type", "")
        if tuple(first.get("loc", ())) == ("body",) and "json" not in kind.lower():
            return rejected(request, APIError(400, "The body must be a JSON object sent with Content-Type: "
                                              f"application/json (this one came as {kind or 'no content type'!r})"))
        model = bodies.get(request.url.path)
        params = [error_param(tuple(err.get("loc", ())), model) for err in errors]
        param = params[0]
        if first.get("type") == "extra_forbidden":
            message = f"Unrecognized request argument supplied: {param}"
        else:  # one line per error (a union's value gets one per member it failed), the same line once
            lines = list(dict.fromkeys(f"{p or 'body'}: {err.get('msg')}" for p, err in zip(params, errors)))
            message = "; ".join(lines[:5]) + (f"; ... ({len(lines) - 5} more)" if len(lines) > 5 else "")
        return rejected(request, APIError(400, message, param=param))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, e: StarletteHTTPException):
        if e.status_code == 400 and e.detail == "There was an error parsing the body":  # FastAPI's, on any failure
            return rejected(request, APIError(400, _unparsable(await request.body())))
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return JSONResponse(APIError(e.status_code, str(e.detail), type=kind).body(), status_code=e.status_code)

    @app.exception_handler(Exception)
    async def _internal(request: Request, e: Exception):
        log.exception("internal error on %s", request.url.path)
        return JSONResponse(APIError(500, f"{type(e).__name__}: {e}", type="server_error").body(), status_code=500)

    # ------------------------------------------------------------------ routes
    @app.get("/health")
    async def health():
        if not state.service.accepting:
            return JSONResponse({"status": "shutting_down"}, status_code=503)
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        base = {"object": "model", "created": state.created, "owned_by": "paged",
                "max_model_len": generator.max_seq_len}
        data = [{"id": state.model_name, "root": state.model_name, "parent": None, **base}]
        data += [{"id": name, "root": name, "parent": state.model_name, **base} for name in state.served()[1:]]
        return {"object": "list", "data": data}

    @app.get("/v1/models/{name:path}")
    async def model(name: str):
        state.check_model(name)
        return next(m for m in (await models())["data"] if m["id"] == name)

    @app.get("/metrics")
    async def metrics():
        return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await _serve("/v1/completions", "completion", completion_plan, body, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return await _serve("/v1/chat/completions", "chat", chat_plan, body, request)

    async def _serve(endpoint: str, kind: str, make_plan, body, request: Request):
        arrival = time.perf_counter()
        is_lora = state.check_model(body.model)
        param = "n" if body.n > 1 else "prompt" if kind == "completion" else "messages"
        state.service.check_room(choices_of(body), param)  # before any prompt is encoded or job built
        plan = await asyncio.to_thread(make_plan, body, state.context(), is_lora)
        try:
            stream = await state.service.open(plan.jobs, param)
        except GeneratorError as e:
            raise from_generator_error(e, type(body)) from None
        req = _Request(state, endpoint, kind, body.model, plan, stream, arrival)
        if body.stream:
            opts = body.stream_options
            return _JobStream(_events(req, opts.include_usage if opts else False,
                                      opts.continuous_usage_stats if opts else False),
                              on_close=lambda: req.end("cancelled"))
        collect = asyncio.ensure_future(_collect(req))
        gone = asyncio.ensure_future(_disconnected(request))
        try:
            done, _ = await asyncio.wait({collect, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not collect.done():
                collect.cancel()
                req.end("cancelled")
            elif not req.ended:  # collecting failed (a bug): its jobs are cancelled all the same
                req.end("error")
        if collect not in done:
            return Response(status_code=499)  # nobody is listening
        return collect.result()

    async def _collect(req: _Request) -> JSONResponse:
        async for items in req.stream.batches():
            _, error = req.absorb(items)
            if error is not None:
                req.end("error")
                return _error_response(error)
        failed = next((c for c in req.choices if c.error is not None), None)
        if failed is not None:
            req.end("error")
            e = job_failed(failed.index, failed.error)
            return JSONResponse(e.body(), status_code=e.status)
        req.end()
        return JSONResponse(req.fmt.response(req.choices))

    async def _events(req: _Request, include_usage: bool, continuous: bool):
        fmt = req.fmt
        usage = (lambda: fmt.usage(req.choices)) if continuous else (lambda: None)
        if fmt.kind == "chat":
            yield _sse(fmt.chunk([fmt.role_chunk(c) for c in req.choices], usage(), include_usage))
        async for items in req.stream.batches():
            touched, error = req.absorb(items)
            out = [d for d in (fmt.delta_choice(c) for c in touched) if d is not None]
            failed = next((c for c in touched if c.error is not None), None)
            if out:
                yield _sse(fmt.chunk(out, usage(), include_usage))
            if failed is not None or error is not None:
                req.end("error")
                if failed is not None:
                    yield _sse(job_failed(failed.index, failed.error).body())
                else:
                    err_type = "server_shutdown" if isinstance(error, ServerShutdown) else "server_error"
                    yield _sse(APIError(500, f"{type(error).__name__}: {error}", type=err_type,
                                        code="job_failed").body())
                yield "data: [DONE]\n\n"
                return
        req.end()
        if include_usage:
            yield _sse(fmt.chunk([], fmt.usage(req.choices), True))
        yield "data: [DONE]\n\n"

    def _error_response(error: BaseException) -> JSONResponse:
        err_type = "server_shutdown" if isinstance(error, ServerShutdown) else "server_error"
        status = 503 if isinstance(error, ServerShutdown) else 500
        return JSONResponse(APIError(status, f"{type(error).__name__}: {error}", type=err_type).body(),
                            status_code=status)

    return app
