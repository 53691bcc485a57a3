"""The Triton handler's chat tensors (``MESSAGES``, ``ADD_GENERATION_PROMPT``, ``CHAT_TEMPLATE_KWARGS``) in
process, no tritonserver (the served twin is ``tests/serving/test_served_chat.py``). Ids are compared with HF
``tokenizers`` ids of transformers' render, computed here."""

from __future__ import annotations

import json

import numpy as np
import pytest
from prometheus_client import CollectorRegistry

import toktier_backend as tt
from toktier_backend.chat.template import load_chat_template, special_tokens
from toktier_backend.errors import InvalidRequest, UnknownSession
from toktier_backend.faces.triton import Handler
from toktier_backend.serving.core import ServingCore
from toktier_backend.serving.metrics import Metrics

from .conftest import auto_tokenizer, hf_ids

MSGS = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "naïve: what's 1 & 2?"}]


def _s(v) -> np.ndarray:
    return np.array([[v]], dtype=np.object_ if isinstance(v, bytes) else np.bool_)


@pytest.fixture()
def handler(chat_folder):
    path = chat_folder("qwen3") / "tokenizer.json"
    reg = CollectorRegistry()
    core = ServingCore(tt.load_tokenizer(str(path)), metrics=Metrics(reg), chat_template=load_chat_template(path),
                       special_tokens=special_tokens(path))
    h = Handler(core)
    h.registry = reg
    yield h
    h.close()


def test_messages_tensors(handler, chat_folder):
    hf = auto_tokenizer(str(chat_folder("qwen3")))
    out = handler.handle_session_tensors(5, {"MESSAGES": _s(json.dumps(MSGS).encode()),
                                             "ADD_GENERATION_PROMPT": _s(True),
                                             "CHAT_TEMPLATE_KWARGS": _s(b'{"enable_thinking": false}')},
                                         start=True, end=False)
    text = hf.apply_chat_template(MSGS, tokenize=False, add_generation_prompt=True, enable_thinking=False)
    assert out["INPUT_ID"].tolist() == hf_ids("qwen3", text, add_special_tokens=False)
    assert out["REQUEST_INPUT_LEN"].tolist() == [len(out["INPUT_ID"])] and out["KEEP"].tolist() == [0]
    more = MSGS + [{"role": "assistant", "content": "3"}]
    out = handler.handle_session_tensors(5, {"MESSAGES": _s(json.dumps(more).encode()), "REPLY": _s(b"patch")},
                                         start=False, end=True)
    want = hf_ids("qwen3", hf.apply_chat_template(more, tokenize=False), add_special_tokens=False)
    keep = int(out["KEEP"][0])
    assert keep > 0 and out["INPUT_ID"].tolist() == want[keep:]
    assert 5 not in handler.store  # END freed it


def test_bad_chat_tensors_are_refused_and_start_is_honoured(handler):
    handler.handle_session_tensors(9, {"TEXT": _s(b"held text")}, start=True, end=False)
    assert 9 in handler.store
    for inputs, why in [
        ({"TEXT": _s(b"x"), "MESSAGES": _s(b"[]")}, "both 'TEXT' and 'MESSAGES'"),
        ({}, "exactly one of the inputs"),
        ({"MESSAGES": _s(b"{")}, "not JSON"),
        ({"MESSAGES": _s(b"[]"), "CHAT_TEMPLATE_KWARGS": _s(b"[1]")}, "must be a JSON object"),
        ({"MESSAGES": _s(b"[]"), "CHAT_TEMPLATE_KWARGS": _s(b'{"continue_final_message": 1}')}, "boolean"),
    ]:
        with pytest.raises(InvalidRequest, match=why):
            handler.handle_session_tensors(9, inputs, start=True, end=False)
        assert 9 not in handler.store  # START dropped what the key held, even on a refused request
        handler.handle_session_tensors(9, {"TEXT": _s(b"held text")}, start=True, end=False)
    # a delta of messages on START has no previous request to extend (as a text delta on START)
    with pytest.raises(InvalidRequest, match="START request has MODE='delta' with MESSAGES"):
        handler.handle_session_tensors(9, {"MESSAGES": _s(b"[]"), "MODE": _s(b"delta")}, start=True, end=False)
    assert 9 not in handler.store
    # after a text request the sequence holds no chat session to extend: NOT_FOUND, as an unknown text session
    handler.handle_session_tensors(9, {"TEXT": _s(b"held text")}, start=True, end=False)
    with pytest.raises(UnknownSession, match="resend the whole conversation with MODE=full"):
        handler.handle_session_tensors(9, {"MESSAGES": _s(b"[]"), "MODE": _s(b"delta")}, start=False, end=False)
    errors = sum(s.value for fam in handler.registry.collect() for s in fam.samples
                 if s.name == "toktier_request_errors_total" and s.labels["face"] == "triton")
    assert errors == 7
