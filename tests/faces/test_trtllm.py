"""The TensorRT-LLM ``preprocessing`` drop-in: in process (unit) and through the real ensemble (L0).

Two oracles for every tensor:

- the HF reference, ``Tokenizer.from_file(path).encode(text, add_special_tokens=...).ids``;
- :class:`OriginalPreprocessing`, what NVIDIA/TensorRT-LLM's ``preprocessing/1/model.py`` computes, written
  here from its documented behaviour with the tokenizer it loads (``transformers.AutoTokenizer`` on the
  tokenizer folder): ``_create_request`` (encode with the ``add_special_tokens`` parameter, right-pad with the
  tokenizer's pad id), ``_to_word_list_format`` (each word encoded without special tokens, empty words
  skipped, ids concatenated and 0-padded, cumulative word ends -1-padded, width ``max(1, longest)``;
  ``[b, 2, 0]`` without a list), ``_get_embedding_bias`` (``encode(word)`` with its default special tokens,
  weights added per id over ``len(vocab)``; ``[b, 0]`` without words), end/pad ids from the eos/pad tokens
  (pad falls back to eos), ``DECODER_INPUT_ID = [[pad_id]]`` without a decoder query.
"""

from __future__ import annotations

import numpy as np
import pytest

from toktier_backend.corpus import load_turns, trajectory_files

from .conftest import auto_tokenizer, hf_ids, require


# ---------------------------------------------------------------- the oracle


class OriginalPreprocessing:
    """TensorRT-LLM's text-only preprocessing semantics, on the tokenizer it would load."""

    def __init__(self, folder, add_special_tokens: bool = True):
        tok = auto_tokenizer(str(folder), legacy=False, padding_side="left")
        self.tok = tok
        self.add_special_tokens = add_special_tokens
        eos = tok.eos_token
        pad = tok.pad_token or eos
        self.end_id = tok.encode(eos, add_special_tokens=False)[0]
        self.pad_id = tok.encode(pad, add_special_tokens=False)[0]

    def create_request(self, queries: list[str]):
        rows = [self.tok.encode(q, add_special_tokens=self.add_special_tokens) for q in queries]
        width = max(len(r) for r in rows)
        ids = np.array([r + [self.pad_id] * (width - len(r)) for r in rows], dtype=np.int32)
        return ids, np.array([[len(r)] for r in rows], dtype=np.int32)

    def word_list(self, word_lists, batch_size: int):
        if word_lists is None:
            return np.empty([batch_size, 2, 0], dtype=np.int32)
        flat, offs = [], []
        for words in word_lists:
            ids_row, ends = [], []
            for w in words:
                ids = self.tok.encode(w, add_special_tokens=False)
                if not ids:
                    continue
                ids_row += ids
                ends.append(len(ids))
            flat.append(ids_row)
            offs.append(list(np.cumsum(ends)))
        width = max(1, max(len(r) for r in flat))
        out = np.zeros((len(flat), 2, width), dtype=np.int32)
        out[:, 1, :] = -1
        for i, (r, o) in enumerate(zip(flat, offs)):
            out[i, 0, : len(r)] = r
            out[i, 1, : len(o)] = o
        return out

    def embedding_bias(self, words, weights, batch_size: int):
        if words is None or weights is None:
            return np.empty([batch_size, 0], dtype=np.float32)
        rows = []
        for ws, xs in zip(words, weights):
            bias = [0.0] * len(self.tok.get_vocab())
            for w, x in zip(ws, xs):
                for i in self.tok.encode(w):  # the original's default: special tokens added
                    bias[i] += x
            rows.append(bias)
        return np.array(rows, dtype=np.float32)


def _obj(rows):
    return np.array([[r.encode() if isinstance(r, str) else r for r in row] for row in rows], dtype=np.object_)


TEXTS = [
    "hello world",
    "  leading spaces and trailing\n\n",
    "naïve café — 東京 🙂",
    "<|begin_of_text|>special text<|eot_id|> inside",
    "digits 1234567 and 3.14159",
    "",
]


# ---------------------------------------------------------------- unit: the handler in process


@pytest.fixture(scope="module", params=["gpt2", "llama3_1"])
def unit(request, hf_folder):
    from toktier_backend.faces.trtllm import PreprocessingHandler

    folder = hf_folder(request.param)
    handler = PreprocessingHandler.from_parameters({"tokenizer": str(folder), "add_special_tokens": "${add_special_tokens}",
                                                    "tokenizer_dir": "${tokenizer_dir}"})
    return request.param, handler, OriginalPreprocessing(folder)


