"""The HTTP routes: thin handlers that hand each request to its serving object (on `app.state`)."""
from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from .protocol_conversations import ConversationCreateRequest, ConversationItemsRequest, ConversationUpdateRequest
from .protocol import APIError, ChatCompletionRequest, CompletionRequest, ModelCard, ModelList
from .protocol_messages import CountTokensRequest, MessagesRequest
from .protocol_responses import ResponsesRequest
from .protocol_sessions import SessionCreateRequest, SessionMessageRequest
from .protocol_tokenize import DetokenizeRequest, TokenizeRequest

router = APIRouter()


@router.get("/health")
async def health(request: Request) -> Response:
    if not request.app.state.backend.is_running:
        raise APIError(503, "the engine is not running", headers={"Retry-After": "5"})
    return JSONResponse({"status": "ok"})


DASHBOARD = (Path(__file__).parent / "dashboard.html").read_text()


@router.get("/dashboard")
async def dashboard() -> Response:
    """The live view (server/dashboard.html): open like /metrics, whose numbers it shows."""
    return HTMLResponse(DASHBOARD)


def model_card(request: Request, name: str) -> ModelCard:
    info = request.app.state.backend.info
    return ModelCard(id=name, root=info.model, max_model_len=info.max_model_len, display_name=name)


@router.get("/v1/models")
async def models(request: Request) -> Response:
    """A card per served name (`--served-model-name` takes several, as vLLM's does)."""
    cards = [model_card(request, name) for name in request.app.state.model_names]
    return JSONResponse(ModelList(data=cards).model_dump(mode="json"))


@router.get("/v1/models/{model:path}")
async def model(model: str, request: Request) -> Response:
    """The served model by any name it answers to (OpenAI's and Anthropic's retrieve), else 404."""
    state = request.app.state
    state.completions.check_model(model)
    name = model if model in state.model_names else state.model_name
    return JSONResponse(model_card(request, name).model_dump(mode="json"))


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    state = request.app.state
    if state.backend.is_running:
        state.metrics.engine.snapshot = await state.backend.snapshot()
    return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
    state = request.app.state
    return await (state.chat_server_tools if body.server_tools else state.chat).create(body, request)


# vLLM's render routes: the prompt token ids a request would be served with. vllm-router's cache_aware
# policy asks every replica for them and routes a request where the longest prefix of its ids went before.
@router.post("/v1/chat/completions/render")
async def render_chat_completion(body: ChatCompletionRequest, request: Request) -> Response:
    return JSONResponse(request.app.state.chat.render(body, request))


@router.post("/v1/completions/render")
async def render_completion(body: CompletionRequest, request: Request) -> Response:
    return JSONResponse(request.app.state.completions.render(body))


# vLLM's tokenizer routes (at the root, as vLLM has them): a prompt's or a conversation's token ids, and
# token ids' text.
@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, request: Request) -> Response:
    return JSONResponse(request.app.state.tokenize.tokenize(body, request))


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, request: Request) -> Response:
    return JSONResponse(request.app.state.tokenize.detokenize(body))


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request) -> Response:
    return await request.app.state.completions.create(body, request)


@router.post("/v1/responses")
async def create_response(body: ResponsesRequest, request: Request) -> Response:
    return await request.app.state.responses.create(body, request)


@router.get("/v1/responses/{response_id}")
async def retrieve_response(response_id: str, request: Request) -> Response:
    return await request.app.state.responses.retrieve(response_id, request)


@router.get("/v1/responses/{response_id}/input_items")
async def response_input_items(response_id: str, request: Request) -> Response:
    return await request.app.state.responses.input_items(response_id, request)


@router.post("/v1/responses/{response_id}/cancel")
async def cancel_response(response_id: str, request: Request) -> Response:
    return await request.app.state.responses.cancel(response_id, request)


@router.delete("/v1/responses/{response_id}")
async def delete_response(response_id: str, request: Request) -> Response:
    return await request.app.state.responses.delete(response_id, request)


@router.post("/v1/conversations")
async def create_conversation(body: ConversationCreateRequest, request: Request) -> Response:
    return await request.app.state.conversations_api.create(body, request)


@router.get("/v1/conversations/{conversation_id}")
async def retrieve_conversation(conversation_id: str, request: Request) -> Response:
    return await request.app.state.conversations_api.retrieve(conversation_id, request)


@router.post("/v1/conversations/{conversation_id}")
async def update_conversation(conversation_id: str, body: ConversationUpdateRequest, request: Request) -> Response:
    return await request.app.state.conversations_api.update(conversation_id, body, request)


@router.delete("/v1/conversations/{conversation_id}")
async def delete_conversation(conversation_id: str, request: Request) -> Response:
    return await request.app.state.conversations_api.delete(conversation_id, request)


@router.post("/v1/conversations/{conversation_id}/items")
async def add_conversation_items(conversation_id: str, body: ConversationItemsRequest, request: Request) -> Response:
    return await request.app.state.conversations_api.add_items(conversation_id, body, request)


@router.get("/v1/conversations/{conversation_id}/items")
async def list_conversation_items(conversation_id: str, request: Request) -> Response:
    return await request.app.state.conversations_api.list_items(conversation_id, request)


@router.get("/v1/conversations/{conversation_id}/items/{item_id}")
async def retrieve_conversation_item(conversation_id: str, item_id: str, request: Request) -> Response:
    return await request.app.state.conversations_api.retrieve_item(conversation_id, item_id, request)


@router.delete("/v1/conversations/{conversation_id}/items/{item_id}")
async def delete_conversation_item(conversation_id: str, item_id: str, request: Request) -> Response:
    return await request.app.state.conversations_api.delete_item(conversation_id, item_id, request)


@router.post("/v1/messages")
async def create_message(body: MessagesRequest, request: Request) -> Response:
    return await request.app.state.messages.create(body, request)


@router.post("/v1/messages/count_tokens")
async def count_message_tokens(body: CountTokensRequest, request: Request) -> Response:
    return await request.app.state.messages.count_tokens(body, request)


@router.post("/v1/sessions")
async def create_session(body: SessionCreateRequest, request: Request) -> Response:
    return await request.app.state.sessions.create(body, request)


@router.get("/v1/sessions/{session_id}")
async def retrieve_session(session_id: str, request: Request) -> Response:
    return await request.app.state.sessions.retrieve(session_id, request)


@router.delete("/v1/sessions/{session_id}")
async def delete_session(session_id: str, request: Request) -> Response:
    return await request.app.state.sessions.delete(session_id, request)


@router.post("/v1/sessions/{session_id}/messages")
async def post_session_message(session_id: str, body: SessionMessageRequest, request: Request) -> Response:
    return await request.app.state.sessions.post(session_id, body, request)
