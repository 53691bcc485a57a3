"""Agent sessions from SWE-agent trajectories, rendered the way a serving frontend receives them.

A trajectory file (``*.traj``, JSON with a ``history`` list of OpenAI-style ``{"role", "content"}``
messages) becomes a list of *turn texts*: turn ``i`` is the ChatML rendering of messages ``0..i``, so each
turn's text starts with the previous one, exactly as a coding agent resends its whole conversation.
"""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path


def _content(message: dict) -> str:
    content = message.get("content", "")
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # OpenAI multi-part content
        return "".join(p.get("text", "") if isinstance(p, dict) else str(p) for p in content)
    return json.dumps(content)


def render_chatml(messages: list[dict]) -> str:
    """Render messages as ChatML (``<|im_start|>role\\ncontent<|im_end|>\\n`` per message)."""
    return "".join(f"<|im_start|>{m.get('role', 'user')}\n{_content(m)}<|im_end|>\n" for m in messages)


def load_turns(path: str | Path) -> list[str]:
    """Cumulative turn texts of one trajectory file.

    Returns:
        ``list[str]``; ``turns[i]`` is a prefix of ``turns[i+1]`` (chars).

    Raises:
        ValueError: the file is not a trajectory (no ``history`` list).
    """
    data = json.loads(Path(path).read_text(encoding="utf-8"))
    history = data.get("history") if isinstance(data, dict) else None
    if not isinstance(history, list):
        raise ValueError(f"{path}: not a SWE-agent trajectory (no 'history' list)")
    turns, text = [], ""
    for message in history:
        text += render_chatml([message])
        turns.append(text)
    return turns


def trajectory_files(folder: str | Path | None = None) -> list[Path]:
    """The ``*.traj`` files of ``folder``, or of the bundled sample (MIT, SWE-agent) when ``None``."""
    if folder is None:
        folder = Path(str(resources.files("toktier_backend") / "data" / "sessions"))
    files = sorted(Path(folder).glob("*.traj"))
    if not files:
        raise FileNotFoundError(f"no *.traj files in {folder}")
    return files


def long_session_text(n_chars: int, folder: str | Path | None = None) -> str:
    """A session text of exactly ``n_chars`` chars: trajectories rendered and concatenated, repeated."""
    parts = [load_turns(f)[-1] for f in trajectory_files(folder)]
    body = "".join(parts)
    reps = n_chars // len(body) + 1
    return (body * reps)[:n_chars]
