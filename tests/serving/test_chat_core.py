"""The core's chat step (``ServingCore.chat``) against transformers and HF ``tokenizers``.

Real SWE-agent trajectories (``../shared/corpus/swe-agent``) are replayed turn by turn through the core, with
the models' real chat templates (``../shared/chat_templates``). Every reply's ids are compared with
``Tokenizer.from_file(path).encode(text, add_special_tokens=False).ids`` of ``text`` =
``AutoTokenizer.apply_chat_template(messages, tokenize=False, ...)``, both computed here. The verifier's
quarantine is triggered by a ``ChatSession`` subclass that really renders a wrong text, passed to the core
through its ``chat_session`` argument.
"""

from __future__ import annotations

import json
import tracemalloc

import pytest
from prometheus_client import CollectorRegistry

import toktier_backend as tt
from tests.chat.conftest import hf_tokenizer
from tests.chat.corpus import TOOL_TEMPLATES, conversation, trajectories
from toktier_backend.chat.session import ChatSession
from toktier_backend.chat.template import load_chat_template, special_tokens
from toktier_backend.errors import InvalidRequest, UnknownSession
from toktier_backend.serving.core import ChatTemplate, CoreConfig, ServingCore, chat_nbytes
from toktier_backend.serving.metrics import Metrics, Origin
from toktier_backend.serving.session_store import ENTRY_OVERHEAD
from toktier_backend.serving.verifier import CHAT_KEY_PREFIX, Verifier

from .conftest import hf_ids

ORIGIN = Origin("triton", "toktier_session")
TOOLS = [{"type": "function", "function": {"name": "bash", "description": "Run a shell command",
                                           "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}},
                                                          "required": ["cmd"]}}}]


def _trajectory(name: str, n: int = 16) -> tuple[list[dict], dict]:
    path = next(f for f in trajectories() if "function_calling" in f.name)
    conv = conversation(name, path)[:n]
    return conv, ({"tools": TOOLS} if name in TOOL_TEMPLATES else {})


def _want(folder, name: str, messages, **options) -> tuple[str, list[int]]:
    """The reference: transformers renders, HF tokenizers encodes (add_special_tokens=False)."""
    text = hf_tokenizer(str(folder)).apply_chat_template(messages, tokenize=False, **options)
    return text, hf_ids(name, text, add_special_tokens=False)


def _core(folder, tmp_path, **kw):
    """A core with the folder's chat template, metrics on a private registry; ``kw``: ServingCore's."""
    reg = CollectorRegistry()
    path = folder / "tokenizer.json"
    tok = kw.pop("tokenizer", None) or tt.load_tokenizer(str(path))
    core = ServingCore(tok, metrics=Metrics(reg), chat_template=load_chat_template(path),
                       special_tokens=special_tokens(path), **kw)
    core.register(ORIGIN, sessions=True)

    def value(name, **labels):
        want = set(labels.items())
        return sum(s.value for fam in reg.collect() for s in fam.samples
                   if s.name == name and want <= set(s.labels.items()))

    return core, value


@pytest.mark.parametrize("name", ["qwen3", "llama3_1"])
def test_keyed_trajectory_turn_by_turn(chat_folder, tmp_path, name):
    """A conversation keyed by one ID, request after request (generation prompt when the last message is not
    the assistant's): ids equal the reference each turn, the render is incremental from the second turn,
    and the tokenizer session repairs instead of re-encoding."""
    folder = chat_folder(name)
    core, value = _core(folder, tmp_path)
    conv, options = _trajectory(name)
    routes, renders = [], []
    for i in range(2, len(conv) + 1):
        agp = conv[i - 1]["role"] != "assistant"
        msgs = json.loads(json.dumps(conv[:i]))  # decoded from the wire: new objects each request
        r = core.chat(ORIGIN, msgs, key="conv-1", add_generation_prompt=agp, **options)
        text, ids = _want(folder, name, conv[:i], add_generation_prompt=agp, **options)
        assert r.ids.tolist() == ids, (name, i)
        assert r.n == len(ids) and r.session == "key"
        routes.append(r.shown_route)
        renders.append(r.render)
    assert renders[0] == "incremental" and set(renders) == {"incremental"}, renders
    assert routes[0] == "new" and "append" in routes[1:], routes
    assert value("toktier_chat_renders_total", face="triton", model="toktier_session", route="incremental") == len(renders)
    assert value("toktier_requests_total", face="triton", mode="chat") == len(renders)
    # the chat session is charged with its tokenizer session, and leaves with it
    entry = core.store.get("conv-1")
    assert entry.chat is not None and entry.chat_nbytes > 0
    assert entry.nbytes == entry.session.nbytes + ENTRY_OVERHEAD + entry.chat_nbytes
    assert core.drop("conv-1") and core.store.nbytes == 0


