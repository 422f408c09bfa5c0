"""Error feedback: keep what compression lost and add it to the next gradient (1-bit SGD, EF-SGD).

``ErrorFeedback(codec)`` is itself a codec. For each key (one per bucket and phase of the
compressed all-reduce) it keeps ``r = y - decode(encode(y))`` where ``y = x + r_prev``, so over T
steps the sum of what was sent equals the sum of the gradients minus the final residual.
Non-finite residuals are dropped (set to 0) so one overflow cannot poison later steps.
"""
from __future__ import annotations

from typing import Any, Dict, Tuple

from ..ops.base import Tensor, TensorOps
from .codecs import Codec


class ErrorFeedback(Codec):
    def __init__(self, codec: Codec) -> None:
        if not isinstance(codec, Codec):
            raise TypeError(f"error_feedback wraps a codec, got {codec!r}")
        if isinstance(codec, ErrorFeedback):
            raise ValueError("error_feedback is already applied to this codec")
        self.codec = codec
        self.name = f"{codec.name}+ef"
        self.summable = codec.summable
        self.lossless = codec.lossless
        self._residuals: Dict[str, Tensor] = {}

    def padded_cols(self, cols: int) -> int:
        return self.codec.padded_cols(cols)

    def block_width(self, cols: int) -> int:
        return self.codec.block_width(cols)

    def encode(self, ops: TensorOps, x: Tensor, *, key: str, seed: Any) -> Tuple[Tensor, Any]:
        held = self._residuals.get(key)
        residual = ops.read(held) if held is not None else None
        if residual is not None and ops.shape(residual) != ops.shape(x):
            held = residual = None  # the bucket layout changed (parameters frozen or added): start afresh
        if residual is not None:
            moved = ops.move_like(residual, x)  # loaded with map_location="cpu": back to the bucket's device
            if moved is not residual:
                held = residual = self._residuals[key] = ops.new_state(moved)
        # One pass where the codec has a fused kernel: it may update the residual in place.
        payload, ctx, error = self.codec.encode_ef(ops, x, residual, key=key, seed=seed)
        if held is None:
            self._residuals[key] = ops.new_state(error)
        elif error is not residual:
            ops.assign(held, error)
        return payload, ctx

    def decode(self, ops: TensorOps, payload: Tensor, ctx: Any) -> Tensor:
        return self.codec.decode(ops, payload, ctx)

    def decode_sum(self, ops: TensorOps, payload: Tensor, ctx: Any, scale: float = 1.0) -> Tensor:
        return self.codec.decode_sum(ops, payload, ctx, scale)

    def residual(self, key: str) -> Any:
        """The residual kept for ``key`` (None before its first step)."""
        return self._residuals.get(key)

    def state_dict(self) -> Dict[str, Any]:
        return {"residuals": dict(self._residuals)}

    def load_state_dict(self, state: Dict[str, Any], ops: TensorOps) -> None:
        self._residuals = {k: ops.new_state(v) for k, v in state.get("residuals", {}).items()}
