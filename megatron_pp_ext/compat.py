"""Megatron versions: the one module of megatron_pp_ext that knows how they differ.

Supported: **megatron-core 0.16.1 through 0.19.x** (:data:`SUPPORTED`, also declared in
``setup.py``) and **Megatron-LM core_v0.16.1, core_v0.17.1, core_v0.18.2 and core_v0.19.0**
(:data:`MEGATRON_LM_TAGS`; ``patches/`` has one patch per tag); and, as a development build
verified by hand, **Megatron-LM main** (megatron-core 0.20.0) from a git checkout at or after the
commit of :data:`MEGATRON_LM_MAIN` (its own patch; :func:`main_checkout`). Nothing else in the package
branches on the Megatron version: it calls the functions here, which find out what the loaded
Megatron can do by probing it (a signature, an attribute, a module) rather than by comparing
version strings. The version number itself is read only to refuse an unsupported release
with one clear line at start-up (:func:`check_supported`).

============================================  ==========  ============================================
difference                                    since       handled by
============================================  ==========  ============================================
``import megatron.core`` imports ``triton``   core 0.18   :func:`install_import_shims`: when triton is
(MoE paged-stash kernels, defined only)                   not installed, those kernel modules get a
                                                          stub while they execute, nothing else does
``typing.override`` in Megatron-LM's          LM 0.18     :func:`install_import_shims`: on Python
training code (a Python 3.12 name)                        < 3.12, present while a ``megatron.training``
                                                          module executes (``typing_extensions``')
``schedules.backward_step`` lost              core 0.17   :func:`backward_step` (signature probe)
``model_type``
``linear_with_grad_accumulation_and_``        core 0.19   :func:`bind_linear_call` binds the call with
``async_allreduce`` gained ``gtp_remat_size``             the function's own signature; a value the
(lost ``async_grad_allreduce``)                           B/W split cannot honour raises
                                                          :class:`LinearCallError` (never a silent
                                                          fallback to W inside B)
... gained ``output_dtype`` (fp32 logits:     main        :func:`linear_output_gemm` (the split's
a widening GEMM; the backward casts dY to                 forward calls Megatron's own GEMM);
the input's dtype)                                        ``grad_to_input_dtype`` of
                                                          :func:`bind_linear_call` (its B casts)
``start_grad_sync`` calls                     core 0.19   the CPU compatibility layer
``torch.cuda.current_stream()``                           (``runtime/cpu_compat.py``, CPU only)
SwiGLU ``linear_fc1`` tagged                  core 0.18   ``runtime/model.py`` handles every
``partition_stride`` 2 at any init                        ``partition_stride`` (not version specific)
``validate_args`` moved from ``initialize``   LM 0.18     :func:`lm_sites` (where each hooked name
to ``arguments.parse_and_validate_args``;                 is bound in the loaded Megatron-LM)
``pretrain(cfg_container, ...)`` without
``extra_args_provider``
model built by ``cfg_container.model``'s      LM 0.19     :func:`lm_model_builders`; the integration
builder (``GPTModelBuilder``), not by                     also refuses to train a model that did not
``get_model(model_provider)``                             go through its stage placement
``get_forward_backward_func(                  LM 0.19     the integration accepts any arguments and
schedule_pg_collection=...)``                             checks that its schedule ran
loss on ``is_pp_last_stage(pg_collection.pp)``  LM 0.19   :func:`lm_sites` (``training.mpu`` and
                                                          ``training.is_pp_last_stage``)
``get_batch_on_this_tp_rank`` in              LM 0.18     :func:`lm_sites`, :func:`bind_call`
``megatron.core.utils``, keyword API
checkpoint writer's result queue renamed     core 0.19   :func:`names_of` (the CPU layer patches it)
``get_write_results_queue``
MoE router's gating GEMM reads                core 0.16   :func:`moe_without_te`: defines the name as
``te_general_gemm``, defined only when                    None where it is missing (the router then
Transformer Engine imports (NameError)                    runs its torch GEMM, as intended)
MoE aux-loss tracker: a module dict           core 0.19   :func:`moe_metric_values`,
(``get_moe_layer_wise_logging_tracker``)                  :func:`clear_moe_metrics`,
became ``moe_logging.MoEMetricsTracker``                  :func:`reset_moe_metrics` (the legacy getter
                                                          returns a fresh copy there)
NullTokenizer vocabulary ``--vocab-size``     LM 0.19     nothing to do (tests pick a size whose
(was ``--vocab-size`` + 1)                                padding is the same at tp 1 and 2)
``schedules.forward_step`` / ``backward_step``  main      :func:`signature` reads the wrapped
wrapped by a tracing decorator                            function's parameters (``functools.wraps``
                                                          or not); one line when it cannot
``_build_default_pg_collection`` fills the    main        :func:`default_pg_collection` calls it
``gtp_remat`` groups                                      where the release has it
SSM kernel modules ``import triton``          main        :func:`install_import_shims` (the list)
(``megatron.training.models.hybrid``)
Megatron-Bridge imports Transformer Engine    Bridge 0.6  :func:`install_import_shims`: a stub of the
(LoRA layers) and nvidia-resiliency-ext                   missing package while those modules execute
(``pretrain``) unconditionally                            (``_ABSENT_IMPORT_MODULES``)
where Megatron-Bridge binds the names its     Bridge 0.6  :func:`bridge_sites`
training loop calls (schedule getter,
training step, evaluation, stage checks)
the multi-token prediction layer's            core 0.19   :func:`mtp_inner_layer`
``transformer_layer`` renamed
``mtp_model_layer``
fine-grained schedule plan: ``set_streams``   core 0.19   :func:`fine_grained_plan` calls it without
lost ``comp_stream`` (reads the current                   arguments; the CPU layer gives both
stream), streams passed as functions, the                 releases a synchronous stream and event
``attn`` node renamed                                     (the runtime names no node)
``pre_dispatch_computation``
============================================  ==========  ============================================

Megatron-Bridge (NVIDIA's training framework on megatron-core): **0.6.x** (:data:`BRIDGE_SUPPORTED`),
refused otherwise by :func:`check_bridge_supported`, read from its ``package_info.py`` like
megatron-core's version.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import inspect
import os
import re
import sys
import threading
import types
from typing import Any, Callable

__all__ = [
    "SUPPORTED", "SUPPORTED_TEXT", "PIP_REQUIREMENT", "MEGATRON_LM_TAGS", "UnsupportedMegatronError",
    "megatron_core_version", "megatron_core_location", "check_supported", "install_import_shims",
    "backward_step", "bind_linear_call", "moe_without_te", "moe_metric_values", "clear_moe_metrics",
    "reset_moe_metrics", "LinearCallError", "bind_call", "names_of", "lm_sites", "lm_model_builders",
    "default_pg_collection", "MEGATRON_LM_MAIN", "main_checkout", "signature",
    "linear_output_gemm", "BRIDGE_SUPPORTED", "megatron_bridge_version", "check_bridge_supported", "bridge_sites",
    "fine_grained_plan", "plan_loss_stage", "mtp_inner_layer", "has_fine_grained_plan",
]

#: supported megatron-core releases: (lowest, first unsupported)
SUPPORTED = ((0, 16, 1), (0, 20, 0))
SUPPORTED_TEXT = "megatron-core 0.16.1 through 0.19.x"
PIP_REQUIREMENT = "megatron-core>=0.16.1,<0.20"
#: Megatron-LM tags with a patch in patches/ (megatron-lm-<tag>.patch) and their commits
MEGATRON_LM_TAGS = {
    "core_v0.16.1": "55ac7082517c3878ae653c07c09c534b8aed49f6",
    "core_v0.17.1": "266f1c97dca477ca8b92c16087506da2000b0b84",
    "core_v0.18.2": "571370c829ca768fe37244f4e2e7f28d8accc4ab",
    "core_v0.19.0": "5be9626709af2722333bf54797c954c09edeada3",
}
#: Megatron-LM's main branch, verified by hand at this commit (docs/compatibility.md; patch
#: patches/megatron-lm-main-<commit[:10]>.patch): the version its package_info reports is accepted as a
#: development build when megatron.core is imported from a git checkout whose HEAD has this commit in
#: its history (a wheel of that version, or an older or unrelated checkout, has no way to tell)
MEGATRON_LM_MAIN = {"commit": "d98e8a64ddf34856e74b24714e3bedb2f5a39553", "date": "2026-08-22",
                    "version": (0, 20, 0)}
_ALLOW_ENV = "MPPX_ALLOW_UNSUPPORTED_MEGATRON"


class UnsupportedMegatronError(RuntimeError):
    """The installed Megatron-Core is outside :data:`SUPPORTED` (one line, with the fix)."""


#: supported Megatron-Bridge releases: (lowest, first unsupported)
BRIDGE_SUPPORTED = ((0, 6, 0), (0, 7, 0))
BRIDGE_SUPPORTED_TEXT = "megatron-bridge 0.6.x"


# --- which Megatron-Core, without importing it -------------------------------------------------

def megatron_lm_requires_one_queue(*, tp: int, cp: int, blackwell: bool, ep_overlap: bool = False,
                                   fsdp: bool = False) -> bool:
    """Whether Megatron-LM's argument checks demand ``CUDA_DEVICE_MAX_CONNECTIONS=1`` (one hardware
    queue per GPU): tensor or context parallelism on a GPU before Blackwell, unless FSDP or the
    overlapped expert-parallel all-to-all is on (``megatron/training/arguments.py`` since core_v0.14,
    through core_v0.19 and main)."""
    return (tp > 1 or cp > 1) and not blackwell and not (fsdp or ep_overlap)


def megatron_core_location() -> str | None:
    """Directory of the ``megatron.core`` that ``import megatron.core`` loads (None: none).
    Found without importing it (a Megatron-LM checkout on ``sys.path`` wins over a wheel, as for
    the import itself)."""
    mod = sys.modules.get("megatron.core")
    if mod is not None and getattr(mod, "__file__", None):
        return os.path.dirname(mod.__file__)
    try:
        spec = importlib.util.find_spec("megatron")
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    for base in spec.submodule_search_locations or []:
        if os.path.isfile(os.path.join(base, "core", "__init__.py")):
            return os.path.join(base, "core")
    return None


def has_fine_grained_plan() -> bool:
    """Whether the megatron-core that would be imported carries the fine-grained schedule plan that
    overlapped pairs run through (``pipeline_parallel/combined_1f1b.py`` and
    ``models/common/model_chunk_schedule_plan.py``); read without importing it (flag checks run
    before any process starts). :func:`fine_grained_plan` is the import-time probe."""
    where = megatron_core_location()
    return where is not None and all(os.path.isfile(os.path.join(where, *rel)) for rel in (
        ("pipeline_parallel", "combined_1f1b.py"), ("models", "common", "model_chunk_schedule_plan.py")))


def megatron_core_version() -> tuple[int, int, int] | None:
    """(major, minor, patch) of the Megatron-Core that would be imported, read from its
    ``package_info.py`` (None: not installed or unreadable)."""
    where = megatron_core_location()
    return _package_version(os.path.join(where, "package_info.py") if where else None)


def _package_version(path: str | None) -> tuple[int, int, int] | None:
    """(major, minor, patch) from a Megatron ``package_info.py`` (None: unreadable)."""
    if path is None:
        return None
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError:
        return None
    parts = []
    for key in ("MAJOR", "MINOR", "PATCH"):
        m = re.search(rf"^{key}\s*=\s*(\d+)", text, re.M)
        if m is None:
            return None
        parts.append(int(m.group(1)))
    return tuple(parts)  # type: ignore[return-value]


def megatron_bridge_location() -> str | None:
    """Directory of the ``megatron.bridge`` that ``import megatron.bridge`` loads (None: none),
    found without importing it."""
    mod = sys.modules.get("megatron.bridge")
    if mod is not None and getattr(mod, "__file__", None):
        return os.path.dirname(mod.__file__)
    try:
        spec = importlib.util.find_spec("megatron")
    except (ImportError, ValueError):
        return None
    for base in (spec.submodule_search_locations or []) if spec is not None else []:
        if os.path.isfile(os.path.join(base, "bridge", "__init__.py")):
            return os.path.join(base, "bridge")
    return None


def megatron_bridge_version() -> tuple[int, int, int] | None:
    """(major, minor, patch) of the Megatron-Bridge that would be imported (None: not installed)."""
    where = megatron_bridge_location()
    return _package_version(os.path.join(where, "package_info.py") if where else None)


def main_checkout(where: str | None = None) -> tuple[bool, str]:
    """Whether the Megatron-Core at ``where`` (default: the one that would be imported) is a git
    checkout of Megatron-LM at or after :data:`MEGATRON_LM_MAIN`'s commit: ``(True, HEAD)``, or
    ``(False, why not)``. Read with ``git`` (``merge-base --is-ancestor``), without importing it."""
    import shutil
    import subprocess

    where = where or megatron_core_location()
    pinned = MEGATRON_LM_MAIN["commit"]
    git = shutil.which("git")
    if where is None:
        return False, "megatron-core is not installed"
    if git is None:
        return False, "git is not installed, so its commit cannot be read"

    def run(*args: str) -> subprocess.CompletedProcess:
        env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}
        return subprocess.run([git, "-C", where, *args], capture_output=True, text=True, timeout=60, env=env)

    try:
        if run("ls-files", "--error-unmatch", "package_info.py").returncode != 0:
            return False, "it is not a git checkout of Megatron-LM (a wheel or a copy: its commit is unknown)"
        head = run("rev-parse", "HEAD").stdout.strip()
        anc = run("merge-base", "--is-ancestor", pinned, "HEAD").returncode
    except (OSError, subprocess.SubprocessError) as e:
        return False, f"git could not read its checkout ({e})"
    if anc == 0:
        return True, head
    if anc == 1:
        return False, f"its checkout is at {head[:10]}, which does not descend from main {pinned[:10]}"
    return False, (f"its checkout at {head[:10]} does not have main {pinned[:10]} in its history "
                   "(a shallow clone? git fetch --unshallow)")


_CHECKED: list = []


def _rank0() -> bool:
    return os.environ.get("RANK", "0") == "0"


def check_supported() -> None:
    """Refuse an unsupported Megatron-Core with one line naming the fix
    (:class:`UnsupportedMegatronError`); ``MPPX_ALLOW_UNSUPPORTED_MEGATRON=1`` turns that into
    a one-line warning (once per process). Megatron-LM main at or after
    :data:`MEGATRON_LM_MAIN`'s commit (a git checkout, :func:`main_checkout`) runs with one
    line saying it is a development build (rank 0)."""
    if _CHECKED:
        return
    ver = megatron_core_version()
    fix = f"pip install '{PIP_REQUIREMENT}' (docs/compatibility.md)"
    if ver is None:
        raise UnsupportedMegatronError(f"megatron-core is not installed (or not readable): {fix}")
    if SUPPORTED[0] <= ver < SUPPORTED[1]:
        _CHECKED.append(ver)
        return
    text = ".".join(map(str, ver))
    what = (f"megatron_pp_ext supports {SUPPORTED_TEXT}, but megatron-core {text} is installed "
            f"({megatron_core_location()})")
    if ver == MEGATRON_LM_MAIN["version"]:
        pinned, date = MEGATRON_LM_MAIN["commit"][:10], MEGATRON_LM_MAIN["date"]
        ok, detail = main_checkout()
        if ok:
            _CHECKED.append(ver)
            if _rank0():
                print(f"megatron_pp_ext: note: megatron-core {text} is a development build (Megatron-LM main at "
                      f"{detail[:10]}, at or after {pinned} of {date}, verified by hand: docs/compatibility.md)",
                      file=sys.stderr, flush=True)
            return
        what += (f" and {detail}; {text} runs only as Megatron-LM main at or after {pinned} ({date}) "
                 "from a git checkout")
        fix += f", or scripts/install_megatron.sh --ref {pinned} DIR and PYTHONPATH=DIR"
    if os.environ.get(_ALLOW_ENV, "") not in ("", "0"):
        print(f"megatron_pp_ext: warning: {what}; trying anyway ({_ALLOW_ENV}=1)", file=sys.stderr)
        _CHECKED.append(ver)
        return
    raise UnsupportedMegatronError(f"{what}: {fix}, or set {_ALLOW_ENV}=1 to try it anyway")


def check_bridge_supported() -> None:
    """Refuse an unsupported Megatron-Bridge (or Megatron-Core: :func:`check_supported`) with one
    line naming the fix (:class:`UnsupportedMegatronError`); ``MPPX_ALLOW_UNSUPPORTED_MEGATRON=1``
    turns the Bridge check into a one-line warning too."""
    check_supported()
    ver = megatron_bridge_version()
    fix = "pip install --ignore-requires-python 'megatron-bridge>=0.6,<0.7' (docs/bridge.md)"
    if ver is None:
        raise UnsupportedMegatronError(f"megatron-bridge is not installed (or not readable): {fix}")
    if BRIDGE_SUPPORTED[0] <= ver < BRIDGE_SUPPORTED[1]:
        return
    what = (f"megatron_pp_ext supports {BRIDGE_SUPPORTED_TEXT}, but megatron-bridge {'.'.join(map(str, ver))} is "
            f"installed ({megatron_bridge_location()})")
    if os.environ.get(_ALLOW_ENV, "") not in ("", "0"):
        if _rank0():
            print(f"megatron_pp_ext: warning: {what}; trying anyway ({_ALLOW_ENV}=1)", file=sys.stderr)
        return
    raise UnsupportedMegatronError(f"{what}: {fix}, or set {_ALLOW_ENV}=1 to try it anyway")


# --- import shims: triton (core 0.18+) and typing.override (Megatron-LM 0.18+ on Python 3.11) --

#: modules that ``import triton`` unconditionally only to *define* kernels, on the import path of
#: ``megatron.core`` (the kernels run on CUDA only, where triton is installed with torch)
_TRITON_KERNEL_MODULES = frozenset({
    "megatron.core.transformer.moe.paged_stash",        # core 0.18
    "megatron.core.transformer.moe.ops.paged_stash",    # core 0.19
    "megatron.core.transformer.custom_layers.batch_invariant_kernels",
    # Megatron-LM main after core_v0.19.0 (megatron.training.models.hybrid imports the SSM layers)
    "megatron.core.ssm.ops.common.causal_conv1d_varlen",
    "megatron.core.ssm.ops.mamba2.batch_invariant_decode",
    "megatron.core.ssm.ops.mamba2.ssd_bmm",
    "megatron.core.ssm.ops.mamba2.ssd_chunk_scan",
    "megatron.core.ssm.ops.mamba2.ssd_chunk_state",
    "megatron.core.ssm.ops.mamba2.ssd_combined",
    "megatron.core.ssm.ops.mamba2.ssd_state_passing",
})


class _TritonStub:
    """Just enough of ``triton`` for a module that defines kernels to import: every attribute
    is a stub; ``@triton.jit`` and ``@triton.autotune(...)`` return the function unchanged."""

    def __init__(self, name: str) -> None:
        self.__name__ = name

    def __getattr__(self, name: str) -> "_TritonStub":
        if name.startswith("__"):
            raise AttributeError(name)
        return _TritonStub(f"{self.__name__}.{name}")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if len(args) == 1 and callable(args[0]) and not kwargs:
            return args[0]
        return lambda fn: fn


def _triton_stub_modules() -> dict:
    mods = {}
    for name in ("triton", "triton.language"):
        m = types.ModuleType(name)
        m.__getattr__ = _TritonStub(name).__getattr__  # type: ignore[attr-defined]
        m.__version__ = "0.0.0"   # (version checks that follow a successful import then say "too old")
        m.__mppx_stub__ = True    # type: ignore[attr-defined]
        mods[name] = m
    mods["triton"].language = mods["triton.language"]  # type: ignore[attr-defined]
    return mods


#: Megatron-Bridge (0.6) modules that import a package unconditionally though only a path that
#: needs it uses it: {module: (package, its submodules the module imports)}. Transformer Engine:
#: LoRA's fused TE branches (built only when a TE layer is wrapped); nvidia-resiliency-ext:
#: ``pretrain``'s in-process restart (a type annotation; the restart itself imports it again)
_ABSENT_IMPORT_MODULES = {
    "megatron.bridge.peft.lora_layers": ("transformer_engine", ("pytorch",)),
    "megatron.bridge.training.pretrain": ("nvidia_resiliency_ext", ("inprocess",)),
}


class _Absent(type):
    """A name of a package that is not installed, in a module that imported its stub: a class
    nothing is an instance of (``isinstance(m, te.Linear)`` is False), whose attributes are more
    of the same (``te.ops.Linear``) and whose use says that the package is not installed."""

    def __getattr__(cls, name: str) -> "_Absent":
        if name.startswith("__"):
            raise AttributeError(name)
        return _Absent(f"{cls.__name__}.{name}", (), {})

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        top = cls.__name__.split(".")[0]
        raise ImportError(f"{cls.__name__} needs {top}, which is not installed")


def _absent_modules(package: str, submodules: tuple[str, ...]) -> dict:
    mods = {}
    for name in (package,) + tuple(f"{package}.{s}" for s in submodules):
        m = types.ModuleType(name)
        m.__getattr__ = _Absent(name, (), {}).__getattr__  # type: ignore[attr-defined]
        m.__mppx_stub__ = True    # type: ignore[attr-defined]
        mods[name] = m
    for s in submodules:
        setattr(mods[package], s, mods[f"{package}.{s}"])
    return mods


def _override(fn: Any) -> Any:   # typing.override (Python 3.12), as typing_extensions defines it
    try:
        fn.__override__ = True
    except (AttributeError, TypeError):
        pass
    return fn


class _WindowLoader(importlib.abc.Loader):
    """Runs the real loader of a module with ``enter()`` / ``exit()`` around its execution."""

    def __init__(self, loader: Any, enter: Callable[[], Any], exit_: Callable[[Any], None]) -> None:
        self._loader = loader
        self._enter = enter
        self._exit = exit_

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module) -> None:
        token = self._enter()
        try:
            self._loader.exec_module(module)
        finally:
            self._exit(token)

    def __getattr__(self, name: str) -> Any:   # get_source, get_code, is_package, ...
        return getattr(self._loader, name)


_SHIM_LOCK = threading.RLock()
_OVERRIDE_DEPTH = [0]


def _stub_enter(make: Callable[[], dict]) -> dict:
    """Put the stub modules ``make()`` returns in ``sys.modules`` unless the real package (or the
    stub of an enclosing window) is there; returns what to restore."""
    with _SHIM_LOCK:
        mods = make()
        top = next(iter(mods))
        saved = {k: sys.modules.get(k) for k in mods}
        if saved[top] is not None or importlib.util.find_spec(top) is not None:
            return {}
        sys.modules.update(mods)
        return saved


def _triton_enter() -> dict:
    return _stub_enter(_triton_stub_modules)


def _absent_enter(module: str) -> Callable[[], dict]:
    package, subs = _ABSENT_IMPORT_MODULES[module]
    return lambda: _stub_enter(lambda: _absent_modules(package, subs))


def _stub_exit(saved: dict) -> None:
    with _SHIM_LOCK:
        for k, v in saved.items():
            if v is None:
                sys.modules.pop(k, None)
            else:
                sys.modules[k] = v


def _override_enter() -> bool:
    import typing
    with _SHIM_LOCK:
        if _OVERRIDE_DEPTH[0] == 0 and hasattr(typing, "override"):
            return False
        _OVERRIDE_DEPTH[0] += 1
        typing.override = _override  # type: ignore[attr-defined]
        return True


def _override_exit(added: bool) -> None:
    import typing
    if not added:
        return
    with _SHIM_LOCK:
        _OVERRIDE_DEPTH[0] -= 1
        if _OVERRIDE_DEPTH[0] == 0:
            try:
                del typing.override  # type: ignore[attr-defined]
            except AttributeError:
                pass


class _ShimFinder(importlib.abc.MetaPathFinder):
    """Finds Megatron's modules with the real finders and wraps their loaders in the windows
    of :func:`install_import_shims`; finds nothing itself."""

    def __init__(self, triton: bool, override: bool, absent: frozenset = frozenset()) -> None:
        self.triton = triton
        self.override = override
        self.absent = absent    # the modules of _ABSENT_IMPORT_MODULES whose package is not installed

    def find_spec(self, name, path=None, target=None):
        if not name.startswith("megatron."):
            return None
        window = None
        if self.triton and name in _TRITON_KERNEL_MODULES:
            window = (_triton_enter, _stub_exit)
        elif name in self.absent:
            window = (_absent_enter(name), _stub_exit)
        elif self.override and name.startswith("megatron.training"):
            window = (_override_enter, _override_exit)
        if window is None:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                break
        else:
            return None
        if spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        spec.loader = _WindowLoader(spec.loader, *window)
        return spec


_FINDER: list = []


def install_import_shims() -> None:
    """Let every supported Megatron import on this interpreter (idempotent, cheap).

    * Without triton (CPU machines: triton comes with CUDA builds of torch), the modules of
      Megatron-Core that ``import triton`` only to define kernels (0.18+) see a stub while
      they execute; ``sys.modules`` never keeps it, so every other ``import triton`` (torch's
      own probes included) still finds no triton. Installing triton (``pip install triton``,
      which works on CPU) makes this a no-op.
    * On Python < 3.12, while a ``megatron.training`` module executes, ``typing.override``
      exists (Megatron-LM's training code from core_v0.18 imports it; a decorator that only
      marks the method).
    * Megatron-Bridge's modules that import Transformer Engine or nvidia-resiliency-ext
      unconditionally but use them only on a path that needs them (LoRA's fused TE branches,
      in-process restart: ``_ABSENT_IMPORT_MODULES``) see a stub of the missing package while
      they execute (:class:`_Absent`: isinstance checks against its classes are False, using one
      says the package is not installed); ``sys.modules`` never keeps it, so Megatron-Core's own
      probes (``HAVE_TE``, nvrx's version check) still find no such package.
    """
    with _SHIM_LOCK:
        if _FINDER:
            return
        import typing
        triton = importlib.util.find_spec("triton") is None
        override = not hasattr(typing, "override")
        absent = frozenset(m for m, (pkg, _) in _ABSENT_IMPORT_MODULES.items() if importlib.util.find_spec(pkg) is None)
        finder = _ShimFinder(triton, override, absent)
        _FINDER.append(finder)
        if triton or override or absent:
            sys.meta_path.insert(0, finder)


# --- Megatron-Core runtime -----------------------------------------------------------------------

def _opaque(sig: inspect.Signature) -> bool:
    """Only ``*args, **kwargs``: the signature of a wrapper that does not say what it wraps."""
    kinds = {p.kind for p in sig.parameters.values()}
    return bool(kinds) and kinds <= {inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD}


def _wrapped_inside(fn: Any, name: str) -> Any:
    """The function a wrapper without ``functools.wraps`` calls: the one function it holds (in its
    closure, or as an attribute of a wrapper object) that the decorator did not define itself (a
    helper next to the wrapper), or the one of them named ``name``."""
    held = [c.cell_contents for c in (getattr(fn, "__closure__", None) or ()) if _is_cell_set(c)]
    held += list(getattr(fn, "__dict__", {}).values())
    scope = getattr(fn, "__qualname__", "").rpartition(".")[0]
    funcs = [f for f in held if (inspect.isfunction(f) or inspect.ismethod(f))
             and not (scope.endswith("<locals>") and getattr(f, "__qualname__", "").rpartition(".")[0] == scope)]
    named = [f for f in funcs if getattr(f, "__name__", None) == name]
    if len(named) == 1:
        return named[0]
    return funcs[0] if len(funcs) == 1 else None


def _is_cell_set(cell) -> bool:
    try:
        cell.cell_contents
    except ValueError:
        return False
    return True


def signature(fn: Callable, name: str | None = None) -> inspect.Signature | None:
    """``fn``'s signature seen through wrappers: ``functools.wraps`` (``__wrapped__``, as
    ``inspect.signature`` follows it) and wrappers without it whose own signature is only
    ``*args, **kwargs`` (Megatron-LM main wraps ``schedules.forward_step`` / ``backward_step``
    in a tracing decorator, a no-op without its package; another build of it may not use
    ``functools.wraps``). None when it cannot be read."""
    name = name or getattr(fn, "__name__", "")
    for _ in range(8):
        try:
            sig = inspect.signature(fn)
        except (TypeError, ValueError):
            return None
        if not _opaque(sig):
            return sig
        inner = _wrapped_inside(fn, name)
        if inner is None:
            return None
        fn = inner
    return None


def _params(fn: Callable, name: str | None = None) -> dict:
    sig = signature(fn, name)
    return {} if sig is None else dict(sig.parameters)


_BACKWARD_TAKES_MODEL_TYPE: dict = {}


def backward_step(input_tensor, output_tensor, output_tensor_grad, model_type, config):
    """Megatron-Core's ``schedules.backward_step`` (``model_type`` dropped where the function
    no longer takes it: core 0.17+), read through a tracing wrapper (:func:`signature`)."""
    from megatron.core.pipeline_parallel import schedules as msched

    fn = msched.backward_step
    cached = _BACKWARD_TAKES_MODEL_TYPE.get(id(fn))
    takes = cached[1] if cached is not None and cached[0] is fn else None   # (an id can be reused)
    if takes is None:
        params = _params(fn, "backward_step")
        if not params:
            raise RuntimeError(f"megatron_pp_ext cannot read the parameters of Megatron-Core's schedules.backward_step "
                               f"through its wrapper {fn!r} (a decorator without functools.wraps that hides the "
                               "function it wraps): uninstall the package that wraps it, or have it use functools.wraps")
        takes = "model_type" in params
        _BACKWARD_TAKES_MODEL_TYPE[id(fn)] = (fn, takes)
    if takes:
        return fn(input_tensor, output_tensor, output_tensor_grad, model_type, config)
    return fn(input_tensor, output_tensor, output_tensor_grad, config)


def default_pg_collection(pp_group=None):
    """The ``ProcessGroupCollection`` Megatron-Core's schedules build when the caller passes none
    (``schedules._build_default_pg_collection`` where the release has it, core 0.19+; the same
    fields from ``parallel_state`` otherwise), so that ``finalize_model_grads`` finds every group
    it asks for -- e.g. ``tp_dp_cp`` with ``moe_router_enable_expert_bias`` (0.18.2+ assert it).
    ``pp_group``: the caller's pipeline group (a ``p2p_communicator``'s), if any."""
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import schedules as msched
    from megatron.core.process_groups_config import ProcessGroupCollection

    build = getattr(msched, "_build_default_pg_collection", None)
    if build is not None:
        pgc = build()
    else:
        pgc = ProcessGroupCollection()
        pgc.tp = ps.get_tensor_model_parallel_group()
        pgc.cp = ps.get_context_parallel_group()
        pgc.embd = ps.get_embedding_group(check_initialized=False)
        pgc.pos_embd = ps.get_position_embedding_group(check_initialized=False)
        pgc.pp = ps.get_pipeline_model_parallel_group()
        pgc.dp_cp = ps.get_data_parallel_group(with_context_parallel=True, partial_data_parallel=False)
    # what later releases add, where this one's parallel_state has the group
    if getattr(pgc, "tp_dp_cp", None) is None and hasattr(ps, "get_tensor_and_data_parallel_group"):
        pgc.tp_dp_cp = ps.get_tensor_and_data_parallel_group(with_context_parallel=True)
    if getattr(pgc, "dp", None) is None:
        pgc.dp = ps.get_data_parallel_group(with_context_parallel=False, partial_data_parallel=False)
    if pp_group is not None:
        pgc.pp = pp_group
    return pgc


def moe_without_te() -> None:
    """Let Megatron-Core's MoE router run without Transformer Engine: its gating function tests
    ``te_general_gemm is not None``, a name its module defines only when TE imports (a NameError
    on CPU); define it as None where it is missing (idempotent; nothing changes where TE is)."""
    from megatron.core.transformer.moe import moe_utils
    if "te_general_gemm" not in vars(moe_utils):
        moe_utils.te_general_gemm = None


def _moe_metrics_tracker() -> Any:
    """Megatron-Core's MoE metrics tracker object (core 0.19), or None (the module dict of older
    releases)."""
    try:
        from megatron.core.transformer.moe import moe_logging
    except ImportError:
        return None
    return moe_logging.get_moe_metrics_tracker()


def moe_metric_values(name: str = "load_balancing_loss") -> Any:
    """The per-layer values (a tensor, summed over the forwards since the last clear) that the MoE
    router recorded under ``name`` on this rank, or None if it recorded none."""
    tracker = _moe_metrics_tracker()
    if tracker is not None:
        entry = tracker.metrics.get(name)
        return None if entry is None else entry.values
    from megatron.core.transformer.moe import moe_utils
    entry = moe_utils.get_moe_layer_wise_logging_tracker().get(name)
    return None if entry is None else entry["values"]


def clear_moe_metrics() -> None:
    """Zero the MoE router's recorded values (what Megatron-LM does after logging them)."""
    tracker = _moe_metrics_tracker()
    if tracker is not None:
        tracker.clear()
        return
    from megatron.core.transformer.moe import moe_utils
    for entry in moe_utils.get_moe_layer_wise_logging_tracker().values():
        entry["values"].zero_()


