"""OpenAI's Conversations API: POST /v1/conversations, GET / POST / DELETE /v1/conversations/{id}, and its
items: POST and GET /v1/conversations/{id}/items, GET and DELETE /v1/conversations/{id}/items/{item_id}.

A conversation is a record of the conversation store (`Kind.CONVERSATION`): its items (as listed) and
the chat messages they make. A Responses request naming it (`conversation`) continues those messages
and adds its input and output items when it ends (serving_responses.py); a response that ends in
function calls leaves its generation paused, held by the conversation, so the request that brings the
`function_call_output` items (as its input, or added to the conversation first) resumes it. Editing the
conversation's history (deleting an item) lets that paused generation go: nothing could resume it.
"""
from __future__ import annotations

from fastapi.responses import JSONResponse, Response
from starlette.requests import Request

from .conversation_items import kept_items, list_page, messages_of, page_of, parsed_items
from .conversations import Conversation, ConversationStore, State
from .protocol import APIError, new_id, now
from .protocol_conversations import ConversationCreateRequest, ConversationItemsRequest, ConversationUpdateRequest
from .tenants import owner_of


class ConversationsServing:
    def __init__(self, conversations: ConversationStore):
        self.conversations = conversations

    def of(self, conversation_id: str, owner: str | None, editing: bool = False,
           param: str = "conversation_id") -> Conversation:
        """The conversation (404 if unknown); `editing`: one no response is being generated in (409)."""
        record = self.conversations.conversation(conversation_id, owner)
        if record is None:
            raise APIError(404, f"Conversation with id '{conversation_id}' not found.", param=param,
                           code="conversation_not_found")
        if editing and record.state is State.GENERATING:
            raise APIError(409, f"conversation {conversation_id!r} has a response in progress", param=param,
                           code="conversation_locked")
        return record

    def keep(self, record: Conversation, items: list[dict]) -> None:
        """`items` are the conversation's now, and their messages its history."""
        self.conversations.keep_items(record, items, messages_of(items))

    async def create(self, req: ConversationCreateRequest, raw: Request) -> Response:
        items = kept_items(parsed_items(req.items or ()), set(), param="items")
        body = {"id": new_id("conv_"), "object": "conversation", "created_at": now(), "metadata": req.metadata or {}}
        record = self.conversations.open_conversation(body["id"], body, owner_of(raw))
        self.keep(record, items)
        return JSONResponse(body)

    async def retrieve(self, conversation_id: str, raw: Request) -> Response:
        return JSONResponse(self.of(conversation_id, owner_of(raw)).body)

    async def update(self, conversation_id: str, req: ConversationUpdateRequest, raw: Request) -> Response:
        record = self.of(conversation_id, owner_of(raw))
        record.body = {**record.body, "metadata": req.metadata}
        return JSONResponse(record.body)

    async def delete(self, conversation_id: str, raw: Request) -> Response:
        # Its paused generation is released with it; a response being generated in it ends unrecorded.
        self.conversations.close(self.of(conversation_id, owner_of(raw)), reason=f"conversation {conversation_id} deleted")
        return JSONResponse({"id": conversation_id, "object": "conversation.deleted", "deleted": True})

    # -- items -------------------------------------------------------------------------------------
    async def add_items(self, conversation_id: str, req: ConversationItemsRequest, raw: Request) -> Response:
        record = self.of(conversation_id, owner_of(raw), editing=True)
        items = kept_items(parsed_items(req.items), {item["id"] for item in record.items}, param="items")
        self.keep(record, record.items + items)
        return JSONResponse(page_of(items, has_more=False))

    async def list_items(self, conversation_id: str, raw: Request) -> Response:
        """A page of the items, newest first unless `order=asc`, after the item `after` (cursor paging)."""
        record = self.of(conversation_id, owner_of(raw))
        return JSONResponse(list_page(record.items, raw.query_params, f"conversation {conversation_id!r}"))

    async def retrieve_item(self, conversation_id: str, item_id: str, raw: Request) -> Response:
        record = self.of(conversation_id, owner_of(raw))
        return JSONResponse(record.items[self._index(record, item_id)])

    async def delete_item(self, conversation_id: str, item_id: str, raw: Request) -> Response:
        record = self.of(conversation_id, owner_of(raw), editing=True)
        index = self._index(record, item_id)
        self.keep(record, record.items[:index] + record.items[index + 1:])
        self.conversations.release_paused(record, f"conversation {conversation_id}: item {item_id} deleted")
        if record.state is State.PAUSED:
            record.state = State.IDLE
        return JSONResponse(record.body)

    @staticmethod
    def _index(record: Conversation, item_id: str) -> int:
        index = next((i for i, item in enumerate(record.items) if item["id"] == item_id), None)
        if index is None:
            raise APIError(404, f"Item with id '{item_id}' not found.", param="item_id", code="item_not_found")
        return index

