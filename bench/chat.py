"""Chat-turn benchmark: render + tokenize one agent turn at 100K / 1M / 3M chars of conversation.

For each template and size, a conversation is built from the SWE-agent corpus (``tests/chat/corpus.py``:
function-calling trajectories with tool calls, tool results and reasoning for the tool templates; tool
results as user turns for the others; gemma3's roles merged to alternate), each message's content clipped
to 1,200 chars, until the size is reached. Then ``--samples`` turns of 2 new messages (~1.5K chars: the
assistant's reply and the next observation; the same messages at every size, for gemma3 before its roles
are merged) are requested one after another, each with the whole history and ``add_generation_prompt=True``,
as an agent resends it. Each request is an OpenAI-style JSON body
(``{"model", "messages", "tools"}``, bytes built untimed). Systems, each on all samples in turn:

- ``ours``: timed from the body's bytes: ``chat.wire.IncrementalBody.load`` (parses only the bytes from the
  first changed message on), ``ChatSession.render(messages, same_prefix=..., tools=body["tools"])``
  (incremental), then our tokenizer session: ``append(delta)`` when the render extends the previous text,
  else ``splice(departure, delta)``. Before each sample the body is copied (untimed), as a socket read
  leaves a just-received body in cache; the previous body is wherever the run left it. The reply's ids
  are dropped after the exactness check, as a face drops its view once the response is written (a view
  held across an edit makes the tokenizer copy the ids: ``pipeline/token_buffer.py``). Also printed: the
  p50 of each stage (parse, render, tokenize) and of one ``bytes.startswith`` of the body against the
  previous one (the memory-bandwidth floor of any exact byte comparison). ``--reuse-objects``: no
  bytes; the previous list plus the new dicts, as an in-process caller would pass them, with
  ``ChatSession(trust_identity=True)``;
- ``ours_delta``: the client sends only the new messages (Triton ``MODE=delta``): timed from their JSON
  array's bytes: ``ChatSession.render_more_body`` (``chat.wire.parse_messages``, then the render of
  ``render_more``), then the tokenizer session as for ``ours``; nothing of the old conversation is sent,
  compared or parsed (a second warm session);
- ``transformers``: ``apply_chat_template(tokenize=True)`` (``--hf-samples`` samples: it encodes the whole
  text with HF);
- ``jinja2+gigatoken``: full render by the transformers-compatible jinja2 renderer, gigatoken encode;
- ``minijinja+gigatoken``: full render by minijinja, gigatoken encode;
- ``floor`` (not a system: a lower bound of what any exact pipeline pays for the turn, measured the same
  way): ``orjson.loads`` of the new messages' JSON, minijinja's render of those messages alone (as a
  conversation of their own, without tools: none of the context's text) and gigatoken's encode of the text
  the turn adds (``ChatRender.delta``). Timed on the same turns, interleaved with ``ours_delta``, each
  preceded by the same check traffic, so both start from the same cache state. ``-`` where the template
  refuses the new messages alone (gemma3: roles must start with a user turn).

The anchors and transformers get the messages already decoded (``orjson.loads`` of the same body, untimed):
their JSON parse is not counted, ours is (conservative for ours).

Cache state. By default (``--checks between``) the run checks each reply between two timed turns (the whole
text against the jinja2 render, the ids against gigatoken's): tens of MB at 3M chars, less at 100K, so the
bigger sizes start their turns with colder caches. ``--checks after`` keeps each reply instead
(:class:`Reply`: the render, and the SHA-256 of its ids, read once as a face reads them to write its
response) and checks them all after the timed turns: between two turns only that read runs, as in a server
between one agent's calls, where nothing else reads the session's context (the shadow verifier checks a
sample of the replies, not each one). An old render's text stays exact after later turns
(``session._Memo``), so each kept reply is checked as served. ``--sweep-mb N`` also reads an N MB buffer
after each sample (after its check or its hash, and after each anchor sample), so that every turn at every
size starts from the same cold state (32 MB is above this machine's caches).
``--neighbour`` runs, untimed, one turn of another session of the same template (the same conversation with
each message's ``content`` case-swapped, sharing the timed session's template analysis and
tokenizer, as a server's sessions of one model do) right before each timed ``ours_delta`` turn, and the
floor's parts on that session's new messages right before each timed floor: a server's other traffic between
one agent's calls, warming the shared code and tables but not this session's data. Its replies are checked too.
``--interleave`` sets up every size of a template first, then runs their ``ours_delta`` turns (each with its
floor) in rounds, one turn of each size per round (:func:`interleaved`): the sizes are compared in the same
stretch of the run, so a drift of this VM's speed (the floor alone moves up to 2x between runs) falls on all
of them alike. ``ours`` runs per size while the sizes are set up, the anchors per size after all the turns.

Background indexing. A session's first text is indexed for prefix reuse by a background thread
(``pipeline/prefix_index.py``); the timed turns start once it is done (:func:`_settle`), as an agent's next
call comes seconds after its first. Turns sent while it runs wait for the GIL (``docs/design/chat.md``,
session 17).

Exactness first: every sample's text is compared with the jinja2 full render, every sample's ids with
gigatoken's encode of that text, and the first and last samples' ids with HF ``tokenizers``
(``add_special_tokens=False``); a system with a mismatch is printed as INEXACT. Output: a table, then
``<out>/chat.json`` and ``<out>/chat.png`` (p50 latency vs context size, log-log, one panel per template).

Usage:
    python bench/chat.py
    python bench/chat.py --templates qwen3,llama3_1 --sizes 100000,1000000,3000000 --samples 24
    python bench/chat.py --templates qwen3,llama3_1 --sizes 100000,1000000,3000000 --sweep-mb 32
    python bench/chat.py --templates qwen3,llama3_1 --sizes 100000,1000000,3000000 --neighbour
    python bench/chat.py --templates qwen3,llama3_1 --sizes 100000,1000000,3000000 --checks after --interleave
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import platform
import sys
import time
from pathlib import Path

import numpy as np
import orjson

sys.path.insert(0, str(Path(__file__).resolve().parent))
import anchors as A  # noqa: E402

A.ensure_repo_on_path()

from tests.chat import corpus as C  # noqa: E402

SYSTEMS = ("ours", "ours_delta", "transformers", "jinja2+gigatoken", "minijinja+gigatoken")
FLOOR = "floor"  # a lower bound of the turn's parts, not a system (module docstring)
COLORS = {"ours": "tab:blue", "ours_delta": "tab:purple", "transformers": "tab:red", "jinja2+gigatoken": "tab:green",
          "minijinja+gigatoken": "tab:orange", FLOOR: "tab:gray"}
CLIP = 1200
TOOLS = [{"type": "function", "function": {"name": "bash", "description": "Run a shell command",
                                           "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}},
                                                          "required": ["cmd"]}}}]


def _clip(m: dict) -> dict:
    m = dict(m)
    m["content"] = m["content"][:CLIP]
    if "reasoning_content" in m:
        m["reasoning_content"] = m["reasoning_content"][:400]
    return m


def conversation(name: str, size: int, samples: int) -> tuple[list[dict], int]:
    """(messages, index where the timed turns start): about ``size`` chars of content before it, ending at
    an observation, then ``2 * samples`` more messages. The timed messages are the same at every size (the
    pool's first ``2 * samples`` messages from its first assistant reply on), so that the sizes differ by the
    context only, not by what the timed turns hold."""
    tools = name in C.TOOL_TEMPLATES
    files = C.trajectories()
    chosen = [f for f in files if "function_calling" in f.name] if tools else files
    head = [_clip(m) for m in C.messages(chosen[0], tools=tools)[:2]]
    pool = []
    for f in chosen:
        pool += [_clip(m) for m in C.messages(f, tools=tools)[2:]]
    first = next(j for j, m in enumerate(pool) if m["role"] == "assistant")
    timed = [dict(m) for m in pool[first:first + 2 * samples + 1]]
    conv = list(head)
    total, i = 0, 0
    while total < size or conv[-1]["role"] == "assistant":
        m = pool[i % len(pool)]
        conv.append(m)
        total += len(m["content"])
        i += 1
    start = len(conv)
    conv += timed
    if name == "gemma3":
        conv = C.alternating(conv)
        start = min(start, len(conv) - 2 * samples - 1)
    # each timed request ends at an observation (the model answers it)
    while conv[start - 1]["role"] == "assistant":
        start += 1
    if len(conv) - start < 2 * samples:
        raise SystemExit(f"{name}: the trajectories hold {len(conv) - start} messages for the timed turns, "
                         f"{2 * samples} needed: --samples {(len(conv) - start) // 2} at most")
    return conv, start


def body(name: str, msgs: list[dict]) -> bytes:
    """The request body an OpenAI-style client sends."""
    value = {"model": name, "messages": msgs}
    if name in C.TOOL_TEMPLATES:
        value["tools"] = TOOLS
    return orjson.dumps(value)


class Decoded:
    """The requests' messages, decoded from their bodies one at a time when asked (untimed): holding 24
    decoded copies of a 3M-char conversation (about 160K dicts) would put them in the process's heap
    during our timed turns, which a server does not have."""

    def __init__(self, bodies: list[bytes]):
        self.bodies = bodies

    def __len__(self) -> int:
        return len(self.bodies)

    def __getitem__(self, i: int) -> list[dict]:
        return orjson.loads(self.bodies[i])["messages"]

    def __iter__(self):
        return (self[i] for i in range(len(self)))


def requests(name, conv, start, samples, reuse: bool):
    """(messages per request: a list, or :class:`Decoded` from the bodies; body bytes per request, or
    ``None`` with ``reuse``)."""
    if not reuse:
        bodies = [body(name, conv[:start + 2 * (s + 1)]) for s in range(samples)]
        return Decoded(bodies), bodies
    out = []
    prev = None
    for s in range(samples):
        end = start + 2 * (s + 1)
        msgs = (prev or conv[:end - 2]) + [dict(m) for m in conv[end - 2:end]]
        prev = msgs
        out.append(msgs)
    return out, None


def _dumps(value) -> bytes:
    return orjson.dumps(value)


def _options(options: dict, value: dict) -> dict:
    """The render options a face takes from the body (``tools``) over the bench's defaults."""
    if "tools" in value:
        return {**options, "tools": value["tools"]}
    return options


def _settle(tok) -> None:
    """Wait (untimed) for the background indexing of the session's first text (module docstring)."""
    idx = tok.tokenizer.prefix_index
    if idx is not None:
        idx.drain()


def _same(render, ids, text: str, want: np.ndarray) -> bool:
    """The reply check between timed turns: the whole text and the ids (its memory traffic is part of the
    cache state the next turn starts from)."""
    return render.text == text and np.array_equal(np.asarray(ids, dtype=np.int64), want)


class Reply:
    """A reply kept for the checks after the timed turns (``--checks after``): its render (an old render's text
    stays exact after later turns: ``session._Memo``) and the SHA-256 of its ids as served, with their dtype
    and count. Hashing reads the ids once and keeps 32 bytes: nothing of the reply's size is copied or held
    between two turns (a kept copy would be fresh memory written every turn: ``docs/design/chat.md``,
    session 23)."""

    __slots__ = ("render", "count", "dtype", "digest")

    def __init__(self, render, ids):
        a = np.ascontiguousarray(ids)
        self.render, self.count, self.dtype, self.digest = render, len(a), a.dtype, hashlib.sha256(a).digest()

    def same(self, text: str, want: np.ndarray) -> bool:
        """Are the text and the ids ``text`` and ``want`` (as :func:`_same`)?"""
        if self.render.text != text or self.count != len(want):
            return False
        w = want.astype(self.dtype)
        return bool(np.array_equal(w, want)) and hashlib.sha256(w).digest() == self.digest


def delta_turn(chat, tok, raw: bytes, options: dict):
    """One ``ours_delta`` turn: ``raw`` (a JSON array of the new messages) parsed, rendered on top of the
    session ``chat`` and tokenized by the tokenizer session ``tok``; (the render, the ids)."""
    r = chat.render_more_body(raw, **options)
    delta = r.delta
    return r, (tok.append(delta) if r.extends_previous else tok.splice(r.departure, delta))


def floor_turn(mini, giga, raw: bytes, delta: str) -> None:
    """The floor's parts of one turn (module docstring): the new messages alone rendered by minijinja, the
    rendered delta encoded by gigatoken. Raises what the template raises on those messages alone."""
    mini.render(orjson.loads(raw), add_generation_prompt=True)
    giga.encode(delta)


class Neighbour:
    """Another session of the same template (``--neighbour``, module docstring): the same conversation with
    every message's ``content`` case-swapped (the same structure and lengths, other text and tokens). One of
    its turns runs, untimed, right before each timed ``ours_delta`` turn, and the floor's parts on its new
    messages right before each timed floor. Its replies are checked with the timed turn's (text against the
    jinja2 render, ids against gigatoken's)."""

    def __init__(self, chat, tok, conv, start, ends, options, ref, giga, defer: bool = False):
        from toktier_backend.chat.session import ChatSession

        def swap(m: dict) -> dict:
            m = dict(m)
            if isinstance(m.get("content"), str):
                m["content"] = m["content"].swapcase()
            return m

        self.conv = [swap(m) for m in conv]
        self.ends, self.options, self.prev_end = ends, options, start - 2
        self.texts = [ref.render(self.conv[:e], **options) for e in ends]
        self.want = [np.asarray(giga.encode(t), dtype=np.int64) for t in self.texts]
        # as a server's sessions of one template: the timed session's analysis and tokenizer (its own full
        # renderer, which only a first render or a fallback runs)
        self.chat = ChatSession(chat.reference.source, chat.reference.special_tokens, plan=chat.plan)
        self.tok = tok.tokenizer.session(add_special_tokens=False)
        self.tok.update(self.chat.render(self.conv[:start - 2], **options).text)
        _settle(self.tok)
        self.raw = self.render = self.ids = None
        self.defer = defer  # ``--checks after``: keep every reply (:class:`Reply`) for the checks after the turns
        self.replies: dict[int, Reply] = {}

    def turn(self, i: int) -> None:
        self.raw = _dumps(self.conv[self.prev_end:self.ends[i]])
        self.prev_end = self.ends[i]
        r, ids = delta_turn(self.chat, self.tok, self.raw, self.options)
        self.render = r
        if self.defer:
            self.replies[i] = Reply(r, ids)
        else:
            self.ids = np.array(ids)  # (a copy: the reply's view is dropped, as a face does)

    def check(self, i: int) -> bool:
        """Turn ``i``'s reply against the jinja2 render and gigatoken: the last turn's, or with ``defer``
        any turn's."""
        if self.defer:
            return self.replies[i].same(self.texts[i], self.want[i])
        return _same(self.render, self.ids, self.texts[i], self.want[i])

    def floor_turn(self, mini, giga) -> None:
        floor_turn(mini, giga, self.raw, self.render.delta)


def run(name: str, size: int, args, shared: Path):
    """One template and size, as a generator: it yields once its ``ours_delta`` session is ready, then after
    each ``ours_delta`` turn and its floor, and returns the cell's row (:func:`complete`, :func:`interleaved`)."""
    import gigatoken
    from tokenizers import Tokenizer

    from toktier_backend import load_tokenizer
    from toktier_backend.chat.fast import MiniJinjaRenderer, admit
    from toktier_backend.chat.session import ChatSession
    from toktier_backend.chat.template import ChatRenderer, special_tokens
    from toktier_backend.chat.wire import IncrementalBody

    src, cfg = C.template_source(name)
    tok_path = shared / "tokenizers" / name / "tokenizer.json"
    specials = special_tokens(cfg)
    options = {"add_generation_prompt": True}
    if name in C.TOOL_TEMPLATES:
        options["tools"] = TOOLS
    conv, start = conversation(name, size, args.samples)
    reqs, bodies = requests(name, conv, start, args.samples, args.reuse_objects)
    ref = ChatRenderer(src, specials)
    mini = MiniJinjaRenderer(src, specials)
    admitted = admit(src, specials).reason is None
    giga = gigatoken.Tokenizer(str(tok_path))
    for _ in range(2):
        giga.encode("warm <|im_start|>user\nhello<|im_end|>\n" * 50)
    hf = Tokenizer.from_file(str(tok_path))
    texts = [ref.render(m, **options) for m in reqs]
    want_ids = [np.asarray(giga.encode(t), dtype=np.int64) for t in texts]
    exact = {s: True for s in SYSTEMS}
    for i in (0, len(texts) - 1):
        if hf.encode(texts[i], add_special_tokens=False).ids != want_ids[i].tolist():
            exact["jinja2+gigatoken"] = exact["minijinja+gigatoken"] = False
    times: dict[str, list[float]] = {s: [] for s in (*SYSTEMS, FLOOR)}
    if args.sweep_mb:
        sweep = np.ones(args.sweep_mb << 18, dtype=np.float32)

        def cool() -> None:
            sweep.sum()
    else:
        def cool() -> None:
            pass
    stages: dict[str, list[float]] = {"parse": [], "render": [], "tokenize": [], "memcmp": []}
    stats = {}

    # ours: a warm session (the base conversation loaded, rendered and tokenized, untimed)
    chat = ChatSession(src, specials, trust_identity=args.reuse_objects)
    loader = IncrementalBody(top="object")
    tok = load_tokenizer(str(tok_path)).session(add_special_tokens=False)
    first = conv[:start - 2] if start > 2 else conv[:1]
    base = ref.render(first, **options)
    if bodies is None:
        r = chat.render(first, **options)
    else:
        prev_raw = body(name, first)
        got = loader.load(prev_raw)
        r = chat.render(got.messages, same_prefix=got.same_prefix, **_options(options, got.value))
    assert r.text == base
    tok.update(r.text)
    _settle(tok)
    extends = reused_all = 0
    defer = args.checks == "after"
    replies: list[Reply] = []  # ``--checks after``: each reply, checked after the turns

    def _checked(i: int, r, ids=None) -> bool:
        # the whole text against jinja2's and the ids against gigatoken's, for the first and last request also
        # against HF's (``r``: a Reply, or a render with its ids)
        refs = [want_ids[i]]
        if i in (0, len(reqs) - 1):
            refs.append(np.asarray(hf.encode(texts[i], add_special_tokens=False).ids, dtype=np.int64))
        return all(r.same(texts[i], w) if ids is None else _same(r, ids, texts[i], w) for w in refs)

    n_messages = [len(m) for m in reqs]
    gc.collect()
    for i in range(len(reqs)):
        msgs = reqs[i] if bodies is None else None
        if bodies is not None:
            raw = bytes(bytearray(bodies[i]))  # untimed: the body as a socket read leaves it
        t0 = time.perf_counter_ns()
        if bodies is not None:
            got = loader.load(raw)
            t1 = time.perf_counter_ns()
            r = chat.render(got.messages, same_prefix=got.same_prefix, **_options(options, got.value))
        else:
            t1 = time.perf_counter_ns()
            r = chat.render(msgs, **options)
        delta = r.delta
        t2 = time.perf_counter_ns()
        if r.extends_previous:
            ids = tok.append(delta)
            extends += 1
        else:
            ids = tok.splice(r.departure, delta)
        t3 = time.perf_counter_ns()
        times["ours"].append((t3 - t0) / 1e6)
        stages["parse"].append((t1 - t0) / 1e6)
        stages["render"].append((t2 - t1) / 1e6)
        stages["tokenize"].append((t3 - t2) / 1e6)
        if bodies is not None:  # after the sample, so that its reads do not evict the caches before it
            old = memoryview(prev_raw)
            t4 = time.perf_counter_ns()
            raw.startswith(old[: min(len(old), len(raw)) - 1])
            stages["memcmp"].append((time.perf_counter_ns() - t4) / 1e6)
            del old
            prev_raw = raw
            reused_all += got.same_prefix == n_messages[i] - 2
        if defer:
            replies.append(Reply(r, ids))
        elif not _checked(i, r, ids):
            exact["ours"] = False
        del ids  # a face drops its view of the reply once the response is written (token_buffer.py)
        cool()
    if defer and not all(_checked(i, reply) for i, reply in enumerate(replies)):
        exact["ours"] = False
    replies.clear()
    stats["ours_routes"] = {k: v for k, v in chat.stats.items()}
    stats["ours_append_share"] = extends / len(reqs)
    stats["ours_parse_reused_all_share"] = reused_all / len(reqs) if bodies is not None else None
    stats["ours_stages_p50"] = {k: A.percentile(v, 50) for k, v in stages.items() if v}

    # ours_delta: a second warm session; each request's bytes are its 2 new messages only
    chat_d = ChatSession(src, specials)
    tok_d = load_tokenizer(str(tok_path)).session(add_special_tokens=False)
    r = chat_d.render(first, **options)
    tok_d.update(r.text)
    _settle(tok_d)
    ends = [start + 2 * (s + 1) for s in range(len(reqs))]
    prev_end = len(first)
    floor_ok = True
    nb = Neighbour(chat_d, tok_d, conv, start, ends, options, ref, giga, defer) if args.neighbour else None
    gc.collect()
    yield  # ready for the ours_delta turns; with --interleave the other sizes' turns alternate with these
    for i, end in enumerate(ends):
        raw = _dumps(conv[prev_end:end])  # untimed: what the client sends (the 2 new messages)
        prev_end = end
        if nb is not None:
            nb.turn(i)
        t0 = time.perf_counter_ns()
        r, ids = delta_turn(chat_d, tok_d, raw, options)
        times["ours_delta"].append((time.perf_counter_ns() - t0) / 1e6)
        if defer:
            replies.append(Reply(r, ids))
        elif not _same(r, ids, texts[i], want_ids[i]) or (nb is not None and not nb.check(i)):
            exact["ours_delta"] = False
        cool()
        if floor_ok:  # the floor of the same turn, after the same check traffic (module docstring)
            try:
                if nb is not None:
                    nb.floor_turn(mini, giga)
                t0 = time.perf_counter_ns()
                floor_turn(mini, giga, raw, r.delta)
                times[FLOOR].append((time.perf_counter_ns() - t0) / 1e6)
            except Exception:  # noqa: BLE001 - the template refuses the messages alone: no floor
                floor_ok = False
                times[FLOOR].clear()
            if not defer:
                _same(r, ids, texts[i], want_ids[i])
            cool()
        del ids
        yield
    if defer:
        for i, reply in enumerate(replies):
            if not reply.same(texts[i], want_ids[i]) or (nb is not None and not nb.check(i)):
                exact["ours_delta"] = False
        replies.clear()

    for i, msgs in enumerate(reqs):
        t0 = time.perf_counter_ns()
        text = ref.render(msgs, **options)
        ids = giga.encode(text)
        times["jinja2+gigatoken"].append((time.perf_counter_ns() - t0) / 1e6)
        t0 = time.perf_counter_ns()
        text2 = mini.render(msgs, **options)
        ids2 = giga.encode(text2)
        times["minijinja+gigatoken"].append((time.perf_counter_ns() - t0) / 1e6)
        if text2 != texts[i] or not np.array_equal(np.asarray(ids2, dtype=np.int64), want_ids[i]):
            exact["minijinja+gigatoken"] = False
        del ids
        cool()
    if args.hf_samples:
        from transformers import AutoTokenizer

        folder = Path(args.out) / f"hf_{name}"
        folder.mkdir(parents=True, exist_ok=True)
        for f, target in (("tokenizer.json", tok_path), ("tokenizer_config.json", cfg)):
            link = folder / f
            if not link.exists():
                link.symlink_to(Path(target).resolve())
        hft = AutoTokenizer.from_pretrained(str(folder))
        for i in range(min(args.hf_samples, len(reqs))):
            msgs = reqs[i]
            t0 = time.perf_counter_ns()
            ids = hft.apply_chat_template(msgs, tokenize=True, return_dict=False, **options)
            times["transformers"].append((time.perf_counter_ns() - t0) / 1e6)
            if ids != want_ids[i].tolist():
                exact["transformers"] = False
    row = {"template": name, "size": size, "chars": len(texts[-1]), "messages": n_messages[-1],
           "body_bytes": len(bodies[-1]) if bodies else 0,
           "minijinja_admitted": admitted, "exact": exact, **stats}
    for s in (*SYSTEMS, FLOOR):
        row[s] = {"n": len(times[s]), "p50": A.percentile(times[s], 50) if times[s] else None,
                  "p90": A.percentile(times[s], 90) if times[s] else None}
    row["sweep_mb"] = args.sweep_mb
    return row


def complete(cell) -> dict:
    """Run one :func:`run` generator to its end; its row."""
    try:
        while True:
            next(cell)
    except StopIteration as stop:
        return stop.value


def interleaved(cells: list) -> list[dict]:
    """Run :func:`run` generators (one template's sizes) with their ``ours_delta`` turns alternating: each is
    set up (up to its first yield), then each round runs one turn (and its floor) of every size, in an order
    rotated by one each round, so that a drift of the machine's speed during the run falls on every size
    alike. Their rows, in order."""
    for cell in cells:
        next(cell)
    gc.collect()
    rows: list = [None] * len(cells)
    live = list(range(len(cells)))
    turn = 0
    while live:
        shift = turn % len(live)
        for j in live[shift:] + live[:shift]:
            try:
                next(cells[j])
            except StopIteration as stop:
                rows[j] = stop.value
                live.remove(j)
        turn += 1
    return rows


def table(rows: list[dict]) -> str:
    head = (f"{'template':12} {'size':>8} {'msgs':>5} | " + " | ".join(f"{s:>22}" for s in (*SYSTEMS, FLOOR))
            + " | mini/ours  delta/floor  exact")
    lines = [head, "-" * len(head)]
    for r in rows:
        cells = []
        for s in (*SYSTEMS, FLOOR):
            st = r[s]
            cell = "-" if not st["n"] else f"{st['p50']:.3f}/{st['p90']:.3f} n={st['n']}"
            cells.append(f"{cell:>22}")
        ratio = r["minijinja+gigatoken"]["p50"] / r["ours"]["p50"]
        over = A.fmt_ratio(r["ours_delta"]["p50"] / r[FLOOR]["p50"]) if r[FLOOR]["n"] else "-"
        bad = [s for s, ok in r["exact"].items() if not ok and r[s]["n"]]
        lines.append(f"{r['template']:12} {r['size']:>8} {r['messages']:>5} | " + " | ".join(cells)
                     + f" | {A.fmt_ratio(ratio):>9}  {over:>11}  {'INEXACT: ' + ','.join(bad) if bad else 'yes'}")
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(dict.fromkeys(r["template"] for r in rows))
    fig, axes = plt.subplots(1, len(names), figsize=(4 * len(names), 3.6), squeeze=False)
    for ax, name in zip(axes[0], names):
        rs = [r for r in rows if r["template"] == name]
        for s in (*SYSTEMS, FLOOR):
            pts = [(r["size"], r[s]["p50"]) for r in rs if r[s]["n"]]
            if pts:
                ax.plot(*zip(*pts), marker="o", label=s, color=COLORS[s])
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_title(name)
        ax.set_xlabel("conversation (chars)")
        ax.set_ylabel("p50 per turn (ms)")
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--templates", default="qwen3,qwen2_5,deepseek_v3,gemma3,llama3_1")
    p.add_argument("--sizes", default="100000,1000000,3000000")
    p.add_argument("--samples", type=int, default=24)
    p.add_argument("--hf-samples", type=int, default=3, help="transformers samples per cell (0: skip)")
    p.add_argument("--reuse-objects", action="store_true", help="pass the previous list plus new dicts")
    p.add_argument("--sweep-mb", type=int, default=0,
                   help="read an N MB buffer after each sample: the same cold start at every size")
    p.add_argument("--checks", choices=("between", "after"), default="between",
                   help="check each reply between the timed turns (default), or keep the replies (their "
                        "renders and ids' SHA-256) and check them all after the turns")
    p.add_argument("--interleave", action="store_true",
                   help="alternate the sizes' ours_delta turns (and floors) instead of running one size after another")
    p.add_argument("--neighbour", action="store_true",
                   help="one turn of another session of the template before each ours_delta turn and floor")
    p.add_argument("--out", default=str(Path(__file__).resolve().parent / "out"))
    p.add_argument("--shared", default=None)
    args = p.parse_args(argv)
    shared = A.shared_dir(args.shared)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    rows = []
    sizes = list(map(int, args.sizes.split(",")))
    for name in args.templates.split(","):
        if args.interleave:
            rows += interleaved([run(name, size, args, shared) for size in sizes])
        else:
            rows += [complete(run(name, size, args, shared)) for size in sizes]
        for row in rows[-len(sizes):]:
            print(f"[{name} {row['size']}] ours routes {row['ours_routes']}", file=sys.stderr, flush=True)
    print(f"# chat turns, ms p50/p90; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, "
          f"{platform.python_version()}, {'reused objects' if args.reuse_objects else 'messages from JSON'}, "
          f"{f'{args.sweep_mb} MB swept after each check' if args.sweep_mb else 'no sweep'}"
          f"{', a neighbour session before each ours_delta turn and floor' if args.neighbour else ''}"
          f"{', replies checked after the timed turns' if args.checks == 'after' else ''}"
          f"{', the sizes interleaved' if args.interleave else ''}")
    print(table(rows))
    if args.reuse_objects:
        print("ours = render + tokenize from the caller's objects (trust_identity); no bytes. Stage p50 (ms):")
    else:
        print("ours = parse (wire, from bytes) + render + tokenize; anchors from decoded messages (parse not "
              "counted). Stage p50 (ms); memcmp = one bytes.startswith of the body vs the previous one:")
    for r in rows:
        st = r["ours_stages_p50"]
        print(f"  {r['template']:12} {r['size']:>8}: " + "  ".join(f"{k} {v:.3f}" for k, v in st.items())
              + f"  append share {r['ours_append_share']:.2f}  body KB {r.get('body_bytes', 0) // 1000}")
    Path(args.out, "chat.json").write_text(json.dumps({"rows": rows, "revision": A.core_revision(),
                                                       "reuse_objects": args.reuse_objects,
                                                       "sweep_mb": args.sweep_mb,
                                                       "neighbour": args.neighbour,
                                                       "checks": args.checks,
                                                       "interleave": args.interleave}, indent=1))
    plot(rows, Path(args.out, "chat.png"))
    print(f"wrote {args.out}/chat.json, chat.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
