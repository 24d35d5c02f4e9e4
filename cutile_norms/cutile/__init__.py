"""cuTile kernels (`cuda.tile`): one op per module."""
