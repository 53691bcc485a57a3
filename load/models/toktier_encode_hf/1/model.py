"""Triton Python backend model ``toktier_encode_hf``: the load tests' stateless CPU baseline.

Inputs (batch dimension first, one element per request):
    TEXT               TYPE_STRING [1]  UTF-8 text
    ADD_SPECIAL_TOKENS TYPE_BOOL   [1]  optional, default true
Outputs:
    INPUT_ID           TYPE_INT32  [-1] HF ``Tokenizer.from_file(path).encode(text, add_special_tokens).ids``
    REQUEST_INPUT_LEN  TYPE_INT32  [1]  number of ids

What a conventional tokenization frontend does: the reference encode of the whole text on every request.
Input parsing and errors go through ``toktier_backend.faces.triton_io`` like ``toktier_encode``.
"""

import json
from pathlib import Path

import numpy as np
import tokenizers
import triton_python_backend_utils as pb_utils

from toktier_backend.faces import triton_io


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        params = triton_io.model_parameters(config)
        spec = params.get("tokenizer", "default")
        if spec in ("", "default"):
            import toktier_backend as tt

            spec = str(tt.default_tokenizer_path())
        path = Path(spec) / "tokenizer.json" if Path(spec).is_dir() else Path(spec)
        self.reference = tokenizers.Tokenizer.from_file(str(path))
        self.batched = triton_io.is_batched(config)

    def execute(self, requests):
        responses = []
        for request in requests:
            try:
                args = triton_io.encode_args(
                    triton_io.read_inputs(lambda n: pb_utils.get_input_tensor_by_name(request, n), triton_io.ENCODE_INPUTS)
                )
                text = args["text"]
                text = text.decode("utf-8") if isinstance(text, (bytes, bytearray)) else text
                flag = True if args.get("add_special") is None else bool(args["add_special"])
                ids = np.asarray(self.reference.encode(text, add_special_tokens=flag).ids, dtype=np.int32)
                outputs = {"INPUT_ID": ids, "REQUEST_INPUT_LEN": np.array([len(ids)], dtype=np.int32)}
                tensors = [pb_utils.Tensor(k, v) for k, v in triton_io.with_batch_dim(outputs, self.batched).items()]
                responses.append(pb_utils.InferenceResponse(output_tensors=tensors))
            except Exception as e:  # one bad request never fails the batch
                code = getattr(pb_utils.TritonError, triton_io.error_code(e))
                responses.append(pb_utils.InferenceResponse(error=pb_utils.TritonError(triton_io.error_message(e), code)))
        return responses

    def finalize(self):
        self.reference = None