def reset_moe_metrics() -> None:
    """Forget every MoE metric entry (their sizes are the number of layers of the model that made
    them, and they hold its process groups) and the aux-loss scale: between runs in one process."""
    try:
        from megatron.core.transformer.moe import moe_utils
    except ImportError:  # pragma: no cover - megatron-core is a dependency
        return
    try:
        from megatron.core.transformer.moe import moe_logging
    except ImportError:
        moe_logging = None
    if moe_logging is not None and hasattr(moe_logging, "destroy_moe_metrics_tracker"):
        moe_logging.destroy_moe_metrics_tracker()
    else:
        moe_utils.get_moe_layer_wise_logging_tracker().clear()
    moe_utils.MoEAuxLossAutoScaler.main_loss_backward_scale = None


def mtp_inner_layer(layer: Any) -> Any:
    """The transformer layer inside a multi-token prediction layer: ``transformer_layer`` (core
    0.16), ``mtp_model_layer`` (core 0.19)."""
    inner = getattr(layer, "transformer_layer", None)
    return inner if inner is not None else layer.mtp_model_layer


def fine_grained_plan(comm_stream: Any = None) -> Callable | None:
    """Megatron-Core's combined forward-backward step over its fine-grained schedule plan
    (``combined_1f1b.combined_forward_backward_step``: ``GPTModel.build_schedule_plan`` and
    ``TransformerModelChunkSchedulePlan.run``, what ``--overlap-moe-expert-parallel-comm`` runs),
    or None where this megatron-core lacks it. Its streams are set up first: the communication
    stream (``comm_stream``; None: Megatron-Core's own draw from PyTorch's pool, which runs out
    where the first call of the process set one) -- core 0.16 also keeps the compute stream, core
    0.19 reads the current one; both take ``comm_stream=``."""
    try:
        from megatron.core.models.gpt.gpt_model import GPTModel
        from megatron.core.pipeline_parallel import combined_1f1b, utils as pp_utils
    except ImportError:
        return None
    step = getattr(combined_1f1b, "combined_forward_backward_step", None)
    if step is None or not hasattr(GPTModel, "build_schedule_plan") or not hasattr(pp_utils, "set_streams"):
        return None
    # (idempotent; the positional arguments differ between releases, the keyword does not)
    pp_utils.set_streams(**({} if comm_stream is None else {"comm_stream": comm_stream}))
    return step


