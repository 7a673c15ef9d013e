"""The package's layers, lowest first: a module imports from its own layer and the ones below.

Used by ``tests/test_layers.py`` (which reads every module's imports and fails on one that goes
up, or on a name with a leading underscore taken from another package) and drawn in
docs/architecture.md. Features plug into the layers below them through registries (op kinds,
passes and checks of the schedule core; the trainer's feature registry; the CLI's extension
points in :mod:`megatron_pp_ext.extensions`), never by being named there.
"""

from __future__ import annotations

#: (layer, the packages and modules in it), lowest first
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("base", ("megatron_pp_ext.layers", "megatron_pp_ext._lazy", "megatron_pp_ext.layer_pattern",
              "megatron_pp_ext.clibase", "megatron_pp_ext.extensions", "megatron_pp_ext.textfile")),
    ("schedule core", ("megatron_pp_ext.schedule",)),
    ("version layer", ("megatron_pp_ext.compat",)),
    ("runtime and planner", ("megatron_pp_ext.runtime", "megatron_pp_ext.planner")),
    ("trainer", ("megatron_pp_ext.trainer",)),
    ("features", ("megatron_pp_ext.features",)),
    ("Megatron-LM and Megatron-Bridge integration", ("megatron_pp_ext.megatron_lm", "megatron_pp_ext.launch",
                                                     "megatron_pp_ext.bridge")),
    ("command line", ("megatron_pp_ext.cli",)),
    ("test support", ("megatron_pp_ext.testing",)),
)

#: features built on another feature's public API (BPipe's partner store is activation offload's
#: store with groups that leave for the partner rank); any other import between features fails
FEATURE_DEPENDS: dict[str, tuple[str, ...]] = {
    "megatron_pp_ext.features.bpipe": ("megatron_pp_ext.features.offload",),
}

#: modules outside the layers: the package's facade (it re-exports lazily, importing nothing above)
FACADE = ("megatron_pp_ext",)


def layer_of(module: str) -> int | None:
    """Index in :data:`LAYERS` of ``module`` (a dotted name), None when it is in none."""
    best, found = -1, None
    for i, (_, prefixes) in enumerate(LAYERS):
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and len(p) > best:
                best, found = len(p), i
    return found


def feature_of(module: str) -> str | None:
    """``megatron_pp_ext.features.<name>`` of a feature's module (None elsewhere and for the
    shared ``megatron_pp_ext.features.flags``)."""
    parts = module.split(".")
    if len(parts) >= 3 and parts[:2] == ["megatron_pp_ext", "features"] and parts[2] not in ("flags", "__init__"):
        return ".".join(parts[:3])
    return None
