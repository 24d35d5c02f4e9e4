"""Experimental kernels (experimental/), called directly."""
