"""Feature packages built on the schedule core and the runtime (activation offload, ...).

Importing a feature registers its op kinds, passes and validator checks with the schedule
core; the torch parts of a feature are imported lazily (the schedule side stays torch-free).
"""
