"""Flax linen modules of the decoder LM."""
from sharenet.models.config import ModelConfig
from sharenet.models.lm import (DecoderLM, TRAINABLE, abstract_variables, init_boxed,
                                init_collection, init_variables, logical_axes, param_table)