def test_unit_input_ids_padding_and_ids(unit):
    name, handler, orig = unit
    out = handler.execute({"QUERY": _obj([[t] for t in TEXTS]), "REQUEST_OUTPUT_LEN": np.full((len(TEXTS), 1), 9, np.int32)})
    want_ids, want_len = orig.create_request(TEXTS)
    assert out["INPUT_ID"].dtype == np.int32 and np.array_equal(out["INPUT_ID"], want_ids)
    assert np.array_equal(out["REQUEST_INPUT_LEN"], want_len)
    for i, t in enumerate(TEXTS):
        assert out["INPUT_ID"][i, : want_len[i, 0]].tolist() == hf_ids(name, t)
    assert out["OUT_END_ID"].tolist() == [[orig.end_id]] * len(TEXTS)
    assert out["OUT_PAD_ID"].tolist() == [[orig.pad_id]] * len(TEXTS)
    assert out["DECODER_INPUT_ID"].tolist() == [[orig.pad_id]] * len(TEXTS)
    assert out["REQUEST_DECODER_INPUT_LEN"].tolist() == [[1]] * len(TEXTS)
    assert out["REQUEST_OUTPUT_LEN"].tolist() == [[9]] * len(TEXTS)
    assert out["BAD_WORDS_IDS"].shape == (len(TEXTS), 2, 0) and out["EMBEDDING_BIAS"].shape == (len(TEXTS), 0)
    assert out["ROUTE"].tolist() == [[b"encode"]] * len(TEXTS)


def test_unit_word_lists_and_bias(unit):
    name, handler, orig = unit
    bad = [["hello", " world", "", "<|eot_id|>"], ["x", "a much longer phrase of words", "", ""]]
    stop = [["\n\n", "</s>"], ["", ""]]
    assert np.array_equal(handler.word_list(_obj(bad), 2), orig.word_list(bad, 2))
    assert np.array_equal(handler.word_list(_obj(stop), 2), orig.word_list(stop, 2))
    assert np.array_equal(handler.word_list(_obj([["", ""]]), 1), orig.word_list([["", ""]], 1))  # width max(1, 0)
    assert np.array_equal(handler.word_list(None, 3), orig.word_list(None, 3))
    words, weights = [["hello", " hello", "world"]], [[0.5, -2.0, 1.25]]
    got = handler.embedding_bias(_obj(words), np.array(weights, np.float32), 1)
    want = orig.embedding_bias(words, weights, 1)
    assert got.dtype == np.float32 and got.shape == want.shape and np.array_equal(got, want)
    if name == "llama3_1":  # the original's encode(word) adds BOS: its bias is the sum of all weights
        assert got[0, 128000] == pytest.approx(0.5 - 2.0 + 1.25)


def test_unit_sessions_repair_exactly(unit):
    name, handler, _ = unit
    turns = load_turns(trajectory_files()[0])[:8]
    routes = []
    for i, t in enumerate(turns):
        out = handler.execute({"QUERY": _obj([[t]]), "REQUEST_OUTPUT_LEN": np.array([[1]], np.int32)},
                              correlation_id=f"unit-{name}", start=(i == 0))
        assert out["INPUT_ID"][0].tolist() == hf_ids(name, t)
        routes.append(out["ROUTE"][0, 0].decode())
        if i:
            assert 0 < out["KEEP"][0, 0] <= out["REQUEST_INPUT_LEN"][0, 0]
    assert routes[0] == "new" and set(routes[1:]) <= {"append", "edit"}, routes
    out = handler.execute({"QUERY": _obj([[turns[0]]]), "REQUEST_OUTPUT_LEN": np.array([[1]], np.int32)},
                          correlation_id=f"unit-{name}", end=True)  # a truncation, then END frees it
    assert out["INPUT_ID"][0].tolist() == hf_ids(name, turns[0])
    out = handler.execute({"QUERY": _obj([[turns[1]]]), "REQUEST_OUTPUT_LEN": np.array([[1]], np.int32)},
                          correlation_id=f"unit-{name}")
    assert out["ROUTE"][0, 0] == b"new"


def test_unit_errors(unit):
    from toktier_backend.errors import InvalidRequest

    _, handler, _ = unit
    with pytest.raises(InvalidRequest, match="REQUEST_OUTPUT_LEN"):
        handler.execute({"QUERY": _obj([["x"]])})
    with pytest.raises(InvalidRequest, match="not valid UTF-8"):
        handler.execute({"QUERY": np.array([[b"\xff\xfe"]], dtype=object), "REQUEST_OUTPUT_LEN": np.array([[1]], np.int32)},
                        correlation_id=7)
    with pytest.raises(InvalidRequest, match="one weight per word"):
        handler.embedding_bias(_obj([["a", "b"]]), np.array([[1.0]], np.float32), 1)


