"""A stand-in for ``triton_python_backend_utils`` so tests drive ``model_repository/*/1/model.py`` without a
server: :func:`load_model` imports a model.py against this module and calls ``initialize`` with the ``args``
the Python backend passes (``model_config`` JSON, ``model_instance_kind``, ``model_instance_device_id``).

Only what our model.py files use: ``Tensor``, ``InferenceResponse``, ``TritonError`` (codes as attributes),
``get_input_tensor_by_name``. Requests are :class:`FakeRequest` objects holding numpy inputs.
"""

from __future__ import annotations

import importlib.util
import json
import re
import sys
import types
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
MODEL_REPOSITORY = REPO / "model_repository"


class Tensor:
    def __init__(self, name: str, array):
        self._name, self._array = name, np.asarray(array)

    def name(self) -> str:
        return self._name

    def as_numpy(self) -> np.ndarray:
        return self._array


class TritonError(Exception):
    UNKNOWN, INTERNAL, NOT_FOUND, INVALID_ARG, UNAVAILABLE, UNSUPPORTED, ALREADY_EXISTS, CANCELLED = range(8)

    def __init__(self, msg: str, code: int = 1):
        super().__init__(msg)
        self._msg, self._code = msg, code

    def message(self) -> str:
        return self._msg

    def code(self) -> int:
        return self._code


class InferenceResponse:
    def __init__(self, output_tensors=None, error=None):
        self.output_tensors = list(output_tensors or [])
        self.error = error

    def has_error(self) -> bool:
        return self.error is not None

    def output(self, name: str) -> np.ndarray:
        return next(t.as_numpy() for t in self.output_tensors if t.name() == name)


class FakeRequest:
    """One request: ``inputs`` maps tensor names to numpy arrays (absent optional inputs left out)."""

    def __init__(self, inputs: dict[str, np.ndarray]):
        self.inputs = inputs


def get_input_tensor_by_name(request: FakeRequest, name: str):
    a = request.inputs.get(name)
    return None if a is None else Tensor(name, a)


def encode_request(text: bytes | str, add_special: bool | None = None) -> FakeRequest:
    """A ``toktier_encode`` request with the batch dimension (``TEXT`` [1, 1], ``ADD_SPECIAL_TOKENS`` [1, 1])."""
    data = text.encode("utf-8") if isinstance(text, str) else text
    inputs = {"TEXT": np.array([[data]], dtype=np.object_)}
    if add_special is not None:
        inputs["ADD_SPECIAL_TOKENS"] = np.array([[add_special]], dtype=bool)
    return FakeRequest(inputs)


def _module() -> types.ModuleType:
    m = types.ModuleType("triton_python_backend_utils")
    for name in ("Tensor", "TritonError", "InferenceResponse", "get_input_tensor_by_name"):
        setattr(m, name, globals()[name])
    return m


def model_config(model: str, parameters: dict[str, str] | None = None) -> dict:
    """The parts of the model's shipped ``config.pbtxt`` our model.py reads, as Triton's JSON would give them:
    ``name``, ``max_batch_size``, ``parameters`` (``{key: {"string_value": v}}``, ``parameters`` overriding)."""
    text = (MODEL_REPOSITORY / model / "config.pbtxt").read_text()
    text = "\n".join(line.split("#", 1)[0] for line in text.splitlines())  # comments out
    params = dict(re.findall(r'\{\s*key:\s*"([^"]+)"\s*value:\s*\{\s*string_value:\s*"([^"]*)"\s*\}\s*\}', text))
    params.update(parameters or {})
    batch = re.search(r"^max_batch_size:\s*(\d+)", text, re.MULTILINE)
    return {"name": model, "max_batch_size": int(batch.group(1)) if batch else 0,
            "parameters": {k: {"string_value": v} for k, v in params.items()}}


def load_model(model: str, *, parameters: dict[str, str] | None = None, kind: str = "CPU", device_id: int = 0):
    """Import ``model_repository/<model>/1/model.py`` against this stand-in and return an initialized
    ``TritonPythonModel`` (``kind`` "CPU" or "GPU", as Triton's ``model_instance_kind``)."""
    path = MODEL_REPOSITORY / model / "1" / "model.py"
    saved = sys.modules.get("triton_python_backend_utils")
    sys.modules["triton_python_backend_utils"] = _module()
    try:
        spec = importlib.util.spec_from_file_location(f"_fake_triton_{model}", path)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
    finally:
        if saved is None:
            sys.modules.pop("triton_python_backend_utils", None)
        else:
            sys.modules["triton_python_backend_utils"] = saved
    instance = mod.TritonPythonModel()
    instance.initialize({
        "model_config": json.dumps(model_config(model, parameters)),
        "model_instance_kind": kind,
        "model_instance_device_id": str(device_id),
        "model_repository": str(MODEL_REPOSITORY / model),
        "model_version": "1",
        "model_name": model,
    })
    return instance
