# SPDX-License-Identifier: MPL-2.0
"""An MLServer runtime that runs an ONNX model with onnxruntime: the KServe v2 server that
tests/kserve.rs starts on loopback. `parameters.extra` in model-settings.json: `delay_ms` makes
every answer after the first `fast_requests` that late (a server that slows down); `record_file` names a file the runtime keeps a JSON
record in: the most requests it had at once, and the datatype of the last input it got;
while the file `fail_file` names exists, every request fails."""

import asyncio
import json
import os

import numpy as np
import onnxruntime as ort
from mlserver import MLModel
from mlserver.codecs import NumpyCodec
from mlserver.types import InferenceRequest, InferenceResponse
from mlserver.utils import get_model_uri


class OnnxModel(MLModel):
    async def load(self) -> bool:
        self._session = ort.InferenceSession(
            await get_model_uri(self._settings), providers=["CPUExecutionProvider"]
        )
        extra = self._settings.parameters.extra or {}
        self._delay = float(extra.get("delay_ms", 0)) / 1000
        self._fast = int(extra.get("fast_requests", 0))
        self._requests = 0
        self._record_file = extra.get("record_file")
        self._fail_file = extra.get("fail_file")
        self._active = self._most = 0
        return True

    async def predict(self, payload: InferenceRequest) -> InferenceResponse:
        self._active += 1
        self._most = max(self._most, self._active)
        if self._record_file:
            record = {"most_at_once": self._most, "input_datatype": payload.inputs[0].datatype}
            with open(self._record_file, "w") as f:
                json.dump(record, f)
        try:
            if self._fail_file and os.path.exists(self._fail_file):
                raise RuntimeError("failing on purpose: " + self._fail_file)
            self._requests += 1
            if self._delay and self._requests > self._fast:
                await asyncio.sleep(self._delay)
            return self._run(payload)
        finally:
            self._active -= 1

    def _run(self, payload: InferenceRequest) -> InferenceResponse:
        # A model declared FP16 in model-settings.json takes FP16 on the wire; the ONNX model
        # itself may compute in FP32.
        types = {i.name: i.type for i in self._session.get_inputs()}
        feeds = {
            i.name: NumpyCodec.decode_input(i).astype(
                np.float16 if types[i.name] == "tensor(float16)" else np.float32
            )
            for i in payload.inputs
        }
        names = [o.name for o in self._session.get_outputs()]
        outputs = self._session.run(names, feeds)
        return InferenceResponse(
            model_name=self.name,
            outputs=[
                NumpyCodec.encode_output(n, np.ascontiguousarray(a))
                for n, a in zip(names, outputs)
            ],
        )