def test_unit_no_eos_needs_end_id():
    """A file without tokenizer_config.json and several special tokens names no eos: END_ID is required."""
    from toktier_backend.errors import InvalidRequest
    from toktier_backend.faces.trtllm import PreprocessingHandler

    from ..conftest import load  # the run-wide cached tokenizer of the shared file

    handler = PreprocessingHandler(load("qwen3"))
    assert handler.end_id is None
    with pytest.raises(InvalidRequest, match="END_ID"):
        handler.execute({"QUERY": _obj([["x"]]), "REQUEST_OUTPUT_LEN": np.array([[1]], np.int32)})
    out = handler.execute({"QUERY": _obj([["x"]]), "REQUEST_OUTPUT_LEN": np.array([[1]], np.int32),
                           "END_ID": np.array([[151645]], np.int32), "PAD_ID": np.array([[151643]], np.int32)})
    assert out["OUT_END_ID"].tolist() == [[151645]] and out["OUT_PAD_ID"].tolist() == [[151643]]
    assert out["INPUT_ID"].tolist() == [hf_ids("qwen3", "x")]


def _parse_config(text: str):
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2 as pb

    return text_format.Parse(text, pb.ModelConfig())


def test_config_pbtxt_matches_the_contract():
    """Our config, filled as ``toktier serve`` fills it, parses as Triton's ModelConfig, with the original's
    tensor names, dtypes and dims (upstream's current preprocessing/config.pbtxt, text and multimodal inputs)."""
    require("tritonclient.grpc", "serve")
    from tritonclient.grpc import model_config_pb2 as pb

    from toktier_backend.faces.trtllm_config import fill_defaults

    from .conftest import REPO

    cfg = _parse_config(fill_defaults((REPO / "model_repository" / "preprocessing" / "config.pbtxt").read_text()))
    dt = pb.DataType.Name
    ins = {i.name: (dt(i.data_type), list(i.dims), i.optional) for i in cfg.input}
    outs = {o.name: (dt(o.data_type), list(o.dims)) for o in cfg.output}
    assert ins == {
        "QUERY": ("TYPE_STRING", [1], False), "DECODER_QUERY": ("TYPE_STRING", [1], True),
        "REQUEST_OUTPUT_LEN": ("TYPE_INT32", [1], False), "BAD_WORDS_DICT": ("TYPE_STRING", [-1], True),
        "STOP_WORDS_DICT": ("TYPE_STRING", [-1], True), "EMBEDDING_BIAS_WORDS": ("TYPE_STRING", [-1], True),
        "EMBEDDING_BIAS_WEIGHTS": ("TYPE_FP32", [-1], True), "END_ID": ("TYPE_INT32", [1], True),
        "PAD_ID": ("TYPE_INT32", [1], True), "PROMPT_TABLE_EXTRA_ID": ("TYPE_UINT64", [1], True),
        "IMAGE_BYTES": ("TYPE_UINT8", [-1, -1, -1, -1], True), "IMAGE_URL": ("TYPE_STRING", [1], True),
        "IMAGES": ("TYPE_STRING", [-1], True), "VIDEO_BYTES": ("TYPE_UINT8", [-1, -1, -1, -1], True),
    }
    assert outs == {
        "INPUT_ID": ("TYPE_INT32", [-1]), "REQUEST_INPUT_LEN": ("TYPE_INT32", [1]),
        "DECODER_INPUT_ID": ("TYPE_INT32", [-1]), "REQUEST_DECODER_INPUT_LEN": ("TYPE_INT32", [1]),
        "BAD_WORDS_IDS": ("TYPE_INT32", [2, -1]), "STOP_WORDS_IDS": ("TYPE_INT32", [2, -1]),
        "EMBEDDING_BIAS": ("TYPE_FP32", [-1]), "REQUEST_OUTPUT_LEN": ("TYPE_INT32", [-1]),
        "OUT_END_ID": ("TYPE_INT32", [1]), "OUT_PAD_ID": ("TYPE_INT32", [1]),
        "OUT_PROMPT_TABLE_EXTRA_IDS": ("TYPE_UINT64", [-1]),
        "ROUTE": ("TYPE_STRING", [1]), "KEEP": ("TYPE_INT32", [1]),  # ours, extra
    }
    assert cfg.max_batch_size == 256 and list(cfg.dynamic_batching.preferred_batch_size) == [256]
    assert cfg.dynamic_batching.default_queue_policy.max_queue_size == 0
    assert [g.count for g in cfg.instance_group] == [1]
    assert cfg.parameters["tokenizer"].string_value == "${tokenizer}"  # no default: refused unfilled
    assert cfg.parameters["tokenizer_dir"].string_value == "${tokenizer_dir}"


