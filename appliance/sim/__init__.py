"""The what-if simulator: predict what a knob change does before applying it.

`fit` learns the step time of one iteration from the store's iteration rows; `replay` drives the
engine's own Scheduler and BlockManager on a virtual clock with those step times; `records`
reads runs and iterations from the store and keeps fitted models there; `whatif` answers the
operator's questions (a knob change, a grid, a fleet size) that `cli` exposes as
`appliance simulate`.
"""