def plan_loss_stage(is_last_stage: bool, cp_group_size: int):
    """A context in which Megatron-Core's ``forward_step_calc_loss`` -- which the combined step
    calls without saying which stage it runs, so that the function asks the parallel state (the
    last pipeline rank's last virtual stage) -- is told: the loss of the V placement is on rank
    0's last chunk. Both releases take ``cp_group_size`` and ``is_last_stage``."""
    import contextlib
    from megatron.core.pipeline_parallel import schedules

    orig = schedules.forward_step_calc_loss

    def calc(model, output_tensor, loss_func, config, vp_stage, *args, **kwargs):
        kwargs.update(cp_group_size=cp_group_size, is_last_stage=is_last_stage)
        return orig(model, output_tensor, loss_func, config, None, *args, **kwargs)

    @contextlib.contextmanager
    def scoped():
        schedules.forward_step_calc_loss = calc
        try:
            yield
        finally:
            schedules.forward_step_calc_loss = orig
    return scoped()


class LinearCallError(RuntimeError):
    """A call of Megatron-Core's linear layer that the B/W split cannot run exactly."""


#: arguments of ``linear_with_grad_accumulation_and_async_allreduce`` the B/W split implements
#: (after input and weight), and the values it can run for the others
_LINEAR_KNOWN = ("bias", "gradient_accumulation_fusion", "allreduce_dgrad", "sequence_parallel",
                 "grad_output_buffer", "wgrad_deferral_limit", "async_grad_allreduce", "tp_group",
                 "output_dtype")
