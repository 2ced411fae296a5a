"""Models bundled with accel-graph (no download): used by ``accel-graph bench`` and the demo;
``TPDecoder`` is the bundled decoder sharded for tensor parallelism (``demo --tp``)."""

from .decoder import Decoder, DecoderConfig, greedy_generate
from .tp_decoder import TPDecoder, shard_state

__all__ = ["Decoder", "DecoderConfig", "TPDecoder", "greedy_generate", "shard_state"]