# ---------------------------------------------------------------- TensorRT-LLM's setup command


def fill_template(path, substitutions: str) -> str:
    """What TensorRT-LLM's ``tools/fill_template.py FILE key:value,...`` prints (written here from its
    behaviour): ``,`` and ``:`` split pairs (a backslash escapes the next char), each key must occur in the
    file (else ``AssertionError: key ... does not exist``), ``max_queue_size`` and
    ``max_queue_delay_microseconds`` default to 0, then ``string.Template.safe_substitute``."""
    import string

    def split(text, sep):
        out, cur, esc = [], "", False
        for ch in text:
            if esc:
                cur, esc = cur + ch, False
            elif ch == sep:
                out.append(cur)
                cur = ""
            elif ch == "\\":
                esc = True
            else:
                cur += ch
        return out + [cur]

    template = string.Template(open(path).read())
    values = {"max_queue_size": 0, "max_queue_delay_microseconds": 0}
    for pair in split(substitutions, ","):
        key, value = split(pair, ":")
        values[key] = value
        assert key in template.template, f"key '{key}' does not exist in the file {path}."
    return template.safe_substitute(values)


@pytest.mark.parametrize("batch", [64, 512])
def test_fill_template_documented_command_fills_our_config(tmp_path, hf_folder, batch):
    """The documented setup command fills ours completely (every structural key; the model then loads on the
    filled tokenizer_dir), and triton_max_batch_size drives max_batch_size and the preferred batch size."""
    require("tritonclient.grpc", "serve")
    from toktier_backend.faces import triton_io
    from toktier_backend.faces.trtllm import PreprocessingHandler
    from toktier_backend.faces.trtllm_config import template_keys

    from .conftest import REPO

    folder = hf_folder("llama3_1")
    src = REPO / "model_repository" / "preprocessing" / "config.pbtxt"
    text = fill_template(src, f"tokenizer_dir:{folder},triton_max_batch_size:{batch},preprocessing_instance_count:1")
    cfg = _parse_config(text)
    assert cfg.max_batch_size == batch and list(cfg.dynamic_batching.preferred_batch_size) == [batch]
    assert cfg.dynamic_batching.max_queue_delay_microseconds == 0 and [g.count for g in cfg.instance_group] == [1]
    # left: only parameter values, each with a documented meaning when unfilled
    assert template_keys(text) == {"tokenizer", "add_special_tokens", "multimodal_model_path", "engine_dir",
                                   "max_num_images", "hf_model_path"}
    params = {k: v.string_value for k, v in cfg.parameters.items()}
    assert params["tokenizer_dir"] == str(folder)
    handler = PreprocessingHandler.from_parameters(triton_io.model_parameters(
        {"parameters": {k: {"string_value": v} for k, v in params.items()}}))
    out = handler.execute({"QUERY": _obj([["hello world"]]), "REQUEST_OUTPUT_LEN": np.array([[1]], np.int32)})
    assert out["INPUT_ID"].tolist() == [hf_ids("llama3_1", "hello world")]  # add_special_tokens unfilled: true
    assert out["INPUT_ID"][0, 0] == 128000


def test_fill_template_upstream_keys_all_exist():
    """Every key TensorRT-LLM's docs pass for preprocessing exists in ours (fill_template asserts it)."""
    from .conftest import REPO

    src = REPO / "model_repository" / "preprocessing" / "config.pbtxt"
    fill_template(src, "tokenizer_dir:/x,triton_max_batch_size:8,preprocessing_instance_count:2,"
                       "max_queue_delay_microseconds:100,max_queue_size:4,add_special_tokens:false,"
                       "multimodal_model_path:,engine_dir:/e,max_num_images:1,hf_model_path:/h")
    with pytest.raises(AssertionError, match="does not exist"):  # the helper is the real check
        fill_template(src, "no_such_key:1")


@pytest.mark.parametrize("params", [
    {"tokenizer": "${tokenizer}", "tokenizer_dir": "${tokenizer_dir}"},
    {"tokenizer": "", "tokenizer_dir": ""},
    {},
])
def test_unfilled_tokenizer_refuses_to_load(params):
    from toktier_backend.errors import UnsupportedTokenizer
    from toktier_backend.faces.trtllm import PreprocessingHandler

    with pytest.raises(UnsupportedTokenizer, match="tokenizer_dir"):
        PreprocessingHandler.from_parameters(params)