_LINEAR_NEUTRAL = {"gtp_remat_size": (1, None)}   # core 0.19: generalized-TP weight rematerialisation
_LINEAR_SIG: dict = {}


def linear_output_gemm() -> Callable | None:
    """Megatron-Core's own forward GEMM of its linear layers with an output dtype,
    ``_linear_forward(input, weight, bias, output_dtype)`` (main after core_v0.19,
    ``--output-logit-dtype fp32``: a widening GEMM through Transformer Engine's ``general_gemm``,
    the plain matmul when the dtypes agree), or None where this release has none. The B/W split
    calls it, so its forward is Megatron's whatever the GEMM."""
    from megatron.core.tensor_parallel import layers

    fn = getattr(layers, "_linear_forward", None)
    if fn is None or list(_params(fn))[:4] != ["input", "weight", "bias", "output_dtype"]:
        return None
    return fn


def bind_linear_call(args: tuple, kwargs: dict) -> dict:
    """The arguments (after input and weight) of a call of Megatron-Core's
    ``linear_with_grad_accumulation_and_async_allreduce``, bound with the function's own
    signature: ``{bias, gradient_accumulation_fusion, allreduce_dgrad, sequence_parallel,
    grad_output_buffer, tp_group, output_dtype, grad_to_input_dtype}``. ``grad_to_input_dtype``:
    this release's backward casts the output gradient to the input's dtype before using it (it
    came with ``output_dtype``, main after core_v0.19). Raises :class:`LinearCallError` for an
    argument the split does not implement (a new one, or ``gtp_remat_size`` > 1)."""
    from megatron.core.tensor_parallel import layers

    fn = layers.linear_with_grad_accumulation_and_async_allreduce
    cached = _LINEAR_SIG.get(id(fn))
    sig = cached[1] if cached is not None and cached[0] is fn else None   # (an id can be reused)
    if sig is None:
        sig = inspect.signature(fn)
        _LINEAR_SIG[id(fn)] = (fn, sig)
    try:
        bound = sig.bind(None, None, *args, **kwargs)
    except TypeError as e:
        raise LinearCallError(f"cannot bind the call of linear_with_grad_accumulation_and_async_allreduce "
                              f"({e}) in this megatron-core") from None
    bound.apply_defaults()
    names = list(sig.parameters)[2:]
    out = {}
    for name in names:
        value = bound.arguments.get(name)
        if name in _LINEAR_KNOWN:
            out[name] = value
        elif name in _LINEAR_NEUTRAL:
            if value not in _LINEAR_NEUTRAL[name]:
                raise LinearCallError(f"{name}={value!r} (the B/W split implements {name} "
                                      f"{_LINEAR_NEUTRAL[name][0]} only)")
        elif sig.parameters[name].kind in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD):
            if value:
                raise LinearCallError(f"extra arguments {value!r} the B/W split does not know")
        elif not _is_default(value, sig.parameters[name].default):
            raise LinearCallError(f"argument {name}={value!r}, which the B/W split does not implement")
    for name in ("bias", "gradient_accumulation_fusion", "allreduce_dgrad", "sequence_parallel",
                 "grad_output_buffer", "tp_group", "output_dtype"):
        out.setdefault(name, None if name in ("bias", "grad_output_buffer", "tp_group", "output_dtype") else False)
    if out["output_dtype"] is not None and linear_output_gemm() is None:
        raise LinearCallError(f"output_dtype={out['output_dtype']} (this megatron-core has no "
                              "_linear_forward(input, weight, bias, output_dtype) for the B/W split to run it with)")
    out["grad_to_input_dtype"] = "output_dtype" in names
    return out


