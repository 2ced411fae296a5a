"""``accel-alloc``: replay recorded allocator traces under other settings and recommend one."""
