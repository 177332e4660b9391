"""The performance model (docs/perfmodel.md), pure numpy and YAML: ``model`` (hardware, shapes,
layer times, the closed forms), ``sim`` (event simulators over those times), ``plan`` (planner,
goodput search, world plan); ``trace`` (the trace format both the runtime and the simulators
write) and ``timeline_plot`` serve all three. Dependencies run model <- sim <- plan."""
