"""memfit-offload's plugin module: makes the package known to memfit (``memfit plugins`` lists it).

It implements no hook. The offload pass plans from a program's forward and backward graphs,
which exist only when a step is compiled (:func:`memfit_offload.backend`), while ``plan_memory``
receives a step trace (operators and tensors, no graph to insert operators into); so the offload
plans are made at compile time and read from :meth:`memfit_offload.OffloadBackend.plan`, as
:class:`memfit.plan.MemoryPlan` objects of the same schema as every other planner's.

Importing this module does not import torch.
"""
