"""MoonViT vision towers (K2.5 and K3's MoonViT-V2): config, encoder, processor, checkpoint import."""
from moonshot_jax.vision.config import VisionConfig, k25_vision, k3_vision
from moonshot_jax.vision.encoder import VisionTower, encode_images, init_vision
from moonshot_jax.vision.layout import PatchLayout, patch_layout, token_counts

__all__ = ["VisionConfig", "VisionTower", "PatchLayout", "encode_images", "init_vision", "k25_vision",
           "k3_vision", "patch_layout", "token_counts"]
