"""Machine profiles for the cost model: ``load("h200x4-nvlink")``, ``save(profile, path)``.

Folder profiler/, imported as ``hidup.profiler``; layer ``profile data``, a leaf the cost model reads
(it imports only the IR).  The measuring harness that writes profiles is the subpackage
:mod:`hidup.profiler.measure` (profiler/measure/), a layer above the runtime (docs/design.md, "Map").

Builtin profiles live in ``profiler/defaults/*.json`` so that search runs with no GPU; see
:mod:`hidup.profiler.profile` for the schema and the formulas, and
:mod:`hidup.profiler.corrections` for the fitted corrections and their provenance.
"""

from hidup.profiler.profile import (
    COLLECTIVES,
    DTYPES,
    CommTable,
    Corrections,
    Profile,
    ProfileError,
    builtin_names,
    load,
    op_dtype,
    op_key,
    save,
)

__all__ = [
    "Profile",
    "CommTable",
    "Corrections",
    "ProfileError",
    "load",
    "save",
    "builtin_names",
    "op_key",
    "op_dtype",
    "COLLECTIVES",
    "DTYPES",
]
