"""Models bundled with accel-graph (no download): used by ``accel-graph bench`` and the demo;
``TPDecoder`` is the bundled decoder sharded for tensor parallelism (``demo --tp``); ``ResNet``
is a small convnet for ``accel-graph bench --models``."""

from .decoder import Decoder, DecoderConfig, greedy_generate
from .resnet import ResNet, ResNetConfig
from .tp_decoder import TPDecoder, shard_state

__all__ = [
    "Decoder",
    "DecoderConfig",
    "ResNet",
    "ResNetConfig",
    "TPDecoder",
    "greedy_generate",
    "shard_state",
]
