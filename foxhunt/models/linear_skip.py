"""A linear skip from the decision row's inputs to a forecaster's quantiles: the network's direct path to a weak signal.

A weak planted signal (the quick-start market's next return is 0.1 x the last standardised return, R^2 1%) is a
linear function of the last bar's inputs, yet the deep paths of a TFT or a Mamba-2 stack do not find it in a
few thousand pinball steps (the quick start's TFT median: correlation 0.04 with the true conditional mean after 1,500
steps), while a linear quantile regression on the decision row does in 250 (0.9). This is LSTNet's autoregressive
"highway" (Lai et al., 2018) on a forecaster's inputs: the network's output plus ``Linear(x[t])`` per horizon step
and quantile. Zero at initialisation, so a network with it starts as one without; causal (row t only).
"""

from __future__ import annotations

from torch import Tensor, nn


class LinearSkip(nn.Module):
    """[B, H, Q] a linear quantile regression on the decision row's F inputs (``x_past[:, -1]``), zero at first."""

    def __init__(self, n_features: int, horizon: int, n_quantiles: int) -> None:
        super().__init__()
        self.horizon, self.n_quantiles = horizon, n_quantiles
        self.linear = nn.Linear(n_features, horizon * n_quantiles)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)

    def forward(self, x_past: Tensor) -> Tensor:
        out = self.linear(x_past[:, -1].to(self.linear.weight.dtype))
        return out.view(x_past.shape[0], self.horizon, self.n_quantiles)


def add_skip(prediction: Tensor, skip: LinearSkip | None, x_past: Tensor) -> Tensor:
    """``prediction`` [B, H, Q] plus the skip's (unchanged without one), in the prediction's dtype."""
    if skip is None:
        return prediction
    return prediction + skip(x_past).to(prediction.dtype)


__all__ = ["LinearSkip", "add_skip"]