def _is_default(value: Any, default: Any) -> bool:
    if value is default:
        return True
    try:
        same = value == default
    except Exception:  # noqa: BLE001 - e.g. a tensor
        return False
    return same is True


#: names one thing has had across the supported releases (newest last)
_RENAMED = {
    # the distributed checkpoint writer's result queue (core 0.19 made it public, with an argument)
    "checkpoint_results_queue": ("_get_write_results_queue", "get_write_results_queue"),
}


def names_of(what: str, module: Any) -> list[str]:
    """The names under which ``module`` defines ``what`` (see ``_RENAMED``) in this release."""
    if module is None:
        return []
    return [n for n in _RENAMED[what] if n in vars(module)]


def bind_call(fn: Callable, args: tuple, kwargs: dict) -> inspect.BoundArguments | None:
    """``fn``'s arguments by name, with the signature of the function a wrapper wraps
    (:func:`signature`; None when the call does not bind: it is then passed through)."""
    sig = signature(fn)
    if sig is None:
        return None
    try:
        return sig.bind(*args, **kwargs)
    except (TypeError, ValueError):
        return None


# --- Megatron-LM (megatron.training) ---------------------------------------------------------------

def _mod(name: str):
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


def lm_sites() -> dict[str, list[tuple[Any, str]]]:
    """Where the loaded Megatron-LM binds each name the integration hooks: ``{what: [(module,
    attribute), ...]}`` (only the bindings that exist; every binding of one function, so a
    call through any of them is seen):

    * ``parse_args``: the argument parser (``initialize`` calls it up to core_v0.17,
      ``arguments.parse_and_validate_args`` from core_v0.18);
    * ``validate_args``: likewise;
    * ``pretrain``; ``get_model``; ``get_forward_backward_func``; ``train_step``; ``evaluate``;
      ``save_checkpoint`` (``megatron.training.training``);
    * ``mpu`` (the ``parallel_state`` view of training.py up to core_v0.18) and
      ``is_pp_last_stage`` (core_v0.19): which pipeline rank reduces and reports the loss;
    * ``is_first_or_last_pipeline_stage`` (``megatron.training.utils``);
    * ``get_batch_on_this_tp_rank`` (``megatron.training.utils``; ``megatron.core.utils`` from
      core_v0.18);
    * ``Float16Module`` (as ``get_model`` uses it; a core_v0.19 builder takes it as a default
      argument of ``build_distributed_models`` instead, see :func:`lm_model_builders`);
    * ``core_transformer_config_from_args`` (``megatron.training.arguments``; from core_v0.19
      defined in ``megatron.training.argument_utils``, which ``gpt_config_from_args`` calls it from).
    """
    training = _mod("megatron.training.training")
    mtraining = _mod("megatron.training")
    initialize = _mod("megatron.training.initialize")
    arguments = _mod("megatron.training.arguments")
    utils = _mod("megatron.training.utils")
    cutils = _mod("megatron.core.utils")
    argument_utils = _mod("megatron.training.argument_utils")

    def where(name: str, *mods) -> list:
        out = []
        for m in mods:
            if m is not None and name in vars(m):
                out.append((m, name))
        return out

    return {
        "parse_args": where("parse_args", initialize, arguments),
        "validate_args": where("validate_args", initialize, arguments),
        "pretrain": where("pretrain", training, mtraining),
        "get_model": where("get_model", training),
        "get_forward_backward_func": where("get_forward_backward_func", training),
        "train_step": where("train_step", training),
        "evaluate": where("evaluate", training),
        "save_checkpoint": where("save_checkpoint", training),
        "mpu": where("mpu", training),
        "is_pp_last_stage": where("is_pp_last_stage", training),
        "is_first_or_last_pipeline_stage": where("is_first_or_last_pipeline_stage", utils),
        "get_batch_on_this_tp_rank": where("get_batch_on_this_tp_rank", utils, cutils),
        "Float16Module": where("Float16Module", training),
        "core_transformer_config_from_args": where("core_transformer_config_from_args", arguments, argument_utils),
    }


