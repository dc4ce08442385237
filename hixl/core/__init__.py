"""The pure core: descriptors, planning, KV layouts and wire formats. No I/O, no verbs, no clock."""
