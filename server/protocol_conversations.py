"""Wire shapes of OpenAI's Conversations API (`/v1/conversations`): its requests, strict at the top level
like OpenAI's. Items stay JSON objects here; conversation_items.py reads them as Responses input items."""
from __future__ import annotations

from pydantic import Field, field_validator

from .protocol import Strict

MAX_ITEMS_PER_REQUEST = 20  # OpenAI's: "You may add up to 20 items at a time"


def checked_metadata(metadata: dict[str, str] | None) -> dict[str, str] | None:
    """OpenAI's bounds: at most 16 pairs, keys up to 64 characters, values up to 512."""
    if metadata is not None and (len(metadata) > 16 or any(len(k) > 64 or len(v) > 512 for k, v in metadata.items())):
        raise ValueError("metadata has at most 16 pairs, keys of up to 64 characters and values of up to 512")
    return metadata


class ConversationCreateRequest(Strict):
    items: list[dict] | None = Field(default=None, max_length=MAX_ITEMS_PER_REQUEST)
    metadata: dict[str, str] | None = None
    safety_identifier: str | None = None  # (accepted and ignored, as on Responses)

    _metadata = field_validator("metadata")(checked_metadata)


class ConversationUpdateRequest(Strict):
    metadata: dict[str, str]

    _metadata = field_validator("metadata")(checked_metadata)


class ConversationItemsRequest(Strict):
    items: list[dict] = Field(min_length=1, max_length=MAX_ITEMS_PER_REQUEST)
