"""Triton Python backend model ``preprocessing``: the TensorRT-LLM ensemble's preprocessing, exact.

Inputs (batch dimension first):
    QUERY TYPE_STRING [1]; REQUEST_OUTPUT_LEN TYPE_INT32 [1]; optional DECODER_QUERY TYPE_STRING [1],
    BAD_WORDS_DICT / STOP_WORDS_DICT / EMBEDDING_BIAS_WORDS TYPE_STRING [-1], EMBEDDING_BIAS_WEIGHTS TYPE_FP32 [-1],
    END_ID / PAD_ID TYPE_INT32 [1]
Outputs:
    INPUT_ID TYPE_INT32 [-1] (HF encode(QUERY, add_special_tokens).ids), REQUEST_INPUT_LEN [1],
    DECODER_INPUT_ID [-1], REQUEST_DECODER_INPUT_LEN [1], BAD_WORDS_IDS / STOP_WORDS_IDS [2, -1],
    EMBEDDING_BIAS TYPE_FP32 [-1], REQUEST_OUTPUT_LEN [-1], OUT_END_ID / OUT_PAD_ID [1]

A request with a correlation ID is repaired in that ID's session (START replaces it, END frees it); without
one it is a full encode. Errors are per request (INVALID_ARG, UNAVAILABLE, INTERNAL). All logic is in
``toktier_backend.faces.trtllm``.
"""

import json

import triton_python_backend_utils as pb_utils

from toktier_backend.faces.trtllm import INPUTS, PreprocessingHandler
from toktier_backend.faces import triton_io


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        self.handler = PreprocessingHandler.from_parameters(triton_io.model_parameters(config))

    def execute(self, requests):
        responses = []
        for request in requests:
            flags = request.flags()
            try:
                outputs = self.handler.execute(
                    triton_io.read_inputs(lambda n: pb_utils.get_input_tensor_by_name(request, n), INPUTS),
                    correlation_id=request.correlation_id(),
                    start=bool(flags & triton_io.SEQUENCE_START),
                    end=bool(flags & triton_io.SEQUENCE_END),
                )
                tensors = [pb_utils.Tensor(k, v) for k, v in outputs.items()]
                responses.append(pb_utils.InferenceResponse(output_tensors=tensors))
            except Exception as e:  # one bad request never fails the batch
                code = getattr(pb_utils.TritonError, triton_io.error_code(e))
                responses.append(pb_utils.InferenceResponse(error=pb_utils.TritonError(triton_io.error_message(e), code)))
        return responses

    def finalize(self):
        if self.handler is not None:
            self.handler.core.close()  # stops the shadow verifier's and the session sweeper's threads
        self.handler = None
