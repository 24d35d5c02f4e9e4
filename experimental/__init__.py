"""Experimental kernels (compile-checked, not yet validated on hardware).

Importable only as `cutile_norms.experimental`, and only after opting in with
CUTILE_NORMS_EXPERIMENTAL=1 or `cutile_norms.enable_experimental()`. A kernel here carries
`@experimental_kernel`, warns once at its first launch and is never picked by `mode=None`; it moves
into the package once the full GPU suite is green and the bench has run on hardware (CONTRIBUTING.md).
"""
from cutile_norms._experimental import require_experimental

require_experimental()

# Modes whose implementation lives here: mode name -> "module:function" (relative to this package).
MODES: dict[str, str] = {}
