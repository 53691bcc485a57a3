"""Triton Python backend model ``toktier_encode_fast``: a plain stateless encode on the fastest exact engine.

Inputs (batch dimension first, one element per request):
    TEXT               TYPE_STRING [1]  UTF-8 text
    ADD_SPECIAL_TOKENS TYPE_BOOL   [1]  optional, default true
Outputs:
    INPUT_ID           TYPE_INT32  [-1] fastokens ``encode_batch_flat([text], add_special_tokens)`` ids
                                        (gigatoken body ids for files fastokens cannot load)
    REQUEST_INPUT_LEN  TYPE_INT32  [1]  number of ids

The baseline a user would deploy instead of toktier_backend: one engine call on the whole text per request,
no session, no prefix index, no guard set. Its replies are checked against HF ``tokenizers`` by whoever
measures it (``toktier demo``, ``load/capacity.py``), never trusted. Input parsing and errors go through
``toktier_backend.faces.triton_io`` like ``toktier_encode``.
"""

import json

import numpy as np
import triton_python_backend_utils as pb_utils

from toktier_backend.errors import InvalidRequest, UnsupportedTokenizer
from toktier_backend.faces import triton_io
from toktier_backend.tokenizer import tokenizer_path


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        params = triton_io.model_parameters(config)
        path = str(tokenizer_path(params.get("tokenizer", "default")))
        self.max_text_bytes = int(params.get("max_text_bytes") or 16777216)
        self.batched = triton_io.is_batched(config)
        self.fastokens = self.gigatoken = None
        try:
            import fastokens

            self.fastokens = fastokens.Tokenizer.from_file(path)
            self.fastokens.enable_segment_cache(0)  # as engines/fastokens.py: no cache of repeated text
        except Exception:  # noqa: BLE001 - cl100k_base / o200k_base: fastokens cannot load them
            import tokenizers

            from toktier_backend.engines import registry

            post = tokenizers.Tokenizer.from_file(path).post_processor
            if post is not None and post.num_special_tokens_to_add(False):
                raise UnsupportedTokenizer(f"{path}: fastokens cannot load it and gigatoken has no post-processor")
            self.gigatoken = registry.create("gigatoken", path)

    def _encode(self, text: str, flag: bool) -> np.ndarray:
        if self.fastokens is not None:
            buf, _offsets = self.fastokens.encode_batch_flat([text], add_special_tokens=flag)
            return np.frombuffer(buf, dtype="<u4").view(np.int32)
        return np.asarray(self.gigatoken.encode(text), dtype=np.int32)

    def execute(self, requests):
        responses = []
        for request in requests:
            try:
                args = triton_io.encode_args(
                    triton_io.read_inputs(lambda n: pb_utils.get_input_tensor_by_name(request, n), triton_io.ENCODE_INPUTS)
                )
                raw = args["text"]
                if len(raw) > self.max_text_bytes:
                    raise InvalidRequest(f"TEXT is {len(raw)} bytes, over max_text_bytes={self.max_text_bytes}.")
                try:
                    text = raw.decode("utf-8") if isinstance(raw, (bytes, bytearray)) else raw
                except UnicodeDecodeError as e:
                    raise InvalidRequest(f"TEXT is not UTF-8: {e}") from None
                flag = True if args.get("add_special") is None else bool(args["add_special"])
                ids = self._encode(text, flag)
                outputs = {"INPUT_ID": ids, "REQUEST_INPUT_LEN": np.array([len(ids)], dtype=np.int32)}
                tensors = [pb_utils.Tensor(k, v) for k, v in triton_io.with_batch_dim(outputs, self.batched).items()]
                responses.append(pb_utils.InferenceResponse(output_tensors=tensors))
            except Exception as e:  # one bad request never fails the batch
                code = getattr(pb_utils.TritonError, triton_io.error_code(e))
                responses.append(pb_utils.InferenceResponse(error=pb_utils.TritonError(triton_io.error_message(e), code)))
        return responses

    def finalize(self):
        self.fastokens = self.gigatoken = None
