"""Reading one trace: ``inspect`` (peaks, waste at the peak and the knob that removes it,
allocation sites) and ``timeline`` (memory curves for plots)."""