@pytest.mark.parametrize("name", ["qwen3", "llama3_1"])
def test_keyed_raw_bodies_parse_from_the_first_changed_message(chat_folder, tmp_path, name):
    """``messages`` as the JSON array's bytes (Triton's ``MESSAGES``), keyed: turn by turn, then a rewrite of
    an early message and a truncation (renders that do not extend the previous text: ``splice``). Every reply
    equals the reference; after the first turn the leading messages are reused from the previous body
    (``messages_trusted``), not parsed and compared again."""
    folder = chat_folder(name)
    core, _ = _core(folder, tmp_path)
    conv, options = _trajectory(name)
    edited = json.loads(json.dumps(conv))
    edited[2]["content"] = "rewritten: " + str(edited[2]["content"])[:200]
    steps = [(conv[:i], conv[i - 1]["role"] != "assistant") for i in range(2, len(conv) + 1)]
    steps += [(edited, True), (edited[:7], True), (edited[:7] + [{"role": "user", "content": "and now?"}], True)]
    for i, (msgs, agp) in enumerate(steps):
        raw = json.dumps(msgs).encode()
        r = core.chat(ORIGIN, raw, key="raw-1", add_generation_prompt=agp, **options)
        assert r.ids.tolist() == _want(folder, name, msgs, add_generation_prompt=agp, **options)[1], (name, i)
        assert r.render == "incremental", (name, i, r.render)
    entry = core.store.get("raw-1")
    assert entry.chat.stats["messages_trusted"] > len(conv)  # the byte-identical prefixes were reused
    assert entry.chat_nbytes >= len(raw)  # the loader's kept body is charged


@pytest.mark.parametrize("name", ["qwen3", "llama3_1"])
def test_delta_of_messages_extends_the_previous_request(chat_folder, tmp_path, name):
    """``mode="delta"``: the first request carries the conversation, each later one only the messages after
    the previous request's (as bytes, Triton's ``MODE=delta`` + ``MESSAGES``). Every reply equals the
    reference of the whole conversation so far; the verifier (every reply sampled) agrees; a full request
    after deltas is still exact."""
    folder = chat_folder(name)
    tok = tt.load_tokenizer(str(folder / "tokenizer.json"))
    verifier = Verifier(tok, rate=1.0, first_n=0, cpu_share=1.0, quarantine_file=tmp_path / "q.json")
    core, value = _core(folder, tmp_path, tokenizer=tok, verifier=verifier)
    conv, options = _trajectory(name)
    r = core.chat(ORIGIN, json.dumps(conv[:3]).encode(), key="d", add_generation_prompt=True, **options)
    assert r.ids.tolist() == _want(folder, name, conv[:3], add_generation_prompt=True, **options)[1]
    for i in range(3, len(conv) - 1, 2):
        raw = json.dumps(conv[i:i + 2]).encode()
        r = core.chat(ORIGIN, raw, key="d", mode="delta", add_generation_prompt=True, **options)
        assert r.ids.tolist() == _want(folder, name, conv[:i + 2], add_generation_prompt=True, **options)[1], i
        assert r.render == "incremental" and r.shown_route in ("append", "edit"), (i, r.render, r.shown_route)
    n = i + 2
    r = core.chat(ORIGIN, json.dumps(conv[:n] + conv[n:n + 1]).encode(), key="d", add_generation_prompt=True,
                  **options)
    assert r.ids.tolist() == _want(folder, name, conv[:n + 1], add_generation_prompt=True, **options)[1]
    assert verifier.drain() and verifier.samples >= len(conv) // 2 and verifier.mismatches == 0
    verifier.close()


