"""Triton Python backend model ``toktier_encode``: stateless encode under the dynamic batcher.

Inputs (batch dimension first, one element per request):
    TEXT               TYPE_STRING [1]  UTF-8 text
    ADD_SPECIAL_TOKENS TYPE_BOOL   [1]  optional, default true
Outputs:
    INPUT_ID           TYPE_INT32  [-1] equals HF encode(text, add_special_tokens).ids
    REQUEST_INPUT_LEN  TYPE_INT32  [1]  number of ids

Errors are per request: INVALID_ARG (not UTF-8, lone surrogate, over max_text_bytes), UNAVAILABLE, INTERNAL.
An instance of kind GPU routes fresh texts above ``gpu_crossover_chars`` to the GPU engine on its device
(``gpu_engine`` "auto"; CPU fallback, never a failed load: ``toktier_backend.gpu.routing``); CPU instances
take the overflow. All logic is in ``toktier_backend.faces.triton``.
"""

import json

import triton_python_backend_utils as pb_utils

from toktier_backend.faces import triton_io
from toktier_backend.faces.triton import Handler


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        params = triton_io.model_parameters(config)
        self.batched = triton_io.is_batched(config)
        # tokenizer (+ sha256 pin), size limit, shadow verifier, GPU router: see model_repository/README.md
        self.handler = Handler.from_parameters(
            params, model="toktier_encode", instance_kind=args.get("model_instance_kind", "CPU"),
            device_id=int(args.get("model_instance_device_id") or 0),
        )

    def execute(self, requests):
        # the whole request list in one call: a GPU instance encodes its GPU share in one device pass
        batch = [triton_io.read_inputs(lambda n, r=r: pb_utils.get_input_tensor_by_name(r, n), triton_io.ENCODE_INPUTS)
                 for r in requests]
        responses = []
        for result in self.handler.handle_encode_batch(batch):
            if isinstance(result, Exception):  # one bad request never fails the batch
                code = getattr(pb_utils.TritonError, triton_io.error_code(result))
                error = pb_utils.TritonError(triton_io.error_message(result), code)
                responses.append(pb_utils.InferenceResponse(error=error))
            else:
                tensors = [pb_utils.Tensor(k, v) for k, v in triton_io.with_batch_dim(result, self.batched).items()]
                responses.append(pb_utils.InferenceResponse(output_tensors=tensors))
        return responses

    def finalize(self):
        if self.handler is not None:
            self.handler.close()  # stops the shadow verifier's thread
        self.handler = None