def test_tokenizer_parameters_conflict_and_default(hf_folder):
    from toktier_backend.errors import UnsupportedTokenizer
    from toktier_backend.faces.trtllm import PreprocessingHandler

    folder = hf_folder("llama3_1")
    with pytest.raises(UnsupportedTokenizer, match="different tokenizers"):
        PreprocessingHandler.from_parameters({"tokenizer": "default", "tokenizer_dir": str(folder)})
    with pytest.raises(UnsupportedTokenizer, match="multimodal"):
        PreprocessingHandler.from_parameters({"tokenizer_dir": str(folder), "multimodal_model_path": "/m"})
    h = PreprocessingHandler.from_parameters({"tokenizer": "default", "tokenizer_dir": "${tokenizer_dir}"})
    out = h.execute({"QUERY": _obj([["hello world"]]), "REQUEST_OUTPUT_LEN": np.array([[1]], np.int32)})
    assert out["INPUT_ID"].tolist() == [hf_ids("gpt2", "hello world")] == [[31373, 995]]  # named: served


@pytest.mark.parametrize("model", ["toktier_session", "toktier_encode"])
def test_unfilled_tokenizer_refuses_every_model(model):
    """The shipped toktier_session / toktier_encode configs, unfilled, refuse to load; ``default`` loads."""
    from toktier_backend.errors import UnsupportedTokenizer

    from ..serving.fake_pb_utils import load_model

    for params in ({}, {"tokenizer": ""}):
        with pytest.raises(UnsupportedTokenizer, match="'tokenizer'"):
            load_model(model, parameters={**params, "pool_workers": "1"})
    m = load_model(model, parameters={"tokenizer": "default", "pool_workers": "1", "verifier_rate": "0",
                                      "verifier_first_n": "0"})
    m.finalize()


def test_unit_prompt_table_extra_ids_and_multimodal(hf_folder):
    """OUT_PROMPT_TABLE_EXTRA_IDS as the original computes it: the row's extra id where the id is at or above
    HF's ``vocab_size`` (without added tokens: llama3_1's BOS 128000 and the pad/eos), else 0."""
    from toktier_backend.errors import InvalidRequest
    from toktier_backend.faces.trtllm import PreprocessingHandler

    folder = hf_folder("llama3_1")
    handler = PreprocessingHandler.from_parameters({"tokenizer_dir": str(folder)})
    orig = OriginalPreprocessing(folder)
    vocab_size = orig.tok.vocab_size
    texts = ["hello world", "a longer prompt<|eot_id|> here"]
    out = handler.execute({"QUERY": _obj([[t] for t in texts]), "REQUEST_OUTPUT_LEN": np.full((2, 1), 3, np.int32),
                           "PROMPT_TABLE_EXTRA_ID": np.array([[7], [2**40]], np.uint64)})
    ids, _ = orig.create_request(texts)
    want = np.zeros_like(ids, dtype=np.uint64)
    for i, e in enumerate((7, 2**40)):
        want[i] = np.where(ids[i] >= vocab_size, e, 0)
    got = out["OUT_PROMPT_TABLE_EXTRA_IDS"]
    assert got.dtype == np.uint64 and np.array_equal(got, want) and got[0, 0] == 7 and got[0, 1] == 0
    assert "OUT_PROMPT_TABLE_EXTRA_IDS" not in handler.execute(
        {"QUERY": _obj([["x"]]), "REQUEST_OUTPUT_LEN": np.array([[1]], np.int32)})
    with pytest.raises(InvalidRequest, match="PROMPT_TABLE_EXTRA_ID"):
        handler.execute({"QUERY": _obj([["x"]]), "REQUEST_OUTPUT_LEN": np.array([[1]], np.int32),
                         "PROMPT_TABLE_EXTRA_ID": np.array([[1, 2]], np.uint64)})
    with pytest.raises(InvalidRequest, match=r"IMAGE_URL.*text prompts only"):
        handler.execute({"QUERY": _obj([["x"]]), "REQUEST_OUTPUT_LEN": np.array([[1]], np.int32),
                         "IMAGE_URL": _obj([["http://x/y.png"]])})


# ---------------------------------------------------------------- L0: the real ensemble


def _client(server, protocol):
    if protocol == "grpc":
        import tritonclient.grpc as mod

        return mod, mod.InferenceServerClient(server.grpc_url)
    import tritonclient.http as mod

    return mod, mod.InferenceServerClient(server.http_url)


def _infer(mod, client, model, tensors: dict, **kw):
    inputs = []
    for name, arr in tensors.items():
        dtype = {np.object_: "BYTES", np.int32: "INT32", np.float32: "FP32", np.uint64: "UINT64",
                 np.uint8: "UINT8"}[arr.dtype.type]
        x = mod.InferInput(name, list(arr.shape), dtype)
        x.set_data_from_numpy(arr)
        inputs.append(x)
    return client.infer(model, inputs, **kw)


