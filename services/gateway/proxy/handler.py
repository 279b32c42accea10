"""The proxy: each attempt's OpenAI and Anthropic base URLs, every model call forwarded and recorded.

    /proxy/rollout/{rid}/attempt/{aid}/mode/{train|val}/openai/v1/
        POST chat/completions, POST responses, GET models
    /proxy/rollout/{rid}/attempt/{aid}/mode/{train|val}/anthropic/
        HEAD, POST v1/messages, POST v1/messages/count_tokens, GET v1/models

An agent of a multi-agent harness names itself with `agent/{name}` after the mode, or with the
`X-Rollwire-Agent` header (`agents.py`); the name is recorded on its calls and may route them.

This is the hot path, so it is a plain ASGI handler (no routing or validation framework in the
way), admission is checked against the in-memory state (`services.gateway.state`), the upstream is one pooled
`UpstreamClient` (`upstream.py`), and JSON goes through msgspec.

A path is parsed into a `Route` (attempt, mode, which API, the rest), the call is admitted
(403 foreign token, 404 unknown attempt, 409 finished attempt or wrong mode, 503 NATS down;
nothing is forwarded otherwise), and the route's front end (`frontends/`) turns the request into
the engine's chat-completions body and a translator for the answer. `pipeline.py` forwards,
records and answers. Every refusal is written in the API's own error shape.
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec

from schemas import ModelRequestRecorded, new_id
from schemas.ids import MODEL_REQUEST
from schemas.rollout import RolloutView
from services.common.metrics import HttpObserver
from services.gateway.asgi import Receive, Scope, Send, header, read_body, send_json
from services.gateway.auth import AttemptScope, Principal
from services.gateway.context import Gateway
from services.gateway.errors import (
    ApiError,
    ended_attempt,
    forbidden,
    internal,
    not_found,
    too_deep,
    translate,
    unauthorized,
    unavailable,
)
from services.gateway.http import refuse_huge_numbers
from services.gateway.metrics import CallWatch, Served
from services.gateway.proxy.agents import AGENT_HEADER, agent_name, split_agent
from services.gateway.proxy.call import Call
from services.gateway.proxy.frontends import chat, messages, responses
from services.gateway.proxy.frontends.base import Api, Translator, error_body
from services.gateway.proxy.frontends.canonical import Conversation, TranslationError, Turn, history
from services.gateway.proxy.ledger import Charge
from services.gateway.proxy.limits import check_call
from services.gateway.proxy.openai_format import prepare_request
from services.gateway.proxy.pipeline import Pipeline
from services.gateway.proxy.routing import sticky
from services.gateway.proxy.upstream import UpstreamError
from services.gateway.state import ModelEntry

PREFIX = "/proxy/rollout/"
PROXY_BASE = PREFIX + "{rollout_id}/attempt/{attempt_id}/mode/{mode}"
"""An attempt's proxy base URL as a path template."""
AGENT_BASE = PROXY_BASE + "/agent/{agent}"
SERVED = (
    "this proxy serves OpenAI's API under .../openai/v1/ (POST chat/completions, POST responses, GET models) "
    "and Anthropic's Messages API under .../anthropic/ (POST v1/messages, POST v1/messages/count_tokens, "
    "GET v1/models, HEAD)"
)
_MODEL_API = re.compile(
    r"(?:/(?:v1|openai|anthropic))*/(?:chat/completions|completions|responses(?:/.*)?|models(?:/.*)?"
    r"|messages(?:/count_tokens)?|embeddings)/?"
)
"""A model API's path under a base URL: what an SDK requests when given the gateway's own URL as its base."""
_encode = msgspec.json.Encoder().encode
_decode_obj = msgspec.json.Decoder(dict[str, Any]).decode


class Route(msgspec.Struct, frozen=True):
    """A parsed proxy path: whose attempt, which mode, which API, and the rest of the path."""

    rollout_id: str
    attempt_id: str
    mode: str
    api: Api
    rest: str
    agent: str | None = None


