"""torch's per-pool ``memory_stats`` statistics, written out here (not imported from the
library) so that the tests check the engine against torch's names rather than against itself."""

TORCH_STAT_NAMES = (
    "allocation",
    "segment",
    "active",
    "inactive_split",
    "allocated_bytes",
    "reserved_bytes",
    "active_bytes",
    "inactive_split_bytes",
    "requested_bytes",
)
