"""Engine chunks -> one request's OpenAI answer: the whole response, or its SSE events.

`Answer` builds the completions or chat shapes from the engine's `Chunk`s
(text, logprobs, usage with the prefix cache's share); `EventStream` is the SSE
response whose engine request is cancelled however the response ends.
"""

from __future__ import annotations

import logging
import time

from starlette.responses import StreamingResponse

from radianced.engine.streams import Chunk, EngineFailed, RequestStream
from radianced.server import api_responses as r
from radianced.server.api_errors import ProtocolError
from radianced.server.state import Served

log = logging.getLogger("radianced.http")


class Answer:
    """Engine chunks -> one request's OpenAI response or SSE chunks (completions or chat)."""

    def __init__(self, served: Served, rid: str, chat: bool, req, prompt_tokens: int):
        self.rid = rid
        self.model = served.name
        self.tokenizer = served.engine.tokenizer
        self.chat = chat
        self.req = req
        self.prompt_tokens = prompt_tokens
        self.created = int(time.time())
        self.generated = 0
        self.text_len = 0  # characters of output so far (completions logprobs' text_offset)

    async def collect(self, stream: RequestStream):
        """The whole response (raises EngineFailed)."""
        texts, logprobs, reason = [], [], None
        async for chunk in stream:
            texts.append(chunk.text)
            logprobs += self._token_logprobs(chunk)
            self.generated += len(chunk.token_ids)
            reason = chunk.finish_reason
        text = "".join(texts)
        usage = r.usage(self.prompt_tokens, self.generated, stream.num_reused_tokens)
        if self.chat:
            lp = r.ChatLogprobs(content=[r.chat_token_logprob(*x) for x in logprobs]) if self.req.logprobs else None
            return r.chat_completion_response(self.rid, self.model, self.created, text, reason, usage, lp)
        return r.completion_response(self.rid, self.model, self.created, text, reason, usage,
                                     self._completion_logprobs(logprobs))

    async def events(self, stream: RequestStream):
        """SSE bytes: the chunks (an SSE event each; those queued while the response was writing go in one
        write: under load the per-write cost of the HTTP stack is paid once for several tokens), the usage
        chunk if asked, `data: [DONE]`."""
        if self.chat:
            yield r.sse(r.chat_completion_chunk(self.rid, self.model, self.created, role="assistant", content=""))
        try:
            async for first in stream:
                events = []
                for chunk in (first, *stream.ready()):
                    self.generated += len(chunk.token_ids)
                    event = self._chunk(chunk)
                    if event is not None:
                        events.append(r.sse(event))
                if events:
                    yield b"".join(events)
        except EngineFailed as e:
            log.error("%s: %s", self.rid, e)
            yield b"data: " + ProtocolError(500, str(e)).body() + b"\n\n"
        else:
            if self.req.include_usage:
                usage = r.usage(self.prompt_tokens, self.generated, stream.num_reused_tokens)
                build = r.chat_usage_chunk if self.chat else r.completion_usage_chunk
                yield r.sse(build(self.rid, self.model, self.created, usage))
        yield r.SSE_DONE

    def _chunk(self, chunk: Chunk):
        """The SSE chunk for one engine chunk, or None when it carries nothing to send."""
        logprobs = self._token_logprobs(chunk)
        if not chunk.text and not logprobs and chunk.finish_reason is None:
            return None  # held back (a split character, a possible stop string)
        if self.chat:
            lp = r.ChatLogprobs(content=[r.chat_token_logprob(*x) for x in logprobs]) if self.req.logprobs else None
            return r.chat_completion_chunk(self.rid, self.model, self.created, content=chunk.text or None,
                                           finish_reason=chunk.finish_reason, logprobs=lp)
        return r.completion_chunk(self.rid, self.model, self.created, chunk.text, chunk.finish_reason,
                                  self._completion_logprobs(logprobs))

    def _token_logprobs(self, chunk: Chunk) -> list[tuple[str, float, list[tuple[str, float]]]]:
        """(token text, logprob, [(top token text, logprob)]) per token of the chunk that has logprobs."""
        if chunk.logprobs is None or not chunk.token_ids:
            return []
        chosen, top = chunk.logprobs  # one token per step: (its logprob, [(id, logprob)] of the top-N)
        return [(self._piece(chunk.token_ids[0]), chosen, [(self._piece(i), lp) for i, lp in top])]

    def _completion_logprobs(self, logprobs) -> r.CompletionLogprobs | None:
        if self.req.logprobs is None:
            return None
        tokens = [t for t, _, _ in logprobs]
        out = r.completion_logprobs(tokens, [lp for _, lp, _ in logprobs], [top for _, _, top in logprobs],
                                    self.text_len)
        self.text_len += sum(len(t) for t in tokens)
        return out

    def _piece(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)


class EventStream(StreamingResponse):
    """An SSE response whose engine request is cancelled however the response ends."""

    def __init__(self, events, stream: RequestStream):
        super().__init__(events, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.stream = stream

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            if not self.stream.done:
                scope["state"]["client_gone"] = True
            self.stream.close()
