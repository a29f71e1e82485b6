"""The front end: a model's training step into hidup's IR (layer ``trace``, above :mod:`hidup.rules`).

``model, inputs -> torch.export -> fx graph -> annotated Graph``.  Modules:
:mod:`~hidup.frontend.trace` (the pipeline: ``hidup.trace(model, inputs)``),
:mod:`~hidup.frontend.export` (``torch.export`` of the step, meta and fake models),
:mod:`~hidup.frontend.stamp` (repeated layers traced once and stamped),
:mod:`~hidup.frontend.saved` and :mod:`~hidup.frontend.saved_blocks` (what autograd saves, per node
and per layer, for the memory model), :mod:`~hidup.frontend.describe` (``hidup describe``).

The public entry points are ``hidup.trace``, ``hidup.trace_module`` and ``hidup.describe``; this
package re-exports nothing, so ``hidup.frontend.trace`` is always the module.
"""