def parse_route(path: str) -> Route:
    """The route of a `/proxy/rollout/...` path (404 naming the served APIs when it is not one)."""
    agent, parts = split_agent(path[len(PREFIX) :].split("/"))
    # rid / attempt / aid / mode / m [/ agent / name] / api [/ v1] / rest...
    if len(parts) < 6 or parts[1] != "attempt" or parts[3] != "mode":
        raise not_found(
            f"unknown proxy path; use /proxy/rollout/{{rid}}/attempt/{{aid}}/mode/{{train|val}}/...: {SERVED}"
        )
    rollout_id, attempt_id, mode, api = parts[0], parts[2], parts[4], parts[5]
    if mode not in ("train", "val"):
        raise not_found(f"unknown proxy mode {mode!r}; use train or val")
    if api == "openai" and parts[6:7] == ["v1"]:
        return Route(rollout_id, attempt_id, mode, "openai", "/".join(parts[7:]), agent)
    if api == "anthropic":
        return Route(rollout_id, attempt_id, mode, "anthropic", "/".join(parts[6:]).rstrip("/"), agent)
    raise not_found(f"the proxy does not serve {'/'.join(parts[5:])!r}: {SERVED}")


def misdirected(path: str, anthropic_version: str | None, base_url: str) -> tuple[Api, str] | None:
    """For a model API request sent to the gateway's root (its URL used as a base URL): the API it was
    meant for and a message naming the URL to use instead; None for any other path."""
    if not _MODEL_API.fullmatch(path):
        return None
    anthropic = anthropic_version is not None or "/messages" in path or path.startswith("/anthropic")
    proxy = f"{base_url}/proxy/rollout/{{rollout_id}}/attempt/{{attempt_id}}/mode/{{train|val}}"
    use = f"{proxy}/anthropic" if anthropic else f"{proxy}/openai/v1"
    variable, field = ("ANTHROPIC", "anthropic_base_url") if anthropic else ("OPENAI", "proxy_base_url")
    return "anthropic" if anthropic else "openai", (
        f"{base_url} is the gateway's own URL, not a model base URL. The model API is served for each "
        f"attempt at its proxy base URL: {use}. An agent started by the controller has it in ${variable}_BASE_URL; "
        f"otherwise take `{field}` from POST /api/rollouts/{{rollout_id}}/attempts"
    )


def _api_of(path: str) -> Api:
    return "anthropic" if "/anthropic/" in path or path.endswith("/anthropic") else "openai"


Handler = Callable[["Proxy", Scope, Receive, Send, Route], Awaitable[None]]


def _replica_of(name: str, model: str) -> bool:
    """Whether `name` is one replica's entry of `model` (`model-rN`, as the trainer registers replicas)."""
    stem, _, index = name.rpartition("-r")
    return stem == model and index.isdigit()


