"""The trainable DFlash drafter and the frozen target that feeds it hidden states."""

from dflash_mp.models.drafter import DFlashDrafter
from dflash_mp.models.drafter_config import build_drafter_config
from dflash_mp.models.target import TargetFeatureExtractor, load_embedding_and_head, load_target_config

__all__ = [
    "DFlashDrafter",
    "TargetFeatureExtractor",
    "build_drafter_config",
    "load_embedding_and_head",
    "load_target_config",
]