@pytest.mark.serving
@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_ensemble_full_encode_matches_hf_and_original(ensemble_server, protocol):
    mod, client = _client(ensemble_server, protocol)
    orig = OriginalPreprocessing(ensemble_server.folder)
    for text in TEXTS:
        r = _infer(mod, client, "ensemble", {"text_input": _obj([[text]]), "max_tokens": np.array([[16]], np.int32)})
        ids = r.as_numpy("output_ids").reshape(-1).tolist()  # the stand-in echoes the INPUT_ID it received
        assert ids == hf_ids("llama3_1", text) == orig.create_request([text])[0][0].tolist()
        assert ids[0] == 128000  # add_special_tokens defaults to true, as in the original
        assert r.as_numpy("sequence_length").reshape(-1).tolist() == [len(ids)]
        assert r.as_numpy("echo_input_lengths").reshape(-1).tolist() == [len(ids)]
        assert r.as_numpy("echo_request_output_len").reshape(-1).tolist() == [16]
        assert r.as_numpy("echo_end_id").reshape(-1).tolist() == [orig.end_id] == [128009]  # <|eot_id|>
        assert r.as_numpy("echo_pad_id").reshape(-1).tolist() == [orig.pad_id]
        assert r.as_numpy("echo_decoder_input_ids").reshape(-1).tolist() == [orig.pad_id]
        assert r.as_numpy("echo_bad_words_list").shape == (1, 2, 0)
        assert r.as_numpy("echo_embedding_bias").shape == (1, 0)
        assert r.as_numpy("preprocessing_route").reshape(-1).tolist() == [b"encode"]


@pytest.mark.serving
def test_ensemble_words_bias_and_ids(ensemble_server):
    mod, client = _client(ensemble_server, "grpc")
    orig = OriginalPreprocessing(ensemble_server.folder)
    bad, stop = [["hello", " world", "", "<|eot_id|>"]], [["\n\nUser:", "</s>"]]
    words, weights = [["hello", " there"]], [[0.5, -1.5]]
    r = _infer(mod, client, "ensemble", {
        "text_input": _obj([["hello there"]]), "max_tokens": np.array([[4]], np.int32),
        "bad_words": _obj(bad), "stop_words": _obj(stop),
        "embedding_bias_words": _obj(words), "embedding_bias_weights": np.array(weights, np.float32),
        "end_id": np.array([[7]], np.int32), "pad_id": np.array([[8]], np.int32),
        "decoder_text_input": _obj([["decoder side"]]),
    })
    assert np.array_equal(r.as_numpy("echo_bad_words_list"), orig.word_list(bad, 1))
    assert np.array_equal(r.as_numpy("echo_stop_words_list"), orig.word_list(stop, 1))
    assert np.array_equal(r.as_numpy("echo_embedding_bias"), orig.embedding_bias(words, weights, 1))
    assert r.as_numpy("echo_end_id").reshape(-1).tolist() == [7] and r.as_numpy("echo_pad_id").reshape(-1).tolist() == [8]
    assert r.as_numpy("echo_decoder_input_ids").reshape(-1).tolist() == hf_ids("llama3_1", "decoder side")
    assert r.as_numpy("echo_decoder_input_lengths").reshape(-1).tolist() == [len(hf_ids("llama3_1", "decoder side"))]


@pytest.mark.serving
@pytest.mark.parametrize("protocol,corr", [("grpc", 4242), ("http", "agent-7")])
def test_ensemble_correlation_id_repairs_sessions(ensemble_server, protocol, corr):
    """A correlation ID on the ensemble request reaches preprocessing (int and str, gRPC and HTTP): each turn
    of a resent agent conversation is repaired in that session, and every id still equals HF."""
    mod, client = _client(ensemble_server, protocol)
    turns = load_turns(trajectory_files()[1])[:10]
    routes = []
    for i, text in enumerate(turns):
        r = _infer(mod, client, "ensemble", {"text_input": _obj([[text]]), "max_tokens": np.array([[1]], np.int32)},
                   sequence_id=corr, sequence_start=(i == 0), sequence_end=(i == len(turns) - 1))
        assert r.as_numpy("output_ids").reshape(-1).tolist() == hf_ids("llama3_1", text)
        routes.append(r.as_numpy("preprocessing_route").reshape(-1)[0].decode())
        keep = int(r.as_numpy("preprocessing_keep").reshape(-1)[0])
        assert (keep == 0) if i == 0 else (keep > 0)
    assert routes[0] == "new" and sum(x in ("append", "edit") for x in routes[1:]) == len(turns) - 1, routes
    # END freed it: the same ID starts a new session
    r = _infer(mod, client, "ensemble", {"text_input": _obj([[turns[0]]]), "max_tokens": np.array([[1]], np.int32)},
               sequence_id=corr)
    assert r.as_numpy("preprocessing_route").reshape(-1).tolist() == [b"new"]


