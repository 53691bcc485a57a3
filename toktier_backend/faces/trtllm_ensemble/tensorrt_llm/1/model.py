"""CPU stand-in for TensorRT-LLM's ``tensorrt_llm`` model (example and test fixture only).

Inputs (batch dimension first, one row per request): ``input_ids`` INT32 [-1], ``input_lengths`` INT32 [1],
``request_output_len`` INT32 [-1], optional ``end_id``/``pad_id``/``decoder_input_lengths`` INT32 [1],
``decoder_input_ids`` INT32 [-1], ``bad_words_list``/``stop_words_list`` INT32 [2, -1], ``embedding_bias``
FP32 [-1], ``prompt_table_extra_ids`` UINT64 [-1].
Outputs: ``output_ids`` INT32 [1, n] = ``input_ids[:input_lengths]`` (beam 1: the prompt, "generated"
back), ``sequence_length`` INT32 [1] = n, and ``echo_<input>`` = each input as received (absent optional
inputs: ``-1`` for scalars, an empty tensor otherwise).
"""

import numpy as np
import triton_python_backend_utils as pb_utils

_SCALARS = ("input_lengths", "end_id", "pad_id", "decoder_input_lengths")
_OTHERS = {
    "request_output_len": (np.int32, (0,)),
    "decoder_input_ids": (np.int32, (0,)),
    "bad_words_list": (np.int32, (2, 0)),
    "stop_words_list": (np.int32, (2, 0)),
    "embedding_bias": (np.float32, (0,)),
    "prompt_table_extra_ids": (np.uint64, (0,)),
}


class TritonPythonModel:
    def initialize(self, args):
        pass

    def execute(self, requests):
        responses = []
        for request in requests:
            def get(name):
                t = pb_utils.get_input_tensor_by_name(request, name)
                return None if t is None else t.as_numpy()

            ids = get("input_ids")[0]
            n = int(np.asarray(get("input_lengths")).reshape(-1)[0])
            out = {
                "output_ids": ids[:n].reshape(1, 1, n).astype(np.int32),
                "sequence_length": np.array([[n]], dtype=np.int32),
            }
            for name in _SCALARS:
                v = get(name)
                out["echo_" + name] = np.array([[-1 if v is None else int(np.asarray(v).reshape(-1)[0])]], dtype=np.int32)
            for name, (dtype, empty) in _OTHERS.items():
                v = get(name)
                out["echo_" + name] = (np.zeros((1, *empty), dtype) if v is None else np.asarray(v[:1], dtype=dtype))
            responses.append(pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor(k, v) for k, v in out.items()]))
        return responses
