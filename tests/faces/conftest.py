"""Fixtures for the integration routes: tokenizer folders in the HF layout, the HF references, and a real
tritonserver serving the TensorRT-LLM ensemble example.

Missing packages *fail* the tests that need them, with the install command (a skipped test must never read
as a passing one): ``pip install -e '.[test,serve]'`` (``test`` carries transformers and jinja2).
"""

from __future__ import annotations

import json
import os
from functools import lru_cache
from pathlib import Path

import pytest
import tokenizers

REPO = Path(__file__).resolve().parents[2]
SHARED = Path(os.environ.get("TOKTIER_SHARED", REPO.parent / "shared"))
BUNDLED = REPO / "toktier_backend" / "data" / "gpt2" / "tokenizer.json"

# A ChatML template with tools, as Qwen-style models ship (written for these tests).
CHATML_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n"
    "{%- if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}\n\n{%- endif %}"
    "# Tools\n<tools>\n{%- for tool in tools %}\n{{ tool | tojson }}\n{%- endfor %}\n</tools><|im_end|>\n"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if not (tools and loop.first and message['role'] == 'system') %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{%- if enable_thinking is defined and not enable_thinking %}"
    "<think>\n\n</think>\n\n{%- endif %}{%- endif %}"
)

# Llama-3-style: the template writes bos_token itself.
LLAMA3_TEMPLATE = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "<|start_header_id|>{{ message['role'] }}<|end_header_id|>\n\n{{ message['content'] | trim }}<|eot_id|>"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{%- endif %}"
)

CONFIGS = {
    "gpt2": {"eos_token": "<|endoftext|>", "bos_token": "<|endoftext|>", "chat_template": CHATML_TEMPLATE},
    "qwen3": {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "chat_template": CHATML_TEMPLATE},
    "llama3_1": {"eos_token": "<|eot_id|>", "bos_token": "<|begin_of_text|>", "chat_template": LLAMA3_TEMPLATE},
}


@pytest.fixture(scope="session", autouse=True)
def _state_dir(tmp_path_factory):
    """Quarantine files (``$TOKTIER_STATE_DIR``) of the cores built without an explicit one go to a temp dir,
    never to the user's ``~/.cache``."""
    old = os.environ.get("TOKTIER_STATE_DIR")
    os.environ["TOKTIER_STATE_DIR"] = str(tmp_path_factory.mktemp("state"))
    yield
    if old is None:
        os.environ.pop("TOKTIER_STATE_DIR", None)
    else:
        os.environ["TOKTIER_STATE_DIR"] = old


def tokenizer_file(name: str) -> Path:
    """``gpt2`` -> the bundled file; else ``../shared/tokenizers/<name>/tokenizer.json``."""
    p = BUNDLED if name == "gpt2" else SHARED / "tokenizers" / name / "tokenizer.json"
    if not p.is_file():
        pytest.fail(f"{p} missing (tests need ../shared beside the repo, or TOKTIER_SHARED)")
    return p


@lru_cache(maxsize=None)
def reference(name: str) -> tokenizers.Tokenizer:
    """The HF reference, ``Tokenizer.from_file(path)``, loaded independently of our code."""
    return tokenizers.Tokenizer.from_file(str(tokenizer_file(name)))


def hf_ids(name: str, text: str, add_special_tokens: bool = True) -> list[int]:
    return reference(name).encode(text, add_special_tokens=add_special_tokens).ids


def require(module: str, extra: str = "test") -> None:
    """Import ``module`` or fail with the install command (never skip)."""
    import importlib

    try:
        importlib.import_module(module)
    except ImportError as e:
        pytest.fail(f"{module} is not installed ({e}): pip install -e '.[{extra}]'")


@pytest.fixture(scope="session")
def hf_folder(tmp_path_factory):
    """``hf_folder(name)`` -> a folder in the HF layout: ``tokenizer.json`` (a symlink to the real file) and a
    ``tokenizer_config.json`` with special tokens and a chat template (:data:`CONFIGS`)."""
    made: dict[str, Path] = {}

    def make(name: str) -> Path:
        if name not in made:
            d = tmp_path_factory.mktemp(f"hf_{name}")
            (d / "tokenizer.json").symlink_to(tokenizer_file(name))
            (d / "tokenizer_config.json").write_text(json.dumps(CONFIGS[name]))
            made[name] = d
        return made[name]

    return make


@lru_cache(maxsize=None)
def auto_tokenizer(folder: str, **kwargs):
    """``transformers.AutoTokenizer.from_pretrained(folder)`` (cached)."""
    require("transformers")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder, **kwargs)


@pytest.fixture(scope="session")
def ensemble_server(tmp_path_factory, hf_folder):
    """tritonserver (from nvidia-pytriton) on loopback with ``model_repository/`` and the TensorRT-LLM ensemble
    example, serving the llama3_1 file with a tokenizer_config.json (eos ``<|eot_id|>``; BOS post-processor),
    the ``toktier_*`` exporter on a free port, every reply verified, and its own quarantine file."""
    require("tritonclient.grpc", "serve")
    require("tritonclient.http", "serve")
    from toktier_backend.faces.trtllm import ENSEMBLE_EXAMPLE_REPOSITORY
    from toktier_backend.deploy.server import TritonServer, find_triton_dist

    try:
        find_triton_dist()
    except FileNotFoundError as e:
        pytest.fail(str(e))
    folder = hf_folder("llama3_1")
    tmp = tmp_path_factory.mktemp("ensemble")
    server = TritonServer(str(folder), http_port=0, grpc_port=0, metrics_port=0, session_idle_s=60,
                          log_path=tmp / "tritonserver.log", exit_timeout_s=3, toktier_metrics_port=0,
                          extra_model_repositories=[ENSEMBLE_EXAMPLE_REPOSITORY],
                          parameters={"quarantine_file": str(tmp / "quarantine.json"), "verifier_rate": "1.0"})
    server.folder = folder
    try:
        server.start().wait_ready(240)
    except RuntimeError as e:
        pytest.fail(str(e))
    yield server
    server.stop()


def faulty_core(tokenizer_path, tmp_path, **core_kwargs):
    """A serving core whose tokenizer's fast engine is :class:`tests.faulty_engine.FaultyEngine` (installed
    after admission, as a bad engine build would be), with a real shadow verifier that checks every reply
    (its quarantine file in ``tmp_path``) and real ``toktier_*`` metrics on a private Prometheus registry.

    Returns:
        ``(core, value)``: ``value(name, **labels)`` sums the registry's samples of ``name`` whose labels
        include ``labels``.
    """
    from prometheus_client import CollectorRegistry

    import toktier_backend as tt
    from toktier_backend.serving.core import ServingCore
    from toktier_backend.serving.metrics import Metrics
    from toktier_backend.serving.verifier import Verifier

    from ..faulty_engine import install

    tok = tt.load_tokenizer(tokenizer_path)  # its own: quarantine is per Tokenizer
    install(tok)
    reg = CollectorRegistry()
    verifier = Verifier(tok, rate=1.0, first_n=0, quarantine_file=tmp_path / "quarantine.json")
    core = ServingCore(tok, verifier=verifier, metrics=Metrics(reg), **core_kwargs)

    def value(name, **labels):
        want = set(labels.items())
        return sum(s.value for fam in reg.collect() for s in fam.samples
                   if s.name == name and want <= set(s.labels.items()))

    return core, value