def test_delta_of_messages_without_a_held_conversation_is_refused(chat_folder, tmp_path):
    """A delta needs the key's previous chat request: no key (InvalidRequest), an unknown key or a key whose
    last step was a text request (UnknownSession: Triton NOT_FOUND, as a text delta) are refused with what to
    do instead; the held session still answers exactly."""
    name = "llama3_1"
    folder = chat_folder(name)
    core, _ = _core(folder, tmp_path)
    conv, options = _trajectory(name, 6)
    one = json.dumps(conv[4:5]).encode()
    with pytest.raises(InvalidRequest, match="needs a session key"):
        core.chat(ORIGIN, one, key=None, mode="delta", add_generation_prompt=True)
    with pytest.raises(UnknownSession, match="MODE=full"):
        core.chat(ORIGIN, one, key="unknown", mode="delta", add_generation_prompt=True)
    core.encode(ORIGIN, "plain text", key="t")
    with pytest.raises(UnknownSession, match="MODE=full"):
        core.chat(ORIGIN, one, key="t", mode="delta", add_generation_prompt=True)
    core.chat(ORIGIN, json.dumps(conv[:4]).encode(), key="k", add_generation_prompt=True)
    with pytest.raises(InvalidRequest, match="MODE"):
        core.chat(ORIGIN, one, key="k", mode="sideways", add_generation_prompt=True)
    r = core.chat(ORIGIN, one, key="k", mode="delta", add_generation_prompt=True)
    assert r.ids.tolist() == _want(folder, name, conv[:5], add_generation_prompt=True)[1]


def test_raw_bodies_refused_with_what_is_wrong(chat_folder, tmp_path):
    """Malformed ``MESSAGES`` bytes, keyed or not, new or on a held conversation: InvalidRequest naming the
    problem, and the held conversation still answers exactly afterwards."""
    name = "qwen3"
    folder = chat_folder(name)
    core, _ = _core(folder, tmp_path)
    conv, options = _trajectory(name, 6)
    core.chat(ORIGIN, json.dumps(conv[:4]).encode(), key="k", add_generation_prompt=True, **options)
    for key in ("k", "other", None):
        for raw, why in [(b"[{not json", "not JSON"), (b'{"role": "user"}', "JSON array of message objects"),
                         (b'[{"role": "user", "content": "x"}, 3]', "element 1 is a int")]:
            with pytest.raises(InvalidRequest, match=why):
                core.chat(ORIGIN, raw, key=key, add_generation_prompt=True, **options)
    r = core.chat(ORIGIN, json.dumps(conv[:6]).encode(), key="k", add_generation_prompt=True, **options)
    assert r.ids.tolist() == _want(folder, name, conv[:6], add_generation_prompt=True, **options)[1]


def test_unkeyed_conversation_found_by_its_first_messages(chat_folder, tmp_path):
    """No key: a short request is rendered in full and encoded without a session (``full:no_session``); once
    the contents reach ``min_prefix_chars`` a session is opened and found again by the first two messages."""
    name = "qwen3"
    folder = chat_folder(name)
    core, value = _core(folder, tmp_path)
    conv, options = _trajectory(name, 14)
    seen = []
    for i in range(1, len(conv) + 1):
        agp = conv[i - 1]["role"] != "assistant"
        r = core.chat(ORIGIN, json.loads(json.dumps(conv[:i])), add_generation_prompt=agp, **options)
        assert r.ids.tolist() == _want(folder, name, conv[:i], add_generation_prompt=agp, **options)[1], i
        seen.append((r.session, r.render))
    assert seen[0] == (None, "full:no_session")
    held = [s for s in seen if s[0] == "prefix"]
    assert len(held) >= 4 and held[-1][1] == "incremental", seen
    assert len(core.store) == 1
    assert value("toktier_chat_renders_total", route="full", reason="no_session") >= 1


def test_text_requests_between_chat_steps_stay_exact(chat_folder, tmp_path):
    """A TEXT request on the same key moves the tokenizer session away from the chat session's last render;
    the next chat step must update from the whole text, not append its delta."""
    name = "llama3_1"
    folder = chat_folder(name)
    core, _ = _core(folder, tmp_path)
    conv, options = _trajectory(name, 6)
    core.chat(ORIGIN, conv[:3], key=7, add_generation_prompt=True)
    core.encode(ORIGIN, "something else entirely", key=7, add_special_tokens=False)
    r = core.chat(ORIGIN, conv[:4], key=7)
    assert r.ids.tolist() == _want(folder, name, conv[:4])[1]
    r = core.chat(ORIGIN, conv[:5], key=7, add_generation_prompt=True)
    assert r.ids.tolist() == _want(folder, name, conv[:5], add_generation_prompt=True)[1]
    assert r.render == "incremental"


