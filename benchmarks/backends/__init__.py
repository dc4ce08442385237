"""The contenders, each behind the same few calls: perftest (the C baseline), hixl, and
the peers (Mooncake Transfer Engine, NIXL), which run in their own virtual environment."""
