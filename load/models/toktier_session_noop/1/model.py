"""Triton Python backend model ``toktier_session_noop``: the serving floor (``load/capacity.py`` route ``noop``).

Inputs and outputs as ``toktier_session`` (TEXT or MESSAGES, optional MODE, REPLY, ADD_SPECIAL_TOKENS, chat inputs; INPUT_ID,
REQUEST_INPUT_LEN, KEEP, ROUTE), under the same sequence batcher. ``execute`` reads every input tensor of
each request (as ``toktier_session`` does, through ``triton_io.read_inputs``) and answers a constant:
``INPUT_ID`` int32[0], ``REQUEST_INPUT_LEN`` [0], ``KEEP`` [0], ``ROUTE`` [b"noop"]. No tokenizer is loaded.
"""

import json

import numpy as np
import triton_python_backend_utils as pb_utils

from toktier_backend.faces import triton_io


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        outputs = {"INPUT_ID": np.zeros(0, dtype=np.int32), "REQUEST_INPUT_LEN": np.zeros(1, dtype=np.int32),
                   "KEEP": np.zeros(1, dtype=np.int32), "ROUTE": np.array([b"noop"], dtype=np.object_)}
        self.outputs = triton_io.with_batch_dim(outputs, triton_io.is_batched(config))

    def execute(self, requests):
        responses = []
        for request in requests:
            triton_io.read_inputs(lambda n: pb_utils.get_input_tensor_by_name(request, n), triton_io.SESSION_INPUTS)
            tensors = [pb_utils.Tensor(k, v) for k, v in self.outputs.items()]
            responses.append(pb_utils.InferenceResponse(output_tensors=tensors))
        return responses