@pytest.mark.serving
def test_preprocessing_batch_and_errors(ensemble_server):
    """``preprocessing`` directly: a [2, 1] batch is right-padded as the original does; a bad request gets
    INVALID_ARG and the server keeps serving."""
    from tritonclient.utils import InferenceServerException

    mod, client = _client(ensemble_server, "grpc")
    orig = OriginalPreprocessing(ensemble_server.folder)
    texts = ["a longer prompt with several words", "short"]
    r = _infer(mod, client, "preprocessing", {"QUERY": _obj([[t] for t in texts]),
                                              "REQUEST_OUTPUT_LEN": np.array([[3], [3]], np.int32)})
    ids, lens = orig.create_request(texts)
    assert np.array_equal(r.as_numpy("INPUT_ID"), ids) and np.array_equal(r.as_numpy("REQUEST_INPUT_LEN"), lens)
    with pytest.raises(InferenceServerException) as e:
        _infer(mod, client, "preprocessing", {"QUERY": np.array([[b"\xc3\x28"]], dtype=object),
                                              "REQUEST_OUTPUT_LEN": np.array([[3]], np.int32)})
    assert "INVALID_ARG" in str(e.value.status()) and "InvalidRequest" in str(e.value)
    r = _infer(mod, client, "preprocessing", {"QUERY": _obj([["still serving"]]), "REQUEST_OUTPUT_LEN": np.array([[3]], np.int32)})
    assert r.as_numpy("INPUT_ID").reshape(-1).tolist() == hf_ids("llama3_1", "still serving")


# ---------------------------------------------------------------- the serving core behind the face


def test_faulty_engine_is_caught_and_quarantined_through_preprocessing(hf_folder, tmp_path):
    """A faulty engine build behind ``preprocessing``: the wrong ids of a session's turn go out once, the
    shadow verifier catches them, quarantines the fast routes; from then on every row (keyed or not) is exact,
    and the requests show in ``toktier_*`` under ``face="trtllm"``."""
    from toktier_backend.faces.trtllm import PreprocessingHandler

    from ..faulty_engine import TRIGGER
    from .conftest import faulty_core

    core, value = faulty_core(hf_folder("gpt2") / "tokenizer.json", tmp_path)
    handler = PreprocessingHandler(core)
    one = np.array([[1]], np.int32)
    first = "def pipeline(x):\n    return x\n"
    out = handler.execute({"QUERY": _obj([[first]]), "REQUEST_OUTPUT_LEN": one}, correlation_id=77, start=True)
    assert out["INPUT_ID"][0].tolist() == hf_ids("gpt2", first) and out["ROUTE"][0, 0] == b"new"
    second = first + f"# {TRIGGER} marker"
    out = handler.execute({"QUERY": _obj([[second]]), "REQUEST_OUTPUT_LEN": one}, correlation_id=77)
    assert out["ROUTE"][0, 0] == b"append"
    assert out["INPUT_ID"][0].tolist() != hf_ids("gpt2", second)  # the fault is real and went out
    assert core.verifier.drain(30) and core.verifier.mismatches == 1
    assert set(core.tokenizer.quarantined) == {"full", "append", "edit"}
    assert value("toktier_verifier_mismatches_total", face="trtllm", model="preprocessing", route="append") == 1
    assert value("toktier_quarantined_routes", face="trtllm", model="preprocessing") == 3
    # after the quarantine: the session is rebuilt from the reference, stateless rows are exact too
    third = second + "\nprint(pipeline(1))"
    out = handler.execute({"QUERY": _obj([[third]]), "REQUEST_OUTPUT_LEN": one}, correlation_id=77, end=True)
    assert out["INPUT_ID"][0].tolist() == hf_ids("gpt2", third)
    texts = [f"{TRIGGER} one", f"two {TRIGGER}"]
    out = handler.execute({"QUERY": _obj([[t] for t in texts]), "REQUEST_OUTPUT_LEN": np.array([[1], [1]], np.int32)})
    for i, t in enumerate(texts):
        assert out["INPUT_ID"][i, : out["REQUEST_INPUT_LEN"][i, 0]].tolist() == hf_ids("gpt2", t)
    assert core.verifier.drain(30) and core.verifier.mismatches == 1
    assert value("toktier_requests_total", face="trtllm", model="preprocessing", mode="full") == 3
    assert value("toktier_requests_total", face="trtllm", model="preprocessing", route="encode") == 2
    assert value("toktier_verifier_samples_total", face="trtllm", model="preprocessing", result="match") == 4
    with pytest.raises(Exception, match="REQUEST_OUTPUT_LEN"):
        handler.execute({"QUERY": _obj([["x"]])})
    assert value("toktier_request_errors_total", face="trtllm", model="preprocessing", code="INVALID_ARG") == 1
    assert 77 not in core.store  # END freed it
    core.close()


