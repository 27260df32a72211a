"""LightningModules: they own the training loops; the networks they train live in foxhunt.models."""

from foxhunt.lit.tft import TFTInterpretation, TFTModule

__all__ = ["TFTInterpretation", "TFTModule"]
