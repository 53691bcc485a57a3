"""The Dynamo chat processor's request -> ids step (``ChatProcessor.encode_request``: the core's chat step),
in process, without ai-dynamo (the served path is ``test_dynamo.py``, which needs it). A real SWE-agent
trajectory with Qwen3's real template; every result equals HF ``tokenizers`` ids of transformers' render."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

import toktier_backend as tt
from tests.chat.corpus import conversation, trajectories
from toktier_backend.faces.dynamo import METRICS_MODEL, ChatProcessor, FaceSessions
from toktier_backend.serving.metrics import Metrics

from .conftest import auto_tokenizer, hf_ids


def test_encode_request_turn_by_turn(chat_folder, tmp_path):
    folder = chat_folder("qwen3")
    hf = auto_tokenizer(str(folder))
    reg = CollectorRegistry()
    sessions = FaceSessions(tt.load_tokenizer(str(folder / "tokenizer.json")), name="qwen3", verifier_rate=0,
                            verifier_first_n=0, quarantine_file=str(tmp_path / "q.json"), metrics=Metrics(reg))
    try:
        proc = ChatProcessor(sessions, routed_engine=None, eos_token_ids=[])
        path = next(f for f in trajectories() if "function_calling" in f.name)
        conv = conversation("qwen3", path)[:12]
        renders = []
        for i in range(2, len(conv) + 1):
            body = {"model": "qwen3", "messages": conv[:i], "metadata": {"session_id": "s1"},
                    "chat_template_kwargs": {"enable_thinking": False}}
            if conv[i - 1]["role"] == "assistant":
                body["add_generation_prompt"] = False
            enc = proc.encode_request(body)
            text = hf.apply_chat_template(conv[:i], tokenize=False, enable_thinking=False,
                                          add_generation_prompt=body.get("add_generation_prompt", True))
            assert enc.ids == hf_ids("qwen3", text, add_special_tokens=False), i
            renders.append((enc.session, enc.render))
        assert all(r == ("key", "incremental") for r in renders), renders
        n = sum(s.value for fam in reg.collect() for s in fam.samples
                if s.name == "toktier_chat_renders_total" and s.labels["face"] == "dynamo"
                and s.labels["model"] == METRICS_MODEL and s.labels["route"] == "incremental")
        assert n == len(renders)
    finally:
        sessions.close()