class Proxy:
    """ASGI handler for `/proxy/...` (mounted in front of the API by `app.py`)."""

    def __init__(self, gateway: Gateway, http: HttpObserver) -> None:
        self.gw = gateway
        self.pipeline = Pipeline(gateway)
        self.http = http

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        watch = CallWatch(send)  # counted, timed and access-logged here: the only wrapper on this path
        served: Served | None = None  # a route the proxy serves
        try:
            route = parse_route(scope["path"])
            agent = agent_name(route.agent, header(scope, AGENT_HEADER))
            if agent != route.agent:
                route = msgspec.structs.replace(route, agent=agent)
            endpoint = ROUTES.get((route.api, scope["method"], route.rest))
            if endpoint is None:
                raise not_found(f"the proxy does not serve {scope['method']} {route.rest or '/'}: {SERVED}")
            handler, served = endpoint
            await handler(self, scope, receive, watch.send, route)
        except Exception as exc:
            await self._refuse(exc, scope, watch.send, watch.status is not None)
        finally:
            watch.answered(scope, self.http, served)

    async def _refuse(self, exc: Exception, scope: Scope, send: Send, started: bool) -> None:
        if isinstance(exc, TranslationError):
            exc = ApiError(exc.status, f"{exc.message} (at {exc.field})", field=exc.field)
        error = translate(exc)
        if started:  # a stream already began: nothing more can be said over HTTP
            if error is None:
                raise exc
            return
        if error is None:
            error = internal(exc)  # logged there with a reference; the body says nothing internal
        body = error_body(_api_of(scope["path"]), error.status, error.message, **error.extra)
        await send_json(send, error.status, body, error.headers)

    # ---- admission -----------------------------------------------------------------------------

    async def admit(self, scope: Scope, route: Route) -> RolloutView:
        """The rollout of a call this token may make now (401/403/404/409/503 otherwise)."""
        gw = self.gw
        principal: Principal | None = gw.auth.principal(header(scope, b"authorization"), header(scope, b"x-api-key"))
        if principal is None:
            raise unauthorized("missing or invalid token: send `Authorization: Bearer <token>` or `x-api-key: <token>`")
        if isinstance(principal, AttemptScope):
            if principal.role != "agent":
                raise forbidden("an evaluator token cannot call the model through the proxy")
            if (principal.rollout_id, principal.attempt_id) != (route.rollout_id, route.attempt_id):
                raise forbidden(
                    f"this token belongs to rollout {principal.rollout_id} attempt "
                    f"{principal.attempt_id}, not rollout {route.rollout_id} attempt {route.attempt_id}"
                )
        view = await gw.rollout_for(principal, route.rollout_id)
        if isinstance(principal, AttemptScope) and principal.run_id != view.run_id:
            raise forbidden(f"this token belongs to run {principal.run_id}")
        attempt = view.attempt(route.attempt_id)
        if attempt is None:
            view = await gw.rollout_for(principal, route.rollout_id, refresh=True)
            attempt = view.attempt(route.attempt_id)
            if attempt is None:
                raise not_found(f"rollout {route.rollout_id} has no attempt {route.attempt_id}")
        if attempt.ended:
            raise ended_attempt(view, attempt, "its calls are no longer accepted")
        if route.mode != view.mode:
            raise ApiError(409, f"rollout {route.rollout_id} is a {view.mode} rollout; use mode/{view.mode} in the URL")
        if not gw.store.nc.is_connected:
            raise unavailable("the event store (NATS) is unavailable, so the call cannot be recorded; retry later")
        return view

    def models(self, view: RolloutView) -> list[ModelEntry]:
        """The endpoints a call of this rollout may use (503 when none is registered)."""
        models = self.gw.state.models_for(view.run_id, self.gw.settings.default_run)
        if not models:
            raise unavailable(
                f"no model endpoint is registered for run {view.run_id}; register one with POST /api/models"
            )
        return models

    def choose(self, view: RolloutView, requested: Any, agent: str | None = None) -> ModelEntry:
        """The endpoint for a call: the agent's routed model, else those `requested` names (or its alias),
        else the run's; one endpoint per rollout of a pool.
        """
        models = self.models(view)
        route = self.gw.state.spec(view.run_id).agent_models.get(agent) if agent is not None else None
        if route is not None:  # the run routes this agent to its model, whatever the request says
            routed = [m for m in models if m.name == route or _replica_of(m.name, route)]
            if not routed:
                raise unavailable(f"run {view.run_id} routes agent {agent} to model {route}, which is not registered")
            return sticky(view.rollout_id, routed).for_agent(agent)
        requested = self.gw.state.model_alias(view.run_id, requested)
        matching = [m for m in models if requested in (m.name, m.served_model)]
        # A rollout sticks to one endpoint (its prefix cache), the same through every gateway.
        # An agent whose role has its own LoRA adapter on that endpoint is served by the adapter.
        return sticky(view.rollout_id, matching or models).for_agent(agent)

    async def json_body(self, scope: Scope, receive: Receive) -> dict[str, Any]:
        """The request body as a JSON object (413 too large, 422 not an object)."""
        body = await read_body(scope, receive, self.gw.settings.max_body_bytes)
        try:
            decoded = _decode_obj(body)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise ApiError(422, f"the request body is not a JSON object: {exc}", field="body") from None
        except RecursionError:
            raise too_deep() from None
        refuse_huge_numbers(body)  # before anything is translated, forwarded or recorded
        return decoded

    def call(self, view: RolloutView, route: Route, model: ModelEntry, **fields: Any) -> Call:
        """A call of this route to `model` (the front end supplies payload, request and translator)."""
        return Call(view=view, attempt_id=route.attempt_id, mode=route.mode, model=model, agent=route.agent, **fields)

    async def previous(self, view: RolloutView, attempt_id: str, response_id: Any) -> list[Turn]:
        """The turns of this attempt's recorded call `resp_<call_id>` and its answer (404 if none)."""
        call_id = response_id[5:] if isinstance(response_id, str) and response_id.startswith("resp_") else None
        if call_id:
            subject = MODEL_REQUEST.format(run=view.run_id, rollout=view.rollout_id)
            async for stored in self.gw.store.read(subject):
                event = stored.event
                if (
                    isinstance(event, ModelRequestRecorded)
                    and event.call_id == call_id
                    and event.attempt_id == attempt_id
                    and event.choice_index == 0
                    and event.status == "ok"
                ):
                    return history(event.request, event.response)
        raise ApiError(
            404,
            f"previous response {response_id!r} was not found among this attempt's calls",
            field="previous_response_id",
        )

    async def forward(
        self,
        view: RolloutView,
        route: Route,
        conv: Conversation,
        api: str,
        translator_for: Callable[[str, str], Translator],
        receive: Receive,
        send: Send,
    ) -> None:
        """Send a canonical conversation through the pipeline (the Responses and Messages front ends)."""
        model = self.choose(view, conv.model, route.agent)
        recorded = conv.chat_body()
        upstream, _ = prepare_request(recorded, model.upstream_model)
        call_id = new_id()
        call = self.call(
            view,
            route,
            model,
            call_id=call_id,
            api=api,
            payload=_encode(upstream),
            recorded_request=recorded,
            stream=conv.stream,
            translator=translator_for(call_id, conv.model or model.name),
        )
        await self.pipeline.run(call, receive, send)


