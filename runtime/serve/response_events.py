"""The Responses API's answer (runtime/serve/responses.py): the chat path's answer, split by
its `Answer` into reasoning, content and tool calls, as output items (`reasoning`,
`message`, `function_call`), whole or streamed as OpenAI's typed Server-Sent Events:

    response.created, response.in_progress, then per item
    response.output_item.added
      message:   response.content_part.added, response.output_text.delta..., response.output_text.done,
                 response.content_part.done
      reasoning: response.content_part.added, response.reasoning_text.delta..., response.reasoning_text.done,
                 response.content_part.done
      function_call: response.function_call_arguments.delta..., response.function_call_arguments.done
    response.output_item.done
    response.completed (or response.incomplete at max_output_tokens), each with a sequence_number.

A fault after the stream began is an `error` event, and the stream ends.
"""

from __future__ import annotations

import json
import time
import uuid

from fastapi.responses import JSONResponse

from runtime.serve.answer import Answer
from runtime.serve.reasoning import ReasoningSplitter
from runtime.serve.respond import next_event
from runtime.serve.scheduler import Job


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def message_item(text: str, status: str = "completed", item_id: str | None = None) -> dict:
    return {"id": item_id or _id("msg"), "type": "message", "status": status, "role": "assistant",
            "content": [text_part(text)]}


def text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def reasoning_item(text: str, status: str = "completed", item_id: str | None = None) -> dict:
    return {"id": item_id or _id("rs"), "type": "reasoning", "status": status, "summary": [],
            "content": [{"type": "reasoning_text", "text": text}]}


def call_item(call_id: str, name: str, arguments: str, status: str = "completed", item_id: str | None = None) -> dict:
    return {"id": item_id or _id("fc"), "type": "function_call", "status": status, "call_id": call_id, "name": name,
            "arguments": arguments}


class ResponseReply:
    """One response's shapes: the whole object, its usage, and the answer's parser."""

    def __init__(self, model_id: str, body: dict, request, rename):
        self.id, self.created, self.model = _id("resp"), int(time.time()), model_id
        self.body, self.rename = body, rename
        self.answer = Answer(request.answer)
        self.thinking = ReasoningSplitter(request.answer.think_open) if request.answer.thinks else None
        self.reasoning_tokens, self.last_in_reasoning = 0, False

    def count(self, text: str) -> None:
        """One delta event's text: a token's, but for the engine's last (its flush, no
        token), so a token counts once the next event comes. Reasoning tokens: those inside
        the think block (not `<think>` or `</think>` themselves)."""
        self.reasoning_tokens += self.last_in_reasoning
        if self.thinking is not None:
            before = self.thinking.state
            self.thinking.feed(text)
            self.last_in_reasoning = before == self.thinking.state == "reasoning"

    def usage(self, usage: dict) -> dict:
        return {"input_tokens": usage["prompt_tokens"], "input_tokens_details": {"cached_tokens": 0},
                "output_tokens": usage["completion_tokens"],
                "output_tokens_details": {"reasoning_tokens": self.reasoning_tokens},
                "total_tokens": usage["total_tokens"]}

    def response(self, status: str, output: list, usage: dict | None = None) -> dict:
        body = self.body
        text = body.get("text") if isinstance(body.get("text"), dict) else {}
        return {"id": self.id, "object": "response", "created_at": self.created, "status": status, "error": None,
                "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
                "instructions": body.get("instructions"), "max_output_tokens": body.get("max_output_tokens"),
                "model": self.model, "output": output, "parallel_tool_calls": body.get("parallel_tool_calls", True),
                "previous_response_id": None, "reasoning": {"effort": None, "summary": None}, "store": False,
                "temperature": body.get("temperature"), "top_p": body.get("top_p"),
                "text": {"format": text.get("format") or {"type": "text"}},
                "tool_choice": body.get("tool_choice", "auto"), "tools": body.get("tools") or [],
                "truncation": "disabled", "usage": self.usage(usage) if usage else None, "user": body.get("user"),
                "metadata": body.get("metadata") or {}}

    def whole(self, text: str, finish: str, usage: dict) -> dict:
        """The whole response of the answer's `text`."""
        message = self.answer.message(text)
        items = [reasoning_item(message["reasoning"])] if message.get("reasoning") else []
        calls = message.get("tool_calls") or []
        if message["content"] or not calls:
            items.append(message_item(message["content"] or ""))
        items += [call_item(c["id"], c["function"]["name"], c["function"]["arguments"]) for c in calls]
        status = "incomplete" if finish == "length" else "completed"
        items[-1]["status"] = status
        return self.response(status, items, usage)


async def collect(job: Job, reply: ResponseReply, gone, folder) -> JSONResponse:
    pieces = []
    while True:
        event = await next_event(job, gone)
        if event[0] == "delta":
            reply.count(event[1])
            pieces.append(event[1])
        elif event[0] == "done":
            return JSONResponse(reply.whole("".join(pieces), event[1], event[2]))
        else:
            raise folder.scrub(event[1])


