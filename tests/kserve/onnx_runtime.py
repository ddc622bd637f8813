# SPDX-License-Identifier: MPL-2.0
"""An MLServer runtime that runs an ONNX model with onnxruntime: the KServe v2 server that
tests/kserve.rs starts on loopback. `parameters.extra.delay_ms` in model-settings.json makes
every answer that late (a slow server)."""

import asyncio

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
        return True

    async def predict(self, payload: InferenceRequest) -> InferenceResponse:
        if self._delay:
            await asyncio.sleep(self._delay)
        feeds = {i.name: NumpyCodec.decode_input(i) for i in payload.inputs}
        names = [o.name for o in self._session.get_outputs()]
        outputs = self._session.run(names, feeds)
        return InferenceResponse(
            model_name=self.name,
            outputs=[
                NumpyCodec.encode_output(n, np.ascontiguousarray(a))
                for n, a in zip(names, outputs)
            ],
        )
