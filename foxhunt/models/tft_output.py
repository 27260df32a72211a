"""The TFT's output, shared by the network and its inference form."""

from __future__ import annotations

from typing import NamedTuple

from torch import Tensor


class TFTOutput(NamedTuple):
    """Forecast quantiles with everything needed to interpret them."""

    prediction: Tensor  # [B, H, Q]
    static_weights: Tensor  # [B, S]
    encoder_weights: Tensor  # [B, L, V_enc]
    decoder_weights: Tensor  # [B, H, V_dec]
    attention: Tensor  # [B, heads, H, L + H], decoder queries over all positions
