"""Real SWE-agent trajectories as OpenAI-style ``messages`` for the chat tests and ``bench/chat.py``.

``history`` entries keep ``role``, ``content``, ``tool_calls`` and ``tool_call_id``; the assistant's
``thought`` becomes ``reasoning_content`` on every other assistant turn (so templates see both shapes).
Templates without tool roles (``tools=False``) get tool results as ``user`` turns and no ``tool_calls``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SHARED = Path(os.environ.get("TOKTIER_SHARED", REPO.parent / "shared"))
CORPUS = SHARED / "corpus" / "swe-agent"
TEMPLATES = ("qwen3", "qwen2_5", "deepseek_v3", "gemma3", "llama3", "llama3_1")
TOOL_TEMPLATES = frozenset({"qwen3", "qwen2_5", "deepseek_v3"})


def trajectories() -> list[Path]:
    files = sorted(CORPUS.glob("*.traj"))
    if not files:
        raise FileNotFoundError(f"no trajectories under {CORPUS}")
    return files


def _content(c) -> str:
    if isinstance(c, list):
        return "".join(x.get("text", "") for x in c if isinstance(x, dict))
    return "" if c is None else str(c)


def messages(path: Path, *, tools: bool) -> list[dict]:
    """One trajectory's history as messages (see the module docstring)."""
    hist = json.loads(path.read_text(encoding="utf-8"))["history"]
    out: list[dict] = []
    n_assistant = 0
    for h in hist:
        role = h.get("role")
        content = _content(h.get("content"))
        if role == "assistant":
            m = {"role": "assistant", "content": content}
            calls = h.get("tool_calls")
            if tools and calls:
                m["tool_calls"] = [{"id": c.get("id", f"call_{i}"), "type": "function",
                                    "function": {"name": c["function"]["name"],
                                                 "arguments": c["function"]["arguments"]}}
                                   for i, c in enumerate(calls) if isinstance(c, dict) and "function" in c]
            if n_assistant % 2 == 1 and h.get("thought"):
                m["reasoning_content"] = _content(h["thought"])
            n_assistant += 1
            out.append(m)
        elif role == "tool":
            if tools:
                ids = h.get("tool_call_ids") or [None]
                out.append({"role": "tool", "content": content, "tool_call_id": ids[0] or "call_0"})
            else:
                out.append({"role": "user", "content": content})
        elif role in ("system", "user"):
            out.append({"role": role, "content": content})
    return out


def alternating(msgs: list[dict]) -> list[dict]:
    """Merge consecutive same-role turns (after the system message) so user/assistant alternate, starting
    with user (gemma3's template refuses anything else)."""
    out: list[dict] = []
    for m in msgs:
        if out and out[-1]["role"] == m["role"] and m["role"] != "system":
            out[-1] = {**out[-1], "content": out[-1]["content"] + "\n" + m["content"]}
        else:
            out.append(dict(m))
    while len(out) > 1 and out[0]["role"] == "system" and out[1]["role"] != "user":
        out.pop(1)
    return out


def conversation(name: str, path: Path) -> list[dict]:
    """The messages of ``path`` shaped for template ``name``."""
    msgs = messages(path, tools=name in TOOL_TEMPLATES)
    return alternating(msgs) if name == "gemma3" else msgs


def template_source(name: str) -> tuple[str, Path]:
    cfg = SHARED / "chat_templates" / name / "tokenizer_config.json"
    return json.loads(cfg.read_text(encoding="utf-8"))["chat_template"], cfg
