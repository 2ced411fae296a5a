"""Models bundled with accel-graph (no download): used by ``accel-graph bench`` and the demo."""

from .decoder import Decoder, DecoderConfig, greedy_generate

__all__ = ["Decoder", "DecoderConfig", "greedy_generate"]
