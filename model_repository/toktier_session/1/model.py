"""Triton Python backend model ``toktier_session``: stateful tokenization under the sequence batcher.

Inputs (batch dimension first, one element per request; exactly one of TEXT and MESSAGES):
    TEXT               TYPE_STRING [1]  UTF-8: the whole text (MODE=full) or the appended text (MODE=delta)
    MODE               TYPE_STRING [1]  optional, "full" (default) | "delta" (TEXT: the appended text;
                                    MESSAGES: the messages after the previous request's)
    REPLY              TYPE_STRING [1]  optional, "full" (default) | "patch"
    ADD_SPECIAL_TOKENS TYPE_BOOL   [1]  optional, default true for TEXT, false for MESSAGES
    MESSAGES           TYPE_STRING [1]  optional, UTF-8 JSON array of chat messages (the whole conversation,
                                    or with MODE=delta the new ones)
    ADD_GENERATION_PROMPT TYPE_BOOL [1] optional, default false (MESSAGES only)
    CHAT_TEMPLATE_KWARGS TYPE_STRING [1] optional, JSON object: tools, documents, continue_final_message,
                                    template variables (MESSAGES only)
Outputs:
    INPUT_ID           TYPE_INT32  [-1] all ids, or ids[KEEP:] with REPLY=patch
    REQUEST_INPUT_LEN  TYPE_INT32  [1]  total ids of the session text
    KEEP               TYPE_INT32  [1]  ids of the previous reply still valid
    ROUTE              TYPE_STRING [1]  repair route taken

The session is keyed by ``request.correlation_id()`` (int or str); the START flag replaces it, END frees it.
Errors are per request: INVALID_ARG (bad input), NOT_FOUND (delta for an unknown session: resend MODE=full),
UNAVAILABLE, INTERNAL. All logic is in ``toktier_backend.faces.triton``.
"""

import json

import triton_python_backend_utils as pb_utils

from toktier_backend.faces import triton_io
from toktier_backend.faces.triton import DEFAULT_SESSION_TTL_S, Handler


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        params = triton_io.model_parameters(config)
        self.batched = triton_io.is_batched(config)
        # tokenizer (+ sha256 pin), size limits, session budget, shadow verifier: see model_repository/README.md
        self.handler = Handler.from_parameters(
            params, session_ttl_s=triton_io.sequence_idle_seconds(config, DEFAULT_SESSION_TTL_S), model="toktier_session"
        )

    def execute(self, requests):
        responses = []
        for request in requests:
            flags = request.flags()
            try:
                outputs = self.handler.handle_session_tensors(
                    request.correlation_id(),
                    triton_io.read_inputs(lambda n: pb_utils.get_input_tensor_by_name(request, n), triton_io.SESSION_INPUTS),
                    start=bool(flags & triton_io.SEQUENCE_START),
                    end=bool(flags & triton_io.SEQUENCE_END),
                )
                tensors = [pb_utils.Tensor(k, v) for k, v in triton_io.with_batch_dim(outputs, self.batched).items()]
                responses.append(pb_utils.InferenceResponse(output_tensors=tensors))
            except Exception as e:  # one bad request never fails the batch
                code = getattr(pb_utils.TritonError, triton_io.error_code(e))
                responses.append(pb_utils.InferenceResponse(error=pb_utils.TritonError(triton_io.error_message(e), code)))
        return responses

    def finalize(self):
        if self.handler is not None:
            self.handler.close()  # stops the shadow verifier's thread
        self.handler = None
