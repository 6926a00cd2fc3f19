"""The prefix relation between an agent's requests, computed as they pass the recorder.

A request is cut into *segments*: the system prompt (Responses:
``instructions``), then one per message (chat and Anthropic Messages) or input
item (Responses), or pieces of the prompt string (completions).
Each earlier request's *context* is its segments followed by its reply. A new
request's parent is the earlier context sharing the longest leading run of
equal segments with it (ties: the most recent); see
:mod:`quanta.bench.sessions` for the recorded fields. No tokenizer is
needed: the upstream's ``usage.prompt_tokens`` minus the parent's shared
tokens is split over the new segments by their characters.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field


def _text(content) -> str:
    """The text of an OpenAI/Anthropic message content (a string or a list of parts/blocks)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        out = []
        for part in content:
            if isinstance(part, dict) and isinstance(part.get("text"), str):
                out.append(part["text"])
            elif isinstance(part, dict) and part.get("type") == "tool_result":
                out.append(_text(part.get("content")))
            else:
                out.append(json.dumps(part, sort_keys=True))
        return "\n".join(out)
    return json.dumps(content, sort_keys=True)


@dataclass(frozen=True)
class Seg:
    """One segment: role, text (kept in memory only) and the key it is compared by."""

    role: str
    text: str
    key: str


def seg(role: str, text: str, extra=None) -> Seg:
    return Seg(role, text, json.dumps([role, text, extra], sort_keys=True))


def chat_segments(body: dict) -> list[Seg]:
    """OpenAI chat ``messages`` -> segments (tool calls and ids are part of the key)."""
    out = []
    for m in body.get("messages") or []:
        if isinstance(m, dict):
            extra = [m.get("tool_calls") or None, m.get("tool_call_id") or None] if m.get("tool_calls") or m.get("tool_call_id") else None
            out.append(seg(str(m.get("role", "user")), _text(m.get("content")), extra))
    return out


def anthropic_segments(body: dict) -> list[Seg]:
    """Anthropic ``system`` + ``messages`` -> segments."""
    out = [seg("system", _text(body["system"]))] if body.get("system") else []
    for m in body.get("messages") or []:
        if isinstance(m, dict):
            out.append(seg(str(m.get("role", "user")), _text(m.get("content"))))
    return out


def responses_segments(body: dict) -> list[Seg]:
    """OpenAI Responses ``instructions`` + ``input`` -> segments: a message item by its role, any
    other item (function call, its output, reasoning) by its type, with its call id and name in the key."""
    out = [seg("system", _text(body["instructions"]))] if body.get("instructions") else []
    items = body.get("input")
    for item in [{"role": "user", "content": items}] if isinstance(items, str) else items or []:
        if not isinstance(item, dict):
            continue
        if item.get("type", "message") == "message":
            out.append(seg(str(item.get("role", "user")), _text(item.get("content"))))
        else:
            text = item.get("output") if "output" in item else item.get("arguments", item.get("content"))
            out.append(seg(str(item["type"]), _text(text), [item.get("call_id"), item.get("name"), item.get("namespace")]))
    return out


@dataclass
class Entry:
    """What the tracker keeps of one request (text stays in memory, never written unless asked)."""

    id: int
    t: float
    session: int
    turn: int
    segs: list[Seg]
    seg_tokens: list[int] | None = None
    reply: Seg | None = None
    reply_tokens: int | None = None
    done: bool = False
    ok: bool = False
    extra: dict = field(default_factory=dict)

    def context(self) -> list[Seg]:
        return self.segs + ([self.reply] if self.ok and self.reply is not None else [])

    def context_tokens(self) -> list[int]:
        toks = self.seg_tokens if self.seg_tokens is not None else [_estimate(s.text) for s in self.segs]
        return toks + ([self.reply_tokens or _estimate(self.reply.text)] if self.ok and self.reply is not None else [])


def _estimate(text: str) -> int:
    """Tokens of ``text`` when the upstream gave no usage: ~4 characters per token."""
    return max(1, round(len(text) / 4)) if text else 0


def _shared_chat(ctx: list[Seg], segs: list[Seg]) -> int:
    n = 0
    while n < min(len(ctx), len(segs)) and ctx[n].key == segs[n].key:
        n += 1
    return n


def _shared_string(ctx: list[Seg], prompt: str) -> int:
    n, pos = 0, 0
    for s in ctx:
        if not s.text or not prompt.startswith(s.text, pos):
            break
        pos += len(s.text)
        n += 1
    return n


class Tracker:
    """Assigns each request its parent, session and turn; splits its tokens over its new segments."""

    def __init__(self) -> None:
        self.entries: list[Entry] = []
        self.sessions = 0

    def begin(self, t: float, segs: list[Seg] | None = None, prompt: str | None = None) -> tuple[Entry, dict]:
        """Register a request arriving at ``t`` (chat/Anthropic ``segs``, or a completions ``prompt``).

        Returns ``(entry, relation)``: relation has ``parent``, ``shared``, ``extends``.
        """
        best, shared = None, 0
        for e in reversed(self.entries):  # most recent first: ties go to the latest
            ctx = e.context()
            n = _shared_chat(ctx, segs) if segs is not None else _shared_string(ctx, prompt)
            if n > shared:
                best, shared = e, n
        if prompt is not None:  # a completions prompt: the parent's pieces, then the rest as one new piece
            head = best.context()[:shared] if best else []
            rest = prompt[sum(len(s.text) for s in head):]
            segs = head + ([seg("user", rest)] if rest or not head else [])
        extends = best is not None and shared >= len(best.segs)
        if extends:
            session, turn = best.session, best.turn + 1
        else:
            session, turn = self.sessions, 0
            self.sessions += 1
        entry = Entry(len(self.entries), t, session, turn, segs)
        self.entries.append(entry)
        return entry, {"parent": best.id if best else None, "shared": shared, "extends": extends}

    def finish(self, entry: Entry, relation: dict, ok: bool, prompt_tokens: int | None, completion_tokens: int | None,
               reply: str) -> dict:
        """Close ``entry``; returns the token fields of its record (``shared_tokens``, ``segments``, ...)."""
        parent = self.entries[relation["parent"]] if relation["parent"] is not None else None
        shared = relation["shared"]
        shared_toks = parent.context_tokens()[:shared] if parent else []
        new = entry.segs[shared:]
        estimated = prompt_tokens is None
        total_new = sum(_estimate(s.text) for s in new) if estimated else max(0, prompt_tokens - sum(shared_toks))
        chars = [len(s.text) for s in new]
        weights = chars if sum(chars) else [1] * len(new)
        new_toks = _split(total_new, weights)
        entry.seg_tokens = shared_toks + new_toks
        entry.done, entry.ok = True, ok
        entry.reply = seg("assistant", reply)
        entry.reply_tokens = completion_tokens
        return {"shared_tokens": sum(shared_toks), "new": list(zip(new, new_toks)), "usage_estimated": estimated}


def _split(total: int, weights: list[int]) -> list[int]:
    """``total`` split proportionally to ``weights`` (largest remainders; sums exactly to ``total``)."""
    if not weights:
        return []
    w = sum(weights)
    raw = [total * x / w for x in weights]
    out = [int(r) for r in raw]
    for i in sorted(range(len(raw)), key=lambda i: raw[i] - out[i], reverse=True)[: total - sum(out)]:
        out[i] += 1
    return out