async def stream(job: Job, reply: ResponseReply, folder):
    """The SSE body; a client gone away (this generator cancelled) cancels the job."""
    out = Events(reply)
    try:
        yield out.event("response.created", response=reply.response("in_progress", []))
        yield out.event("response.in_progress", response=reply.response("in_progress", []))
        while True:
            event = await next_event(job, None)
            if event[0] == "delta":
                reply.count(event[1])
                for delta in reply.answer.feed(event[1]) if event[1] else []:
                    for piece in out.delta(delta):
                        yield piece
            elif event[0] == "done":
                for delta in reply.answer.finish():
                    for piece in out.delta(delta):
                        yield piece
                for piece in out.finish(event[1], event[2]):
                    yield piece
                break
            else:
                error = reply.rename(folder.scrub(event[1]))
                yield out.event("error", code=error.code, message=error.message, param=error.param)
                break
    finally:
        job.cancelled.set()
        folder.close()


class Events:
    """Chat deltas (Answer.feed's) in, the Responses events out; the output items so far."""

    def __init__(self, reply: ResponseReply):
        self.reply, self.sequence, self.items = reply, 0, []
        self.open = None  # the item being written (its dict; its text in "text")

    def event(self, kind: str, **fields) -> str:
        data = json.dumps({"type": kind, "sequence_number": self.sequence, **fields}, ensure_ascii=False)
        self.sequence += 1
        return f"event: {kind}\ndata: {data}\n\n"

    def delta(self, delta: dict) -> list[str]:
        if delta.get("reasoning"):
            return self._ensure("reasoning") + [self._text_delta("response.reasoning_text.delta", delta["reasoning"])]
        if delta.get("content"):
            return self._ensure("message") + [self._text_delta("response.output_text.delta", delta["content"],
                                                               logprobs=[])]
        out = []
        for piece in delta.get("tool_calls", []):
            function = piece.get("function", {})
            if "id" in piece:  # a call begins
                out += self._close("completed")
                self.open = call_item(piece["id"], function["name"], "", "in_progress")
                out.append(self._added())
            if function.get("arguments"):
                self.open["arguments"] += function["arguments"]
                out.append(self.event("response.function_call_arguments.delta", item_id=self.open["id"],
                                      output_index=len(self.items), delta=function["arguments"]))
        return out

    def finish(self, finish: str, usage: dict) -> list[str]:
        """The last item closed (incomplete at max_output_tokens), an empty message if the
        answer held no content and no call, and the response."""
        out = []
        if not any(item.get("type") in ("message", "function_call") for item in self.items + [self.open or {}]):
            out += self._ensure("message")
        status = "incomplete" if finish == "length" else "completed"
        out += self._close(status)
        response = self.reply.response(status, self.items, usage)
        return out + [self.event(f"response.{status}", response=response)]

    def _text_delta(self, kind: str, text: str, **extra) -> str:
        self.open["text"] += text
        return self.event(kind, item_id=self.open["id"], output_index=len(self.items), content_index=0, delta=text,
                          **extra)

    def _ensure(self, kind: str) -> list[str]:
        if self.open is not None and self.open["type"] == kind:
            return []
        out = self._close("completed")
        make = message_item if kind == "message" else reasoning_item
        self.open = dict(make("", "in_progress"), content=[], text="")
        part = text_part("") if kind == "message" else {"type": "reasoning_text", "text": ""}
        return out + [self._added(), self.event("response.content_part.added", item_id=self.open["id"],
                                                output_index=len(self.items), content_index=0, part=part)]

    def _added(self) -> str:
        item = {k: v for k, v in self.open.items() if k != "text"}
        return self.event("response.output_item.added", output_index=len(self.items), item=item)

    def _close(self, status: str) -> list[str]:
        item, self.open = self.open, None
        if item is None:
            return []
        at = dict(item_id=item["id"], output_index=len(self.items))
        if item["type"] == "function_call":
            done = call_item(item["call_id"], item["name"], item["arguments"], status, item["id"])
            out = [self.event("response.function_call_arguments.done", arguments=item["arguments"],
                              name=item["name"], **at)]
        elif item["type"] == "message":
            done = message_item(item["text"], status, item["id"])
            out = [self.event("response.output_text.done", content_index=0, text=item["text"], logprobs=[], **at),
                   self.event("response.content_part.done", content_index=0, part=done["content"][0], **at)]
        else:
            done = reasoning_item(item["text"], status, item["id"])
            out = [self.event("response.reasoning_text.done", content_index=0, text=item["text"], **at),
                   self.event("response.content_part.done", content_index=0, part=done["content"][0], **at)]
        self.items.append(done)
        return out + [self.event("response.output_item.done", output_index=at["output_index"], item=done)]