@pytest.mark.serving
def test_ensemble_requests_show_in_toktier_metrics(ensemble_server):
    """``preprocessing`` inside tritonserver goes through the serving core: its requests (keyed and not) and
    the shadow verifier's checks of them are in the scraped ``toktier_*`` metrics under ``face="trtllm"``."""
    import time

    from toktier_backend.serving.metrics import metric, scrape

    mod, client = _client(ensemble_server, "grpc")
    url = ensemble_server.toktier_metrics_url
    before = scrape(url)
    texts = ["metrics through the ensemble", "metrics through the ensemble, next turn"]
    for i, text in enumerate(texts):
        r = _infer(mod, client, "ensemble", {"text_input": _obj([[text]]), "max_tokens": np.array([[1]], np.int32)},
                   sequence_id="metrics-1", sequence_start=i == 0, sequence_end=i == len(texts) - 1)
        assert r.as_numpy("output_ids").reshape(-1).tolist() == hf_ids("llama3_1", text)
    r = _infer(mod, client, "ensemble", {"text_input": _obj([["no session"]]), "max_tokens": np.array([[1]], np.int32)})
    assert r.as_numpy("output_ids").reshape(-1).tolist() == hf_ids("llama3_1", "no session")

    def delta(samples, name, **labels):
        return metric(samples, name, face="trtllm", model="preprocessing", **labels) - \
            metric(before, name, face="trtllm", model="preprocessing", **labels)

    deadline = time.monotonic() + 30
    while True:  # the verifier checks every reply here (verifier_rate 1.0), off the request path
        after = scrape(url)
        if delta(after, "toktier_verifier_samples_total") >= 3 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert delta(after, "toktier_requests_total", mode="full") == 2
    assert delta(after, "toktier_requests_total", mode="encode", route="encode") == 1
    assert delta(after, "toktier_verifier_samples_total", result="match") == 3
    assert metric(after, "toktier_verifier_samples_total", face="trtllm", result="mismatch") == 0
    assert metric(after, "toktier_quarantined_routes", face="trtllm") == 0


@pytest.mark.serving
def test_ensemble_upstream_mapping_prompt_table_extra_id_and_multimodal(ensemble_server):
    """The example ensemble wires every preprocessing tensor of TensorRT-LLM's own text-only ensemble
    (PROMPT_TABLE_EXTRA_ID -> OUT_PROMPT_TABLE_EXTRA_IDS -> tensorrt_llm's prompt_table_extra_ids): it loads
    with our model in place, and the stand-in receives the tensors the original computes; a multimodal
    input gets INVALID_ARG."""
    from tritonclient.utils import InferenceServerException

    mod, client = _client(ensemble_server, "grpc")
    orig = OriginalPreprocessing(ensemble_server.folder)
    text = "hello<|eot_id|> world"
    r = _infer(mod, client, "ensemble", {"text_input": _obj([[text]]), "max_tokens": np.array([[2]], np.int32),
                                         "prompt_table_extra_id": np.array([[99]], np.uint64)})
    ids = orig.create_request([text])[0][0]
    assert r.as_numpy("output_ids").reshape(-1).tolist() == ids.tolist()
    got = r.as_numpy("echo_prompt_table_extra_ids")
    assert got.dtype == np.uint64
    assert got.reshape(-1).tolist() == np.where(ids >= orig.tok.vocab_size, 99, 0).tolist()
    assert got.reshape(-1).tolist().count(99) == 2  # BOS and <|eot_id|>
    r = _infer(mod, client, "ensemble", {"text_input": _obj([[text]]), "max_tokens": np.array([[2]], np.int32)})
    assert r.as_numpy("echo_prompt_table_extra_ids").size == 0  # not sent: not produced (as the original)
    with pytest.raises(InferenceServerException) as e:
        _infer(mod, client, "preprocessing", {"QUERY": _obj([["x"]]), "REQUEST_OUTPUT_LEN": np.array([[1]], np.int32),
                                              "IMAGE_BYTES": np.zeros((1, 1, 2, 2, 3), np.uint8)})
    assert "INVALID_ARG" in str(e.value.status()) and "text prompts only" in str(e.value)
