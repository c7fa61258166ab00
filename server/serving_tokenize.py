"""vLLM's `POST /tokenize` and `POST /detokenize`: the token ids of a prompt or a chat conversation, and
the text of token ids, nothing run.

Messages tokenize to exactly the prompt /v1/chat/completions would serve them with: the same rendering,
tools and `chat_template_kwargs` included, and every assistant turn the server generated (a paused tool
call's) as the very tokens it generated, not a re-tokenization of its text, which may split differently.
So a client that keeps token ids (an RL rollout, a token-budgeting agent) gets the ids the KV holds. A
prompt longer than the model's context is counted (`count` against `max_model_len`), not refused.
"""
from __future__ import annotations

from starlette.requests import Request

from .protocol import ChatCompletionRequest, bad_request
from .protocol_tokenize import DetokenizeRequest, DetokenizeResponse, TokenizeRequest, TokenizeResponse
from .serving_base import Frontend
from .serving_chat import ChatServing


class TokenizeServing(Frontend):
    def __init__(self, *args, chat: ChatServing | None, **kwargs):
        super().__init__(*args, **kwargs)
        self.chat = chat  # None: the model has no chat template (messages are refused)

    def tokenize(self, req: TokenizeRequest, raw: Request) -> dict:
        model = self.model_name if req.model is None else req.model
        self.check_model(model)
        ids = self._chat_ids(req, model, raw) if req.messages is not None else self._prompt_ids(req)
        strs = self.tokenizer.convert_ids_to_tokens(ids) if req.return_token_strs else None
        return TokenizeResponse(count=len(ids), max_model_len=self.turns.max_model_len, tokens=ids,
                                token_strs=strs).model_dump()

    def detokenize(self, req: DetokenizeRequest) -> dict:
        self.check_model(self.model_name if req.model is None else req.model)
        vocab = len(self.tokenizer)
        if any(t >= vocab for t in req.tokens):
            raise bad_request(f"token ids must be integers in [0, {vocab})", param="tokens")
        return DetokenizeResponse(prompt=self.tokenizer.decode(req.tokens)).model_dump()

    def _prompt_ids(self, req: TokenizeRequest) -> list[int]:
        return self.encode_prompt(req.prompt, True if req.add_special_tokens is None else req.add_special_tokens)

    def _chat_ids(self, req: TokenizeRequest, model: str, raw: Request) -> list[int]:
        if req.chat_template is not None:
            raise bad_request("a request's own chat_template is not used: this server renders with the model's "
                              "(or the operator's --chat-template)", param="chat_template")
        if req.add_special_tokens:
            raise bad_request("add_special_tokens applies to a text prompt: the chat template writes the model's "
                              "special tokens itself", param="add_special_tokens")
        if self.chat is None:
            raise bad_request("this model has no chat template; tokenize a prompt instead", param="messages",
                              code="no_chat_template")
        chat_req = ChatCompletionRequest(model=model, messages=req.messages, tools=req.tools,
                                         chat_template_kwargs=req.chat_template_kwargs,
                                         add_generation_prompt=req.add_generation_prompt,
                                         continue_final_message=req.continue_final_message)
        spec = self.chat.spec(chat_req, raw, peek=True)
        return self.turns.render_prompt(spec, fit_context=False)