# ---- routes --------------------------------------------------------------------------------------


async def _chat(proxy: Proxy, scope: Scope, receive: Receive, send: Send, route: Route) -> None:
    view = await proxy.admit(scope, route)
    request = await proxy.json_body(scope, receive)
    if not isinstance(request.get("messages"), list):
        raise ApiError(422, 'chat completions need a list of "messages"', field="messages")
    model = proxy.choose(view, request.get("model"), route.agent)
    payload, translator = chat.prepare(request, model.upstream_model)
    call = proxy.call(
        view,
        route,
        model,
        call_id=new_id(),
        api="chat",
        payload=payload,
        recorded_request=request,
        stream=bool(request.get("stream")),
        translator=translator,
    )
    await proxy.pipeline.run(call, receive, send)


async def _responses(proxy: Proxy, scope: Scope, receive: Receive, send: Send, route: Route) -> None:
    view = await proxy.admit(scope, route)
    request = await proxy.json_body(scope, receive)
    prior: list[Turn] = []
    if request.get("previous_response_id") is not None:
        prior = await proxy.previous(view, route.attempt_id, request["previous_response_id"])
    conv = responses.conversation(request, prior)
    await proxy.forward(
        view,
        route,
        conv,
        "responses",
        lambda call_id, name: responses.ResponsesTranslator(request, call_id, name),
        receive,
        send,
    )


async def _messages(proxy: Proxy, scope: Scope, receive: Receive, send: Send, route: Route) -> None:
    view = await proxy.admit(scope, route)
    conv = messages.conversation(await proxy.json_body(scope, receive))
    await proxy.forward(view, route, conv, "messages", messages.MessagesTranslator, receive, send)


async def _count_tokens(proxy: Proxy, scope: Scope, receive: Receive, send: Send, route: Route) -> None:
    """Count a Messages request's input tokens with a one-token engine call, within the run's limits and
    the attempt's budget (charged the prompt and the one token, not a call), behind the phase gate."""
    gw = proxy.gw
    view = await proxy.admit(scope, route)
    request = await proxy.json_body(scope, receive)
    conv = messages.conversation({"max_tokens": 1, **request})
    model = proxy.choose(view, conv.model, route.agent)
    body = messages.count_body(conv, model.upstream_model)
    settings = gw.state.spec(view.run_id)
    check_call(body, settings.limits)
    payload = _encode(body)
    if len(payload) > gw.store.max_payload:
        raise ApiError(413, f"this request's {len(payload)} bytes exceed the {gw.store.max_payload} a call may send")
    reservation = await gw.budgets.reserve(
        view, route.attempt_id, settings.budget, prompt=len(payload), n=1, max_tokens=1, size=0, calls=0
    )
    counted: int | None = None
    try:
        counted = await _counted(proxy, view, model, payload)
    finally:
        if reservation is not None:
            spent = reservation.charge if counted is None else Charge(tokens=counted + 1)
            await gw.budgets.settle(reservation, spent, [])
    await send_json(send, 200, _encode({"input_tokens": counted}))