_STEP_SIZE = re.compile(r"^[^:\s]+:(\d+)$")


def lm_batch_sizes(args: Any) -> list[tuple[int, str]]:
    """Every global batch size a Megatron-LM run trains with, each with the flag that asks for it
    (the final ``--global-batch-size`` last): ``--rampup-batch-size START INCREMENT SAMPLES``
    (START, START + INCREMENT, ... below the global batch size) where the installed megatron-core
    still ramps up (its ``RampupBatchsizeNumMicroBatchesCalculator``; core_v0.19 has none and
    ignores the flag), and every size of ``--step-batch-size-schedule "THRESHOLD:BS ..."``
    (core_v0.19+). An unparsable value is left to Megatron-LM's own checks."""
    gbs = getattr(args, "global_batch_size", None)
    out: list[tuple[int, str]] = []
    ramp = getattr(args, "rampup_batch_size", None)
    calc = _mod("megatron.core.num_microbatches_calculator")
    if ramp and calc is not None and hasattr(calc, "RampupBatchsizeNumMicroBatchesCalculator"):
        try:
            start, inc = int(ramp[0]), int(ramp[1])
        except (TypeError, ValueError, IndexError):
            start, inc = 0, 0
        if start > 0 and inc > 0 and gbs is not None:
            out += [(b, "--rampup-batch-size") for b in range(start, int(gbs), inc)]
    step = getattr(args, "step_batch_size_schedule", None)
    if step:
        for part in str(step).split():
            m = _STEP_SIZE.match(part)
            if m:
                out.append((int(m.group(1)), "--step-batch-size-schedule"))
    if gbs is not None:
        out.append((int(gbs), "--global-batch-size"))
    seen, unique = set(), []
    for b, flag in out:
        if b not in seen:
            seen.add(b)
            unique.append((b, flag))
    return unique