class WrongAfterThree(ChatSession):
    """Renders one char wrong from its third request on: a real incremental-renderer bug, as the verifier
    would meet it (the text is what the tokenizer then encodes)."""

    def render(self, messages, **options):
        r = super().render(messages, **options)
        self.calls = getattr(self, "calls", 0) + 1
        if self.calls < 3:
            return r
        bad = r.text[:-1] + ("X" if not r.text.endswith("X") else "Y")
        r._text, r._delta, r.departure = bad, bad, 0
        return r


def test_verifier_quarantines_incremental_rendering_of_the_template(chat_folder, tmp_path):
    name = "qwen3"
    folder = chat_folder(name)
    tok = tt.load_tokenizer(str(folder / "tokenizer.json"))
    verifier = Verifier(tok, rate=1.0, first_n=0, quarantine_file=tmp_path / "quarantine.json")
    core, value = _core(folder, tmp_path, tokenizer=tok, verifier=verifier, chat_session=WrongAfterThree)
    conv, options = _trajectory(name, 10)
    for i in range(2, 5):
        core.chat(ORIGIN, conv[:i], key="a", add_generation_prompt=True, **options)
    assert verifier.drain()
    key = core.chat_template.key
    assert key in verifier.chat_quarantined
    assert value("toktier_verifier_samples_total", face="triton", result="mismatch") == 1
    assert value("toktier_verifier_mismatches_total", route="chat:incremental") == 1
    data = json.loads((tmp_path / "quarantine.json").read_text())
    assert CHAT_KEY_PREFIX + key in data
    # from now on every chat request of the template renders in full, and its ids are right again
    for i in range(5, 9):
        r = core.chat(ORIGIN, conv[:i], key="a", add_generation_prompt=True, **options)
        assert r.render == "full:quarantined"
        assert r.ids.tolist() == _want(folder, name, conv[:i], add_generation_prompt=True, **options)[1]
    assert value("toktier_chat_renders_total", route="full", reason="quarantined") == 4
    assert value("toktier_chat_template_quarantined", face="triton") == 1
    assert verifier.drain() and verifier.mismatches == 1  # the full renders verify clean
    # another instance (process) sharing the file sees it at its next sync
    other = Verifier(tt.load_tokenizer(str(folder / "tokenizer.json")), rate=0, first_n=0,
                     quarantine_file=tmp_path / "quarantine.json")
    assert key in other.chat_quarantined
    assert verifier.release_chat() == [key]
    r = core.chat(ORIGIN, conv[:9], key="a", add_generation_prompt=True, **options)
    assert r.render == "incremental"  # a fresh chat session, the tokenizer session updated from the whole text
    assert r.ids.tolist() == _want(folder, name, conv[:9], add_generation_prompt=True, **options)[1]
    other.close()
    verifier.close()


def test_from_config_loads_the_template_beside_the_tokenizer(chat_folder, tmp_path):
    from tests.chat.corpus import template_source

    folder = chat_folder("qwen3")
    core = ServingCore.from_config(CoreConfig(tokenizer=str(folder), verifier_rate=0, verifier_first_n=0),
                                   metrics=Metrics(CollectorRegistry()), sweeper=False)
    assert core.chat_template.source == template_source("qwen3")[0]
    assert core.chat_template.special_tokens["eos_token"] == "<|im_end|>"
    (tmp_path / "t.jinja").write_text("{% for m in messages %}[{{ m.content }}]{% endfor %}")
    other = ServingCore.from_config(CoreConfig(tokenizer=str(folder), chat_template=str(tmp_path / "t.jinja"),
                                               verifier_rate=0, verifier_first_n=0),
                                    metrics=Metrics(CollectorRegistry()), sweeper=False)
    r = other.chat(ORIGIN, [{"role": "user", "content": "hi"}])
    assert r.ids.tolist() == hf_ids("qwen3", "[hi]", add_special_tokens=False)
    assert CoreConfig.from_parameters({"chat_template": "x.jinja"}).chat_template == "x.jinja"


