"""The plan layer: what a search chose, as an object and a versioned JSON file, and its report.

It sits between the search that writes plans and the code generator and runtime that read them
(``ir -> rules -> frontend -> profile data -> plan -> search -> codegen -> runtime``):
:mod:`~hidup.plan.record` defines :class:`Plan`, its conversions and the JSON format;
:mod:`~hidup.plan.report` renders ``hidup show`` (``hidup.show(plan)``).
"""

from hidup.plan.record import (
    PLAN_VERSION,
    READABLE_VERSIONS,
    ConversionRecord,
    MeshStepRecord,
    Plan,
    PlanError,
    layer_of,
    model_record,
    sent_share,
    traced_versions,
)
from hidup.plan.report import summary

__all__ = [
    "Plan",
    "ConversionRecord",
    "MeshStepRecord",
    "PlanError",
    "summary",
    "PLAN_VERSION",
    "READABLE_VERSIONS",
    "layer_of",
    "model_record",
    "sent_share",
    "traced_versions",
]