def lm_model_builders(pretrain_args: inspect.BoundArguments | None) -> list[type]:
    """The model-builder classes a ``pretrain(...)`` call will build the model with (core_v0.19:
    ``cfg_container.model.get_builder_cls()``, e.g. ``GPTModelBuilder``); [] when the model
    comes from ``get_model(model_provider)``."""
    if pretrain_args is None:
        return []
    cfg = pretrain_args.arguments.get("cfg_container")
    model_cfg = getattr(cfg, "model", None)
    if model_cfg is None or not hasattr(model_cfg, "get_builder_cls"):
        return []
    cls = model_cfg.get_builder_cls()
    return [cls] if isinstance(cls, type) else []


# --- Megatron-Bridge (megatron.bridge.training) ----------------------------------------------------

def bridge_sites() -> dict[str, list[tuple[Any, str]]]:
    """Where the loaded Megatron-Bridge binds each name its integration hooks (``{what: [(module,
    attribute), ...]}``, only the bindings that exist; Bridge 0.6):

    * ``get_forward_backward_func``: the schedule getter, as ``training.train`` (once per
      ``train()``) and ``training.eval`` (per evaluation) import it;
    * ``train_step`` (``training.train``), ``evaluate`` (``training.eval``);
    * ``P2PCommunicator``: the communicator ``train()`` builds and whose ``is_pp_last_stage`` says
      which rank reduces the loss (``training.train``, ``training.eval``);
    * ``is_pp_last_stage``: the loss rank in ``evaluate`` and which chunk reads labels in
      ``gpt_step.get_batch``;
    * ``compile_helpers``: the dataset helpers (``megatron.core.datasets.utils``, and as
      ``training.initialize`` imports it);
    * ``resolve_embedding_ranks``: ``training.setup._resolve_embedding_ranks_fn`` (the word-embedding
      group of tied embeddings);
    * ``initialize_megatron``, ``set_jit_fusion_options``: as ``training.setup`` calls them (the CPU
      layer: ``allow_no_cuda``, no CUDA JIT warm-up).
    """
    train = _mod("megatron.bridge.training.train")
    ev = _mod("megatron.bridge.training.eval")
    step = _mod("megatron.bridge.training.gpt_step")
    init = _mod("megatron.bridge.training.initialize")
    setup = _mod("megatron.bridge.training.setup")
    dutils = _mod("megatron.core.datasets.utils")

    def where(name: str, *mods) -> list:
        return [(m, name) for m in mods if m is not None and name in vars(m)]

    return {
        "get_forward_backward_func": where("get_forward_backward_func", train, ev),
        "train_step": where("train_step", train),
        "evaluate": where("evaluate", ev),
        "P2PCommunicator": where("P2PCommunicator", train, ev),
        "is_pp_last_stage": where("is_pp_last_stage", ev, step),
        "compile_helpers": where("compile_helpers", dutils, init),
        "resolve_embedding_ranks": where("_resolve_embedding_ranks_fn", setup),
        "initialize_megatron": where("initialize_megatron", setup),
        "set_jit_fusion_options": where("set_jit_fusion_options", setup),
    }