async def _counted(proxy: Proxy, view: RolloutView, model: ModelEntry, payload: bytes) -> int:
    """The prompt length the engine reports for a one-token call (behind the phase gate)."""
    headers = {"content-type": "application/json"} | (
        {"authorization": f"Bearer {model.api_key}"} if model.api_key else {}
    )
    gate = proxy.gw.gate
    await gate.enter(view.run_id)
    try:
        response = await proxy.gw.upstream.request("POST", f"{model.base_url}/chat/completions", payload, headers)
        status, content = response.status, await response.read()
    except (UpstreamError, TimeoutError) as exc:
        raise ApiError(502, f"the model endpoint {model.base_url} failed: {exc}") from None
    finally:
        gate.leave(view.run_id)
    try:
        ids = _decode_obj(content).get("prompt_token_ids") if status < 400 else None
    except (msgspec.DecodeError, msgspec.ValidationError):
        ids = None
    if not isinstance(ids, list):
        raise ApiError(502, f"the model endpoint answered {status} without prompt_token_ids; tokens cannot be counted")
    return len(ids)


async def _openai_models(proxy: Proxy, scope: Scope, receive: Receive, send: Send, route: Route) -> None:
    view = await proxy.admit(scope, route)
    data = [
        {"id": name, "object": "model", "created": 0, "owned_by": "rollwire"} for name in await _model_ids(proxy, view)
    ]
    await send_json(send, 200, _encode({"object": "list", "data": data}))


async def _anthropic_models(proxy: Proxy, scope: Scope, receive: Receive, send: Send, route: Route) -> None:
    view = await proxy.admit(scope, route)
    ids = await _model_ids(proxy, view)
    data = [{"type": "model", "id": name, "display_name": name, "created_at": "1970-01-01T00:00:00Z"} for name in ids]
    page = {"data": data, "has_more": False, "first_id": ids[0] if ids else None, "last_id": ids[-1] if ids else None}
    await send_json(send, 200, _encode(page))


async def _model_ids(proxy: Proxy, view: RolloutView) -> list[str]:
    """Every model a call of this rollout may name: each endpoint's own list, then the registered names."""
    ids: list[str] = []
    for model in sorted(proxy.models(view), key=lambda m: m.name):
        headers = {"authorization": f"Bearer {model.api_key}"} if model.api_key else {}
        try:
            response = await proxy.gw.upstream.request("GET", f"{model.base_url}/models", b"", headers)
            status, content = response.status, await response.read()
            listed = _decode_obj(content).get("data") if status < 400 else None
        except (UpstreamError, TimeoutError, msgspec.DecodeError, msgspec.ValidationError):
            listed = None  # an endpoint that cannot list still serves its registered names
        for entry in listed if isinstance(listed, list) else []:
            if isinstance(entry, dict) and isinstance(entry.get("id"), str):
                ids.append(entry["id"])
        ids += [model.name, model.upstream_model]
    return list(dict.fromkeys(ids))


async def _head(proxy: Proxy, scope: Scope, receive: Receive, send: Send, route: Route) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": b""})


_ENDPOINTS: tuple[tuple[Api, str, str, Handler, str], ...] = (
    # API, method, path below the API's base, handler, the front end's metrics label
    ("openai", "POST", "chat/completions", _chat, "chat_completions"),
    ("openai", "POST", "responses", _responses, "responses"),
    ("openai", "GET", "models", _openai_models, "models"),
    ("anthropic", "POST", "v1/messages", _messages, "anthropic_messages"),
    ("anthropic", "POST", "v1/messages/count_tokens", _count_tokens, "anthropic_count_tokens"),
    ("anthropic", "GET", "v1/models", _anthropic_models, "models"),
    ("anthropic", "HEAD", "", _head, "other"),
)


def route_template(api: str, rest: str, base: str = PROXY_BASE) -> str:
    """The path template of the proxy route `rest` below `api`'s base (`base`: `AGENT_BASE` for an agent's)."""
    return f"{base}/openai/v1/{rest}" if api == "openai" else f"{base}/anthropic/{rest}".rstrip("/")


ROUTES: dict[tuple[str, str, str], tuple[Handler, Served]] = {
    (api, method, rest): (handler, Served(front_end, route_template(api, rest)))
    for api, method, rest, handler, front_end in _ENDPOINTS
}
"""Every route the proxy serves, by (API, method, path below the API's base): its handler and metrics labels."""
FRONT_ENDS = tuple(dict.fromkeys(front_end for *_, front_end in _ENDPOINTS))
"""The front ends' metrics labels."""
