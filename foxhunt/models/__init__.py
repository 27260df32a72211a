"""Networks (plain nn.Modules) trained by the LightningModules in foxhunt.lit."""

from foxhunt.models.tft import (
    GLU,
    GateAddNorm,
    GatedResidualNetwork,
    GroupedGatedResidualNetwork,
    InterpretableMultiHeadAttention,
    TemporalFusionTransformer,
    TFTOutput,
    VariableSelectionNetwork,
)

__all__ = [
    "GLU",
    "GateAddNorm",
    "GatedResidualNetwork",
    "GroupedGatedResidualNetwork",
    "InterpretableMultiHeadAttention",
    "TFTOutput",
    "TemporalFusionTransformer",
    "VariableSelectionNetwork",
]