def test_errors_are_clear_and_leave_the_session(chat_folder, tmp_path):
    folder = chat_folder("llama3_1")
    core, value = _core(folder, tmp_path)
    msgs = [{"role": "user", "content": "hello"}]
    first = core.chat(ORIGIN, msgs, key="k", add_generation_prompt=True)
    with pytest.raises(InvalidRequest, match="list of objects"):
        core.chat(ORIGIN, "not a list", key="k")
    with pytest.raises(InvalidRequest, match="chat_template_kwargs may not set"):
        core.chat(ORIGIN, msgs, key="k", chat_template_kwargs={"tools": []})
    with pytest.raises(InvalidRequest, match="both be set"):
        core.chat(ORIGIN, msgs, key="k", add_generation_prompt=True, continue_final_message=True)
    with pytest.raises(InvalidRequest, match="boolean or the name of the field"):
        core.chat(ORIGIN, msgs, key="k", continue_final_message=1)
    assert value("toktier_request_errors_total", face="triton", code="INVALID_ARG") == 4
    again = core.chat(ORIGIN, msgs, key="k", add_generation_prompt=True)
    assert again.ids.tolist() == first.ids.tolist() and again.route == "noop"
    bare = ServingCore(tt.load_tokenizer(str(folder / "tokenizer.json")))
    with pytest.raises(InvalidRequest, match="no chat template"):
        bare.chat(ORIGIN, msgs)


def test_chat_nbytes_bounds_what_a_session_holds(chat_folder):
    """``chat_nbytes`` is an upper bound of what ``tracemalloc`` counts for a chat session replayed over a
    real trajectory (messages decoded from JSON, as a face hands them over)."""
    from tests.chat.corpus import template_source

    for name in ("qwen3", "llama3_1"):
        source, _ = template_source(name)
        tpl = ChatTemplate(source, {"bos_token": "<s>", "eos_token": "</s>"})
        tpl.session()  # the shared analysis is not the session's
        conv, options = _trajectory(name, 30)
        wire = json.dumps(conv)
        tracemalloc.start()
        before = tracemalloc.get_traced_memory()[0]
        chat = tpl.session()
        for i in range(2, len(conv) + 1):
            r = chat.render(json.loads(wire)[:i], add_generation_prompt=True, **options)
            r.delta
        held = tracemalloc.get_traced_memory()[0] - before
        tracemalloc.stop()
        text = r.text
        width = 4 if any(ord(c) > 0xFFFF for c in text) else 2 if any(ord(c) > 0xFF for c in text) else 1
        assert held <= chat_nbytes(len(text), width, len(conv)), (name, held)


def test_busy_and_evicted_conversations_stay_exact(chat_folder, tmp_path):
    """A conversation whose session is in use gets a full render and a plain encode (``full:busy``); one
    evicted under the byte budget (chat session and tokenizer session together) is rebuilt exactly."""
    name = "llama3_1"
    folder = chat_folder(name)
    conv, _ = _trajectory(name, 12)
    core, value = _core(folder, tmp_path, session_budget_bytes=1)  # every session alone is over the budget
    r = core.chat(ORIGIN, conv[:4], key="a", add_generation_prompt=True)
    assert r.ids.tolist() == _want(folder, name, conv[:4], add_generation_prompt=True)[1]
    assert len(core.store) == 0 and value("toktier_session_evictions_total", cause="budget") == 1
    r = core.chat(ORIGIN, conv[:6], key="a", add_generation_prompt=True)
    assert r.fresh and r.ids.tolist() == _want(folder, name, conv[:6], add_generation_prompt=True)[1]

    core, value = _core(folder, tmp_path)
    core.chat(ORIGIN, conv[:4], key="b", add_generation_prompt=True)
    entry = core.store.get("b")
    with entry.lock:  # another request of the conversation is running
        r = core.chat(ORIGIN, conv[:6], key="b", add_generation_prompt=True)
    assert r.route == "busy" and r.render == "full:busy" and r.session is None
    assert r.ids.tolist() == _want(folder, name, conv[:6], add_generation_prompt=True)[1]
    r = core.chat(ORIGIN, conv[:8], key="b", add_generation_prompt=True)
    assert r.render == "incremental" and r.ids.tolist() == _want(folder, name, conv[:8], add_generation_prompt=True)[1]
    assert value("toktier_chat_renders_total", route="full", reason="busy") == 1
